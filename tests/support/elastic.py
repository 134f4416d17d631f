"""Seeing what a resume really restored: run `hftrain.train` with a callback that writes the full (gathered)
model and optimizer state, however the backend shards it, either right after checkpoint step S is written
(`save:S`) or right after a resume has loaded its checkpoint (`begin`). Comparing the two dumps checks the
state itself, independent of the data order (which the data side re-derives for a new process count).

Run as `python -m tests.support.elastic RECIPE PREFIX EVENTS [overrides]` in every process (`run_dumping` starts
them: alone for single, else torchrun with the same environment as hftrain's CPU rehearsal launcher).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from .cli import ROOT

KEYS = ("exp_avg", "exp_avg_sq")


def gathered_state(model: Any, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {"param", "exp_avg", "exp_avg_sq", "step"}} as full fp32 tensors on the CPU (collective)."""
    params = dict(model.named_parameters())
    first = next(iter(params.values()))
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if hasattr(first, "ds_id"):  # ZeRO-3: partitioned flat groups; DeepSpeed's own API gathers one parameter
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        inner = getattr(torch_optimizer, "optimizer", torch_optimizer)  # the torch AdamW inside ZeRO
        steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
        out = {}
        for name, p in params.items():
            out[name] = {"param": safe_get_full_fp32_param(p).detach().cpu().clone()}
            out[name].update({k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in KEYS})
            out[name]["step"] = torch.tensor(steps[0] if steps else -1.0)
        return out
    from torch.distributed.tensor import DTensor

    if isinstance(first, DTensor):  # FSDP2
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        optim = get_optimizer_state_dict(model, torch_optimizer, options=options).get("state")
        if not optim:  # full state dicts offloaded to the CPU are rank 0's only
            return {}
        return {
            n: {"param": weights[n].clone(), **{k: torch.as_tensor(optim[n][k]).clone() for k in (*KEYS, "step")}}
            for n in params
        }
    state = torch_optimizer.state
    return {
        n: {
            "param": p.detach().cpu().clone(),
            **{k: torch.as_tensor(state[p][k]).cpu().clone() for k in (*KEYS, "step")},
        }
        for n, p in params.items()
    }


class DumpState(TrainerCallback):
    """Writes `{prefix}-begin.pt` right after a resume loaded its checkpoint and `{prefix}-save<N>.pt` right after
    checkpoint N is written, for each event named in `events` ("begin", "save:N")."""

    def __init__(self, prefix: Path, events: str):
        self.prefix, self.events = prefix, set(events.split(","))

    def _dump(self, name: str, args: Any, state: Any, model: Any, optimizer: Any) -> None:
        dump = gathered_state(model, optimizer)
        if args.process_index == 0:
            lr = optimizer.param_groups[0]["lr"]
            groups = [{k: g[k] for k in ("weight_decay", "betas", "eps")} for g in optimizer.param_groups]
            out = {"step": state.global_step, "lr": lr, "world_size": args.world_size, "state": dump, "groups": groups}
            torch.save(out, f"{self.prefix}-{name}.pt")

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # noqa: ANN001
        if "begin" in self.events:
            self._dump("begin", args, state, model, optimizer)

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):  # noqa: ANN001
        if f"save:{state.global_step}" in self.events:
            self._dump(f"save{state.global_step}", args, state, model, optimizer)


def main(argv: list[str]) -> None:
    import hftrain
    from hftrain.parallel import process_end
    from hftrain.recipe.load import load_recipe

    process_end.register()  # as hftrain.cli.program: the rank ends without tearing its process group down
    recipe_path, prefix, events, *overrides = argv
    hftrain.train(load_recipe(recipe_path, overrides), callbacks=[DumpState(Path(prefix), events)])
    process_end.leave_training()
    process_end.set_exit_code(0)


def run_dumping(
    recipe: Path,
    backend: str,
    nproc: int,
    out: Path,
    prefix: Path,
    events: str,
    *overrides: str,
    expect_ok: bool = True,
) -> subprocess.CompletedProcess:
    """Train `recipe` into `out` on `backend` (single | ddp | fsdp | zero3) with `nproc` processes, dumping the
    state at `events` (see DumpState)."""
    from hftrain.launch.processes import backend_of, find_config
    from hftrain.parallel import rehearsal

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = ["-m", "tests.support.elastic", str(recipe), str(prefix), events, f"training.output_dir={out}", *overrides]
    if backend == "single":
        cmd = [sys.executable, *args]
    else:
        config = find_config(backend)
        threads = str(max(1, (os.cpu_count() or 1) // nproc))
        env.update(
            {
                "CUDA_VISIBLE_DEVICES": "",
                rehearsal.REHEARSAL_ENV: backend_of(config),
                rehearsal.CONFIG_ENV: str(config.resolve()),
                "OMP_NUM_THREADS": threads,
            }
        )
        if backend == "zero3":
            env["DS_ACCELERATOR"] = "cpu"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if expect_ok:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def compare(saved: dict[str, Any], loaded: dict[str, Any]) -> dict[str, float]:
    """Largest absolute difference per kind (param, exp_avg, exp_avg_sq, step) between two dumps, plus lr."""
    assert saved["state"].keys() == loaded["state"].keys()
    worst = {k: 0.0 for k in ("param", *KEYS, "step")}
    for name, a in saved["state"].items():
        b = loaded["state"][name]
        for k in worst:
            assert a[k].shape == b[k].shape, (name, k, a[k].shape, b[k].shape)
            worst[k] = max(worst[k], float((a[k].float() - b[k].float()).abs().max()))
    worst["lr"] = abs(saved["lr"] - loaded["lr"])
    # each param group keeps its own settings (DeepSpeed's universal load gives all of them the first group's)
    assert saved["groups"] == loaded["groups"], (saved["groups"], loaded["groups"])
    return worst


if __name__ == "__main__":
    main(sys.argv[1:])
