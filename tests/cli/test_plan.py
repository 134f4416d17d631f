"""`hftrain plan` with overrides anywhere on its command line."""

from __future__ import annotations

from ..support.cli import ROOT, in_process


def test_plan_with_overrides_anywhere(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, printed = in_process(capsys, "plan", "recipes/pretrain/pythia-1b.yaml")
    assert code == 0, printed
    assert "1,011,781,632 total" in printed and "FLOPs per token" in printed and "fp32" in printed
    code, moved = in_process(capsys, "plan", "model.preset=pythia-70m", "recipes/quickstart.yaml", "data.seq_len=64")
    assert code == 0, moved
    assert "model pythia-70m: 6 layers, hidden 512, 8 heads, vocab 4,096" in moved  # quickstart's 4k BPE
