"""`hftrain data prepare` (tokenize once, on datatrove, into a token folder) and `hftrain data inspect`.

A prepare is a datatrove pipeline (prepare_steps.py) of one task per input shard, run by the executor the flags
pick: `local` (a process pool on this machine's cores; several machines share the task space with --tasks and
--task-offset), `slurm` (an array job, then a dependent job that finishes the folder) or `ray`. Every task ends
with a completion marker in OUT/logs, so a prepare killed and run again does only the tasks that had not finished.
The folder is datatrove's tokenized layout (token_folder.py), read by training with `data.train: {pretokenized: OUT}`.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from hftrain import network
from hftrain.checkpoint.output_lock import LOCK_FILE, LOCK_FILES, owning
from hftrain.data import prepare_slurm
from hftrain.data.loader import DataPlan, first_documents, plan_data
from hftrain.data.part import DataPart
from hftrain.data.prepare_progress import Progress, completed_tasks, tasks_console
from hftrain.data.token_folder import LOGS, OLD_MANIFEST, PREPARED, token_size_for
from hftrain.errors import HftrainError, Terminated
from hftrain.model.tokenizer import load_tokenizer

EXECUTORS = ("local", "slurm", "ray")
UPLOAD_PART = 64 * 2**20  # bytes per part of a remote upload: S3's 10,000 parts then hold 640 GB per file
# input files per task, grouped to about this size: a task costs ~0.1
# s to start, so the builtin corpus (577 modules) is 2 tasks, not 577
TASK_MB = 16.0


@dataclass(frozen=True)
class PrepareHow:
    """How a prepare runs (the command's flags); none of it changes the folder's bytes."""

    executor: str = "local"
    workers: int | None = None  # tasks at once: local/ray default every core; slurm default no limit
    tasks: int | None = None  # this launch's share of the task space: tasks [task_offset, task_offset + tasks)
    task_offset: int = 0
    partition: str | None = None  # slurm
    time: str = "24:00:00"  # slurm, per task
    cpus_per_task: int = 1  # slurm, ray
    mem_per_cpu_gb: int = 2  # slurm (a whole number of GB, as sbatch takes it), ray
    qos: str | None = None  # slurm
    sbatch_args: dict[str, str] = field(default_factory=dict)

    @property
    def shared(self) -> bool:
        """Other launches write into the same folder (other machines, the cluster's jobs): datatrove's completion
        markers coordinate them, and no launch owns the folder."""
        return self.tasks is not None or self.task_offset > 0 or self.executor == "slurm"


def prepare(
    part: DataPart,
    out: str,
    how: PrepareHow = PrepareHow(),
    storage_options: dict[str, Any] | None = None,
    shuffle: bool = True,
    task_mb: float = TASK_MB,
) -> dict[str, Any] | None:
    """Tokenize the recipe's training data into a token folder at `out` (local or URL), in tasks of about `task_mb`
    MB of input files (prepare_steps.task_units). Returns prepared.json when the folder was finished here; None
    when tasks are left to other launches or were submitted to SLURM."""
    from hftrain.data.prepare_steps import FinishFolder, RecipeDocuments, RecipeTokenizer, request_of, task_units

    options = storage_options or {}
    network.require_backend(out, "--out")
    plan = plan_data(part.data, part.seed)
    _check_preparable(plan)
    tasks = task_units(plan, task_mb * 2**20)
    first, count = _task_range(how, len(tasks))
    if how.executor == "slurm":
        prepare_slurm.check_no_jobs(out)  # an earlier submission's jobs still write this folder
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, _ = load_tokenizer(part.model, Path(tmp), lambda n: first_documents(plan, n))
    request = request_of(plan, tokenizer, len(tasks), shuffle, task_mb)
    fs, root = fsspec.core.url_to_fs(out, **options)
    root = root.rstrip("/")
    _claim_out(fs, root, out, request, before_lock=True)  # a refused prepare writes nothing (not even a lock)
    with nullcontext() if how.shared else owning(out, "--out", options), tempfile.TemporaryDirectory() as work:
        done_before = _claim_out(fs, root, out, request)
        _write_start(fs, root, request, tokenizer, work)
        remote = "://" in out and not out.startswith("file://")
        scratch = work if remote and how.executor != "slurm" else None  # shuffled locally, then uploaded
        tokenizing = RecipeTokenizer(
            (out, options) if options else out, tokenizer, part.seed, shuffle, scratch, UPLOAD_PART if remote else None
        )
        steps = [RecipeDocuments(plan, tasks), tokenizing]
        finish = FinishFolder(out, options, plan, tokenizer, request)
        logs = (f"{out.rstrip('/')}/{LOGS}", options) if options else f"{out.rstrip('/')}/{LOGS}"
        if how.executor == "slurm":
            prepare_slurm.submit(steps, finish, logs, out, len(tasks), how)
            return None
        started = time.perf_counter()
        console = Path(root) / LOGS / "console.log" if not remote else Path(work) / "console.log"
        console.parent.mkdir(parents=True, exist_ok=True)
        with tasks_console(console) as said, Progress(fs, root, len(tasks), token_size_for(len(tokenizer)), said):
            _run_here(steps, logs, len(tasks), first, count, how, fs, root, console)
        done = completed_tasks(fs, root)
        if len(done) < len(tasks):
            print(
                f"hftrain: tasks {first}..{first + count - 1} of {len(tasks)} are done here ({len(done)} of "
                f"{len(tasks)} in all); the launch that finishes the last task finishes the folder ({PREPARED}).",
                flush=True,
            )
            return None
        prepared = finish.finish()
    _say_prepared(out, prepared, len(tasks) - done_before, time.perf_counter() - started)
    return prepared


def _say_prepared(out: str, prepared: dict[str, Any], ran: int, seconds: float) -> None:
    tasks = prepared["tasks"]
    print(
        f"prepared {out}: {len(prepared['files'])} file(s), "
        f"{prepared['tokens']:,} tokens in datatrove's tokenized layout "
        f"({ran} of {tasks} task(s) run here, {prepared['tokens'] * ran / tasks / max(seconds, 1e-9):,.0f} tokens/s), "
        f"{prepared['validation_tokens']:,} validation tokens, {prepared['token_size']}-byte tokens.\n"
        + (
            f"data.on_bad_record=skip: {prepared['skipped_records']:,} bad record(s) or file(s) left out "
            "(data.on_bad_record=fail names the first).\n"
            if prepared.get("skipped_records")
            else ""
        )
        + f"train from it with:  data.train: {{pretokenized: {out}}}   tokenizer: {{path: {out.rstrip('/')}/tokenizer}}"
    )


def _check_preparable(plan: DataPlan) -> None:
    """Plain text sources only; a note when the sources have weights (a folder holds each document once)."""
    section = plan.section
    if plan.folders:
        raise HftrainError("data.train: is already tokenized (pretokenized); give the text sources to prepare.")
    if section.instruction_data or section.preference_data:
        raise HftrainError(
            "data.train: instruction and preference data are tokenized as they are read (with their loss masks); "
            "`hftrain data prepare` takes plain text sources."
        )
    if len({s.weight for s in section.train}) > 1:
        print(
            "hftrain: note: a prepared folder holds every document of every source once: the sources' weights apply "
            "only when each source is prepared into its own folder and training lists the folders with their weights.",
            flush=True,
        )


def _task_range(how: PrepareHow, tasks: int) -> tuple[int, int]:
    if how.executor not in EXECUTORS:
        raise HftrainError(f"--executor {how.executor}: give one of {', '.join(EXECUTORS)}.")
    count = how.tasks if how.tasks is not None else tasks - how.task_offset
    if how.task_offset >= tasks or count <= 0 or how.task_offset + count > tasks:
        raise HftrainError(
            f"--tasks {how.tasks} --task-offset {how.task_offset}: this data has {tasks} task(s) (input files grouped "
            f"by --task-mb), numbered 0..{tasks - 1}; give a range inside them."
        )
    if how.executor == "slurm" and (how.tasks is not None or how.task_offset):
        raise HftrainError(
            "--tasks/--task-offset share the task space between plain machines; SLURM runs every task itself."
        )
    if how.executor == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:  # before anything is written
            raise HftrainError(
                "--executor ray: Ray is not installed here; pip install 'hftrain[ray]' (datatrove runs tasks on it)."
            )
    if how.executor == "slurm" and not how.partition:
        raise HftrainError("--executor slurm: give --partition (and --time for each task, default 24:00:00).")
    return how.task_offset, count


def _claim_out(fs: Any, root: str, out: str, request: dict[str, Any], before_lock: bool = False) -> int:
    """--out is new or empty (0 returned), or the same prepare killed before it finished (the number of its tasks
    done: those are kept). Anything else is refused and left as it is. Before the lock, a folder with a lock file
    is left to the lock: another prepare may be writing it (then the lock refuses), or one was killed there."""
    if not fs.isdir(root):
        if fs.exists(root):
            raise HftrainError(f"--out {out}: is a file; give a new or empty directory.")
        return 0
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    if before_lock and LOCK_FILE in names:
        return 0
    names = [n for n in names if n not in LOCK_FILES]
    if PREPARED in names or OLD_MANIFEST in names:
        raise HftrainError(
            f"--out {out}: already holds prepared data ({PREPARED if PREPARED in names else OLD_MANIFEST}); nothing "
            f"was changed. Prepare into a new directory, or delete {out} first to prepare it again."
        )
    if not names:
        return 0
    from hftrain.data.prepare_steps import REQUEST

    if LOGS not in names or not fs.exists(f"{root}/{REQUEST}"):
        raise HftrainError(
            f"--out {out}: is not empty ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) and was not "
            "written by `hftrain data prepare`; nothing was changed. Give a new or empty directory."
        )
    before = json.loads(fs.cat_file(f"{root}/{REQUEST}"))
    if before != request:
        changed = sorted(k for k in set(before) | set(request) if before.get(k) != request.get(k))
        raise HftrainError(
            f"--out {out}: holds an unfinished prepare of other data or settings ({', '.join(changed)} differ from "
            f"{REQUEST}); nothing was changed. To finish it, run the prepare with the settings it started with; to "
            f"prepare with these (e.g. after a prepare that failed on its settings), delete {out} (an unfinished "
            "prepare: nothing reads it until it finishes) or give a new --out."
        )
    return len(completed_tasks(fs, root))


def _write_start(fs: Any, root: str, request: dict[str, Any], tokenizer: Any, work: str) -> None:
    """The tokenizer (tokenizer/) and what the prepare is (logs/hftrain-request.json), before any task runs."""
    from hftrain.data.prepare_steps import REQUEST

    if fs.exists(f"{root}/{REQUEST}"):
        return
    saved = Path(work) / "tokenizer"
    tokenizer.save_pretrained(saved)
    fs.makedirs(f"{root}/tokenizer", exist_ok=True)
    for file in sorted(saved.iterdir()):  # file by file: put(dir) would nest into an existing tokenizer/
        fs.put_file(str(file), f"{root}/tokenizer/{file.name}")
    fs.makedirs(f"{root}/{LOGS}", exist_ok=True)
    with fs.open(f"{root}/{REQUEST}", "w") as f:
        f.write(json.dumps(request, indent=2))


def _run_here(
    steps: list[Any], logs: Any, tasks: int, first: int, count: int, how: PrepareHow, fs: Any, root: str, console: Path
) -> None:
    """The tasks [first, first + count) on this machine (local) or this Ray cluster."""
    if how.executor == "ray":
        # a Ray call after a stop's ray.shutdown() (datatrove's threads make some) must fail, not start a new cluster
        os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")  # read when ray is first imported
        try:
            import ray
            from datatrove.executor.ray import RayPipelineExecutor
        except ImportError:
            raise HftrainError(
                "--executor ray: Ray is not installed here; pip install 'hftrain[ray]' (datatrove runs tasks on it)."
            ) from None
        if not ray.is_initialized():
            ray.init()  # the cluster RAY_ADDRESS names, else a Ray started on this machine (datatrove expects one up)
        executor: Any = RayPipelineExecutor(
            steps,
            tasks=tasks,
            workers=how.workers or -1,
            logging_dir=logs,
            cpus_per_task=how.cpus_per_task,
            mem_per_cpu_gb=how.mem_per_cpu_gb,
        )
    else:
        from datatrove.executor import LocalPipelineExecutor

        workers = min(how.workers or os.cpu_count() or 1, count)
        steps[0].parent = os.getpid()  # each worker ends with this process (it is spawned: no fork hook runs)
        # spawned, not forked: the tokenizer's thread pool does not survive a fork (and a forkserver started by an
        # earlier prepare in this process would keep that prepare's console)
        executor = LocalPipelineExecutor(
            steps,
            tasks=tasks,
            workers=workers,
            logging_dir=logs,
            local_tasks=count,
            local_rank_offset=first,
            start_method="spawn",
        )
    try:
        _run_on_ray(executor) if how.executor == "ray" else executor.run()
    except HftrainError:
        raise
    except Exception as err:
        failed = sorted(set(range(first, first + count)) - completed_tasks(fs, root))
        task = failed[0] if failed else first
        raise HftrainError(
            f"data prepare: task {task} failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            f"its log: {root}/{LOGS}/logs/task_{task:05d}.log (all tasks' output: {console}). Fix the cause and run "
            "the same command again: the finished tasks are kept."
        ) from None


def _run_on_ray(executor: Any) -> None:
    """datatrove's Ray run in a thread, so that Ctrl-C and SIGTERM reach this one at once: either ends the job with
    ray.shutdown() (its tasks and actors; a cluster ray.init() started here, all of it), and the command stops with
    its one line (SIGTERM: exit 143, as a process the signal ended). Before: Ctrl-C waited for ever in datatrove's
    thread pool, whose tasks wait on CPUs the running ones hold, holding the folder's lock; SIGTERM met Ray's own
    handler, which aborts the process (exit 134) unsaid."""
    import threading

    import ray

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return executor.run()
    failed: list[BaseException] = []

    def work() -> None:
        try:
            executor.run()
        except BaseException as err:  # noqa: BLE001 - raised again in the calling thread
            failed.append(err)

    received: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    runner = threading.Thread(target=work, name="hftrain-ray-prepare", daemon=True)
    before = signal.signal(signal.SIGTERM, interrupt)
    runner.start()
    try:
        while runner.is_alive():
            runner.join(0.5)
    except KeyboardInterrupt:
        import logging

        # what datatrove's threads meet once the job is gone is this stop's doing, not news: Ray's log kept quiet
        logging.getLogger("ray").setLevel(logging.CRITICAL)
        ray.shutdown()
        runner.join(5)
        if received:  # SIGTERM: said and exited as a process that signal ended (Ctrl-C: "interrupted", 130)
            raise Terminated(
                "stopped by SIGTERM; the Ray job is ended. Run the same command again: the finished tasks are kept."
            ) from None
        raise
    finally:
        if before is not None:  # None: a handler Python did not install, which it cannot put back
            signal.signal(signal.SIGTERM, before)
    if failed:
        raise failed[0]
