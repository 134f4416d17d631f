"""Distributed scaling on CPU: hftrain with 2-process DDP (gloo) vs one process, same global batch.

    python benchmarks/ddp_scaling.py [--repeats 2] [--steps 8] [--global-batch 8] [--micro-batch 4] [--with-1-thread]

Model: the "medium" shape of benchmarks/throughput.py (6 layers / 6 heads / 384 hidden / context 256, gpt2
tokenizer, python-docs corpus), with hftrain's default settings otherwise. Both configurations train on the same
global batch (parallelism.global_batch_size) of the same micro-batch (training.per_device_train_batch_size):

  1 process    plain `hftrain train` (one process, torch's default thread count: both cores); gradient
               accumulation covers the global batch.
  2 processes  DDP on gloo, started the way `hftrain train RECIPE --accelerate-config ddp` starts it on a CPU
               machine (hftrain.parallel.rehearsal.launch_processes: torchrun --standalone --nproc_per_node 2 with
               HFTRAIN_CPU_REHEARSAL=ddp and OMP_NUM_THREADS = cores / 2 = 1). The CLI cannot take Python
               callbacks, so this script is itself the torchrun entry point and calls hftrain.train(recipe,
               callbacks=[clock]) with that environment. Each run checks that accelerate really ran
               MULTI_CPU x 2 (or one process).
  (--with-1-thread adds "1 process, 1 thread": OMP_NUM_THREADS=1, the per-process budget of the DDP run.)

Runs alternate between the configurations, each in fresh processes; tokens/s is the median over steady-state
steps (after the first 20%, at least 2) of global tokens per step / step time, then the median over repeats.

Scaling efficiency is given two ways:
  * classical: 2-process tok/s / (2 x 1-process tok/s). It assumes each process brings its own hardware, as
    with one GPU per process. Here it cannot exceed about 0.5: the machine has 2 cores and the single process
    already uses both of them through intra-op threads.
  * same threads: 2-process tok/s / 1-process tok/s, both using 2 threads in total (2 processes x 1 thread vs
    1 process x 2 threads). On this machine this is the meaningful number: 1.0 means DDP costs nothing over
    threading; above 1, two processes use the cores better than threads split each op; below 1, the gradient
    all-reduce and the duplicated optimizer step cost more than that.

Where the time goes, per optimizer step (median over steady-state steps, rank 0), from the Trainer's callback
events (transformers 5.x): data wait (previous on_step_end -> on_step_begin: fetching the step's micro-batches,
plus the previous step's logging), forward+backward (on_step_begin -> on_pre_optimizer_step; includes gradient
clipping and, under DDP, the gradient all-reduce, which runs inside backward overlapped with it), optimizer
(-> on_optimizer_step: AdamW) and the rest (-> on_step_end: scheduler, zero_grad). The all-reduce cannot be
separated from backward from the outside, so after training each DDP process also times a bare gloo all-reduce
of a buffer as large as all gradients, in DDP's 25 MB buckets: the cost DDP has to hide inside backward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import StepClock, final_loss, median, phase_medians, run_child, steady_state, write_json

MEDIUM = dict(layers=6, heads=6, hidden=384, seq=256, lr=1e-3)
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


def recipe_overrides(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    m = MEDIUM
    return {
        "model": {
            "preset": "cpu-medium",
            "num_hidden_layers": m["layers"],
            "hidden_size": m["hidden"],
            "num_attention_heads": m["heads"],
            "intermediate_size": 4 * m["hidden"],
        },
        "tokenizer": {"builtin": "gpt2"},
        "data": {"train": [{"builtin": "python-docs"}], "seq_len": m["seq"], "eval_blocks": 4},
        "parallelism": {"global_batch_size": args.global_batch},
        "training": {
            "output_dir": str(out),
            "max_steps": args.steps,
            "per_device_train_batch_size": args.micro_batch,
            "learning_rate": m["lr"],
            "warmup_steps": max(1, args.steps // 10),
            "logging_steps": 2,
            "save_steps": args.steps + 1,
        },
        "monitor": {"sample_max_new_tokens": 0, "plot": False},
    }


def time_allreduce(numel: int, trials: int = 3) -> float:
    """Median seconds to all-reduce `numel` fp32 values in DDP-sized buckets over the default process group."""
    import torch
    import torch.distributed as dist

    per_bucket = BUCKET_BYTES // 4
    buckets = [torch.ones(min(per_bucket, numel - i)) for i in range(0, numel, per_bucket)]
    times = []
    for _ in range(trials):
        dist.barrier()
        start = time.perf_counter()
        for b in buckets:
            dist.all_reduce(b)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child_main(args: argparse.Namespace) -> None:
    """One training run (one process, or one rank of the DDP run); rank 0 writes the result."""
    import torch

    import hftrain
    from hftrain.parallel import process_end

    process_end.register()  # first: it runs after every other exit handler
    clock = StepClock()
    run = hftrain.train(hftrain.load_recipe(None, recipe_overrides(args, Path(args.workdir))), callbacks=[clock])
    targs = run.trainer.args
    result = {
        "clock": clock.to_json(),
        "tokens_per_step": targs.per_device_train_batch_size
        * targs.gradient_accumulation_steps
        * targs.world_size
        * MEDIUM["seq"],
        "accumulation": targs.gradient_accumulation_steps,
        "loss": final_loss(run.log_history),
        "threads": torch.get_num_threads(),
        "distribution": run.trainer.distribution,
        "bf16": bool(targs.bf16),
        "parameters": sum(p.numel() for p in run.trainer.model.parameters()),
    }
    if targs.world_size > 1:
        import torch.distributed as dist

        grads = sum(p.numel() for p in run.trainer.model.parameters() if p.requires_grad)
        result["allreduce_s"] = time_allreduce(grads)
        clocks: list[Any] = [None] * targs.world_size
        dist.all_gather_object(clocks, result["clock"])
        result["rank_clocks"] = clocks
    if targs.process_index == 0:
        write_json(args.result, result)
    process_end.leave_training()  # the rank ends without tearing its process group down (parallel/process_end.py)
    process_end.set_exit_code(0)


def launch(config: str, args: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    """Start one run of `config` in fresh processes and return rank 0's result."""
    from hftrain.launch.processes import find_config
    from hftrain.parallel import rehearsal

    script = str(Path(__file__).resolve())
    child = [
        "--child",
        "--steps",
        str(args.steps),
        "--global-batch",
        str(args.global_batch),
        "--micro-batch",
        str(args.micro_batch),
        "--workdir",
        str(tmp / tag),
        "--result",
        str(tmp / f"{tag}.json"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if config == "2 processes":
        nproc = 2
        env[rehearsal.REHEARSAL_ENV] = "ddp"
        env[rehearsal.CONFIG_ENV] = str(find_config("ddp").resolve())
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            script,
            *child,
        ]
    else:
        if config == "1 process, 1 thread":
            env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, script, *child]
    result = run_child(cmd, tmp / f"{tag}.log", tmp / f"{tag}.json", env=env)
    expected = ("MULTI_CPU", 2) if config == "2 processes" else ("NO", 1)
    got = (result["distribution"]["distributed_type"], result["distribution"]["world_size"])
    if got != expected:
        sys.exit(f"{config}: accelerate ran {got[0]} x {got[1]}, expected {expected[0]} x {expected[1]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, all processes")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward per process")
    parser.add_argument("--with-1-thread", action="store_true", help="also run one process limited to one thread")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    if args.global_batch % (2 * args.micro_batch):
        parser.error("--global-batch must be a multiple of 2 x --micro-batch (both configurations must reach it)")

    configs = ["1 process", "2 processes"] + (["1 process, 1 thread"] if args.with_1_thread else [])
    started = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="hftrain-ddp-") as tmp:
        for r in range(args.repeats):
            for config in configs if r % 2 == 0 else configs[::-1]:
                t0 = time.perf_counter()
                result = launch(config, args, Path(tmp), f"{config.replace(' ', '_').replace(',', '')}-{r}")
                results[config].append(result)
                rate = steady_state(result["clock"], result["tokens_per_step"])["tokens_per_s"]
                print(
                    f"repeat {r + 1} {config:<20} {rate:>7,.0f} tok/s  loss {result['loss']:.4f}  "
                    f"({time.perf_counter() - t0:.0f} s in all)",
                    flush=True,
                )

    print(
        f"\nall runs took {time.perf_counter() - started:.0f} s; medium shape, global batch {args.global_batch} x "
        f"{MEDIUM['seq']} tokens, micro-batch {args.micro_batch}, {args.steps} steps per run\n"
    )
    rates = {
        c: median([steady_state(x["clock"], x["tokens_per_step"])["tokens_per_s"] for x in rs])
        for c, rs in results.items()
    }
    header = (
        f"{'configuration':<20} {'tok/s':>7} {'accum':>5} {'threads':>7} {'cpu':>4} {'loss':>7} | {'data wait':>9} "
        f"{'fwd+bwd':>8} {'optimizer':>9} {'rest':>6} {'step':>6}  (s/step)"
    )
    print(header)
    print("-" * len(header))
    for config, rs in results.items():
        phases = {
            k: median([phase_medians(x["clock"])[k] for x in rs])
            for k in ("data_wait", "forward_backward", "optimizer", "after_step")
        }
        step = median([steady_state(x["clock"], x["tokens_per_step"])["step_s"] for x in rs])
        cpu = median([steady_state(x["clock"], x["tokens_per_step"])["cpu_util"] for x in rs])
        x = rs[0]
        print(
            f"{config:<20} {rates[config]:>7,.0f} {x['accumulation']:>5} {x['threads']:>7} {cpu:>4.1f} "
            f"{median([y['loss'] for y in rs]):>7.4f} | {phases['data_wait']:>9.3f} {phases['forward_backward']:>8.3f} "
            f"{phases['optimizer']:>9.3f} {phases['after_step']:>6.3f} {step:>6.3f}"
        )
    print(
        "(cpu = CPU s per wall s of rank 0 in the timed steps: about its thread count when it had the cores to itself)"
    )
    ddp = results["2 processes"]
    allreduce = median([x["allreduce_s"] for x in ddp])
    grads_mb = ddp[0]["parameters"] * 4 / 1e6
    # how far apart the two ranks' fwd+bwd are: a straggler shows as a difference
    fb = [median([phase_medians(x["rank_clocks"][k])["forward_backward"] for x in ddp]) for k in range(2)]
    print(
        f"\nDDP gradient all-reduce alone (gloo, {grads_mb:,.0f} MB of fp32 gradients in 25 MB buckets): "
        f"{allreduce:.3f} s per step; fwd+bwd rank 0 {fb[0]:.3f} s, rank 1 {fb[1]:.3f} s"
    )
    one, two = rates["1 process"], rates["2 processes"]
    print(f"scaling efficiency, classical (2-process / (2 x 1-process)): {two / (2 * one):.2f}")
    print(
        "scaling efficiency, same total threads (2 processes x 1 thread / 1 process x "
        f"{results['1 process'][0]['threads']} threads): {two / one:.2f}"
    )
    if "1 process, 1 thread" in rates:
        print(
            "scaling efficiency, per thread (2-process / (2 x 1-process-1-thread)): "
            f"{two / (2 * rates['1 process, 1 thread']):.2f}"
        )
    print(f"ddp: 1 process {one:,.0f} tok/s, 2 processes {two:,.0f} tok/s, ratio {two / one:.2f}")


if __name__ == "__main__":
    main()
