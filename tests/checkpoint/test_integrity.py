"""Every checkpoint checked before it is trusted: the record of its files in its completion marker (integrity.py).

The record itself, on a checkpoint laid out as FSDP writes one (no training): sizes of every file, checksums of
the small ones, each kind of damage named, older markers without a record still accepted. `hftrain export`
checks before writing and never leaves a partial --out. Then real formats: a single-process checkpoint with a
state file changed and a LoRA adapter cut short (FSDP shards and ZeRO-3 partitions: test_elastic.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from hftrain.checkpoint import integrity, manager
from hftrain.checkpoint.layout import COMPLETE_MARKER, TRAINER_STATE_FILE
from hftrain.checkpoint.part import CheckpointPart
from hftrain.cli import main
from hftrain.errors import HftrainError
from hftrain.recipe.load import load_recipe

from ..support.checks import assert_export_refused, cut_short
from ..support.data import finetune_recipe

BIG = (1 << 20) + 10  # over the 1 MiB below which files are also hashed
SHARD = "pytorch_model_fsdp_0/__0_0.distcp"


def cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def published(root: Path, **files: bytes) -> Path:
    """checkpoint-3 as publish() leaves it: the Trainer's state, DeepSpeed-style `latest`, an FSDP shard folder."""
    staged = root / ".staging" / "checkpoint-3"
    (staged / "pytorch_model_fsdp_0").mkdir(parents=True)
    contents = {
        TRAINER_STATE_FILE: json.dumps({"global_step": 3}).encode(),
        "latest": b"global_step3",
        "pytorch_model_fsdp_0/.metadata": b"m" * 100,
        SHARD: os.urandom(BIG),
        **files,
    }
    for name, data in contents.items():
        (staged / name).write_bytes(data)
    manager.publish(staged, root / "checkpoint-3", {"step": 3, "world_size": 2, "strategy": "fsdp"})
    return root / "checkpoint-3"


def test_the_marker_records_every_file_with_sizes_and_checksums_of_the_small_ones(tmp_path):
    checkpoint = published(tmp_path)
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    assert (marker["step"], marker["world_size"], marker["strategy"]) == (3, 2, "fsdp")  # what elastic.py reads
    assert list(marker["files"]) == ["rank0"]  # who listed them: on a shared file system, the one publisher
    listed = marker["files"]["rank0"]
    assert sorted(listed) == ["latest", "pytorch_model_fsdp_0/.metadata", SHARD, TRAINER_STATE_FILE]  # not the marker
    assert listed["latest"] == {"size": 12, "sha256": hashlib.sha256(b"global_step3").hexdigest()}
    assert listed[SHARD] == {"size": BIG}  # weights are not hashed at every save
    assert integrity.unreadable(checkpoint) is None


DAMAGE = {  # name: (file, damage, what unreadable() says)
    "cut short": (
        SHARD,
        cut_short,
        f"{SHARD}: truncated ({BIG // 2:,} bytes of {BIG:,} recorded in {COMPLETE_MARKER})",
    ),
    "missing": (
        "pytorch_model_fsdp_0/.metadata",
        Path.unlink,
        f"pytorch_model_fsdp_0/.metadata: missing ({COMPLETE_MARKER} lists it, 100 bytes)",
    ),
    "grown": (
        SHARD,
        lambda f: f.write_bytes(f.read_bytes() + b"x"),
        f"{SHARD}: {BIG + 1:,} bytes, but {COMPLETE_MARKER} recorded {BIG:,}: it changed after the save",
    ),
    "changed, same size": (
        "latest",
        lambda f: f.write_bytes(b"global_step4"),
        f"latest: changed after the save (its sha256 differs from the one recorded in {COMPLETE_MARKER})",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_each_damage_is_named_and_an_explicit_resume_of_it_refused(tmp_path, damage):
    name, harm, expected = DAMAGE[damage]
    checkpoint = published(tmp_path)
    harm(checkpoint / name)
    assert integrity.unreadable(checkpoint) == expected
    with pytest.raises(HftrainError) as info:
        training = {"output_dir": str(tmp_path), "resume_from_checkpoint": str(checkpoint)}
        CheckpointPart.of(load_recipe(None, {"training": training})).build(None).resume_point()
    assert str(info.value) == f"training.resume_from_checkpoint: {checkpoint} cannot be loaded ({expected})."


def test_a_marker_without_a_record_keeps_the_content_checks(tmp_path):
    """A checkpoint written by older hftrain: nothing recorded to compare with, so it resumes as before."""
    checkpoint = published(tmp_path)
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps({"step": 3, "world_size": 2, "strategy": "fsdp"}))
    cut_short(checkpoint / SHARD)
    assert integrity.unreadable(checkpoint) is None
    (checkpoint / TRAINER_STATE_FILE).write_text('{"global_st')
    assert integrity.unreadable(checkpoint).startswith(f"{TRAINER_STATE_FILE} (the Trainer's state): not valid JSON")


def test_records_of_several_listers_merge_and_all_are_checked(tmp_path):
    """The shape per-node publishing needs: one record per lister, merged (as gather_object returns them)."""
    from hftrain.checkpoint import integrity

    checkpoint = published(tmp_path)
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    node = tmp_path / "node1"  # what another node lists: the shard its rank wrote
    (node / "optimizer_0").mkdir(parents=True)
    (node / "optimizer_0" / "__1_0.distcp").write_bytes(b"r" * 10)
    marker["files"] = integrity.merge([marker["files"], integrity.record(node, rank=8), {}])
    assert sorted(marker["files"]) == ["rank0", "rank8"]
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert (
        integrity.unreadable(checkpoint) == f"optimizer_0/__1_0.distcp: missing ({COMPLETE_MARKER} lists it, 10 bytes)"
    )
    shutil.copytree(node / "optimizer_0", checkpoint / "optimizer_0")
    assert integrity.unreadable(checkpoint) is None
    marker["files"] = {"rank0": {"latest": {"size": "12"}}}
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert integrity.unreadable(checkpoint) == f"{COMPLETE_MARKER}: its record of the checkpoint's files is damaged"


# ------------------------------------------------------------------------------------------------------- export
def test_export_checks_the_checkpoint_before_writing_anything(tmp_path, capsys):
    checkpoint = published(tmp_path, **{"config.json": b'{"model_type": "gpt_neox"}'})
    cut_short(checkpoint / SHARD)
    out = tmp_path / "exported"
    code, printed = cli(capsys, "export", str(checkpoint), "--out", str(out))
    assert code == 2 and "Traceback" not in printed and f"exported: {out}" not in printed
    assert f"hftrain: error: {checkpoint / SHARD}: truncated ({BIG // 2:,} bytes of {BIG:,} recorded in" in printed
    assert not out.exists() and not list(tmp_path.glob(".exported*"))


def model_checkpoint(root: Path) -> Path:
    """A single-process checkpoint as export reads it: config, weights, tokenizer, with the record."""
    import safetensors.torch
    import torch

    staged = root / ".staging" / "checkpoint-3"
    staged.mkdir(parents=True)
    safetensors.torch.save_file({"w": torch.zeros(4)}, str(staged / "model.safetensors"))
    (staged / "config.json").write_text('{"model_type": "gpt_neox"}')
    (staged / "tokenizer.json").write_text("{}")
    manager.publish(staged, root / "checkpoint-3", {"step": 3, "world_size": 1, "strategy": "single"})
    return root / "checkpoint-3"


@pytest.mark.parametrize("meanwhile", ["another export finishes first", "the disk fills"])
def test_export_never_leaves_a_partial_out_and_two_at_once_do_not_mix(tmp_path, capsys, monkeypatch, meanwhile):
    checkpoint, out = model_checkpoint(tmp_path), tmp_path / "exported"
    real, copied = shutil.copy2, []

    def copy2(source, target, **kwargs):  # the export's second file: something happens to --out or the disk
        copied.append(target)
        if len(copied) == 2 and meanwhile == "the disk fills":
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        if len(copied) == 2:
            out.mkdir()
            (out / "theirs.safetensors").write_text("the other export's model")
        return real(source, target, **kwargs)

    monkeypatch.setattr(shutil, "copy2", copy2)
    code, printed = cli(capsys, "export", str(checkpoint), "--out", str(out))
    assert code == 2 and "Traceback" not in printed and f"exported: {out}" not in printed, printed
    if meanwhile == "the disk fills":
        assert "No space left on device" in printed and not out.exists()
    else:
        assert (
            f"hftrain: error: --out {out}: was filled by something else (another export?) while this export ran"
            in printed
        )
        assert os.listdir(out) == ["theirs.safetensors"]  # nothing of this export mixed in
    assert not list(tmp_path.glob(".exported*"))  # its staging removed
    monkeypatch.setattr(shutil, "copy2", real)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()  # an existing empty --out is fine, as before
    assert cli(capsys, "export", str(checkpoint), "--out", str(out))[0] == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]


# ------------------------------------------------------------------------------------------------- real formats
@pytest.mark.slow
def test_a_single_process_checkpoint_with_a_state_file_changed_is_set_aside(pretrained_run, tmp_path, capsys):
    """Same size, still valid JSON: only the checksum sees it. The run resumes from the checkpoint before."""
    run_dir = tmp_path / "run"
    shutil.copytree(pretrained_run.output_dir, run_dir, ignore=shutil.ignore_patterns("final", ".hftrain.lock"))
    older, newest = manager.complete_checkpoints(run_dir)[-2:]
    state = newest / TRAINER_STATE_FILE
    text = state.read_text()
    at = re.search(r'"loss": \d+\.(\d)', text).start(1)  # a digit of the first logged loss
    state.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(pretrained_run.as_run.recipe_yaml, encoding="utf-8")  # the recipe as the run ran it
    step = integrity.step_of(older) + 1
    code, printed = cli(capsys, "train", str(recipe), f"training.output_dir={run_dir}", f"training.max_steps={step}")
    assert code == 0, printed[-3000:]
    assert f"hftrain: warning: {newest} cannot be loaded ({TRAINER_STATE_FILE}: changed after the save" in printed
    assert f"resuming from {older}" in printed and (run_dir / f"unreadable-{newest.name}").is_dir()


@pytest.mark.slow
def test_a_lora_adapter_cut_short_is_set_aside_and_its_export_refused(pretrained_run, tmp_path, capsys):
    raw = finetune_recipe(pretrained_run.final_dir, tmp_path, "lora", max_steps=2, save_steps=1, eval_on_start=False)
    raw["monitor"]["sample_max_new_tokens"] = 0
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert cli(capsys, "train", str(recipe))[0] == 0
    run_dir = tmp_path / "lora"
    cut_short(run_dir / "checkpoint-2" / "adapter_model.safetensors")
    assert_export_refused(capsys, run_dir / "checkpoint-2", "adapter_model.safetensors", "--merge")
    code, printed = cli(capsys, "train", str(recipe), "training.max_steps=3")
    assert code == 0, printed[-3000:]
    assert (
        f"hftrain: warning: {run_dir / 'checkpoint-2'} cannot be loaded (adapter_model.safetensors: truncated ("
        in printed
    )
    assert f"resuming from {run_dir / 'checkpoint-1'}" in printed
