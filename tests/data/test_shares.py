"""Readers take equal shares of unequal shards, so the run draws every shard in proportion to its size."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hftrain.data.folder_stream import FolderStream
from hftrain.data.loader import PackedDataset, ResumableLoader, plan_data
from hftrain.data.part import DataPart
from hftrain.data.shares import BALANCE, ShardSlice, Share, deal, share_of
from hftrain.data.sources import BadRecords
from hftrain.data.stream import DocumentStream, SourcePlan, Worker
from hftrain.data.text_pieces import PIECE_CHARS
from hftrain.data.token_folder import TokenFile, TokenFolder
from hftrain.errors import HftrainError
from hftrain.model.tokenizer import gpt2_tokenizer
from hftrain.parallel.readers import ReaderLayout, default_readers
from hftrain.recipe.load import load_recipe

from ..support.data import make_documents, write_jsonl

WORDS = ["apple", "river", "house", "green", "music", "table", "water", "light"]  # one GPT-2 token each


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer()


def section(path, **extra):
    return load_recipe(None, {"data": {"train": {"path": str(path)}, **extra}}).data


def read_all(plan, readers, **kw):
    """Each reader's documents over one epoch, in stream order."""
    out = []
    for r in range(readers):
        stream = DocumentStream(plan.train, seed=0, worker=Worker(r, readers), loop=False, shuffle=False, **kw)
        out.append(list(stream.documents(stream.fresh_state())))
    return out


def draw_shares(tmp_path, tok):
    """Each shard's share of the words in the run's first epoch of blocks, and its share of the corpus's bytes:
    8 JSONL shards of 400 documents each, the documents of shard i being 1 + 3 i words (tokens) long."""
    words = {w: (1 + 3 * i) * 400 for i, w in enumerate(WORDS)}
    for i, w in enumerate(WORDS):
        write_jsonl(tmp_path / "corpus" / f"part-{i}.jsonl", [" ".join([w] * (1 + 3 * i))] * 400)
    val = write_jsonl(tmp_path / "val.jsonl", ["held out"])
    plan = plan_data(section(tmp_path / "corpus", seq_len=32, validation={"path": str(val)}), 0)
    epoch_blocks = (sum(words.values()) + 8 * 400) // 32  # a token per word, an EOS per document
    loader = iter(ResumableLoader(PackedDataset(plan, tok, 0, ReaderLayout(8, 1, 1, 16)), 8, 0))
    seen: Counter[str] = Counter()
    for _ in range(epoch_blocks // 8):
        for block in next(loader)["input_ids"]:
            seen.update(t for t in tok.decode(block).replace(tok.eos_token, " ").split() if t in words)
    drawn = {w: seen[w] / sum(seen.values()) for w in WORDS}
    size = {w: n / sum(words.values()) for w, n in words.items()}
    return drawn, size


def test_unequal_shards_are_drawn_in_proportion_to_their_size(tmp_path, tok):
    drawn, size = draw_shares(tmp_path, tok)
    for w in WORDS:  # the smallest shard is 1.1% of the corpus, the largest 24%
        assert abs(drawn[w] - size[w]) < 0.08 * size[w], (w, drawn[w], size[w])


def test_the_proportion_check_can_fail(tmp_path, tok, monkeypatch):
    """With every L-th shard per reader (the old dealing), the smallest shard is drawn 1/8 of the time."""
    monkeypatch.setattr(
        SourcePlan,
        "share",
        lambda self, w: Share("whole", tuple(range(w.index, len(self.shards), w.count)), w.index, w.count),
    )
    drawn, size = draw_shares(tmp_path, tok)
    assert drawn["apple"] > 4 * size["apple"]


# --------------------------------------------------------------------------------------------- dealing
def test_equal_shards_are_dealt_whole_and_unequal_ones_split():
    assert share_of([100] * 8, True, 3, 8) == Share("whole", (3,), 3, 8)
    assert share_of([100] * 16, False, 0, 8).mode == "whole"
    assert share_of([10, 20, 30, 40, 50, 60, 70, 80], True, 0, 8).mode == "part"
    # compressed: read once, even if unequal
    assert share_of([10, 20, 30, 40, 50, 60, 70, 80], False, 0, 8).mode == "whole"
    assert share_of([100, 200], False, 1, 8) == Share("every", (0, 1), 1, 8)
    assert share_of([100, 200], True, 1, 8) == Share("part", (0, 1), 1, 8)
    assert share_of([5, 500], True, 0, 1).mode == "whole"


def test_many_shards_of_random_size_are_dealt_whole_within_the_balance():
    rng = random.Random(0)
    sizes = [int(rng.lognormvariate(15, 1)) for _ in range(2000)]
    dealt = deal(sizes, 8)
    loads = [sum(sizes[i] for i in d) for d in dealt]
    assert sorted(i for d in dealt for i in d) == list(range(2000))
    assert max(loads) <= (1 + BALANCE) * min(loads)
    assert share_of(sizes, True, 5, 8) == Share("whole", tuple(dealt[5]), 5, 8)
    assert [len(d) for d in deal([0] * 10, 4)] == [3, 3, 2, 2]  # unknown sizes: round-robin


def test_a_part_is_the_readers_slice_and_the_longer_parts_go_round():
    assert [ShardSlice(k, 3).span(10) for k in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [Share("part", (0, 1, 2), r, 3).part(1) for r in range(3)] == [
        ShardSlice(1, 3),
        ShardSlice(2, 3),
        ShardSlice(0, 3),
    ]
    assert Share("whole", (0,), 1, 3).part(0) is None


# --------------------------------------------------------------------------------- parts of one shard
@pytest.mark.parametrize("readers", [2, 3, 5, 7])
def test_parts_of_a_jsonl_file_cover_it_once(tmp_path, readers):
    """Byte ranges start mid-line, at a line's first byte, inside blank lines and inside a record longer than
    one piece: every record is read by exactly one reader, whole."""
    rng = random.Random(readers)
    docs = [f"doc{i} " + "x" * rng.choice([1, 100, 4000]) for i in range(120)]
    docs[17] = "doc17 " + "long " * (PIECE_CHARS // 2)  # comes in pieces
    lines = "".join(json.dumps({"text": d}) + "\n" + ("\n" if i % 9 == 0 else "") for i, d in enumerate(docs))
    (tmp_path / "a.jsonl").write_text(lines, encoding="utf-8")
    plan = plan_data(section(tmp_path / "a.jsonl"), 0)
    assert plan.train[0].share(Worker(0, readers)).mode == "part"
    parts = read_all(plan, readers)
    whole = ["".join(p) for p in parts]
    flat = [d for p in parts for d in p]
    assert sorted(_join_pieces(flat)) == sorted(docs) and all(whole)


def _join_pieces(flat):
    """Documents from a stream's texts (a long one arrives in pieces, each starting where the last ended)."""
    out = []
    for text in flat:
        if text.startswith("doc"):
            out.append(text)
        else:
            out[-1] += text
    return out


def test_a_reader_resumes_inside_its_part(tmp_path):
    docs = [f"doc{i} " + " ".join(make_documents(1, seed=i)) for i in range(80)]
    plan = plan_data(section(write_jsonl(tmp_path / "a.jsonl", docs)), 0)
    stream = DocumentStream(plan.train, seed=0, worker=Worker(2, 3), loop=False)
    state = stream.fresh_state()
    straight = list(stream.documents(json.loads(json.dumps(state))))
    head = []
    for doc in stream.documents(state):
        head.append(doc)
        if len(head) == 9:
            break
    rest = list(stream.documents(json.loads(json.dumps(state))))
    assert head + rest == straight and 15 < len(straight) < 40


@pytest.mark.parametrize("readers", [3, 4])
def test_parts_of_a_parquet_file_cover_it_once(tmp_path, readers):
    docs = [f"row {i} " + "y" * (i % 7) for i in range(50)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "a.parquet", row_group_size=7)
    plan = plan_data(section(tmp_path / "a.parquet"), 0)
    parts = read_all(plan, readers)
    assert sorted(d for p in parts for d in p) == sorted(docs)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_holdout_is_the_same_whichever_reader_reads_a_record(tmp_path):
    docs = [f"doc {i} " + d for i, d in enumerate(make_documents(300))]
    plan = plan_data(section(write_jsonl(tmp_path / "a.jsonl", docs), holdout_every=10), 0)
    train = [d for p in read_all(plan, 3, holdout_every=10, split="train") for d in p]
    held = [d for p in read_all(plan, 1, holdout_every=10, split="holdout") for d in p]
    assert set(train).isdisjoint(held) and sorted(train + held) == sorted(docs)
    assert 10 <= len(held) <= 60


def test_a_bad_line_in_a_later_part_is_named_by_its_line(tmp_path):
    lines = [json.dumps({"text": f"document {i} " + "z" * (i % 13)}) for i in range(50)]
    lines[43] = '{"text": broken'
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    plan = plan_data(section(path), 0)
    with pytest.raises(HftrainError) as info:
        read_all(plan, 4)
    assert f"{path}:44: not valid JSON" in str(info.value)
    skipped = 0
    for r in range(4):
        stream = DocumentStream(plan.train, seed=0, worker=Worker(r, 4), loop=False, bad=BadRecords("skip"))
        state = stream.fresh_state()
        list(stream.documents(state))
        skipped += state["skipped"]
    assert skipped == 1


def test_token_files_of_unequal_size_are_read_in_equal_block_ranges(tmp_path):
    """3 token files of 2, 10 and 40 blocks over 4 readers: each reader gets 13 blocks, each block once."""
    seq, counts, files = 4, [2, 10, 40], []
    start = 0
    for i, n in enumerate(counts):
        np.arange(start, start + n * seq, dtype="<u4").tofile(tmp_path / f"s{i}.ds")
        files.append(TokenFile(f"s{i}.ds", n * seq))
        start += n * seq
    folder = TokenFolder(str(tmp_path), "data.train", {}, 4, tuple(files), "")
    per_reader = []
    for r in range(4):
        stream = FolderStream(folder, folder.shards(seq), seq, 0, Worker(r, 4), window=8, loop=False)
        per_reader.append([int(b[0]) // seq for b, _ in stream.blocks(stream.fresh_state())])
    assert sorted(i for p in per_reader for i in p) == list(range(52))
    assert [len(p) for p in per_reader] == [13, 13, 13, 13]


def _long_record_file(tmp_path, long_chars=40_000):
    """60 short records, then one long one: with 2 or 3 readers the last byte range lies inside it."""
    docs = [f"short {i}" for i in range(60)] + ["long " * (long_chars // 5)]
    return docs, write_jsonl(tmp_path / "a.jsonl", docs)


@pytest.mark.parametrize("readers", [2, 3])
def test_a_record_longer_than_a_part_makes_the_readers_deal_records_instead(tmp_path, readers):
    """A range that would hold no line start (a record longer than the range): the shard is read whole by every
    reader, each keeping its records, so no reader is left without data and every record is read once."""
    docs, path = _long_record_file(tmp_path)
    plan = plan_data(section(path), 0)
    assert plan.train[0].share(Worker(0, readers)).mode == "part"
    parts = read_all(plan, readers)
    assert all(parts) and sorted(_join_long(d for p in parts for d in p)) == sorted(docs)


def test_the_long_record_check_can_fail(tmp_path, monkeypatch):
    """Without the check (byte ranges whatever the records), the reader whose range lies inside the long record
    stops the run."""
    import hftrain.data.stream as stream_module

    monkeypatch.setattr(stream_module, "lines_in_every_part", lambda *a: True)
    _, path = _long_record_file(tmp_path)
    with pytest.raises(HftrainError, match="logical reader 1 of 2 found no documents in its part of every shard"):
        read_all(plan_data(section(path), 0), 2)


def _join_long(flat):
    """Documents from stream texts where only the long record comes in pieces, one after another."""
    out: list[str] = []
    for text in flat:
        if not text.startswith("short ") and out and not out[-1].startswith("short "):
            out[-1] += text
        else:
            out.append(text)
    return out


def test_lines_in_every_part_looks_a_bounded_way_into_each_range(tmp_path, monkeypatch):
    import hftrain.data.sources as sources

    source = section(tmp_path / "a.jsonl").train[0]
    _, path = _long_record_file(tmp_path, long_chars=20_000)
    size = path.stat().st_size
    assert sources.lines_in_every_part(source, str(path), size, 2) is False  # the second half lies inside the record
    assert sources.lines_in_every_part(source, str(path), size, 1) is True
    assert sources.lines_in_every_part(source, str(path), None, 2) is False  # size unknown: no ranges
    even = write_jsonl(tmp_path / "even.jsonl", [f"record {i} " + "x" * 500 for i in range(40)])
    assert sources.lines_in_every_part(source, str(even), even.stat().st_size, 7) is True
    assert sources.lines_in_every_part(source, str(even), 6, 7) is False  # fewer bytes than readers
    import hftrain.data.jsonl as jsonl

    monkeypatch.setattr(jsonl, "PROBE_BYTES", 100)  # a line start further into the range than the probe looks
    assert sources.lines_in_every_part(source, str(even), even.stat().st_size, 7) is False


def test_a_reader_with_no_record_of_its_own_says_so(tmp_path):
    """Two records for three readers: one of them keeps none."""
    docs = ["short one", "long " * 8000]
    plan = plan_data(section(write_jsonl(tmp_path / "a.jsonl", docs)), 0)
    with pytest.raises(HftrainError) as info:
        read_all(plan, 3)
    assert (
        "found no documents in its part of every shard (every 3rd record of a shard whose ranges hold no line start) "
        f"of {tmp_path / 'a.jsonl'}" in str(info.value)
    )
    assert "Set data.readers lower" in str(info.value)


def test_the_default_reader_count_leaves_no_reader_without_data(tmp_path):
    one = plan_data(section(write_jsonl(tmp_path / "one.jsonl", make_documents(5000))), 0)
    assert one.reader_limit == 1 and default_readers(one.reader_limit, 1, 1) == 1  # a file may be one huge record
    docs = make_documents(200)
    for s in range(8):  # 8 small shards: 8 readers on 1 process as on 2, so both launches read the same order
        write_jsonl(tmp_path / "eight" / f"part-{s}.jsonl", docs[s::8])
    eight = plan_data(section(tmp_path / "eight"), 0)
    assert [default_readers(eight.reader_limit, p, 1) for p in (1, 2)] == [8, 8]
    assert all(read_all(eight, 8))


def test_data_inspect_says_how_the_readers_share_each_source(tmp_path):
    from hftrain.data.inspect import inspect

    for i, n in enumerate([900, 2500, 4000]):
        write_jsonl(tmp_path / "corpus" / f"part-{i}.jsonl", make_documents(n, seed=i))
    recipe = load_recipe(
        None, {"data": {"train": {"path": str(tmp_path / "corpus")}, "seq_len": 32}, "tokenizer": {"builtin": "gpt2"}}
    )
    text = inspect(DataPart.of(recipe), blocks=1)
    assert "data.train[0]: " in text and "3 shard(s)" in text
    assert (
        "3 readers share it: each reads a part of every shard (byte, row or block ranges: the shards differ in size)"
        in text
    )
