"""The one gate for `trust_remote_code`: every from_pretrained call that may run a checkpoint's own Python code takes
its flag from ``allow``, which prints the warning first, in every command (train, plan, eval, export, ...)."""

from __future__ import annotations

import sys

_warned: set[tuple[str, str]] = set()


def allow(flag: bool, key: str, source: str | None) -> bool:
    """`flag`, after a warning (once per key and source in a process) when it lets `source`'s code run."""
    if flag and (key, str(source)) not in _warned:
        _warned.add((key, str(source)))
        print(
            f"hftrain: warning: {key} is on: Python code shipped with {source} will run in this process.",
            file=sys.stderr,
            flush=True,
        )
    return flag
