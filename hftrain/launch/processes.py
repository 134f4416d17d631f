"""`hftrain train RECIPE --accelerate-config NAME`: start the processes a backend needs, then train.

On GPUs this is exactly `accelerate launch --config_file CONFIG -m hftrain train RECIPE ...`. Without CUDA
it is a CPU rehearsal: 2 gloo processes through torchrun, with the CPU-only adjustments of rehearsal.py. Either
launcher runs in this process, so that an error of the processes is said once with its exit code (child_errors.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from hftrain.errors import HftrainError, NotShared
from hftrain.launch.multinode import NodeGroup
from hftrain.parallel import child_errors, rehearsal
from hftrain.parallel.batch import check_elastic_batch
from hftrain.parallel.dims import SHIPPED_CONFIGS, Strategy
from hftrain.planning.part import PlanPart

ALIASES = {"zero3": "deepspeed_zero3", "zero3_offload": "deepspeed_zero3_offload", "deepspeed": "deepspeed_zero3"}


def find_config(name: str) -> Path:
    """A path to an accelerate YAML, or the name of one shipped with hftrain (ddp, fsdp, zero3, ...)."""
    path = Path(name)
    if path.is_file():
        return path
    packaged = SHIPPED_CONFIGS / f"{ALIASES.get(name, name)}.yaml"
    if packaged.is_file():
        return packaged
    shipped = ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml")))
    raise HftrainError(
        f"--accelerate-config: no file {name!r} and no shipped config of that name; shipped: {shipped}, zero3"
    )


DEEPSPEED_KEYS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping")


def backend_of(config: Path) -> Strategy:
    """The strategy an accelerate config file launches; a file that is not one (a DeepSpeed JSON, not YAML, not a
    mapping) is named with what to give instead."""
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise HftrainError(f"{config}: not an accelerate config (not YAML: {str(err).splitlines()[0]}).") from None
    if not isinstance(data, dict):
        raise HftrainError(
            f"{config}: not an accelerate config (a YAML mapping with distributed_type, num_processes, ...)."
        )
    deepspeed = [key for key in DEEPSPEED_KEYS if key in data]
    if deepspeed and "distributed_type" not in data:
        raise HftrainError(
            f"{config}: a DeepSpeed config ({', '.join(deepspeed)}), not an accelerate config. Give "
            "--accelerate-config "
            "zero3 (hftrain's ZeRO-3 config), or an accelerate YAML with distributed_type: DEEPSPEED whose "
            "deepspeed_config.deepspeed_config_file names this file (accelerate_configs/deepspeed_zero3.yaml does)."
        )
    kind = str(data.get("distributed_type", "NO")).upper()
    strategy = Strategy.of_accelerate_type(kind)
    if strategy is None:
        raise HftrainError(
            f"{config}: distributed_type {kind} is not a multi-process backend hftrain launches "
            "(use one of MULTI_GPU, MULTI_CPU, FSDP, DEEPSPEED)."
        )
    return strategy


def relaunch(
    train_args: list[str],
    config_name: str,
    nproc: int | None,
    cpu: bool,
    checks: PlanPart | None = None,
    nodes: NodeGroup = NodeGroup(),
) -> int:
    """Run `hftrain train TRAIN_ARGS` under the backend of `config_name` on this node of `nodes`; returns the exit
    code."""
    config = find_config(config_name)
    backend = backend_of(config)
    said = False  # the memory fit, judged before any process starts
    if checks is not None:  # a method the backend cannot run is refused once, before any process starts
        from hftrain.model.finetune import check_starting_weights, check_strategy

        check_starting_weights(checks.model)
        check_strategy(checks.model, backend)
        if cpu or rehearsal.on_cpu():
            rehearsal.check_precision(checks.training_kwargs, backend.value)
        from hftrain.checkpoint.elastic import check_before_launch
        from hftrain.checkpoint.resume import ResumeSetting

        resume = ResumeSetting.of(checks.training_kwargs.get("resume_from_checkpoint"))
        check_before_launch(
            resume, Path(checks.output_dir), backend, nproc or (2 if cpu or rehearsal.on_cpu() else None)
        )
        if nodes.elastic:
            check_elastic_batch(
                checks.batch, nodes.min_count, nodes.count, nproc or (2 if cpu or rehearsal.on_cpu() else _gpus())
            )
        said = _warn_memory(
            checks, backend, nproc or (2 if cpu or rehearsal.on_cpu() else None), cpu or rehearsal.on_cpu()
        )
    from hftrain.parallel.child_errors import MEMORY_WARNED_ENV

    warned = {MEMORY_WARNED_ENV: "1"} if said else {}  # the processes do not say it again
    if cpu or rehearsal.on_cpu():
        return rehearsal.launch_processes(["train", *train_args], config, backend.value, nproc or 2, nodes, env=warned)
    return accelerate_processes(train_args, config, nproc, nodes, env=warned)


def accelerate_processes(
    train_args: list[str],
    config: Path,
    nproc: int | None,
    nodes: NodeGroup = NodeGroup(),
    env: dict[str, str] | None = None,
) -> int:
    """`accelerate launch --config_file CONFIG -m hftrain train TRAIN_ARGS`, with accelerate's launcher in this
    process so that a failure is reported once (child_errors.py); returns the exit code."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    if nodes.count > 1 or nodes.elastic:  # every node starts the same number of processes: this node's GPUs unless told
        nproc = nproc or _gpus()
    words = ["--config_file", str(config), *(nodes.accelerate_args(nproc) if nproc else []), *deepspeed_file(config)]
    args = launch_command_parser().parse_args([*words, "-m", "hftrain", "train", *train_args])
    return child_errors.launch(lambda: launch_command(args), {**nodes.elastic_env(), **(env or {})}, args)


def _gpus() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def deepspeed_file(config: Path) -> list[str]:
    """A DeepSpeed JSON named relative to its accelerate YAML's folder (as the CPU rehearsal reads it), given to
    accelerate as an absolute path: accelerate would read it relative to the working directory."""
    data = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    name = (data.get("deepspeed_config") or {}).get("deepspeed_config_file")
    found = rehearsal.deepspeed_file_of(config)
    if not name or Path(name).is_absolute() or Path(name).is_file() or found is None or not found.is_file():
        return []
    return ["--deepspeed_config_file", str(found)]


def _warn_memory(checks: PlanPart, backend: Any, processes: int | None, cpu: bool) -> bool:
    """An explicit micro-batch that will not fit is said once, before any process starts (fit.py); the launch
    environment then tells the processes it was said (relaunch), never this process's own: a notebook or test that
    launches goes on warning in its own runs. True once the fit was judged here (said or not needed). A layout that
    would certainly run out of memory (with parallelism.fit_memory, the smallest) is refused here, before any
    process starts (fit_this_run's HftrainError); fit_memory's choice is said by the processes that take it."""
    if processes is None or backend.value == "device_map":
        return False
    from hftrain.parallel.batch import global_batch
    from hftrain.planning.estimates import plan
    from hftrain.planning.fit import fit_this_run

    part = checks
    total = global_batch(part.batch, processes)
    _, note = fit_this_run(part, plan(part), processes, processes, backend.value, "cpu" if cpu else "cuda", total)
    if part.batch.fit_memory:
        return False
    if note:
        print(f"hftrain: {note}", flush=True)
    return True


# Exit codes a restart cannot change: done, a configuration problem (HftrainError: the same recipe fails the same
# way again), or stopped by the user. Everything else (a crash signal, a preemption exit 75 that the supervisor
# itself did not receive, an unexpected exit) is restarted.
FINAL_EXIT_CODES = {
    0: "finished",
    2: "a problem in the recipe or data (a restart would fail the same way)",
    130: "interrupted",
    NotShared.exit_code: "trained and saved; sending it failed (a restart would train nothing more)",
}


def supervise(hftrain_args: list[str], max_restarts: int, command: list[str] | None = None) -> int:
    """Run `hftrain HFTRAIN_ARGS` in a child process; after a failure a restart can fix, run it again (it resumes)
    up to N times. A SIGTERM / SIGUSR1 sent to the supervisor goes to the child, and its exit (75, preempted) is
    final, so a scheduler that stops the job can requeue it. `command`: what to run instead of `python -m hftrain`."""
    import signal

    restarts, received = 0, []
    child: list[subprocess.Popen] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        if child:
            child[0].send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        while True:
            child[:] = [subprocess.Popen([*(command or [sys.executable, "-m", "hftrain"]), *hftrain_args])]
            code = child[0].wait()
            if code in FINAL_EXIT_CODES or received:
                if code not in (0, 130):
                    print(
                        f"hftrain: not restarted: {FINAL_EXIT_CODES.get(code, 'the job was told to stop')}.",
                        file=sys.stderr,
                        flush=True,
                    )
                return code if code >= 0 else 128 - code
            what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            if restarts >= max_restarts:
                print(
                    f"hftrain: training died ({what}); no restarts left (--max-restarts {max_restarts}).",
                    file=sys.stderr,
                    flush=True,
                )
                return code if code > 0 else 1
            restarts += 1
            print(
                f"hftrain: training died ({what}); restart {restarts} of {max_restarts}, resuming from the last "
                "complete checkpoint.",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
