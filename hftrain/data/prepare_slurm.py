"""`hftrain data prepare --executor slurm`: the tasks as an array job, then a job that finishes the folder after
them (datatrove's SlurmPipelineExecutor and its `depends`).

The command submits and returns: the jobs are SLURM's, made to outlive it (a prepare is submitted from a login
node, which the user then leaves), and `scancel` ends them. What must not happen is a second submission writing the
same folder while an earlier one's jobs are queued or running: datatrove rewrites the folder's ranks_to_run.json
and executor.pik at each launch, which the earlier array's tasks read when they start, so two submissions would run
each other's tasks twice and finish the folder twice. Every job is named after its folder (`jobs_name`), and a
prepare whose folder has jobs in SLURM's queue is refused, naming them, before anything is written; a submission
killed half-way (its array submitted, its finisher not) is found the same way.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

from hftrain.data.token_folder import LOGS, PREPARED
from hftrain.errors import HftrainError

NOT_ON_PATH = "--executor slurm: sbatch is not on PATH here; run the prepare on a SLURM login node."


def jobs_name(out: str) -> str:
    """The SLURM job name of `out`'s tasks (its finisher adds -finish): the same for every launch into one folder."""
    place = out if "://" in out and not out.startswith("file://") else str(Path(out.removeprefix("file://")).resolve())
    return "hftrain-prepare-" + hashlib.sha256(place.encode()).hexdigest()[:10]


def check_no_jobs(out: str) -> None:
    """Refuse while SLURM's queue holds jobs of an earlier prepare of `out` (pending, running, or being requeued).
    A job left waiting on tasks that failed (DependencyNeverSatisfied: the finisher, datatrove's stats job) can
    never start: it is cancelled."""
    name = jobs_name(out)
    listed = _slurm("squeue", "--noheader", "--all", f"--name={name},{name}-finish", "--format=%A %i %T %r")
    jobs = sorted(  # (job id, as squeue shows it, state, reason), by job id
        (line.split(maxsplit=3) for line in listed.splitlines() if line.strip()), key=lambda job: int(job[0])
    )
    stale = [job for job, _, state, why in jobs if state == "PENDING" and why == "DependencyNeverSatisfied"]
    live = [(job, f"{shown} ({state.lower()})") for job, shown, state, _ in jobs if job not in stale]
    if live:
        ids = " ".join(dict.fromkeys(job for job, _ in live))
        raise HftrainError(
            f"--out {out}: SLURM still holds job(s) {', '.join(shown for _, shown in live)} of an earlier `hftrain "
            f"data prepare` of this folder (named {name}); a second submission would run its tasks again beside "
            f"them. Wait until `squeue --name={name},{name}-finish` lists none, or cancel them (`scancel {ids}`), "
            "then run the same command again: finished tasks are kept."
        )
    if stale:
        _slurm("scancel", *dict.fromkeys(stale))
        print(
            f"hftrain: cancelled job(s) {', '.join(dict.fromkeys(stale))} ({name}): left waiting on tasks of an "
            "earlier launch that failed, they could never start. The unfinished tasks are submitted again.",
            flush=True,
        )


def _slurm(*command: str) -> str:
    """A SLURM client command's output, or one message saying why there is none."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise HftrainError(NOT_ON_PATH.replace("sbatch", command[0])) from None
    except subprocess.TimeoutExpired:
        raise HftrainError(
            f"--executor slurm: {command[0]} gave no answer within 60 s; is the controller up?"
        ) from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise HftrainError(f"--executor slurm: {command[0]} failed ({said}); is the cluster's controller up?")
    return done.stdout


def submit(steps: list[Any], finish: Any, logs: Any, out: str, tasks: int, how: Any) -> None:
    """An array job of the unfinished tasks, then a job that finishes the folder once they all succeeded."""
    from datatrove.executor.slurm import SlurmPipelineExecutor

    name = jobs_name(out)
    common = dict(
        time=how.time,
        partition=how.partition,
        qos=how.qos or "",
        env_command=f"export PATH={Path(sys.executable).parent}:$PATH",  # the jobs run this environment's Python
        sbatch_args=dict(how.sbatch_args),
        mail_type="NONE",
    )
    main = SlurmPipelineExecutor(
        steps,
        tasks=tasks,
        workers=how.workers or -1,
        job_name=name,
        logging_dir=logs,
        cpus_per_task=how.cpus_per_task,
        mem_per_cpu_gb=how.mem_per_cpu_gb,
        **common,
    )
    finisher_logs = (f"{logs[0]}/finish", logs[1]) if isinstance(logs, tuple) else f"{logs}/finish"
    finisher = SlurmPipelineExecutor(
        [finish], tasks=1, depends=main, job_name=f"{name}-finish", logging_dir=finisher_logs, **common
    )
    try:
        main.launch_job()  # job_id -1: every task finished already (a launch killed after its array ran)
        finisher.run()  # after `main`, or at once when it had nothing to run
    except FileNotFoundError:
        raise HftrainError(NOT_ON_PATH) from None
    except subprocess.CalledProcessError:
        raise HftrainError(
            "--executor slurm: sbatch refused the job (its message is above); check --partition, --time, --qos, "
            "--cpus-per-task and --mem-per-cpu-gb against the cluster's limits."
        ) from None
    tasks_line = (
        f"job {main.job_id} ({tasks} task(s)) and job {finisher.job_id}, which finishes {out} ({PREPARED}) after them"
        if main.job_id != -1
        else f"job {finisher.job_id}, which finishes {out} ({PREPARED}): its {tasks} task(s) are done"
    )
    print(
        f"hftrain: submitted {tasks_line}. Logs: {out.rstrip('/')}/{LOGS}; `squeue --name={name},{name}-finish` "
        "lists them. Run the same command again after a failure: only the unfinished tasks are submitted.",
        flush=True,
    )
