"""Turn-taking for the sides of one A/B pair (throughput.py): the sides' processes are all alive, but only one
computes at a time, and the turn moves to the next side every few steps. A shared host's slow phases last
seconds (a char step is 50 ms: run-to-run, one side's tokens/s spanned 12.9k-18.1k on one host, and the
same code gave ratios 0.86-1.19 with whole runs in sequence); taking turns every second or so spreads each
slow phase over all sides instead of over whichever run it fell in.

Protocol. The parent spawns a side when its first turn comes (so start-up runs alone, as before, and "time
to first step" still counts from the spawn), and hands a turn over by writing a byte to that side's FIFO. A
side ends its turn by writing "<index> y" to the parent's FIFO and blocking on its own; it writes "<index> x"
when it has finished everything (training, saving, the held-out loss). A waiting side uses no CPU. If a
side dies, the parent stops the others and fails with that side's log: no hang.

Only the main process of a side is held: data-loader workers would run on during other sides' turns, so
throughput.py warns when a side used any (all sides use none by default).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TURNS_PER_RUN = 12  # turns each side takes over its measured steps, by default
ENV = "HFTRAIN_BENCH_TURNS"  # "<fifo dir>:<index>:<steps per turn>", set by run_in_turns for each side


class Turns:
    """A side's half: `after_step(step)` ends this side's turn every `every` steps and returns the seconds it
    waited for its next one (0.0 otherwise), for the step clock to leave out."""

    def __init__(self, where: Path, index: int, every: int) -> None:
        self.index, self.every = index, every
        self._mine = os.open(where / f"turn-{index}", os.O_RDWR)  # RDWR: the open never blocks
        self._parent = os.open(where / "parent", os.O_RDWR)
        self._parent_pid = os.getppid()

    @classmethod
    def from_env(cls) -> Turns | None:
        spec = os.environ.get(ENV)
        if not spec:
            return None
        where, index, every = spec.rsplit(":", 2)
        return cls(Path(where), int(index), int(every))

    def after_step(self, step: int, last: int) -> float:
        if step % self.every or step >= last:  # the last step keeps the turn: saving and evaluation follow
            return 0.0
        start = time.perf_counter()
        os.write(self._parent, f"{self.index} y\n".encode())
        while not select.select([self._mine], [], [], 2.0)[0]:
            if os.getppid() != self._parent_pid:  # the benchmark was stopped: nobody will hand a turn over
                raise SystemExit(f"side {self.index}: the benchmark that ran it has ended")
        os.read(self._mine, 1)
        return time.perf_counter() - start

    def finished(self) -> None:
        os.write(self._parent, f"{self.index} x\n".encode())


def turn_steps(requested: int | None, steps: int) -> int:
    """Steps per turn: `requested` (--turn-steps), else about TURNS_PER_RUN turns per run of `steps` (char: 20
    steps, about 1 s); 0 runs the sides one after another, whole."""
    return max(1, steps // TURNS_PER_RUN) if requested is None else requested


def run_pair(
    cmds: list[list[str]],
    logs: list[Path],
    results: list[Path],
    where: Path,
    every: int,
    spawned: Callable[[], list[str]],
) -> list[dict[str, Any]]:
    """One A/B pair's results: the sides taking turns of `every` steps, or (0) one after another. `spawned()`
    runs just before each side starts and returns the arguments that go on its command line."""
    if every == 0:
        from benchmarks._common import run_child  # (transformers, for the step clock: not for a side's import of Turns)

        return [run_child([*cmd, *spawned()], log, result) for cmd, log, result in zip(cmds, logs, results)]
    run_in_turns(cmds, logs, where, every, dict(os.environ), before_spawn=lambda i: spawned())
    return [json.loads(result.read_text()) for result in results]


@dataclass
class Side:
    cmd: list[str]
    log: Path
    env: dict[str, str]
    process: subprocess.Popen | None = None
    finished: bool = False


def run_in_turns(
    cmds: list[list[str]],
    logs: list[Path],
    where: Path,
    every: int,
    env: dict[str, str],
    before_spawn: Callable[[int], list[str]] | None = None,
    poll_s: float = 0.5,
) -> None:
    """Run the commands as sides taking turns of `every` steps, in the given order, until all have finished.
    `before_spawn(i)` runs just before side i starts and returns arguments appended to its command (the spawn
    time). Fails (SystemExit, with the log's last lines) when a side exits without finishing."""
    where.mkdir(parents=True, exist_ok=True)
    for name in ["parent", *(f"turn-{i}" for i in range(len(cmds)))]:
        os.mkfifo(where / name)
    fds = [os.open(where / f"turn-{i}", os.O_RDWR) for i in range(len(cmds))]
    parent = os.open(where / "parent", os.O_RDWR)
    sides = [Side(cmd, log, {**env, ENV: f"{where}:{i}:{every}"}) for i, (cmd, log) in enumerate(zip(cmds, logs))]
    try:
        _give_turn(sides, 0, fds, before_spawn)
        pending = b""
        while not all(s.finished for s in sides):
            pending = _read(parent, pending, poll_s)
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                index, kind = line.decode().split()
                side = sides[int(index)]
                if kind == "x":  # let it exit first: its interpreter's teardown would share the next side's turn
                    side.finished = True
                    _end(side, grace_s=60)
                following = _next_side(sides, int(index))
                if following is not None:
                    _give_turn(sides, following, fds, before_spawn)
            if any(s.process is not None and s.process.poll() is not None and not s.finished for s in sides):
                pending = _read(parent, pending, 0.0)  # its last words may have arrived since the read above
                if b"\n" not in pending:
                    _fail(
                        next(
                            s
                            for s in sides
                            if s.process is not None and s.process.poll() is not None and not s.finished
                        )
                    )
    finally:
        for side in sides:
            if side.process is not None and side.process.poll() is None:
                side.process.kill()
                side.process.wait()
        for fd in (*fds, parent):
            os.close(fd)


def _read(fd: int, pending: bytes, timeout: float) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    return pending + os.read(fd, 4096) if ready else pending


def _end(side: Side, grace_s: float) -> None:
    try:
        code = side.process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        side.process.kill()
        code = side.process.wait()
    if code != 0:
        _fail(side)


def _next_side(sides: list[Side], index: int) -> int | None:
    for step in range(1, len(sides) + 1):
        candidate = (index + step) % len(sides)
        if not sides[candidate].finished:
            return candidate
    return None


def _give_turn(sides: list[Side], index: int, fds: list[int], before_spawn: Callable[[int], list[str]] | None) -> None:
    side = sides[index]
    if side.process is None:
        extra = before_spawn(index) if before_spawn else []
        with side.log.open("w") as out:
            side.process = subprocess.Popen([*side.cmd, *extra], stdout=out, stderr=subprocess.STDOUT, env=side.env)
    else:
        os.write(fds[index], b"t")


def _fail(side: Side) -> None:
    """A side that exited before saying it finished (a crash, the OOM killer) would leave the others waiting."""
    tail = "".join(side.log.read_text(errors="replace").splitlines(keepends=True)[-40:])
    raise SystemExit(
        f"benchmark child failed (exit {side.process.returncode}): "
        f"{' '.join(side.cmd)}\n--- last lines of {side.log} ---\n{tail}"
    )
