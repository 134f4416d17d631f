"""The launcher's key-value store (torchrun's TCPStore, which accelerate launch uses too), and the keys hftrain
keeps in it: decisions every process must share (``agree``), the shared-disk probe (node_disks.py), the
heartbeats (liveness.py).

Every key lives under the token of the current start of the run (``round_prefix``). The store outlives a start:
torchrun's agents restart the processes in the same store after a failure, and an elastic rendezvous (a node lost
or joining, multinode.py) starts a new round in it. A restart count cannot name a round: each agent counts its own
restarts, so a node that joins later counts 0 where the others count 1, and a membership change restarts without
counting. Keys named by it were read stale (a previous start's decision, probe token or beat) or waited for in
vain. So at its first use in a start, rank 0 makes a fresh token and hands it to each process that asks with a
fresh nonce of its own: nothing a previous start wrote can be taken for it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from hftrain.errors import HftrainError

POLL_S = 0.05
_rounds: dict[tuple[Any, ...], str] = {}  # this process's round token, per store address and start
_hosted: dict[tuple[Any, ...], Any] = {}  # rank 0's store server, kept for the life of the process


def connect(timeout_s: float) -> Any:
    """The run's store under torchrun, or None without one (one process, or another launcher). torchrun's agent
    holds it (TORCHELASTIC_USE_AGENT_STORE=True), or, where its agent does not share its store (an elastic launch,
    multinode.py), rank 0 holds it on MASTER_PORT: the same server its process group then uses (multi-tenant)."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower()
    if agent_store not in ("true", "false") or "MASTER_ADDR" not in os.environ:
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    host = agent_store == "false" and os.environ.get("RANK", "0") == "0"
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=host,
        multi_tenant=True,
        timeout=timedelta(seconds=timeout_s),
    )
    if host:  # the server ends with the last object that holds it: the others' waits would fail
        _hosted.setdefault(_start(), store)
    return store


def _start() -> tuple[Any, ...]:
    names = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE")
    return (os.getpid(), *(os.environ.get(n) for n in names))


def current_round() -> str | None:
    """This start's key prefix if this process already joined it (after a failure nothing new is agreed)."""
    return _rounds.get(_start())


def round_prefix(store: Any, rank: int, processes: int, timeout_s: float = 600.0) -> str:
    """'hftrain/TOKEN/': the key prefix of this start of the run, the same in all `processes` (a collective: each
    process calls it, the first time at the same point of the run)."""
    start = _start()
    if start not in _rounds:
        _rounds[start] = f"hftrain/{_join(store, rank, processes, timeout_s)}/"
    return _rounds[start]


def _join(store: Any, rank: int, processes: int, timeout_s: float) -> str:
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"hftrain/round/ask/{rank}", nonce)
        token = store.get(f"hftrain/round/answer/{nonce}").decode()  # only this start's rank 0 knows the nonce
        store.add(f"hftrain/round/{token}/joined", 1)
        return token
    token, answered, deadline = uuid.uuid4().hex, set(), time.monotonic() + timeout_s
    while int(store.add(f"hftrain/round/{token}/joined", 0)) < processes - 1:
        for other in range(1, processes):
            key = f"hftrain/round/ask/{other}"
            nonce = store.get(key).decode() if store.check([key]) else None
            if nonce is not None and nonce not in answered:  # a previous start's nonce is answered too, harmlessly
                store.set(f"hftrain/round/answer/{nonce}", token)
                answered.add(nonce)
        if time.monotonic() > deadline:
            raise HftrainError(
                f"not every process of the run started within {timeout_s:.0f} s (rank 0 heard from "
                f"{int(store.add(f'hftrain/round/{token}/joined', 0))} "
                f"of {processes - 1}); see the other ranks' output."
            )
        time.sleep(POLL_S)
    return token


def agree(
    name: str, decide: Callable[[], dict[str, Any]], rank: int, processes: int, timeout_s: float = 600.0
) -> dict[str, Any]:
    """One decision for every process of the run: rank 0 makes it, the others read it from the launcher's store.
    Measured choices such as the speed defaults must agree: two DDP ranks in different precisions would train on,
    silently, with mixed gradients. Without that store (one process, or another launcher) every process decides
    for itself."""
    store = connect(timeout_s) if processes > 1 else None
    if store is None:
        return decide()
    key = round_prefix(store, rank, processes, timeout_s) + name
    if rank == 0:
        value = decide()
        store.set(key, json.dumps(value))
        return value
    return json.loads(store.get(key))  # waits until rank 0 has decided
