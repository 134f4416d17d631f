"""Elastic resume, the model and optimizer side: a checkpoint written by M processes loads on N under the same
backend with exactly the state that was saved (gathered and compared tensor by tensor, so independent of the
data order), and a backend switch is refused with one message.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from hftrain.checkpoint import elastic
from hftrain.checkpoint.layout import COMPLETE_MARKER, RunLayout
from hftrain.errors import HftrainError

from ..support.cli import in_process, messages
from ..support.data import make_documents, tiny_recipe, write_jsonl
from ..support.elastic import compare, run_dumping


def fake_checkpoint(root: Path, marker: dict, dirs: tuple[str, ...] = (), files: tuple[str, ...] = ()) -> Path:
    checkpoint = root / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker), encoding="utf-8")
    for name in dirs:
        (checkpoint / name).mkdir()
    for name in files:
        (checkpoint / name).write_bytes(b"")
    return checkpoint


# ------------------------------------------------------------------------- backend switches (no processes)
def test_a_backend_switch_is_refused_with_one_message(tmp_path):
    checkpoint = fake_checkpoint(tmp_path, {"step": 3, "world_size": 2, "strategy": "zero3"}, dirs=("global_step3",))
    with pytest.raises(HftrainError) as info:
        elastic.check_backend(checkpoint, "fsdp", 1)
    message = str(info.value)
    assert message.startswith(
        f"{checkpoint}: written by DeepSpeed ZeRO-3 (recorded in its {COMPLETE_MARKER}, 2 process(es)), "
        "but this run is launched as FSDP (1 process(es))."
    )
    assert "hftrain train RECIPE --accelerate-config zero3 --nproc N" in message
    assert "training.resume_from_checkpoint=false" in message
    # another process count under the same backend is no switch, and single <-> DDP share one format
    assert elastic.check_backend(checkpoint, "zero3", 1).world_size == 2
    full = fake_checkpoint(tmp_path / "full", {"step": 3, "world_size": 2, "strategy": "ddp"})
    assert elastic.check_backend(full, "single", 1).format == "full"
    with pytest.raises(HftrainError, match=r"written by DDP .* launched as FSDP .*--accelerate-config ddp"):
        elastic.check_backend(full, "fsdp", 2)


@pytest.mark.parametrize(
    ("dirs", "files", "fmt"),
    [
        (("pytorch_model_fsdp_0", "optimizer_0"), ("rng_state_0.pth", "rng_state_1.pth"), "fsdp"),
        (("global_step3",), ("latest", "rng_state_0.pth", "rng_state_1.pth"), "zero3"),
        ((), ("model.safetensors", "optimizer.pt", "rng_state.pth"), "full"),
    ],
)
def test_older_checkpoints_are_judged_by_their_files(tmp_path, dirs, files, fmt):
    # no strategy, no world size: hftrain before elastic resume
    checkpoint = fake_checkpoint(tmp_path, {"step": 3}, dirs, files)
    written = elastic.written_by(checkpoint)
    assert (written.format, written.strategy, written.from_files) == (fmt, None, True)
    assert written.world_size == (1 if fmt == "full" else 2)
    other = "zero3" if fmt != "zero3" else "ddp"
    with pytest.raises(HftrainError, match="judged from its files"):
        elastic.check_backend(checkpoint, other, 2)


def test_the_cli_refuses_a_switch_before_starting_processes(tmp_path, capsys):
    out = tmp_path / "run"
    fake_checkpoint(out, {"step": 3, "world_size": 1, "strategy": "fsdp"}, dirs=("pytorch_model_fsdp_0",))
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tmp_path / "train.jsonl", out)), encoding="utf-8")
    code, printed = in_process(capsys, "train", str(recipe), "--accelerate-config", "zero3", "--nproc", "2")
    assert code == 2, printed[-3000:]
    lines = messages(printed)
    assert len(lines) == 1 and "Traceback" not in printed, printed[-3000:]
    assert lines[0].startswith(f"hftrain: error: {out / 'checkpoint-3'}: written by FSDP")
    assert "launched as DeepSpeed ZeRO-3 (2 process(es))" in lines[0]


def test_rng_state_on_another_process_count_is_the_writers_rank_0(tmp_path):
    checkpoint = fake_checkpoint(tmp_path, {"step": 3, "world_size": 2, "strategy": "ddp"})
    import numpy as np

    for rank in (0, 1):
        torch.manual_seed(100 + rank)
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
        torch.save(state, checkpoint / f"rng_state_{rank}.pth")
    expected = torch.load(checkpoint / "rng_state_0.pth", weights_only=False)["cpu"]

    class Args:
        world_size = 1

    class Trainer:
        args = Args()

    torch.manual_seed(7)
    assert elastic.load_rng_state(Trainer(), str(checkpoint))
    assert torch.equal(torch.random.get_rng_state(), expected)
    Args.world_size = 2  # the writer's count: the Trainer's own loader applies
    assert not elastic.load_rng_state(Trainer(), str(checkpoint))


# ------------------------------------------------------------------------------ state across process counts
@pytest.fixture(scope="module")
def tiny_yaml(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    data = write_jsonl(root / "train.jsonl", make_documents(600))
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(data, root / "unused")), encoding="utf-8")
    return path


def resume_copy(run_dir: Path, new_dir: Path, checkpoint: str) -> None:
    """`new_dir` as `run_dir` was right after `checkpoint` (the checkpoint, its tokenizer and run file)."""
    new_dir.mkdir()
    for name in (checkpoint, RunLayout.TOKENIZER_DIR, RunLayout.RUN_FILE):
        (shutil.copytree if (run_dir / name).is_dir() else shutil.copy)(run_dir / name, new_dir / name)


def digests(checkpoint: Path) -> dict[str, str]:
    skip = (elastic.UNIVERSAL_TAG, elastic.LATEST_UNIVERSAL)
    return {
        str(f.relative_to(checkpoint)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(checkpoint.rglob("*"))
        if f.is_file() and f.relative_to(checkpoint).parts[0] not in skip
    }


def assert_same_state(saved_file: Path, loaded_file: Path, counts: tuple[int, int]) -> None:
    saved, loaded = torch.load(saved_file, weights_only=False), torch.load(loaded_file, weights_only=False)
    assert (saved["world_size"], loaded["world_size"]) == counts
    assert saved["step"] == loaded["step"]
    # a trained optimizer, not fresh
    assert min(float(s["exp_avg_sq"].abs().max()) for s in saved["state"].values()) > 0
    worst = compare(saved, loaded)
    assert max(worst.values()) <= 1e-7, worst


STATE_STEPS = ("training.max_steps=5", "training.save_steps=2", "training.save_total_limit=0")


@pytest.fixture(scope="module")
def written_by_two(tiny_yaml, tmp_path_factory):
    """backend -> (run directory, the state dumped right after its checkpoint-2) of 2 processes training 5 steps
    saving every 2, trained once per module (the ZeRO-3 one is resumed by two tests). Resumes start from copies."""
    runs: dict[str, tuple[Path, Path]] = {}

    def get(many: str) -> tuple[Path, Path]:
        if many not in runs:
            root = tmp_path_factory.mktemp(f"two-{many}")
            run_dumping(tiny_yaml, many, 2, root / "run", root / "two", "save:2", *STATE_STEPS)
            runs[many] = (root / "run", root / "two-save2.pt")
        return runs[many]

    return get


@pytest.mark.slow(seconds=80)  # the suite's order: the longest files start first (tests/conftest.py)
@pytest.mark.parametrize(("many", "one"), [("ddp", "single"), ("fsdp", "fsdp"), ("zero3", "zero3")])
def test_state_loads_on_another_process_count(tiny_yaml, written_by_two, tmp_path, many, one):
    """2 processes write checkpoint-2; 1 process resumes it (and writes checkpoint-4); 2 processes resume that.
    At each resume, the gathered parameters and AdamW moments equal those saved. (A resumed run keeps its
    checkpoint's save_steps: the Trainer takes it from trainer_state.json.)"""
    (two, saved), single, back = written_by_two(many), tmp_path / "one", tmp_path / "back"
    resume_copy(two, single, "checkpoint-2")
    before = digests(single / "checkpoint-2")
    run_dumping(tiny_yaml, one, 1, single, tmp_path / "one", "begin,save:4", *STATE_STEPS)
    assert_same_state(saved, tmp_path / "one-begin.pt", (2, 1))
    assert digests(single / "checkpoint-2") == before  # the original files are never changed
    marker = json.loads((single / "checkpoint-4" / COMPLETE_MARKER).read_text())
    assert (marker["strategy"], marker["world_size"]) == (one, 1)

    resume_copy(single, back, "checkpoint-4")
    run_dumping(tiny_yaml, many, 2, back, tmp_path / "back", "begin", *STATE_STEPS)
    assert_same_state(tmp_path / "one-save4.pt", tmp_path / "back-begin.pt", (1, 2))
    if many == "zero3":
        assert elastic.universal_ready(single / "checkpoint-2") and elastic.universal_ready(back / "checkpoint-4")


@pytest.mark.slow
def test_an_interrupted_universal_conversion_is_redone(tiny_yaml, written_by_two, tmp_path):
    """A kill during the ZeRO-3 conversion leaves a partial folder: the next start removes it and converts again."""
    (two, saved), one = written_by_two("zero3"), tmp_path / "one"
    resume_copy(two, one, "checkpoint-2")
    checkpoint = one / "checkpoint-2"
    (checkpoint / elastic.UNIVERSAL_PARTIAL / "universal" / "zero").mkdir(parents=True)  # as a kill leaves it
    (checkpoint / elastic.UNIVERSAL_TAG).mkdir()
    run_dumping(tiny_yaml, "zero3", 1, one, tmp_path / "one", "begin", *STATE_STEPS)
    assert_same_state(saved, tmp_path / "one-begin.pt", (2, 1))
    assert not (checkpoint / elastic.UNIVERSAL_PARTIAL).exists()
