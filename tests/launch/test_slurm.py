"""A real SLURM (slurmctld + slurmd on this machine, tests/support/slurm.py): the script `hftrain launch-script --kind
slurm --cpu` writes is submitted with sbatch, preempted the way SLURM warns before a preemption (SIGUSR1 to the
batch shell, `--signal=B:USR1@180`), saves, exits 75, is requeued by its own script, waits (Reason=BeginTime) until
released, resumes and finishes with the uninterrupted run's losses. And `hftrain data prepare --executor slurm` on 2
node agents: datatrove's array job and the job that depends on it give the folder one machine gives."""

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


def test_slurm_preempted_job_requeues_and_finishes_with_the_uninterrupted_losses(
    tmp_path, slurm, long_recipe, ddp_40_steps
):
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
            state = (
                f"{fields['JobState']} (Reason={fields['Reason']}, Restarts={fields['Restarts']}, "
                f"ExitCode={fields['ExitCode']})"
            )
            if not states or states[-1] != state:
                states.append(state)
            done = fields["JobState"] in until and (
                reason is None or fields["JobState"] != "PENDING" or fields["Reason"] == reason
            )
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
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (
        states,
        (tmp_path / f"recipe-{job}.out").read_text()[-3000:],
    )
    # COMPLETING (SLURM cleaning up the job's processes) shows between RUNNING and PENDING when a poll lands in it.
    named = [s.split()[0] for s in states if not s.startswith("COMPLETING")]
    seen = [s for i, s in enumerate(named) if i == 0 or s != named[i - 1]]
    assert seen[-4:] == ["RUNNING", "PENDING", "RUNNING", "COMPLETED"] and "Reason=BeginTime, Restarts=1" in "".join(
        states
    ), states
    log = (tmp_path / f"recipe-{job}.out").read_text()
    assert f"resuming from {run_dir / f'checkpoint-{saved}'}" in log
    assert_resumed_matches(ddp_40_steps, metrics_losses(run_dir), range(saved + 1, 41), "requeued")


# `data prepare --executor slurm` killed (an OOM kill, a closed terminal) after sbatch took its array job and before
# the finisher was submitted; the array is held first, so that it is still queued when the next launch comes.
KILLED_AFTER_THE_ARRAY = """
import os, signal, subprocess, sys
from datatrove.executor.slurm import SlurmPipelineExecutor
real = SlurmPipelineExecutor.launch_job
def launch_job(self):
    real(self)
    if not self.job_name.endswith("-finish") and self.job_id not in (None, -1):
        subprocess.run(["scontrol", "hold", str(self.job_id)], check=True)
        os.kill(os.getpid(), signal.SIGKILL)
SlurmPipelineExecutor.launch_job = launch_job
from hftrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_prepare_on_slurm_gives_the_folder_one_machine_gives(tmp_path):
    """`hftrain data prepare --executor slurm` on a real SLURM of 2 node agents: an array job of the tasks (on both
    agents), then the job that finishes the folder after them; the folder equals the one prepared here, byte for
    byte. The launch that submits them is killed between the two: the same command is refused while the array is
    queued (before: submitted again, rewriting the ranks the queued array reads), and after the array ran it submits
    only the finisher."""
    import json
    import re
    import signal
    import subprocess

    import yaml

    from hftrain.data.part import DataPart
    from hftrain.data.prepare import PrepareHow, prepare
    from hftrain.data.prepare_slurm import jobs_name
    from hftrain.recipe.load import load_recipe

    from ..data.test_token_folders import corpus, folder_digest, gpt2_recipe

    raw = gpt2_recipe(corpus(tmp_path, files=4, docs=800), tmp_path / "unused")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    here = prepare(DataPart.of(load_recipe(None, raw)), str(tmp_path / "here"), PrepareHow(workers=1), task_mb=0)
    cluster = start_slurm(tmp_path / "slurm", agents=2)
    try:
        env = {**cluster.env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{cluster.env['PATH']}"}
        out = tmp_path / "on-slurm"
        argv = ["data", "prepare", str(recipe), "--out", str(out), "--executor", "slurm", "--partition", "debug"]
        argv += ["--time", "10:00", "--workers", "2", "--mem-per-cpu-gb", "1", "--task-mb", "0"]
        died = subprocess.run(
            [sys.executable, "-c", KILLED_AFTER_THE_ARRAY, *argv],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **env},
        )
        assert died.returncode == -signal.SIGKILL, died.stderr[-3000:]
        name = jobs_name(str(out))
        queued = cluster.run("squeue", "--noheader", f"--name={name}", "-o", "%A %r").splitlines()
        array = next(line.split()[0] for line in queued if "JobHeldAdmin" in line)  # beside it, datatrove's stats job
        again = run_in_process(*argv, env=env)
        assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-3000:]
        said = again.stderr.strip()
        assert re.search(rf"--out {out}: SLURM still holds job\(s\) {array}\S* \(pending\)", said), said
        assert f"or cancel them (`scancel {array} " in said and "\n" not in said, said
        cluster.run("scontrol", "release", array)
        deadline = time.monotonic() + 300
        while cluster.run("squeue", "--noheader", f"--name={name}").strip():
            assert time.monotonic() < deadline, cluster.run("squeue", "-a", "-o", "%i %T %r %N")
            time.sleep(1)
        assert not (out / "prepared.json").exists()  # the killed launch submitted no finisher
        submitted = run_in_process(*argv, env=env)
        assert submitted.returncode == 0, submitted.stderr[-3000:]
        assert f"which finishes {out} (prepared.json): its 4 task(s) are done" in submitted.stdout, submitted.stdout
        deadline = time.monotonic() + 300
        while not (out / "prepared.json").is_file():
            assert time.monotonic() < deadline, (
                cluster.run("squeue", "-a", "-o", "%i %T %r %N"),
                {p.name: p.read_text()[-1500:] for p in (out / "logs").rglob("*.out")},
            )
            time.sleep(1)
        assert json.loads((out / "prepared.json").read_text()) == here
        assert folder_digest(out) == folder_digest(tmp_path / "here")
        ran = {
            agent: (tmp_path / "slurm" / "log" / f"d-{agent}.log").read_text().count("Launching batch job")
            for agent in ("agent1", "agent2")
        }
        assert all(ran.values()), ran  # both node agents ran tasks
        too_big = [*argv[:4], str(tmp_path / "too-big"), *argv[5:-3], "100000", *argv[-2:]]  # 100 TB per CPU
        refused = run_in_process(*too_big, env=env)  # sbatch refuses the job
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert (
            "hftrain: error: --executor slurm: sbatch refused the job (its message is above); check --partition"
            in refused.stderr
        )
    finally:
        cluster.stop()
