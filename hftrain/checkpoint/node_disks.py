"""A run directory on each node's own disk (nodes without shared storage, SageMaker instances): detected at the
start, and every checkpoint kept whole and checked on every node.

Without shared storage, what the main process alone writes (the model and optimizer of a DDP save, FSDP's
``.metadata``, DeepSpeed's ``latest``, the Trainer's state, every process's data position) would exist on node 0
only, and a resume on another node would find no checkpoint, or half of one. So:

* ``shared_output``: at the start, node 0 writes a probe into training.output_dir and the other nodes look for
  it (the launcher's key-value store carries its token). When they do not all see it, ``storage_settings`` turns
  on TrainingArguments' ``save_on_each_node``: each node's first process writes what the main process writes.
* ``checkpoint_listing`` (every process, at each save, once all have written their part): every file one node
  has and another lacks, or holds otherwise (node 0's version wins: the Trainer's state logged on each node), is
  copied to it over the process group, so that every node's copy is the same bytes (SageMaker uploads every
  instance's copy to one S3 prefix) (a sharded format's loader reads other ranks'
  files too: DCP stores a replicated value once, in one rank's file), so each node holds the whole checkpoint
  and can resume alone, on fewer nodes too; then each node lists its copy, and the merged record goes into every
  node's marker with the name of the part on that disk (``lister``: nodeN), which that node checks. A node
  publishes only after every node has its copy.
* ``common_resume``: the newest checkpoint complete and readable on every node, so one that is complete on one
  node but not on another is never picked, on any node.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from hftrain.checkpoint.integrity import list_files, record
from hftrain.errors import HftrainError

PROBE = ".hftrain-node-probe"
CHUNK = 64 << 20  # bytes sent at a time when a file is copied to the nodes that lack it


def node_of(dims: Any) -> int:
    """This process's node: torchrun's GROUP_RANK (the node rank), else its place in the usual rank layout."""
    return int(os.environ.get("GROUP_RANK", dims.rank // max(1, dims.processes // dims.nodes)))


def shared_output(root: Path, dims: Any) -> bool:
    """Whether every node sees the same training.output_dir (True on one node, or without a launcher's store)."""
    from hftrain.parallel import launcher_store

    store = launcher_store.connect(600.0) if dims.nodes > 1 else None
    if store is None:
        return True
    key, probe = launcher_store.round_prefix(store, dims.rank, dims.processes) + "output-probe", root / PROBE
    if dims.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        probe.write_text(token, encoding="utf-8")
        store.set(key, token)
    token = store.get(key).decode()  # waits for node 0
    node = node_of(dims)
    if dims.local_rank == 0 and node != 0:
        seen = probe.is_file() and probe.read_text(encoding="utf-8") == token
        store.set(f"{key}/node{node}", "1" if seen else "0")
    shared = all(store.get(f"{key}/node{n}").decode() == "1" for n in range(1, dims.nodes))
    if dims.rank == 0:
        probe.unlink(missing_ok=True)  # every node has answered
    return shared


def storage_settings(kwargs: dict[str, Any], root: Path, dims: Any) -> dict[str, Any]:
    """The TrainingArguments values the nodes' disks decide: save_on_each_node where the nodes do not share
    training.output_dir (said once), none otherwise. `kwargs` (the values so far) are only read."""
    if dims.nodes == 1 or shared_output(root, dims):
        return {}
    from hftrain.parallel.child_errors import ELASTIC_ENV

    if os.environ.get(ELASTIC_ENV):
        raise HftrainError(
            f"training.output_dir ({root}) is on each node's own disk (node 0's files are not visible on the others), "
            f"and this is an elastic launch (--nnodes {os.environ[ELASTIC_ENV]}), "
            "which places the ranks on any node at each "
            "restart and takes in nodes whose disks hold no checkpoint. Put training.output_dir on storage every node "
            "mounts, or launch a fixed number of nodes (`hftrain launch-script --kind torchrun` without --min-nodes): "
            "then each node keeps a whole copy of every checkpoint."
        )
    if kwargs.get("save_on_each_node") is False:
        raise HftrainError(
            f"training.save_on_each_node: false, but the {dims.nodes} nodes do not share training.output_dir ({root}: "
            "node 0's files are not visible on the others), so only node 0 would hold the checkpoints. Remove the "
            "setting (each node then keeps its own copy), or put training.output_dir on storage every node mounts."
        )
    if dims.rank == 0:
        print(
            f"hftrain: training.output_dir is on each node's own disk (node 0's files are not visible on the others): "
            f"each of the {dims.nodes} nodes keeps a whole copy of every checkpoint.",
            flush=True,
        )
    return {"save_on_each_node": True}


def node_local(args: Any, dims: Any) -> bool:
    return bool(args.save_on_each_node) and dims.nodes > 1


def checkpoint_listing(staged: Path, args: Any, dims: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(record, marker extras) for the checkpoint staged in `staged`, once every process has written its part
    (`args`: the run's TrainingArguments, `dims`: its parallel dims). One shared directory: the main process lists
    it. Node-local: see the module docstring (every process joins)."""
    if not node_local(args, dims):
        return (record(staged, args.process_index) if args.should_save else {}), {}
    import torch.distributed as dist

    node, main = node_of(dims), args.should_save
    listings: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(listings, (node, dist.get_rank(), list_files(staged) if main else None))
    by_node = {n: files for n, _, files in listings if files is not None}
    sender = {n: rank for n, rank, files in listings if files is not None}  # each node's first process
    for name in sorted({f for files in by_node.values() for f in files}):
        holder = min(n for n, files in by_node.items() if name in files)  # node 0's copy where it has one
        if all(files.get(name) == by_node[holder][name] for files in by_node.values()):
            continue
        receive = main and by_node[node].get(name) != by_node[holder][name]
        _broadcast_file(staged / name, by_node[holder][name]["size"], sender[holder], node == holder and main, receive)
    dist.all_gather_object(listings, {f"node{node}": list_files(staged)} if main else {})
    merged = {k: v for one in listings for k, v in one.items()}
    return merged, {"lister": f"node{node}", "nodes": dims.nodes}


def _broadcast_file(path: Path, size: int, src: int, send: bool, receive: bool) -> None:
    """One file from global rank `src` to every process, in CHUNK-sized pieces (memory stays CHUNK, whatever the
    file's size); the processes with `receive` write it."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if receive:
        path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "rb") if send else open(path, "wb") if receive else open(os.devnull, "wb") as f:
        for offset in range(0, size, CHUNK):
            piece = torch.empty(min(CHUNK, size - offset), dtype=torch.uint8, device=device)
            if send:
                piece.copy_(torch.frombuffer(bytearray(f.read(piece.numel())), dtype=torch.uint8))
            dist.broadcast(piece, src=src)
            if receive:
                f.write(piece.cpu().numpy().tobytes())


def common_resume(chosen: Path | None, complete: list[Path], dims: Any, unreadable: Any) -> Path | None:
    """The checkpoint every node resumes from: the newest step complete and readable on all of them (each node
    judged `chosen`, its newest readable one, from `complete`; a step missing or unreadable on one node is not
    taken on any). One node, or a shared directory: `chosen` as it is."""
    import torch.distributed as dist

    if dims.nodes == 1 or not (dist.is_available() and dist.is_initialized()):
        return chosen
    from hftrain.checkpoint.layout import checkpoint_step

    steps, newest = {checkpoint_step(c): c for c in complete}, checkpoint_step(chosen) if chosen is not None else None
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, newest)
    if len(set(views)) == 1:  # the usual case: every node picked the same one
        return chosen
    mine = sorted(s for s, c in steps.items() if newest is not None and s <= newest and unreadable(c) is None)
    dist.all_gather_object(views, mine)
    common = set(views[0]).intersection(*views[1:])
    if not common:
        if any(views):
            raise HftrainError(
                "training.output_dir: the nodes hold no checkpoint in "
                "common that every one of them can load (newest per "
                f"process: {[v[-1] if v else None for v in views]}). Restore one node's copy onto the others, or set "
                "training.resume_from_checkpoint=false to start over."
            )
        return None
    step = max(common)
    if chosen is not None and checkpoint_step(chosen) != step and dims.rank == 0:
        print(f"hftrain: resuming from checkpoint-{step}, the newest one complete on every node", flush=True)
    return steps[step]
