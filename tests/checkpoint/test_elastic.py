"""Resume, on the same or another process count, with the same data order and the same losses.

For each sharded backend (FSDP, ZeRO-3), in fp32 on gloo, on the 2-process run of reference_runs.py (whose
per-step losses equal one process's: test_distributed.py, the data order belongs to the run, not the launch): its mid
checkpoint continues with the uninterrupted run's losses (loss 1e-5 relative, grad norm 1e-4); the sharded
checkpoint exports to one model; one with a shard cut short is set aside at resume, and its export and explicit
resume are refused with one message (integrity.py). On another process count: the state, tensor by tensor, in
test_elastic_state.py; the losses by `hftrain parity --elastic` on DDP and by a kill -9 of a 2-process run
continued on 1 process.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from hftrain.checkpoint import layout
from hftrain.checkpoint import manager as ckpt
from hftrain.checkpoint.integrity import step_of
from hftrain.checkpoint.layout import RunLayout

from ..support.checks import assert_export_refused, assert_same_steps, copy_checkpoint, damaged_copy, steps, train_log
from ..support.cli import EXPECTED_TYPE, in_background, in_process, kill_at_checkpoint, messages, run_in_process
from ..support.reference_runs import SAVE, STEPS, train

SHARD = {
    "fsdp": "pytorch_model_fsdp_0/__1_0.distcp",
    "zero3": f"global_step{STEPS}/zero_pp_rank_1_mp_rank_00_optim_states.pt",
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_sharded_backend_matches_one_process_resumes_and_exports(sharded_yaml, backend_run, tmp_path, backend, capsys):
    """One sharded run (shared: reference_runs.py) checked every way: what accelerate set up, an exact resume (past a
    newer checkpoint with a shard cut short, set aside), and its sharded checkpoint exported as one model (the
    damaged one refused). Its losses equal one process's from the start (test_distributed.py's backend agreement,
    on the same runs). A resume on another process count restores this state exactly (test_elastic_state.py,
    tensor by tensor) and the data position (the same code for every backend: `parity --elastic` below and the
    kill -9 test, on DDP)."""
    two = backend_run(backend, 2)
    results = json.loads(RunLayout(two).results.read_text())
    assert (results["distributed_type"], results["world_size"], results["data_readers"]) == (
        EXPECTED_TYPE[backend],
        2,
        8,
    )
    for rank in (0, 1):
        assert (two / f"checkpoint-{SAVE}" / layout.data_state_file(rank)).is_file()
    said = (two.parent / "launch.log").read_text()
    # DeepSpeed's inference-only shared-memory op is not compiled in a CPU rehearsal (_compat.skip_shm_comm_build),
    # and its calls of deprecated collectives do not fill the log (_compat.quiet_collective_deprecations: 300 times)
    assert "shm_comm" not in said and "is deprecated. Please use `torch.distributed" not in said, said[-3000:]

    resumed = tmp_path / "resumed"
    copy_checkpoint(two, resumed, f"checkpoint-{SAVE}")
    shard = SHARD[backend]
    damaged = damaged_copy(two / f"checkpoint-{STEPS}", resumed, shard)  # newer, one rank's shard cut short
    out = train(sharded_yaml, backend, 2, resumed).stdout
    aside = resumed / f"unreadable-checkpoint-{STEPS}"
    assert f"hftrain: warning: {damaged} cannot be loaded ({shard}: truncated (" in out, out[-3000:]
    assert f"kept as {aside}" in out and f"resuming from {resumed / f'checkpoint-{SAVE}'}" in out
    assert_same_steps(steps(two), steps(resumed), range(SAVE + 1, STEPS + 1), f"{backend}: resumed")
    assert min(steps(resumed)) == SAVE + 1

    # the last (sharded) checkpoint consolidated into one model that plain transformers loads: the final model's
    exported = tmp_path / "exported"
    code, printed = in_process(capsys, "export", str(two / f"checkpoint-{STEPS}"), "--out", str(exported))
    assert code == 0, printed[-3000:]
    from transformers import AutoModelForCausalLM  # a standard model directory (plain loading: test_train.py)

    ids = torch.arange(1, 20).unsqueeze(0)
    with torch.no_grad():
        a, b = (AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits for d in (exported, two / "final"))
    assert float((a - b).abs().max()) < 1e-5

    assert_export_refused(capsys, aside, shard)  # checked before anything is written
    code, printed = in_process(
        capsys,
        "train",
        str(sharded_yaml),
        "--accelerate-config",
        backend,
        "--nproc",
        "2",
        f"training.output_dir={resumed}",
        f"training.resume_from_checkpoint={aside}",
    )
    cut, whole = (aside / shard).stat().st_size, (two / f"checkpoint-{STEPS}" / shard).stat().st_size
    assert code == 2, printed[-3000:]
    assert messages(printed) == [  # one message, before any process starts
        f"hftrain: error: training.resume_from_checkpoint: {aside} cannot be loaded ({shard}: truncated ({cut:,} bytes "
        f"of {whole:,} recorded in hftrain_complete.json))."
    ]


@pytest.mark.slow
def test_a_killed_2_process_run_continues_on_1(sharded_yaml, tmp_path):
    """kill -9 of a 2-process DDP run, continued on 1 process: the uninterrupted run's losses, and the same kept
    checkpoints."""
    # 24 steps, killed once a checkpoint at step 6 or later is complete: the kill must land while the run is still
    # going, and a 2-core CI host can starve this poller for seconds (a 12-step run once ended unseen between polls).
    # With checkpoints kept for study (issue 30): they survive the kill, the resume on 1 process and rotation.
    total, every = 24, 3
    run_dir, straight = tmp_path / "killed", tmp_path / "straight"
    budget = [
        f"training.max_steps={total}",
        f"training.save_steps={every}",
        "training.save_total_limit=2",
        "checkpoints.schedule=log",
        "checkpoints.log_until=4",
        "checkpoints.steps=[10]",
    ]
    cmd = [
        sys.executable,
        "-m",
        "hftrain",
        "train",
        str(sharded_yaml),
        "--accelerate-config",
        "ddp",
        "--nproc",
        "2",
        f"training.output_dir={run_dir}",
        *budget,
    ]
    uninterrupted = in_background(lambda: train(sharded_yaml, "ddp", 2, straight, *budget))
    survivor = kill_at_checkpoint(cmd, run_dir, 6)
    at = step_of(survivor)  # read now: rotation (save_total_limit 2) removes it once the run goes on
    assert 6 <= at < total
    out = train(sharded_yaml, "ddp", 1, run_dir, *budget).stdout
    assert f"resuming from {survivor}\n" in out
    uninterrupted.result()
    resumed = {e["step"]: (e["loss"], e["grad_norm"]) for e in train_log(run_dir) if e["step"] > at}
    assert sorted(resumed) == list(range(at + 1, total + 1))
    assert_same_steps(steps(straight), resumed, range(at + 1, total + 1), "kill -9, 2 -> 1")
    kept = [1, 2, 4, 10, 21, 24]  # the schedule's, and the 2 newest of save_steps' (rotated)
    for run in (straight, run_dir):
        assert [ckpt.checkpoint_step(c) for c in ckpt.complete_checkpoints(run)] == kept, run
    # step 0, the initialization, written once when each run started (not again at the resume): the seed's weights
    assert (straight / "initial" / "model.safetensors").read_bytes() == (
        run_dir / "initial" / "model.safetensors"
    ).read_bytes()


@pytest.mark.slow(seconds=80)  # the suite's order: the longest files start first (tests/conftest.py)
def test_parity_elastic_prints_its_summary(sharded_yaml, tmp_path):
    result = run_in_process(
        "parity", str(sharded_yaml), "--elastic", "--backends", "DDP", "--steps", "4", f"training.output_dir={tmp_path}"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-3].split()[:4] == ["backend", "1", "vs", "2"] and lines[-2].startswith("DDP ")
    loss_diff, norm_diff = (
        float(x) for x in lines[-1].removeprefix("elastic: max relative loss diff ").split(", grad-norm diff ")
    )
    assert loss_diff < 1e-5 and norm_diff < 1e-4
