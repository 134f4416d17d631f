"""argparse types for the numbers the commands take: a value that cannot work (0 nodes, -1 processes, a
negative restart count, an MFU above 1) is refused where it is parsed, with argparse's one-line message and
exit code 2, before anything starts. tests/test_structure.py checks that every numeric option uses one."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _number(kind: type, low: float, low_ok: bool, high: float | None, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind is int else 'a number'}"
            ) from None
        if (
            value != value
            or value in (float("inf"), float("-inf"))
            or (value < low if low_ok else value <= low)
            or (high is not None and value > high)
        ):
            raise argparse.ArgumentTypeError(f"{text} cannot work: give {what}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _number(int, 0, False, None, "a whole number of 1 or more")
non_negative_int = _number(int, 0, True, None, "a whole number of 0 or more")
positive_float = _number(float, 0.0, False, None, "a number above 0")
non_negative_float = _number(float, 0.0, True, None, "a number of 0 or more")
fraction = _number(float, 0.0, False, 1.0, "a number above 0 and at most 1")


def node_count(text: str) -> tuple[int, int]:
    """--nnodes: N nodes, or MIN:MAX (torchrun's elastic form: MIN..MAX nodes) as (MIN, MAX); N is (0, N)."""
    low, sep, high = text.partition(":")
    count = positive_int(high if sep else low)
    if not sep:
        return 0, int(count)
    least = positive_int(low)
    if least > count:
        raise argparse.ArgumentTypeError(f"{text} cannot work: give MIN:MAX with MIN at most MAX, e.g. 1:{int(count)}")
    return int(least), int(count)


node_count.__name__ = "N or MIN:MAX nodes"
