"""A real SLURM (slurmctld + slurmd on this machine, tests/support/slurm.py): the script `hftrain launch-script --kind
slurm --cpu` writes is submitted with sbatch, preempted the way SLURM warns before a preemption (SIGUSR1 to the
batch shell, `--signal=B:USR1@180`), saves, exits 75, is requeued by its own script, waits (Reason=BeginTime) until
released, resumes and finishes with the uninterrupted run's losses."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from ..support.checks import assert_resumed_matches, metrics_losses
from ..support.cli import run_in_process
from ..support.slurm import start_slurm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    cluster.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{cluster.env['PATH']}"  # hftrain for the job
    yield cluster
    cluster.stop()


def test_slurm_preempted_job_requeues_and_finishes_with_the_uninterrupted_losses(tmp_path, slurm, long_recipe, ddp_40_steps):
    """The job runs the 40 steps of reference_runs.py's recipe, whose uninterrupted run it is compared with."""
    run_dir, script = tmp_path / "run", tmp_path / "job.sh"
    rendered = run_in_process(
        "launch-script",
        str(long_recipe),
        "--kind",
        "slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--cpu",
        "--accelerate-config",
        "ddp",
        "--out",
        str(script),
        f"training.output_dir={run_dir}",
    )
    assert rendered.returncode == 0, rendered.stderr
    job = slurm.sbatch(script, tmp_path)
    states: list[str] = []

    def watch(until: set[str], timeout: float = 300, reason: str | None = None) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            fields = slurm.job(job)
            state = f"{fields['JobState']} (Reason={fields['Reason']}, Restarts={fields['Restarts']}, ExitCode={fields['ExitCode']})"
            if not states or states[-1] != state:
                states.append(state)
            done = fields["JobState"] in until and (reason is None or fields["JobState"] != "PENDING" or fields["Reason"] == reason)
            if done or time.monotonic() > deadline:
                return fields
            time.sleep(0.2)

    deadline = time.monotonic() + 300
    while not any((run_dir / f"checkpoint-{s}" / "hftrain_complete.json").is_file() for s in (5, 10, 15)):
        assert time.monotonic() < deadline, f"no checkpoint; job: {slurm.job(job)}"
        time.sleep(0.1)
    slurm.run("scancel", "--signal=USR1", "--batch", job)  # what --signal=B:USR1@180 sends before a preemption
    fields = watch({"PENDING", "COMPLETED", "FAILED"}, 120, reason="BeginTime")
    assert (fields["JobState"], fields["Reason"], fields["Restarts"]) == ("PENDING", "BeginTime", "1"), states
    saved = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*"))[-1]
    assert 5 <= saved < 40, saved
    # Released within the second of its requeue, slurmd refused to start it ("Killing non-startable batch JobId=1:
    # Job credential revoked": it revokes the job's credentials with a time of whole seconds): wait for the node to
    # finish with the first run, and for the next second, as an operator or a preemption's end would.
    deadline = time.monotonic() + 60
    while "State=IDLE" not in slurm.run("scontrol", "show", "node"):
        assert time.monotonic() < deadline, slurm.run("scontrol", "show", "node")
        time.sleep(0.2)
    time.sleep(2.0)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")  # a requeued job waits; release it
    fields = watch({"COMPLETED", "FAILED"})
    print("job states, as scontrol show job recorded them:\n  " + "\n  ".join(states))
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (states, (tmp_path / f"recipe-{job}.out").read_text()[-3000:])
    # COMPLETING (SLURM cleaning up the job's processes) shows between RUNNING and PENDING when a poll lands in it.
    named = [s.split()[0] for s in states if not s.startswith("COMPLETING")]
    seen = [s for i, s in enumerate(named) if i == 0 or s != named[i - 1]]
    assert seen[-4:] == ["RUNNING", "PENDING", "RUNNING", "COMPLETED"] and "Reason=BeginTime, Restarts=1" in "".join(states), states
    log = (tmp_path / f"recipe-{job}.out").read_text()
    assert f"resuming from {run_dir / f'checkpoint-{saved}'}" in log
    assert_resumed_matches(ddp_40_steps, metrics_losses(run_dir), range(saved + 1, 41), "requeued")
