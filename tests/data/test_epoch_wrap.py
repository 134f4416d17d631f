"""A run that wraps around its data mid-run, resumed twice (before the wrap, then after it, from a checkpoint the
resumed run wrote): every step's loss equals the uninterrupted run's (peers broke exactly here)."""

from __future__ import annotations

import json

import pytest

import hftrain
from hftrain.checkpoint.layout import data_state_file
from hftrain.recipe.load import load_recipe

from ..support.checks import assert_resumed_matches, checkpoint_losses, copy_checkpoint
from ..support.data import make_documents, tiny_recipe, write_jsonl


def epoch_at(checkpoint) -> int:
    position = json.loads((checkpoint / data_state_file(0)).read_text())
    return min(w["start"]["docs"]["cursors"][0]["epoch"] for w in position["positions"].values())


@pytest.mark.slow
def test_resumed_twice_around_an_epoch_wrap_gives_the_same_losses(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(70))
    raw = tiny_recipe(
        data, tmp_path / "straight", max_steps=40, save_steps=10, save_total_limit=10, dataloader_num_workers=2
    )
    raw["data"]["shuffle_window"] = 4
    raw["monitor"]["sample_max_new_tokens"] = 0

    def run(output_dir):
        return hftrain.train(load_recipe(None, {**raw, "training": {**raw["training"], "output_dir": str(output_dir)}}))

    run(tmp_path / "straight")
    straight = checkpoint_losses(tmp_path / "straight")
    assert (
        epoch_at(tmp_path / "straight" / "checkpoint-10") == 0
        and epoch_at(tmp_path / "straight" / "checkpoint-30") >= 1
    )

    copy_checkpoint(tmp_path / "straight", tmp_path / "first", "checkpoint-10")  # killed before the wrap
    run(tmp_path / "first")
    first = checkpoint_losses(tmp_path / "first")
    assert_resumed_matches(straight, first, range(11, 41), "resumed before the wrap")

    copy_checkpoint(tmp_path / "first", tmp_path / "second", "checkpoint-30")  # the resumed run's own, after the wrap
    run(tmp_path / "second")
    second = checkpoint_losses(tmp_path / "second")
    assert sorted(second) == list(range(1, 41))
    assert_resumed_matches(straight, second, range(31, 41), "resumed after the wrap")
