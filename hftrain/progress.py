"""Never silent: from `hftrain` starting to the first training step, a line at least every STILL_EVERY_S seconds.

A run's first step can wait on imports from a cold disk, a speed probe, a tokenizer being trained, a shuffle window
being filled, weights being read: a minute without output looks like a hang. So:

* ``phase("training a tokenizer")`` prints ``hftrain: training a tokenizer ...`` as it starts (or, with
  ``after_s``, only once it has taken that long: for what is usually quick) and names what is under way;
* a watchdog thread, running from ``start()`` (the CLI calls it first thing; a phase starts it too) to ``stop()``
  (the first training step ends), prints ``hftrain: still <phase> (N s)`` whenever nothing of hftrain's was
  printed for STILL_EVERY_S seconds: inside a phase that runs in C or Rust, and between phases alike.

Only the first process of a launch speaks (a rank or loader worker of another reader stays quiet), and on stderr:
a command's stdout (`data inspect`, `plan`, `export`) stays what the command prints.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

STILL_EVERY_S = 6.0
_TICK_S = 0.25


class _Narrator:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.what, self.since, self.announce_after = "starting", time.monotonic(), None  # type: float | None
        self.last = time.monotonic()
        self.thread: threading.Thread | None = None
        self.running = threading.Event()

    def print(self, text: str) -> None:
        with self.lock:
            print(f"hftrain: {text}", file=sys.stderr, flush=True)
            self.last = time.monotonic()

    def watch(self) -> None:
        while self.running.is_set() and self.thread is threading.current_thread():
            time.sleep(_TICK_S)
            now = time.monotonic()
            with self.lock:
                if not self.running.is_set() or self.thread is not threading.current_thread():
                    return  # stopped while asleep: not one line after stop() (a loaded machine wakes late)
                what, since, after, quiet = self.what, self.since, self.announce_after, now - self.last
            if after is not None and now - since >= after:
                self.announce_after = None
                self.print(f"{what} ...")
            elif after is None and quiet >= STILL_EVERY_S:
                self.print(f"still {what} ({now - since:.0f} s)")


_narrator = _Narrator()


def is_first_process() -> bool:
    """Rank 0 of a launch (or a single process): the one that speaks for the others."""
    return os.environ.get("RANK", "0") == "0"


def say(text: str) -> None:
    """One line from the first process, at once (it also resets the watchdog's silence)."""
    if is_first_process():
        _narrator.print(text)


def start() -> None:
    """Watch for silence from now on (idempotent)."""
    if not is_first_process() or _narrator.running.is_set():
        return
    _narrator.running.set()
    _narrator.last = time.monotonic()
    _narrator.thread = threading.Thread(target=_narrator.watch, name="hftrain-progress", daemon=True)
    _narrator.thread.start()


def stop() -> None:
    """Training is under way (its own progress bar and logs speak from here)."""
    _narrator.running.clear()


def is_narration(line: str) -> bool:
    """Whether `line` is one of this module's lines (not a command's output or message): for tools and tests that
    read hftrain's stderr."""
    return line.startswith("hftrain: ") and (
        line.endswith(" ...") or re.fullmatch(r"hftrain: still .+ \(\d+ s\)", line) is not None
    )


@contextmanager
def phase(what: str, after_s: float = 0.0) -> Iterator[None]:
    """Name `what` (lower case, no full stop) as under way for the block; announce it now, or after `after_s`."""
    if not is_first_process():
        yield
        return
    started_here = not _narrator.running.is_set()
    start()
    with _narrator.lock:
        previous = (_narrator.what, _narrator.since, _narrator.announce_after)
        _narrator.what, _narrator.since = what, time.monotonic()
        _narrator.announce_after = after_s or None
    if not after_s:
        _narrator.print(f"{what} ...")
    try:
        yield
    finally:
        with _narrator.lock:
            _narrator.what, _narrator.since, _narrator.announce_after = previous[0], previous[1], None
        if started_here:
            stop()
