"""What a backend really did to the model: a TrainerCallback that records every rank's parameters, and a runner
that trains a recipe under a backend with it (hftrain's own CPU rehearsal launch, or accelerate on GPUs).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/support/backend_probe.py RECIPE.yaml PROBE_DIR
    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes N \
        tests/support/backend_probe.py RECIPE.yaml PROBE_DIR

Each rank writes PROBE_DIR/rank{R}.json: accelerate's distributed type and process count, and per parameter its
class, shape and dtype, the DTensor placements and local shard (FSDP2), the ZeRO-3 partition (ds_numel, local
ds_tensor), and per bitsandbytes layer its class, weight dtype and quantization state. The checks on these
observations are in backend_checks.py; the tests feed them runs of the real backends and of the fallbacks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[2]
QUANT_CLASSES = ("Linear4bit", "Linear8bitLt")


def _dtensor(p: Any) -> dict[str, Any] | None:
    from torch.distributed.tensor import DTensor

    t = p if isinstance(p, DTensor) else getattr(p, "data", None)
    if not isinstance(t, DTensor):
        return None
    return {
        "local_shape": list(t.to_local().shape),
        "placements": [str(x) for x in t.placements],
        "mesh_size": t.device_mesh.size(),
    }


def _zero3(p: Any) -> dict[str, Any] | None:
    if not hasattr(p, "ds_numel"):
        return None
    return {
        "ds_numel": int(p.ds_numel),
        "ds_shape": list(p.ds_shape),
        "local_numel": int(p.ds_tensor.numel()),
        "status": str(getattr(p, "ds_status", "")),
        "persist": bool(getattr(p, "ds_persist", False)),
    }


def _quantized(module: Any) -> dict[str, Any]:
    w = module.weight
    data = getattr(w, "data", w)
    local = data.to_local() if hasattr(data, "to_local") else data
    state = getattr(w, "quant_state", None) or getattr(module, "quant_state", None)
    return {
        "class": type(module).__name__,
        "weight_class": type(w).__name__,
        "weight_dtype": str(local.dtype).removeprefix("torch."),
        "weight_numel": int(local.numel()),
        "device": str(local.device),
        "in_features": module.in_features,
        "out_features": module.out_features,
        "quant_state": None
        if state is None
        else {"quant_type": getattr(state, "quant_type", None), "shape": list(getattr(state, "shape", []))},
        "int8_scales": any(getattr(x, "SCB", None) is not None for x in (w, getattr(module, "state", None))),
        "dtensor": _dtensor(w),
    }


def _is_bnb(module: Any) -> bool:
    """bitsandbytes' own quantized layer (peft's LoRA wrappers of it share the class name)."""
    return type(module).__name__ in QUANT_CLASSES and type(module).__module__.startswith("bitsandbytes")


def observe(model: Any) -> dict[str, Any]:
    """Parameters and quantized layers of `model` as this process holds them (JSON-ready)."""
    params = {}
    for name, p in model.named_parameters():
        params[name] = {
            "class": type(p).__name__,
            "shape": list(p.shape),
            "numel": int(p.numel()),
            "dtype": str(p.dtype).removeprefix("torch."),
            "trainable": bool(p.requires_grad),
            "device": str(p.device),
            "dtensor": _dtensor(p),
            "zero3": _zero3(p),
        }
    quantized = {n: _quantized(m) for n, m in model.named_modules() if _is_bnb(m)}
    linear = [n for n, m in model.named_modules() if type(m).__name__ == "Linear"]
    return {"params": params, "quantized": quantized, "plain_linear": linear}


def _distributed_type() -> str:
    # Read accelerate's shared state without constructing AcceleratorState(): a new instance copies
    # PartialState's fields over it, which undoes the CPU rehearsal's FSDP switch (rehearsal.after_accelerator).
    from accelerate.state import AcceleratorState

    kind = AcceleratorState._shared_state.get("distributed_type")
    return str(getattr(kind, "value", kind))


class Inspector(TrainerCallback):
    """Records the model at the start of training and after the first optimizer step, then writes rankR.json."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.out_dir = Path(out_dir)
        self.seen: dict[str, Any] = {}

    def _real_model(self, model: Any, kwargs: dict[str, Any]) -> Any:
        wrapped = kwargs.get("model") or model
        return getattr(wrapped, "module", wrapped) if type(wrapped).__name__ == "DistributedDataParallel" else wrapped

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.seen["train_begin"] = observe(self._real_model(model, kwargs))
        self.seen["distributed_type_at_train_begin"] = _distributed_type()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if "step_end" not in self.seen:
            self.seen["step_end"] = observe(self._real_model(model, kwargs))
            self.seen["distributed_type_at_step_end"] = _distributed_type()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from accelerate.state import AcceleratorState

        self.seen.update(
            rank=args.process_index,
            world_size=AcceleratorState._shared_state.get("num_processes"),
            distributed_type=_distributed_type(),
        )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{self.seen['rank']}.json").write_text(json.dumps(self.seen, indent=1), encoding="utf-8")


def load_observations(probe_dir: Path) -> list[dict[str, Any]]:
    """Every rank's observation, in rank order."""
    return [json.loads(p.read_text()) for p in sorted(Path(probe_dir).glob("rank*.json"))]


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {
        **os.environ,
        **extra,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def probe_command(
    recipe_file: Path, probe_dir: Path, backend: str | None, nproc: int
) -> tuple[list[str], dict[str, str]]:
    """How to train RECIPE_FILE with the Inspector: one plain process (backend None); with CUDA, accelerate launch
    with the shipped config of BACKEND; without, hftrain's CPU rehearsal (torchrun, gloo, cpu_launch's environment)."""
    import torch

    from hftrain.launch.processes import find_config
    from hftrain.parallel import rehearsal

    script = [__file__, str(recipe_file), str(probe_dir)]
    if backend is None:
        return [sys.executable, *script], _env({})
    config = str(find_config(backend).resolve())
    if torch.cuda.is_available():
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            config,
            "--num_processes",
            str(nproc),
            *script,
        ], _env({})
    env = _env({rehearsal.REHEARSAL_ENV: backend, rehearsal.CONFIG_ENV: config, "OMP_NUM_THREADS": "1"})
    if backend == "zero3":
        env["DS_ACCELERATOR"] = "cpu"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *script], env


def run_probe(
    recipe_file: Path, probe_dir: Path, backend: str | None, nproc: int = 2, timeout: int = 600
) -> list[dict[str, Any]]:
    """Train RECIPE_FILE with the Inspector (see probe_command); returns the observations of every rank."""
    cmd, env = probe_command(recipe_file, probe_dir, backend, nproc)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"probe run failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr[-4000:]}")
    return load_observations(probe_dir)


def main(argv: list[str]) -> int:
    import hftrain
    from hftrain.parallel import process_end

    process_end.register()  # as hftrain.cli.program: the rank ends without tearing its process group down
    recipe_file, probe_dir = argv
    hftrain.train(hftrain.load_recipe(recipe_file), callbacks=[Inspector(probe_dir)])
    process_end.leave_training()
    process_end.set_exit_code(0)
    import gc

    gc.freeze()  # as hftrain.cli.program: the exit skips collecting torch's object graph (2 s per rank)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
