"""Documents -> fixed-length token blocks, as a deterministic, exactly resumable stream.

Two layers, each with a small JSON-able state:

* ``DocumentStream`` mixes the sources of one *logical worker* (a data-parallel rank x DataLoader worker):
  each worker owns disjoint shards (or, when there are fewer shards than workers, disjoint records), walks
  them in a seeded order per epoch and loops forever. Every ``holdout_every``-th record is held out for
  validation by a hash of its identity, so train and validation never overlap whatever the sharding.
* ``BlockStream`` tokenizes, joins documents with EOS and cuts blocks of exactly seq_len tokens; the tail
  is carried into the next block, nothing is padded or dropped. Blocks are shuffled within windows of
  ``shuffle_window`` blocks (a window also ends where a source starts a new epoch). A position is (state at the
  window's start, blocks emitted from it): a resume re-reads at most one window (datasets' shuffle cannot resume).
"""

from __future__ import annotations

import copy
import random
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from hftrain.data.chunking import MAX_BATCH_CHARS, MIN_BATCH_CHARS, SafeCut, TokenRun, next_batch
from hftrain.data.shares import ShardSlice, Share, share_of
from hftrain.data.sources import (
    BadRecords,
    lines_in_every_part,
    list_shard_sizes,
    read_shard,
    shard_problem,
    splittable,
)
from hftrain.data.text_pieces import Record
from hftrain.errors import HftrainError
from hftrain.progress import phase
from hftrain.recipe.data_section import Source

Split = Literal["train", "holdout", "all"]
READ_RETRIES = 6  # transient read errors per shard position before giving up (backoff 0.5 s .. 30 s)


def _mix(*values: int) -> int:
    """A stable 64-bit hash of a few integers (seeds and record identities; Python's hash() is salted)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


@dataclass
class Worker:
    """Which slice of the data one reader owns: logical worker `index` of `count` (ranks x loader workers)."""

    index: int = 0
    count: int = 1


@dataclass
class SourcePlan:
    """A source with its shard list, resolved once per run so that every worker sees the same list."""

    source: Source
    shards: list[str]
    where: str  # recipe path for messages, e.g. data.train[0]
    sizes: list[int] = field(default_factory=list)  # bytes per shard, from the listing

    @property
    def splittable(self) -> bool:
        """Readers can start inside every shard (shares.py: then they read parts of unequal shards)."""
        return all(splittable(self.source, shard) for shard in self.shards)

    def share(self, worker: Worker) -> Share:
        return share_of(self.sizes or [0] * len(self.shards), self.splittable, worker.index, worker.count)


def plan_sources(sources: list[Source], where: str) -> list[SourcePlan]:
    plans = []
    for i, src in enumerate(sources):
        name = f"{where}[{i}]" if len(sources) > 1 or where.endswith("train") else where
        listed = list_shard_sizes(src, name)
        plans.append(SourcePlan(src, [shard for shard, _ in listed], name, [size for _, size in listed]))
    return plans


@dataclass
class DocumentStream:
    plans: list[SourcePlan]
    seed: int
    worker: Worker = field(default_factory=Worker)
    holdout_every: int = 0
    split: Split = "all"
    shuffle: bool = True
    loop: bool = True
    bad: BadRecords = field(default_factory=lambda: BadRecords("fail"))
    only: tuple[int, int] | None = None  # (source, shard): read just that shard, keeping its identity (data prepare)
    _shares: dict[int, Share] = field(default_factory=dict, init=False, repr=False, compare=False)
    _unsplit: dict[tuple[int, int], bool] = field(default_factory=dict, init=False, repr=False, compare=False)

    def fresh_state(self) -> dict[str, Any]:
        cursors = [{"epoch": 0, "shard": 0, "pos": [0, 0], "docs": 0} for _ in self.plans]
        rng = random.Random(_mix(self.seed, self.worker.index, 17))
        return {"cursors": cursors, "rng": _rng_to_json(rng), "skipped": 0}

    def _share(self, s: int) -> Share:
        """This worker's share of source s (shares.py), worked out once."""
        if self.only is not None:
            return Share("whole", (self.only[1],), 0, 1)
        if s not in self._shares:
            self._shares[s] = self.plans[s].share(self.worker)
        return self._shares[s]

    def _reading(self, s: int, shard: int, share: Share) -> tuple[ShardSlice | None, bool]:
        """(this reader's part of the shard, None for all of it; whether it keeps only every L-th record). A shard
        whose byte ranges would leave a part without a line start is read whole by every reader, each keeping
        every L-th record (sources.lines_in_every_part); worked out once per shard."""
        part = share.part(shard)
        if part is None:
            return None, share.mode == "every"
        if (s, shard) not in self._unsplit:
            plan = self.plans[s]
            self._unsplit[s, shard] = not lines_in_every_part(
                plan.source, plan.shards[shard], self._size(s, shard), share.readers
            )
        return (None, True) if self._unsplit[s, shard] else (part, False)

    def _size(self, s: int, shard: int) -> int | None:
        """The shard's size in bytes as listed when the run planned its data (None where unknown)."""
        return self.plans[s].sizes[shard] if self.plans[s].sizes else None

    def _my_shards(self, s: int, epoch: int) -> list[int]:
        """Shard indices this worker reads (its share of each) in `epoch`, in a seeded order per epoch."""
        mine = list(self._share(s).shards)
        if self.shuffle and self.only is None:
            random.Random(_mix(self.seed, s, self.worker.index, epoch)).shuffle(mine)
        return mine

    def _keep(self, s: int, shard: int, rec: Record, share: Share, every: bool) -> bool:
        index = rec.index
        key = _mix(s, shard, index)
        if every:  # records numbered by line take turns; those keyed by their byte offset are dealt by a hash of it
            pick = _mix(shard, index, 29) if rec.key is not None else shard * 1_000_003 + index
            if pick % share.readers != share.reader:
                return False
        if self.split == "all" or not self.holdout_every:
            return True
        held = key % self.holdout_every == 0
        return held if self.split == "holdout" else not held

    def pieces(self, state: dict[str, Any]) -> Iterator[tuple[Any, bool]]:
        """Yield (text, document ends here) forever (or one epoch if not loop), advancing `state` in place
        after each. Long documents come in pieces (text_pieces.py); short ones, and examples, whole."""
        rng = _rng_from_json(state["rng"])
        self.bad.skipped = state.get("skipped", 0)
        weights = [p.source.weight for p in self.plans]
        active = [self.only[0]] if self.only is not None else list(range(len(self.plans)))
        readers: dict[int, Iterator[Record]] = {}
        current = state.get("open")  # a source whose document is in progress is read on until it ends
        while active:
            if current is not None:
                s = current
            elif len(active) > 1:
                s = rng.choices(active, weights=[weights[i] for i in active])[0]
                state["rng"] = _rng_to_json(rng)
            else:
                s = active[0]
            reader = readers.get(s) or readers.setdefault(s, self._source_docs(s, state["cursors"][s]))
            record = next(reader, None)
            state["skipped"] = self.bad.skipped
            if record is None:
                active.remove(s)
                current = None
                continue
            current = None if record.end else s
            state["open"] = current
            yield record.text, record.end

    def documents(self, state: dict[str, Any]) -> Iterator[Any]:
        """Yield whole documents or examples; a long text document comes in pieces (see pieces())."""
        return (text for text, _ in self.pieces(state))

    def _source_docs(self, s: int, cur: dict[str, Any]) -> Iterator[Record]:
        while True:
            mine = self._my_shards(s, cur["epoch"])
            while cur["shard"] < len(mine):
                shard = mine[cur["shard"]]
                yield from self._shard_docs(s, shard, cur, self._share(s))
                cur["shard"] += 1
                cur["pos"] = [0, 0]
            if (
                cur["docs"] == 0 and self.only is None
            ):  # one shard alone may hold nothing: its source is checked as a whole
                raise HftrainError(self._nothing_read(s))
            if not self.loop:
                return
            cur.update(epoch=cur["epoch"] + 1, shard=0, pos=[0, 0], docs=0)

    def _nothing_read(self, s: int) -> str:
        """The message for an epoch of source s that gave this reader no document."""
        plan, share = self.plans[s], self._share(s)
        where = plan.source.path or plan.source.dataset or plan.source.builtin
        if share.readers > 1:
            nth = f"{share.readers}{'nd' if share.readers == 2 else 'rd' if share.readers == 3 else 'th'}"
            how = {"whole": "its shards", "part": "its part of every shard", "every": f"every {nth} record"}[share.mode]
            if share.mode == "part" and any(self._unsplit.get((s, shard)) for shard in share.shards):
                how += f" (every {nth} record of a shard whose ranges hold no line start)"
            return (
                f"{plan.where}: logical reader {share.reader} of "
                f"{share.readers} found no documents in {how} of {where}: the "
                f"source has too few records (or too few shards with data) for {share.readers} readers, or one record "
                "fills a whole part. Set data.readers lower (a multiple "
                "of processes x dataloader workers), or give more data."
            )
        what = (
            "held-out documents (lower data.holdout_every or give data.validation)"
            if self.split == "holdout"
            else "documents"
        )
        hint = ""
        if self.split == "train" and self.holdout_every:
            hint = (
                " Every data.holdout_every-th document is held out for validation, and this source's documents all "
                "were: give data.validation, or more documents (a .txt file is one document unless the source's "
                "document_boundary is blank_line or line)."
            )
        return f"{plan.where}: no {what} found in {where}.{hint}"

    def _shard_docs(self, s: int, shard: int, cur: dict[str, Any], share: Share) -> Iterator[Record]:
        """One shard's kept documents from cur["pos"]. A transient read error (reset connection, 5xx,
        throttling) reopens the shard at the last position with backoff: nothing is lost or read twice."""
        plan, failures = self.plans[s], 0
        name = plan.shards[shard]
        in_doc = len(cur["pos"]) > 2  # resuming inside a document
        while True:
            try:
                part, every = self._reading(s, shard, share)
                for rec in read_shard(plan.source, name, tuple(cur["pos"]), self.bad, part, self._size(s, shard)):
                    cur["pos"] = list(rec.pos)
                    failures = 0
                    if (rec.text or in_doc) and self._keep(s, shard, rec, share, every):
                        cur["docs"] += rec.end
                        yield rec
                    in_doc = not rec.end
                return
            except Exception as err:  # sorted below; anything unknown is re-raised untouched
                kind = shard_problem(err)
                if kind is None:
                    raise
                failures += 1
                if kind == "transient" and failures <= READ_RETRIES:
                    delay = min(30.0, 0.5 * 2 ** (failures - 1))
                    print(
                        f"hftrain: reading {name} failed ({type(err).__name__}: {err}); retry {failures} of "
                        f"{READ_RETRIES} in {delay:g}s",
                        file=sys.stderr,
                    )
                    time.sleep(delay)
                    continue
                what = {
                    "missing": "is missing",
                    "changed": "changed since the run listed it (a resumed run must read the same data)",
                    "corrupt": "is corrupt",
                    "transient": f"could not be read after {READ_RETRIES} retries",
                }[kind]
                self.bad(name, f"{what} ({type(err).__name__}: {err})", "Restore or remove that shard")
                if in_doc:  # skipped mid-document: end that document here rather than join it to the next
                    cur["docs"] += 1
                    yield Record("", tuple(cur["pos"]))
                return


class BlockStream:
    """Token blocks of exactly seq_len from a DocumentStream, window-shuffled, with resumable positions."""

    def __init__(self, docs: DocumentStream, tokenizer: Any, seq_len: int, window: int):
        if tokenizer.eos_token_id is None:
            raise HftrainError("tokenizer: it has no eos_token; documents are joined with EOS, so it needs one.")
        self.docs, self.tokenizer, self.seq_len, self.window = docs, tokenizer, seq_len, window
        self.seed, self.worker, self.shuffle = docs.seed, docs.worker, docs.shuffle
        self.eos = int(tokenizer.eos_token_id)
        self.dtype = np.int32 if len(tokenizer) < 2**31 else np.int64
        self.cutter = SafeCut(tokenizer)

    def fresh_state(self) -> dict[str, Any]:
        return {"start": {"docs": self.docs.fresh_state(), "carry": [], "pending": ""}, "window": 0, "emitted": 0}

    def blocks(self, state: dict[str, Any]) -> Iterator[tuple[np.ndarray, dict[str, Any]]]:
        """Yield (block, position after it). Positions are full states: pass one back to continue from it."""
        state = copy.deepcopy(state)
        pieces, live = self._reader(state["start"])
        try:
            first = self.shuffle and self.window > 1 and self.worker.index == 0  # the wait before step 1: say so
            while True:
                start = copy.deepcopy(state["start"])
                with (
                    phase(f"filling the first shuffle window ({self.window:,} blocks of {self.seq_len:,} tokens)")
                    if first
                    else nullcontext()
                ):
                    blocks, after = self._fill(start, pieces, live)
                first = False
                if not blocks:
                    return
                order = np.arange(len(blocks))
                if self.window > 1 and self.shuffle:
                    order = np.random.default_rng(_mix(self.seed, self.worker.index, state["window"])).permutation(
                        len(blocks)
                    )
                for k in range(state["emitted"], len(blocks)):
                    pos = {"start": start, "window": state["window"], "emitted": k + 1}
                    if k + 1 == len(blocks):
                        pos = {"start": after, "window": state["window"] + 1, "emitted": 0}
                    yield blocks[order[k]], pos
                state = {"start": after, "window": state["window"] + 1, "emitted": 0}
        finally:
            if pieces is not None:
                pieces.close()

    def _reader(self, start: dict[str, Any]) -> tuple[Any, Any]:
        """The document reader for windows from `start` on, and its state (a copy it advances in place)."""
        live = copy.deepcopy(start["docs"])
        return self.docs.pieces(live), live

    def _fill(
        self, start: dict[str, Any], pieces: Iterator[tuple[str, bool]], live: dict[str, Any]
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        """Tokenize pieces until a window of blocks is full, or a source begins a new epoch (so that a small
        corpus is shuffled one epoch at a time, never read over and over to fill a big window); return the blocks
        and the state after them. `pieces` reads on from `start` (its state is `live`), so one reader serves
        window after window."""
        tokens = TokenRun(start["carry"], self.dtype)
        pending = start.get("pending", "")
        blocks: list[np.ndarray] = tokens.take_blocks(self.seq_len)
        epochs = source_epochs(live)
        while len(blocks) < self.window and source_epochs(live) == epochs:
            need = (self.window - len(blocks)) * self.seq_len - len(tokens)
            texts, ends, pending = next_batch(
                pieces, pending, self.cutter, max(MIN_BATCH_CHARS, min(MAX_BATCH_CHARS, 2 * need))
            )
            if not texts:
                break
            ids = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)[
                "input_ids"
            ]
            for seq, end in zip(ids, ends):
                tokens.add(seq, self.eos if end else None)
            blocks.extend(tokens.take_blocks(self.seq_len))
        if len(blocks) > self.window:  # exactly `window` blocks: the surplus starts the next window
            tokens.put_back(np.concatenate(blocks[self.window :]))
            blocks = blocks[: self.window]
        return blocks, {"docs": copy.deepcopy(live), "carry": tokens.rest().tolist(), "pending": pending}


def source_epochs(docs_state: dict[str, Any]) -> list[int]:
    """The epoch each source of a DocumentStream state is in: a window ends when one of them moves on."""
    return [cursor["epoch"] for cursor in docs_state["cursors"]]


def _rng_to_json(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from_json(data: list[Any]) -> random.Random:
    rng = random.Random()
    rng.setstate((data[0], tuple(data[1]), data[2]))
    return rng
