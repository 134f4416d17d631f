"""Which processes of a run are still there, so that a lost node is named instead of dying in a transport error.

When one process of a multi-process run dies (its node lost, a kill -9, an out-of-memory kill), the others fail
inside their next collective: gloo at once with "Connection reset by peer", NCCL after the collective timeout
(training.ddp_timeout, 1,800 s unless the recipe sets it). Neither says which process went, and a process that
is stopped or hung (its node frozen) fails nothing: the others wait in the collective. So every process beats in
the launcher's key-value store (torchrun's, which accelerate launch uses too) from a daemon thread (Heartbeat),
which also watches: a watched beat silent for PEER_TIMEOUT_S (120 s; HFTRAIN_PEER_TIMEOUT_S) ends the process
with the lost rank named. When training fails in a multi-process run, `lost_peers` watches the beats for
LOST_AFTER_S and names the ranks whose beat stopped, or says that the store itself is gone (it lives on the head
node, node 0). Either way the survivors stop with PeerLost (exit 76), naming the lost ranks, their nodes and the
checkpoint to continue from.

A run can also stop moving with every process alive and beating: processes waiting in collectives that do not
match (a bug), or one slow beyond reason. The same thread then reports, once per STALL_REPORT_S (900 s;
HFTRAIN_STALL_REPORT_S, 0 for never) without a finished optimizer step: every process's step, from the beats
(which ranks are behind), and where each of this process's threads is (faulthandler's stacks). It reports and
nothing more: an evaluation or a checkpoint of a large model may take that long.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hftrain.errors import PeerLost

BEAT_S = 1.0
LOST_AFTER_S = 4.0  # after a failure: a beat that does not move for this long is a lost process
PEER_TIMEOUT_S = 120.0  # during training: a watched beat silent this long ends the run (a stuck or frozen process)
PEER_TIMEOUT_ENV = "HFTRAIN_PEER_TIMEOUT_S"
STALL_REPORT_S = 900.0  # without a finished optimizer step this long: say where every process and thread is
STALL_REPORT_ENV = "HFTRAIN_STALL_REPORT_S"


def _key(prefix: str, rank: int) -> str:
    return f"{prefix}beat/{rank}"


def _step_key(prefix: str, rank: int) -> str:
    return f"{prefix}step/{rank}"


class Heartbeat:
    """This process's beat, every BEAT_S, from a daemon thread with its own store connection (nothing without a
    launcher's store: one process, or another launcher). The thread also watches: rank 0 every other rank, the
    others rank 0. A watched process whose beat stops for `peer_timeout_s` (stopped, hung, its node frozen: no
    transport error will come, a collective with it waits until its timeout) ends this process with PeerLost's
    message and exit code; so does a store that stays unreachable as long (the head node is gone)."""

    def __init__(
        self,
        dims: Any,
        checkpoint: Callable[[], str],
        peer_timeout_s: float | None = None,
        step: Callable[[], int] = lambda: 0,
    ):
        from hftrain.parallel import launcher_store

        self.dims, self.checkpoint, self.step, self._stop = dims, checkpoint, step, threading.Event()
        self.timeout = peer_timeout_s or float(os.environ.get(PEER_TIMEOUT_ENV, PEER_TIMEOUT_S))
        self.stall_s = float(os.environ.get(STALL_REPORT_ENV, STALL_REPORT_S))
        self._store = launcher_store.connect(30.0) if dims.processes > 1 else None
        if self._store is not None:
            self._prefix = launcher_store.round_prefix(self._store, dims.rank, dims.processes)
            threading.Thread(target=self._run, name="hftrain-heartbeat", daemon=True).start()

    def _run(self) -> None:
        rank, watched = self.dims.rank, [r for r in range(self.dims.processes) if r != self.dims.rank]
        watched = watched if rank == 0 else [0]
        seen: dict[int, tuple[int, float]] = {}
        unreachable_since = None
        # (this process's step, when it last changed); the step in the store
        moved, told = ((self.step(), time.monotonic()), None)
        while not self._stop.wait(BEAT_S):
            now = time.monotonic()
            step = self.step()
            moved = moved if step == moved[0] else (step, now)
            if self.stall_s > 0 and now - moved[1] > self.stall_s:
                self._report_stall(step, now - moved[1])
                moved = (step, now)  # the next report after as long again
            try:
                if step != told:  # one more store write per optimizer step, not per beat
                    self._store.set(_step_key(self._prefix, rank), str(step))
                    told = step
                self._store.add(_key(self._prefix, rank), 1)
                counts = {r: int(self._store.add(_key(self._prefix, r), 0)) for r in watched}
                unreachable_since = None
            except Exception:
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.timeout:
                    self._end(_head_lost(self.checkpoint()))
                continue
            seen = {r: seen[r] if r in seen and seen[r][0] == c else (c, now) for r, c in counts.items()}
            silent = [r for r, (_, since) in seen.items() if now - since > self.timeout]
            if silent and not self._stop.is_set():
                self._end(
                    _lost(
                        self.dims,
                        silent,
                        f"no beat for {self.timeout:.0f} s while training (stopped, hung, or its node frozen)",
                        self.checkpoint(),
                    )
                )

    def _report_stall(self, step: int, still_s: float) -> None:
        """Every process's step (from the store) and this process's threads, on stderr: where a stuck run stands."""
        try:
            steps = [
                self._store.get(_step_key(self._prefix, r)).decode()
                if self._store.check([_step_key(self._prefix, r)])
                else "?"
                for r in range(self.dims.processes)
            ]
        except Exception:
            steps = ["?"] * self.dims.processes
        ranks = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(steps))
        print(
            f"hftrain: rank {self.dims.rank}: no optimizer step finished for {still_s:.0f} s ({ranks}); training goes "
            f"on, this is a report ({STALL_REPORT_ENV}={self.stall_s:.0f}). Where this process's threads are:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def _end(self, err: PeerLost) -> None:
        from hftrain.parallel import child_errors

        child_errors.say(err.exit_code, str(err), child_errors.error_dir())
        os._exit(err.exit_code)  # the main thread may sit in a collective that never returns

    def stop(self) -> None:
        self._stop.set()


def lost_peers(dims: Any, failure: BaseException, checkpoint: str) -> PeerLost | None:
    """After `failure` in training: a PeerLost naming the processes whose beat stopped, or the lost head node;
    None when every process is still beating (then `failure` is the error to show). `checkpoint`: what a restart
    continues from, in words."""
    if dims.processes == 1:
        return None
    from hftrain.parallel import launcher_store

    prefix = launcher_store.current_round()  # set when the heartbeat started; a failure before it names nobody
    try:
        store = launcher_store.connect(LOST_AFTER_S) if prefix else None
        if store is None:
            return None
        before = [int(store.add(_key(prefix, r), 0)) for r in range(dims.processes)]
        time.sleep(LOST_AFTER_S)
        after = [int(store.add(_key(prefix, r), 0)) for r in range(dims.processes)]
    except Exception:
        return _head_lost(checkpoint)
    lost = [r for r in range(dims.processes) if after[r] == before[r] and r != dims.rank]
    if not lost:
        return None
    reason = (
        str(failure).strip().splitlines()[0].split(". ")[0][:160] if str(failure).strip() else type(failure).__name__
    )
    return _lost(dims, lost, f"no beat for {LOST_AFTER_S:.0f} s after training failed ({reason})", checkpoint)


def _lost(dims: Any, ranks: list[int], why: str, checkpoint: str) -> PeerLost:
    per_node = max(1, dims.processes // dims.nodes)
    nodes = sorted({r // per_node for r in ranks})
    return PeerLost(
        f"lost rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (node{'s' if len(nodes) > 1 else ''} "
        f"{', '.join(map(str, nodes))} of {dims.nodes}): {why}. {_next_steps(checkpoint)}"
    )


def _head_lost(checkpoint: str) -> PeerLost:
    head = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return PeerLost(
        f"lost contact with the head node (node 0, {head}), which holds the run's rendezvous: it stopped "
        f"or is unreachable. {_next_steps(checkpoint)}"
    )


def _next_steps(checkpoint: str) -> str:
    from hftrain.parallel.child_errors import ELASTIC_ENV

    restarts, done = (
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
    if os.environ.get(ELASTIC_ENV) and done < restarts:
        return (
            f"Training stopped; {checkpoint}. torchrun restarts the processes on the nodes left (restart {done + 1} "
            f"of at most {restarts}); they resume from it, with the global batch kept."
        )
    return (
        f"Training stopped; {checkpoint}. Start the same launch again to continue; to continue without the "
        "lost node, start it with fewer nodes (NNODES=...): the run keeps its global batch."
    )
