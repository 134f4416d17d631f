"""Which part of a source each logical reader reads: equal shares, so that the run's round-robin over readers
(readers.py: one block per reader in turn) draws every part of the data in proportion to its size.

Reader r of L takes, per source, one of:

* ``whole``: whole shards, dealt largest first to the least-loaded reader. Used when there are at least L
  shards and the dealt loads stay within BALANCE of each other: each file is then opened by one reader only.
* ``part``: the r-th of L parts of every shard: a byte range of a plain JSONL file (a record belongs to the
  range that holds its first byte), a row range of a parquet file, a block range of a prepared shard. A JSONL
  shard whose ranges would leave one without a line start (a record longer than a range) is read whole by
  every reader instead, each keeping every L-th record (sources.lines_in_every_part).
* ``every``: every L-th record of every shard, for shards that cannot be entered in the middle (compressed
  files, a text file's documents, a streamed dataset). Every reader reads them whole and keeps its records.
  With at least L such shards, whole shards are dealt instead even when unequal: reading every compressed
  file L times would cost L times the I/O.

Why: readers used to own every L-th shard whatever its size. Shards of unequal size then fed the run equal
blocks each, so a small shard's documents were drawn several times as often as a large one's (benchmark
corpus: 8 shards of equal document count and unequal bytes; the short-document shard's EOS tokens came 4x as
often as its share, and held-out loss was worse than run_clm's global shuffle at every shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

BALANCE = 0.02  # whole shards only when the most loaded reader has at most 2% more bytes than the least loaded

Mode = Literal["whole", "part", "every"]


@dataclass(frozen=True)
class Share:
    """What one reader reads of one source: `shards` (indices, in source order), and how."""

    mode: Mode
    shards: tuple[int, ...]
    reader: int
    readers: int

    def describe(self) -> str:
        """How the readers share the source, for `hftrain data inspect`."""
        if self.readers == 1:
            return "1 reader reads every shard"
        return (
            f"{self.readers} readers share it: "
            + {
                "whole": (
                    f"whole shards, dealt by size (within {BALANCE:.0%} of each "
                    "other, or compressed/text shards that cannot be split)"
                ),
                "part": "each reads a part of every shard (byte, row or block ranges: the shards differ in size)",
                "every": (
                    f"each keeps every {self.readers}th record of every "
                    "shard (fewer compressed/text shards than readers)"
                ),
            }[self.mode]
        )

    def part(self, shard: int) -> ShardSlice | None:
        """Which of L parts of shard `shard` this reader reads (None: all of it). Reader r takes part
        (r + shard) % L, so the parts that rounding makes one longer go round the readers."""
        if self.mode != "part":
            return None
        return ShardSlice((self.reader + shard) % self.readers, self.readers)


@dataclass(frozen=True)
class ShardSlice:
    """Slice `index` of `count` equal slices of one shard (a share of a shard: shares.py)."""

    index: int
    count: int

    def span(self, total: int) -> tuple[int, int]:
        """[start, stop) of a shard of `total` bytes, rows or blocks."""
        return total * self.index // self.count, total * (self.index + 1) // self.count


def span(part: ShardSlice | None, total: int) -> tuple[int, int]:
    return (0, total) if part is None else part.span(total)


def deal(sizes: Sequence[int], readers: int) -> list[list[int]]:
    """Whole shards per reader: largest first, each to the reader with the fewest bytes (then fewest shards,
    then lowest index, so unknown sizes of 0 are dealt round-robin)."""
    loads = [(0, 0, r) for r in range(readers)]
    owned: list[list[int]] = [[] for _ in range(readers)]
    for shard in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, count, r = min(loads)
        owned[r].append(shard)
        loads[r] = (load + sizes[shard], count + 1, r)
    return [sorted(o) for o in owned]


def balanced(sizes: Sequence[int], dealt: list[list[int]]) -> bool:
    loads = [sum(sizes[i] for i in shards) for shards in dealt]
    return min(loads) > 0 and max(loads) <= (1 + BALANCE) * min(loads) or max(loads) == 0 and all(dealt)


def share_of(sizes: Sequence[int], splittable: bool, reader: int, readers: int) -> Share:
    """Reader `reader` of `readers`' share of a source whose shards have `sizes` bytes (see the module doc)."""
    everything = tuple(range(len(sizes)))
    if readers == 1:
        return Share("whole", everything, reader, readers)
    if len(sizes) >= readers:
        dealt = deal(sizes, readers)
        if balanced(sizes, dealt) or not splittable:
            return Share("whole", tuple(dealt[reader]), reader, readers)
    return Share("part" if splittable else "every", everything, reader, readers)
