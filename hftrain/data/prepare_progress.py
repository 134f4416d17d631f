"""How `hftrain data prepare` shows its progress: one line per finished task over the tasks of every worker (their
consoles read back), the folder named once."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from hftrain.data.token_folder import LOGS


@contextmanager
def tasks_console(path: Path) -> Iterator[TextIO]:
    """The tasks' own output (datatrove's log lines, tracebacks included) goes to `path`; hftrain's lines go to the
    real stderr, through the stream this yields. Where stderr is not a file (a notebook), nothing is redirected."""
    sys.stderr.flush()
    try:
        os.fstat(2)
    except OSError:
        yield sys.stderr
        return
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
        real = os.fdopen(os.dup(saved), "w", buffering=1)
        try:
            yield real
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            real.close()


class Progress:
    """A line every few seconds while the tasks run: tasks done, their tokens, tokens/s and an ETA."""

    EVERY_S = 5.0

    def __init__(self, fs: Any, root: str, tasks: int, token_size: int, stream: TextIO):
        self.fs, self.root, self.tasks, self.token_size, self.stream = fs, root, tasks, token_size, stream
        self.stop = threading.Event()
        self.tokens: dict[int, int] = {}
        self.start = time.perf_counter()

    def __enter__(self) -> Progress:
        self.before = completed_tasks(self.fs, self.root)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def _loop(self) -> None:
        while not self.stop.wait(self.EVERY_S):
            try:
                self.show()
            except Exception:  # a listing that fails now is tried again at the next line
                continue

    def show(self) -> None:
        done = completed_tasks(self.fs, self.root) - self.before
        new = done - set(self.tokens)
        listing = self.fs.ls(self.root, detail=True) if new else []  # one listing per line, whatever the tasks
        for rank in new:
            mine = [
                p
                for p in listing
                if p["name"].rsplit("/", 1)[-1].startswith(f"{rank:05d}_") and p["name"].endswith(".ds")
            ]
            self.tokens[rank] = sum(int(p["size"]) for p in mine) // self.token_size
        seconds = time.perf_counter() - self.start
        tokens = sum(self.tokens.values())
        line = (
            f"prepare: {len(done) + len(self.before)}/{self.tasks} tasks done, {tokens / 1e6:,.1f}M tokens, "
            f"{tokens / max(seconds, 1e-9):,.0f} tokens/s"
        )
        left = self.tasks - len(done) - len(self.before)
        if done and left:
            eta = seconds * left / len(done)
            line += f", ETA {int(eta // 60)}m{int(eta % 60):02d}s"
        print(line, file=self.stream, flush=True)


def completed_tasks(fs: Any, root: str) -> set[int]:
    """The tasks of the prepare at `root` that finished (datatrove's completion markers)."""
    where = f"{root}/{LOGS}/completions"
    if not fs.isdir(where):
        return set()
    return {int(p.rstrip("/").rsplit("/", 1)[-1]) for p in fs.ls(where, detail=False)}
