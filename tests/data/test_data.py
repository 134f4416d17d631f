"""The data pipeline: formats, exact packing, exact resume, held-out split, and one message per bad input."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from hftrain.data.loader import PackedDataset, ResumableLoader, plan_data
from hftrain.data.stream import BlockStream, DocumentStream, Worker
from hftrain.data.validation_set import validation_blocks
from hftrain.errors import HftrainError
from hftrain.model.tokenizer import gpt2_tokenizer
from hftrain.parallel.readers import STATE_VERSION, ReaderLayout, default_window, merge_positions
from hftrain.recipe.load import load_recipe

from ..support.data import make_documents, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer()


def data_section(path, **extra):
    return load_recipe(None, {"data": {"train": {"path": str(path)}, **extra}}).data


def documents(path, **extra):
    plan = plan_data(data_section(path, **extra), seed=0)
    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False)
    return list(stream.documents(stream.fresh_state()))


def test_formats_read_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = make_documents(40)
    write_jsonl(tmp_path / "a.jsonl", docs)
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    )
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet", row_group_size=7)
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"):
        assert documents(tmp_path / name) == docs, name
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs[:3]):
        (tmp_path / "txt" / f"{i}.txt").write_text(d)
    assert documents(tmp_path / "txt") == docs[:3]  # a directory: every file in it, sorted
    assert documents(tmp_path / "txt" / "*.txt") == docs[:3]  # a glob


def test_custom_text_field(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["hello there"], field="body")
    plan = plan_data(
        load_recipe(None, {"data": {"train": {"path": str(tmp_path / "a.jsonl"), "text_field": "body"}}}).data, 0
    )
    stream = DocumentStream(plan.train, seed=0, loop=False)
    assert list(stream.documents(stream.fresh_state())) == ["hello there"]


def test_packing_joins_with_eos_and_drops_nothing(tmp_path, tok):
    docs = make_documents(50)
    section = data_section(write_jsonl(tmp_path / "a.jsonl", docs), seq_len=16, shuffle_window=1)
    plan = plan_data(section, 0)
    stream = BlockStream(DocumentStream(plan.train, seed=0, shuffle=False, loop=False), tok, 16, window=1)
    blocks = [b for b, _ in stream.blocks(stream.fresh_state())]
    expected = []
    for d in docs:
        expected += tok(d)["input_ids"] + [tok.eos_token_id]
    assert all(len(b) == 16 for b in blocks)
    flat = np.concatenate(blocks).tolist()
    assert flat == expected[: len(flat)]  # same tokens, same order, EOS between documents
    assert len(expected) - len(flat) < 16  # only the final partial block is left over


def test_tail_carries_across_windows(tmp_path, tok):
    """Blocks straddle window boundaries: a window's leftover tokens start the next window's first block."""
    docs = make_documents(80)
    plan = plan_data(data_section(write_jsonl(tmp_path / "a.jsonl", docs)), 0)
    small = BlockStream(DocumentStream(plan.train, seed=0, shuffle=False, loop=False), tok, 24, window=1)
    big = BlockStream(DocumentStream(plan.train, seed=0, shuffle=False, loop=False), tok, 24, window=10_000)
    a = np.concatenate([b for b, _ in small.blocks(small.fresh_state())])
    b = np.concatenate([b for b, _ in big.blocks(big.fresh_state())])
    n = min(len(a), len(b))
    assert n > 1000 and (a[:n] == b[:n]).all()


def global_order(plan, tok, layout, count, resume=None, micro=2):
    """The next `count` blocks of the run's global order as the ranks of `layout` read them (global block g is
    rank g % P's sample g // P), and each rank's saved state after them."""
    P = layout.processes
    ranks = [
        ResumableLoader(PackedDataset(plan, tok, p, layout, resume), micro, layout.workers if layout.workers > 1 else 0)
        for p in range(P)
    ]
    per_rank = []
    for loader in ranks:
        it, got = iter(loader), []
        while len(got) < count // P:
            got += list(next(it)["input_ids"])
        per_rank.append(got)
    blocks = [per_rank[g % P][g // P] for g in range(count)]
    return blocks, [json.loads(json.dumps(r.state_dict())) for r in ranks]  # what the checkpoint files hold


LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]  # processes x workers, all reading 4 logical readers


@pytest.mark.parametrize("window", [8, 100_000])  # 100,000: every window ends with its reader's epoch
@pytest.mark.parametrize("before", LAYOUTS)
def test_data_order_and_resume_are_the_same_on_any_launch(tmp_path, tok, before, window):
    """The global block order is the same for every processes x workers layout of the same 4 readers, and a
    position saved by one layout continues exactly on every other (shuffling on, epochs wrapping)."""
    docs = make_documents(50)
    section = data_section(write_jsonl(tmp_path / "a.jsonl", docs), seq_len=32, shuffle_window=window)
    plan = plan_data(section, 0)
    straight, _ = global_order(plan, tok, ReaderLayout(4, 1, 1, window), 128)
    first, saved = global_order(plan, tok, ReaderLayout(4, *before, window), 32)
    assert all((a == b).all() for a, b in zip(first, straight[:32]))
    for after in LAYOUTS:
        layout = ReaderLayout(4, *after, window)
        resume = merge_positions(saved, layout, 32, "checkpoint-x")
        resumed, _ = global_order(plan, tok, layout, 96, resume)
        assert all((a == b).all() for a, b in zip(resumed, straight[32:])), f"{before} -> {after}"
    # the run crosses more than 2 epochs of this small corpus: looping epochs resumes exactly too
    corpus_tokens = sum(len(tok(d)["input_ids"]) + 1 for d in docs)
    assert 128 * 32 > 2 * corpus_tokens


def test_the_default_window_holds_the_same_tokens_at_any_context():
    assert default_window(8, 2048) == 256 and default_window(8, 64) == 8192 and default_window(1, 256) == 16384
    assert default_window(8, 64) * 8 * 64 == default_window(8, 2048) * 8 * 2048 == 1 << 22


def test_a_big_window_shuffles_a_small_corpus_one_epoch_at_a_time(tmp_path, tok):
    """A window far bigger than the data ends with the epoch: it holds each block of the epoch once, shuffled,
    instead of reading the corpus over and over to fill up (which would put one block in the window many times)."""
    path = write_jsonl(tmp_path / "a.jsonl", make_documents(60))
    plan = plan_data(data_section(path, seq_len=16), 0)

    once = BlockStream(DocumentStream(plan.train, seed=0, shuffle=False, loop=False), tok, 16, window=1)
    epoch = [tuple(b.tolist()) for b, _ in once.blocks(once.fresh_state())]
    stream = BlockStream(DocumentStream(plan.train, seed=0, loop=True), tok, 16, window=100_000)
    window = []
    for block, position in stream.blocks(stream.fresh_state()):
        window.append(tuple(block.tolist()))
        if position["window"] == 1:  # the first window is over
            break
    # the epoch's blocks, shuffled, plus at most the few that the last tokenizer batch read into the next epoch
    assert len(epoch) > 100 and len(epoch) <= len(window) < 1.2 * len(epoch)
    assert set(epoch) <= set(window) and window[: len(epoch)] != epoch


def test_a_position_saved_with_another_window_is_refused():
    saved = [{"version": STATE_VERSION, "readers": 4, "blocks": 16, "seq_len": 32, "window": 256, "positions": {}}]
    with pytest.raises(HftrainError) as info:
        merge_positions(saved, ReaderLayout(4, 1, 1, 8192), 32, "checkpoint-9")
    assert str(info.value) == (
        "checkpoint-9: the data position was saved with shuffle windows of 256 blocks and this run "
        "has 8192; set data.shuffle_window: 256 to resume."
    )


def test_the_order_check_can_fail(tmp_path, tok):
    """Without the rotation of worker slots, a resumed 2-worker loader would start from the wrong reader."""
    plan = plan_data(
        data_section(write_jsonl(tmp_path / "a.jsonl", make_documents(50)), seq_len=32, shuffle_window=8), 0
    )
    straight, _ = global_order(plan, tok, ReaderLayout(4, 1, 2, 8), 40)
    _, saved = global_order(plan, tok, ReaderLayout(4, 1, 2, 8), 6, micro=3)  # 6 samples: next one is from slot 0
    resume = merge_positions(saved, ReaderLayout(4, 1, 2, 8), 32, "c")
    resume["blocks"] += 1  # a position one sample off: the rotation (and every block after it) is wrong
    resumed, _ = global_order(plan, tok, ReaderLayout(4, 1, 2, 8), 34, resume)
    assert not all((a == b).all() for a, b in zip(resumed, straight[6:]))


def test_a_launch_that_cannot_divide_the_readers_is_refused():
    with pytest.raises(HftrainError) as info:
        ReaderLayout(readers=4, processes=3, workers=1, window=8)
    assert (
        "4 logical readers (fixed at its start), which cannot be split over 3 process(es) x 1 dataloader worker(s)"
        in str(info.value)
    )
    assert "1, 2, 4 process(es) work" in str(info.value)
    saved = [{"version": STATE_VERSION, "readers": 8, "blocks": 16, "seq_len": 32, "positions": {}}]
    with pytest.raises(HftrainError) as info:
        merge_positions(saved, ReaderLayout(4, 1, 1, 8), 32, "ckpt")
    assert "saved with 8 logical readers and this run has 4" in str(info.value)
    with pytest.raises(HftrainError) as info:
        merge_positions([{"version": 1, "workers": {}}], ReaderLayout(4, 1, 1, 8), 32, "ckpt")
    assert (
        "saved by another hftrain version, which orders the data differently (data order version 1; this one reads "
        f"version {STATE_VERSION})" in str(info.value)
    )


def test_shuffle_is_seeded(tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", make_documents(200))
    section = data_section(path, seq_len=32, shuffle_window=16)

    def first_batches(seed):
        it = iter(ResumableLoader(PackedDataset(plan_data(section, seed), tok, 0, ReaderLayout(1, 1, 1, 16)), 4, 0))
        return [next(it)["input_ids"] for _ in range(5)]

    a, b, c = first_batches(1), first_batches(1), first_batches(2)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not all((x == y).all() for x, y in zip(a, c))


def test_workers_read_disjoint_parts_covering_everything(tmp_path):
    docs = [f"document number {i}" for i in range(101)]
    plan = plan_data(data_section(write_jsonl(tmp_path / "a.jsonl", docs)), 0)
    seen = []
    for w in range(4):  # e.g. 2 ranks x 2 DataLoader workers
        stream = DocumentStream(plan.train, seed=0, worker=Worker(w, 4), loop=False)
        seen.append(list(stream.documents(stream.fresh_state())))
    flat = [d for part in seen for d in part]
    assert sorted(flat) == sorted(docs) and len(flat) == len(set(flat))
    assert all(part for part in seen)


@pytest.mark.parametrize("shards", [8, 1])  # 8 shards: split by shard; 1 shard: split by example
def test_ranks_and_loader_workers_read_disjoint_parts_covering_the_corpus(tmp_path, tok, shards):
    """2 ranks x 2 real DataLoader worker processes (4 readers): one epoch of each reader, decoded from the blocks."""
    docs = [f"shard {i % shards} doc {i}" for i in range(96)]
    for s in range(shards):
        write_jsonl(tmp_path / "corpus" / f"part-{s}.jsonl", [d for i, d in enumerate(docs) if i % shards == s])
    val = write_jsonl(tmp_path / "val.jsonl", ["held out text"])
    section = load_recipe(
        None,
        {
            "data": {
                "train": {"path": str(tmp_path / "corpus")},
                "validation": {"path": str(val)},
                "seq_len": 16,
                "shuffle_window": 1,
            }
        },
    ).data
    plan = plan_data(section, 0)
    parts = {}
    layout = ReaderLayout(readers=4, processes=2, workers=2, window=1)  # 2 ranks x 2 workers, one reader each
    for rank in range(2):
        loader = ResumableLoader(PackedDataset(plan, tok, rank, layout), batch_size=2, num_workers=2)
        tokens: dict[int, list[int]] = {r: [] for r in layout.rank_readers(rank)}
        k = 0
        for batch in loader:
            for sample in batch["input_ids"]:  # rank sample k comes from rank reader k % 2
                tokens[layout.rank_readers(rank)[k % 2]] += sample.tolist()
                k += 1
            epochs = {r: _split_docs(tok, t) for r, t in tokens.items()}
            if all(len(d) > len(set(d)) for d in epochs.values()):  # every reader has started its second epoch
                break
        for r, seen in epochs.items():
            parts[r] = seen[: seen.index(seen[0], 1)]  # the first epoch (unshuffled, so in stream order)
    flat = [d for part in parts.values() for d in part]
    assert sorted(flat) == sorted(docs) and len(flat) == len(set(flat))  # all of it, nothing twice
    assert all(parts.values())
    if shards == 8:
        owners = {d.split(" doc")[0]: key for key, part in parts.items() for d in part}
        # each shard read by exactly one reader
        assert (
            all(
                {d.split(" doc")[0] for d in part} == {s for s, k in owners.items() if k == key}
                for key, part in parts.items()
            )
            and len(owners) == 8
        )


def _split_docs(tok, ids: list[int]) -> list[str]:
    """Documents of a packed token stream (joined by EOS); the last one may be cut, so it is dropped."""
    docs, cur = [], []
    for i in ids:
        if i == tok.eos_token_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    return docs


def test_holdout_is_disjoint_from_training(tmp_path, tok):
    docs = [f"doc {i} " + d for i, d in enumerate(make_documents(400))]
    plan = plan_data(data_section(write_jsonl(tmp_path / "a.jsonl", docs), holdout_every=10), 0)
    train = DocumentStream(plan.train, seed=0, holdout_every=10, split="train", loop=False)
    held = DocumentStream(plan.train, seed=0, holdout_every=10, split="holdout", loop=False)
    a, b = set(train.documents(train.fresh_state())), set(held.documents(held.fresh_state()))
    assert a.isdisjoint(b) and a | b == set(docs)
    assert 15 <= len(b) <= 70  # about one in ten
    assert len(validation_blocks(plan, tok)) > 0


def test_validation_source_replaces_holdout(tmp_path, tok):
    train = write_jsonl(tmp_path / "t.jsonl", make_documents(100))
    val = write_jsonl(tmp_path / "v.jsonl", ["validation text " * 50])
    section = load_recipe(
        None, {"data": {"train": {"path": str(train)}, "validation": {"path": str(val)}, "seq_len": 8}}
    ).data
    blocks = validation_blocks(plan_data(section, 0), tok)
    assert "validation text" in tok.decode(blocks[0]["input_ids"])


# ----------------------------------------------------------------------------------------- bad input
def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(HftrainError) as info:
        documents(path)
    assert f"{path}:3: not valid JSON" in str(info.value)
    assert "data.on_bad_record=skip" in str(info.value)


def test_skip_mode_counts_bad_records(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "one"}\nnot json\n{"other": 1}\n{"text": "two"}\n', encoding="utf-8")
    plan = plan_data(data_section(path, on_bad_record="skip"), 0)
    from hftrain.data.sources import BadRecords

    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False, bad=BadRecords("skip"))
    state = stream.fresh_state()
    assert list(stream.documents(state)) == ["one", "two"]
    assert state["skipped"] == 2


def test_missing_text_field(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["x"], field="content")
    with pytest.raises(HftrainError, match=r"a.jsonl:1: no string field 'text' \(has: content\)"):
        documents(path)


@pytest.mark.parametrize("pattern", ["missing.jsonl", "nothing-*.jsonl"])
def test_missing_file_or_empty_glob_is_named(tmp_path, pattern):
    with pytest.raises(HftrainError) as info:
        plan_data(data_section(tmp_path / pattern), 0)
    assert f"data.train[0].path: no file matches '{tmp_path / pattern}'" in str(info.value)


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(HftrainError, match=r"data.train\[0\]: no documents found"):
        documents(tmp_path / "empty.jsonl")


def test_builtin_corpus_is_there():
    plan = plan_data(load_recipe(None, {}).data, 0)
    assert len(plan.train[0].shards) > 100
    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False)
    first = next(iter(stream.documents(stream.fresh_state())))
    assert len(first) > 50


def test_hugging_face_dataset_source_streams(tmp_path):
    """`dataset:` goes through datasets.load_dataset(streaming=True); a local data directory needs no hub."""
    docs = make_documents(30)
    write_jsonl(tmp_path / "ds" / "train.jsonl", docs)
    plan = plan_data(
        load_recipe(None, {"data": {"train": {"dataset": str(tmp_path / "ds"), "split": "train"}}}).data, 0
    )
    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False)
    state = stream.fresh_state()
    it = stream.documents(state)
    head = [next(it) for _ in range(10)]
    assert head == docs[:10]
    resumed = DocumentStream(plan.train, seed=0, shuffle=False, loop=False)
    assert list(resumed.documents(json.loads(json.dumps(state)))) == docs[10:]  # skips the 10 consumed records


def test_weighted_mixture_is_deterministic_and_follows_the_weights(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [f"alpha {i}" for i in range(300)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"beta {i}" for i in range(300)])
    section = load_recipe(
        None, {"data": {"train": [{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}]}}
    ).data

    def draw(seed, n=2000):
        plan = plan_data(section, seed)
        stream = DocumentStream(plan.train, seed=seed)
        it = stream.documents(stream.fresh_state())
        return [next(it) for _ in range(n)]

    first, again, other = draw(5), draw(5), draw(6)
    assert first == again and first != other
    share = sum(d.startswith("alpha") for d in first) / len(first)
    assert 0.72 < share < 0.78  # 3:1
    alphas = [d for d in first if d.startswith("alpha")][:300]
    # each source: no document repeated within its epoch
    assert sorted(alphas) == sorted(f"alpha {i}" for i in range(300))
