"""Checks that a backend really did what it is named for, on the observations of backend_probe.py and on the
checkpoint files. Each raises NotWhatWasAsked (an AssertionError) naming what it found instead, and returns a
small summary of what it verified. Plain functions: the CPU tests feed them rehearsal runs of the real backends
and of the silent fallbacks (DDP, an unquantized model), and the GPU tests feed them real GPU runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

FSDP_SHARDS = "pytorch_model_fsdp_0"  # accelerate's layout: one __R_0.distcp per rank plus .metadata
QUANTIZED_CLASS = {"qlora": "Linear4bit", "lora_8bit": "Linear8bitLt"}
PROJECTIONS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")  # every NeoX linear layer but the head


class NotWhatWasAsked(AssertionError):
    """The run did not do what its backend or method promises (a silent fallback)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise NotWhatWasAsked(message)


def shard_rows(rows: int, world: int, rank: int) -> int:
    """Rows rank RANK holds of a dim-0 sharded tensor: torch.chunk's split (FSDP2's Shard(0))."""
    size = -(-rows // world)
    start = min(rows, rank * size)
    return min(rows, start + size) - start


def _ranks(observations: list[dict[str, Any]], world: int) -> None:
    """One observation per rank. (accelerate's distributed type is results.json's business: the checks here
    look at the model itself, which is what a fallback cannot fake.)"""
    _require(len(observations) == world, f"expected observations from {world} rank(s), got {len(observations)}")
    _require([o["rank"] for o in observations] == list(range(world)), f"ranks {[o['rank'] for o in observations]}")
    for o in observations:
        _require(
            o["world_size"] == world, f"rank {o['rank']}: accelerate ran {o['world_size']} process(es), not {world}"
        )


def check_fsdp(observations: list[dict[str, Any]], world: int, when: str = "step_end") -> dict[str, Any]:
    """Every parameter on every rank is a DTensor, Shard(0) over a mesh of WORLD ranks, holding exactly its
    torch.chunk share of rows; the shares add up to the whole model."""
    _ranks(observations, world)
    full, local = 0, [0] * world
    for obs in observations:
        rank = obs["rank"]
        for name, p in obs[when]["params"].items():
            d = p["dtensor"]
            _require(
                d is not None,
                f"rank {rank}: {name} is a plain {p['class']} of shape {p['shape']}, not a DTensor: not sharded",
            )
            _require(
                d["placements"] == ["S(0)"] and d["mesh_size"] == world,
                f"rank {rank}: {name} placed {d['placements']} on a "
                f"mesh of {d['mesh_size']}, not Shard(0) over {world}",
            )
            expected = [shard_rows(p["shape"][0], world, rank), *p["shape"][1:]]
            _require(
                d["local_shape"] == expected,
                f"rank {rank}: {name} of shape {p['shape']} holds {d['local_shape']}, expected {expected}",
            )
            local[rank] += math.prod(d["local_shape"])
            full += p["numel"] if rank == 0 else 0
    _require(sum(local) == full, f"the ranks hold {local} elements, which do not add up to the model's {full}")
    return {"params": len(observations[0][when]["params"]), "full_numel": full, "local_numel": local}


def check_zero3(observations: list[dict[str, Any]], world: int, when: str = "step_end") -> dict[str, Any]:
    """Every parameter on every rank is ZeRO-3 partitioned: ds_numel is the full size, the local ds_tensor holds
    ceil(ds_numel / WORLD), and outside a forward the visible tensor is an empty placeholder (bar the small
    parameters DeepSpeed keeps gathered, ds_persist)."""
    _ranks(observations, world)
    full, local = 0, [0] * world
    for obs in observations:
        rank = obs["rank"]
        for name, p in obs[when]["params"].items():
            z = p["zero3"]
            _require(
                z is not None,
                f"rank {rank}: {name} has no ds_numel/ds_tensor: not "
                f"partitioned by ZeRO-3 (a full {p['shape']} tensor)",
            )
            _require(
                z["ds_numel"] == math.prod(z["ds_shape"]),
                f"rank {rank}: {name} ds_numel {z['ds_numel']} != prod{z['ds_shape']}",
            )
            expected = -(-z["ds_numel"] // world)
            _require(
                z["local_numel"] == expected,
                f"rank {rank}: {name} holds {z['local_numel']} of {z['ds_numel']}, expected {expected}",
            )
            if not z["persist"] and world > 1:
                _require(p["numel"] == 0, f"rank {rank}: {name} is gathered ({p['shape']}) outside a forward pass")
            local[rank] += z["local_numel"]
            full += z["ds_numel"] if rank == 0 else 0
    return {"params": len(observations[0][when]["params"]), "full_numel": full, "local_numel": local}


def check_fsdp_checkpoint(checkpoint: Path, world: int) -> dict[str, Any]:
    """CHECKPOINT/pytorch_model_fsdp_0 holds one __R_0.distcp per rank, and every tensor of WORLD or more rows
    is stored as WORLD row chunks, each in its own rank's file."""
    from torch.distributed.checkpoint import FileSystemReader

    shards = Path(checkpoint) / FSDP_SHARDS
    _require(
        shards.is_dir(),
        f"{checkpoint} has no {FSDP_SHARDS}/ (it holds {sorted(p.name for p in Path(checkpoint).iterdir())})",
    )
    files = sorted(p.name for p in shards.glob("*.distcp"))
    _require(
        files == [f"__{r}_0.distcp" for r in range(world)],
        f"{shards} holds {files}, expected one __R_0.distcp per rank of {world}",
    )
    meta = FileSystemReader(str(shards)).read_metadata()
    where: dict[str, set[str]] = {}
    for index, info in meta.storage_data.items():
        where.setdefault(index.fqn, set()).add(info.relative_path)
    sharded = 0
    for fqn, tensor in meta.state_dict_metadata.items():
        size = getattr(tensor, "size", None)
        if size is None or len(size) == 0 or size[0] < world:
            continue
        _require(
            len(tensor.chunks) == world, f"{fqn}: {len(tensor.chunks)} chunk(s) in the checkpoint, expected {world}"
        )
        _require(
            len(where[fqn]) == world, f"{fqn}: stored in {sorted(where[fqn])}, expected one chunk in each rank's file"
        )
        sharded += 1
    _require(sharded > 0, f"{shards}: no tensor is stored sharded")
    return {"files": files, "sharded_tensors": sharded}


def check_zero3_checkpoint(checkpoint: Path, world: int) -> dict[str, Any]:
    """CHECKPOINT/global_stepN holds each rank's model and optimizer states; each rank's fp32 partition is
    exactly the sum of ceil(numel / WORLD) over the parameters (its own share, not the whole model)."""
    import torch

    steps = sorted(Path(checkpoint).glob("global_step*"))
    _require(
        len(steps) == 1,
        f"{checkpoint} has {[p.name for p in steps]} instead of one global_stepN/ (not a DeepSpeed checkpoint)",
    )
    files = sorted(p.name for p in steps[0].iterdir())
    sizes = []
    for rank in range(world):
        model_file, optim = (
            f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
            [f for f in files if f.endswith(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")],
        )
        _require(
            model_file in files and len(optim) == 1,
            f"{steps[0]} holds {files}: no model/optimizer states of rank {rank}",
        )
        states = torch.load(steps[0] / optim[0], map_location="cpu", weights_only=False)["optimizer_state_dict"]
        _require(
            int(states["zero_stage"]) == 3 and states["partition_count"] == world,
            f"rank {rank}: ZeRO stage {int(states['zero_stage'])}, partitioned over {states['partition_count']}, not "
            f"stage 3 over {world}",
        )
        sizes.append(sum(t.numel() for t in states["fp32_flat_groups"]))
    shapes = torch.load(steps[0] / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)[
        "param_shapes"
    ]
    numels = [math.prod(s) for group in shapes for s in group.values()]
    share = sum(-(-n // world) for n in numels)
    _require(
        sizes == [share] * world,
        f"the ranks' fp32 partitions hold {sizes} elements, expected {share} each of {sum(numels)}",
    )
    return {"files": files, "partition_numel": sizes, "full_numel": sum(numels)}


def check_quantized(
    observation: dict[str, Any], method: str, strategy: str = "single", world: int = 1, compute_dtype: str = "bfloat16"
) -> dict[str, Any]:
    """Every NeoX projection of the base model is a bitsandbytes layer of METHOD's class with its quantized
    storage: qlora packs two 4-bit weights a byte (uint8, or the compute dtype under FSDP, sharded there) with a
    quant_state; lora_8bit holds int8 weights with their scales (SCB)."""
    layers = observation["step_end"]["quantized"]
    wanted = QUANTIZED_CLASS[method]
    _require(
        bool(layers),
        "no bitsandbytes layer in the model: it was loaded unquantized "
        f"({len(observation['step_end']['plain_linear'])} plain Linear)",
    )
    projections = [
        n for n in observation["step_end"]["plain_linear"] if "lora_" not in n and set(n.split(".")) & set(PROJECTIONS)
    ]
    _require(not projections, f"{len(projections)} projection(s) stayed plain Linear, e.g. {projections[:2]}")
    storage = compute_dtype if (method == "qlora" and strategy == "fsdp") else "uint8" if method == "qlora" else "int8"
    stored_bytes = 0
    for name, q in layers.items():
        _require(q["class"] == wanted, f"{name} is {q['class']}, not {wanted}")
        _require(q["weight_dtype"] == storage, f"{name}: weight stored as {q['weight_dtype']}, expected {storage}")
        itemsize = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}[storage]
        stored_bytes += q["weight_numel"] * itemsize
        if method == "qlora":
            _require(q["quant_state"] is not None, f"{name}: 4-bit weight without a quant_state")
        else:
            _require(q["int8_scales"], f"{name}: int8 weight without its scales (SCB)")
        if strategy == "fsdp":
            _require(
                q["dtensor"] is not None and q["dtensor"]["mesh_size"] == world,
                f"{name}: quantized weight not sharded over {world} ranks",
            )
    full = sum(q["in_features"] * q["out_features"] for q in layers.values())
    packed = full / 2 if method == "qlora" else full  # bytes of the whole quantized weights
    shards = world if strategy == "fsdp" else 1  # DDP and one process hold a whole copy
    _require(
        stored_bytes <= math.ceil(packed / shards) + 64 * len(layers),
        f"{stored_bytes} bytes of quantized weights on this rank, "
        f"expected {packed / shards:.0f} (packed, /{shards} shard(s))",
    )
    return {
        "layers": len(layers),
        "class": wanted,
        "storage": storage,
        "weight_bytes": stored_bytes,
        "ratio_to_bf16": stored_bytes * shards / (2 * full),
    }
