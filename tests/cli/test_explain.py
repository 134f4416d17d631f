"""`hftrain train --help` and `hftrain explain`: the recipe keys with their own docs."""

from __future__ import annotations

from ..support.cli import in_process


def test_help_shows_field_docs(capsys):
    code, printed = in_process(capsys, "train", "--help")
    assert code == 0
    assert "Tokens per training block" in printed  # data.seq_len's docstring
    assert "Named GPT-NeoX shape" in printed  # model.preset's docstring
    code, training = in_process(capsys, "explain", "training")
    assert "learning_rate" in training and "The initial learning rate for" in training
