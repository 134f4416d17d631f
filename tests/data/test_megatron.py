"""Megatron / gpt-neox indexed corpora (data.train: {megatron: PREFIX}), read as stored (Pythia's order) or as
documents, and any step's batch on demand (`hftrain data batch`). The corpora are written here with numpy from the
published layout (tests/support/megatron.py), sharded at byte counts that cut rows as Pythia's 21 shards do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from hftrain.recipe.load import load_recipe

from ..support.cli import in_process
from ..support.data import tiny_recipe
from ..support.megatron import pythia_rows, rows_corpus, write_megatron

VOCAB, WIDTH = 300, 33  # seq_len 32: rows of 33 tokens


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Path:
    """A 300-id word-level tokenizer ("t0" ... "t298", EOS last), saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


def stored_recipe(tmp_path: Path, corpus: Path | str, tokenizer: Path, **data) -> Path:
    raw = tiny_recipe(tmp_path / "unused", tmp_path / "run", max_steps=4, save_steps=2, eval_strategy="no")
    raw["tokenizer"] = {"path": str(tokenizer)}
    raw["data"] = {"train": {"megatron": str(corpus)}, "order": "stored", "seq_len": WIDTH - 1, "eval_blocks": 4}
    raw["data"].update(data)
    raw["parallelism"] = {"global_batch_size": 8}
    raw["monitor"]["sample_max_new_tokens"] = 0
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def batch_of(capsys, target: Path, step: int, *more: str) -> list[dict]:
    capsys.readouterr()  # what ran before
    code, out = in_process(capsys, "data", "batch", str(target), "--step", str(step), *more)
    assert code == 0, out
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"')]


def test_a_steps_batch_is_the_rows_pythias_arithmetic_reads(tmp_path, word_tokenizer, capsys):
    """Sharded at 1,000 bytes (rows are 66): step N is items [8N, 8N + 8) read straight from the joined bytes, on
    one process or two, and from data.start_step S step k is the corpus's step S + k."""
    prefix = tmp_path / "pile" / "document"
    rows_corpus(prefix, 80, WIDTH, VOCAB - 1, shard_bytes=1000)
    assert len(list(prefix.parent.glob("document-*-of-00005.bin"))) == 6  # 5,280 bytes: 00000 ... 00005 of 00005
    recipe = stored_recipe(tmp_path, prefix, word_tokenizer)
    for step, more in [(0, ()), (3, ()), (3, ("--processes", "2")), (7, ("--workers", "2"))]:
        got = batch_of(capsys, recipe, step, *more)
        assert [r["item"] for r in got] == list(range(8 * step, 8 * step + 8))
        assert np.array_equal(np.array([r["input_ids"] for r in got]), pythia_rows(prefix, step, 8, WIDTH))
    code, out = in_process(capsys, "data", "inspect", str(recipe))
    assert code == 0 and "Megatron indexed corpus, 80 items in 81 document entries" in out, out
    assert "in 6 shards; stored order: 76 items to train on" in out, out
    later = stored_recipe(tmp_path, prefix, word_tokenizer, start_step=5)
    assert np.array_equal(
        np.array([r["input_ids"] for r in batch_of(capsys, later, 1, "--decode")]), pythia_rows(prefix, 6, 8, WIDTH)
    )
    code, out = in_process(capsys, "data", "batch", str(later), "--step", "1")
    assert (
        f"8 sequences (global blocks 8 to 15; 8 logical readers, shuffle window 1; items 48 to 55 of {prefix}, "
        "corpus step 6)" in out
    ), out
    with_text = batch_of(capsys, later, 0, "--decode")[0]
    assert with_text["text"].split()[:3] == [f"t{i}" for i in with_text["input_ids"][:3]]
    code, out = in_process(capsys, "data", "batch", str(later), "--step", "4")  # items 72 ... 79: the last 4 validate
    assert code == 2 and "--step 4: the training data ends before it" in out, out


def test_the_start_step_is_the_pythia_revision_the_model_starts_from(tmp_path, word_tokenizer):
    raw = yaml.safe_load(stored_recipe(tmp_path, tmp_path / "c", word_tokenizer).read_text())
    raw["model"] = {"from_pretrained": str(tmp_path / "pythia-160m-deduped"), "revision": "step3000"}
    assert load_recipe(None, raw).data.start_step == 3000
    raw["data"]["start_step"] = 12
    assert load_recipe(None, raw).data.start_step == 12
    raw["data"].pop("start_step")
    raw["model"]["revision"] = "main"
    assert load_recipe(None, raw).data.start_step == 0
    # another start step is another run (its output_dir refuses it); recording what is read is not
    from hftrain.recipe.load import fingerprint

    base = fingerprint(load_recipe(None, raw))["data"]
    assert fingerprint(load_recipe(None, raw, data={**raw["data"], "record_batches": True}))["data"] == base
    assert fingerprint(load_recipe(None, raw, data={**raw["data"], "start_step": 4}))["data"] != base


def test_megatron_cores_files_read_alike(tmp_path, word_tokenizer, capsys):
    """megatron-core's trailing mode bytes and int32 tokens; a single .bin."""
    prefix = tmp_path / "core" / "text_document"
    table = rows_corpus(prefix, 24, WIDTH, VOCAB - 1, dtype="<i4", modes=True)
    got = batch_of(capsys, stored_recipe(tmp_path, prefix, word_tokenizer), 1)
    assert np.array_equal(np.array([r["input_ids"] for r in got]), table[8:16])


def _damage(prefix: Path, kind: str) -> None:
    idx = Path(f"{prefix}.idx")
    shards = sorted(prefix.parent.glob("document-*.bin"))
    if kind == "no .bin":
        for s in shards:
            s.unlink()
    elif kind == "a shard missing":
        shards[2].unlink()
    elif kind == "a short shard":
        shards[-1].write_bytes(shards[-1].read_bytes()[:-10])
    elif kind == "bad magic":
        idx.write_bytes(b"TNTIDX\x00\x00" + idx.read_bytes()[8:])
    elif kind == "version 2":
        idx.write_bytes(idx.read_bytes()[:9] + (2).to_bytes(8, "little") + idx.read_bytes()[17:])
    elif kind in ("float code 6", "float code 7"):
        idx.write_bytes(idx.read_bytes()[:17] + bytes([int(kind[-1])]) + idx.read_bytes()[18:])
    elif kind == "a truncated index":
        idx.write_bytes(idx.read_bytes()[:-5])


REFUSED = [
    ("no .bin", r"no .*document\.bin and no shards .*document-NNNNN-of-MMMMM\.bin"),
    ("a shard missing", r"the shards of .*document are incomplete \(missing 00002\)"),
    ("a short shard", r"hold 5,270 bytes, but .*document\.idx ends its last item at byte 5,280 \(short"),
    ("bad magic", r"document\.idx is not a Megatron MMIDIDX index \(the older TNTIDX format"),
    ("version 2", r"document\.idx is index version 2; hftrain reads version 1"),
    ("float code 6", r"dtype code 6: floating-point numbers, not token ids"),
    ("float code 7", r"dtype code 7: floating-point numbers, not token ids"),
    ("a truncated index", r"document\.idx is [\d,]+ bytes, but its header's 80 items and 81 documents take"),
]


@pytest.mark.parametrize("kind, message", REFUSED, ids=[k for k, _ in REFUSED])
def test_a_damaged_corpus_is_refused_in_one_line_naming_the_file(tmp_path, word_tokenizer, capsys, kind, message):
    prefix = tmp_path / "pile" / "document"
    rows_corpus(prefix, 80, WIDTH, VOCAB - 1, shard_bytes=1000)
    _damage(prefix, kind)
    code, out = in_process(capsys, "data", "batch", str(stored_recipe(tmp_path, prefix, word_tokenizer)), "--step", "0")
    assert code == 2 and "Traceback" not in out, out
    (line,) = [x for x in out.splitlines() if x.startswith("hftrain: error:")]
    assert "data.train.megatron:" in line, line
    import re

    assert re.search(message, line), line


def test_rows_of_another_length_and_ids_outside_the_vocabulary_are_refused(tmp_path, word_tokenizer, capsys):
    """Rows of 40 tokens for seq_len 32 (said at once, with the length to set); one row of 34 beside one of 32 (the
    total adds up: said when it is read); an id past the tokenizer's 300 (said naming its
    item)."""
    cases = [
        ([np.ones(40, int)] * 8, r"holds 8 items of 40.0 tokens on average \(the first: 40\), not data.seq_len \+ 1"),
        (
            [np.ones(WIDTH, int)] * 3 + [np.ones(34, int), np.ones(32, int)] + [np.ones(WIDTH, int)] * 11,
            r"item 3 of .* holds 34 tokens, not data.seq_len \+ 1 = 33",
        ),
        (
            [np.full(WIDTH, 7)] * 5 + [np.full(WIDTH, 4000)] + [np.full(WIDTH, 7)] * 10,
            r"item 5 of .*: token id 4,000 is not in the recipe's tokenizer \(300 ids\)",
        ),
    ]
    for i, (items, message) in enumerate(cases):
        prefix = write_megatron(tmp_path / f"c{i}" / "document", items)
        recipe = stored_recipe(tmp_path / f"c{i}", prefix, word_tokenizer, eval_blocks=1)
        code, out = in_process(capsys, "data", "batch", str(recipe), "--step", "0")
        assert code == 2 and "Traceback" not in out, out
        import re

        assert re.search(message, out), (i, out)


def test_a_stored_rows_loss_is_transformers_loss_with_shift_labels(tmp_path):
    """A 2,049-token row trains 2,048 predictions (inputs row[:-1], targets row[1:]), on hftrain's chunked loss and
    on transformers' own with shift_labels, as a plain forward over the row scores them (within 1e-6)."""
    from hftrain.data.loader import as_sample
    from hftrain.data.packed_batch import PackedCollator
    from hftrain.data.stored_rows import StoredRow
    from hftrain.model import fused_loss

    from ..model.test_attention import VOCAB as MODEL_VOCAB
    from ..model.test_attention import pythia_shaped

    model = pythia_shaped(context=2048)
    rows = np.random.default_rng(0).integers(0, MODEL_VOCAB, (2, 2049))
    batch = PackedCollator()([as_sample(StoredRow(r, i)) for i, r in enumerate(rows)])
    assert batch["input_ids"].shape == (2, 2048) and batch["shift_labels"].shape == (2, 2048)
    logits = model(input_ids=torch.from_numpy(rows[:, :-1])).logits
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, MODEL_VOCAB), torch.from_numpy(rows[:, 1:]).reshape(-1)
    )
    plain = model(**batch).loss
    fused_loss.use(model)
    chunked = model(**batch).loss
    assert abs(plain.item() - expected.item()) < 1e-6 and abs(chunked.item() - expected.item()) < 1e-6
    # the labels alone (the silent fallback) score 2,047 of the 2,048 predictions, and another number
    assert abs(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item() - expected.item()) > 1e-5


def _learnable(prefix: Path, rows: int, **kw) -> np.ndarray:
    """Rows that count up (t(k), t(k+1), ...) from a seeded start: a model learns them within a few steps."""
    starts = np.random.default_rng(3).integers(0, VOCAB - 1, rows)
    table = (starts[:, None] + np.arange(WIDTH)[None, :]) % (VOCAB - 1)
    write_megatron(prefix, list(table), **kw)
    return table


def _consumed_steps(run_dir: Path, batch: int) -> dict[int, list[str]]:
    from hftrain.data.step_batch import read_consumed

    seen = read_consumed(run_dir / "batches")
    return {g // batch: [seen[h]["sha256"] for h in sorted(seen) if h // batch == g // batch] for g in seen}


@pytest.mark.slow(seconds=100)
def test_a_pythia_continuation_killed_on_2_processes_resumes_on_1_on_the_stored_rows(tmp_path, word_tokenizer, capsys):
    """From data.start_step 3, 2 DDP processes killed (-9) after a checkpoint, continued on 1: every step trained the
    corpus's rows [8·(3 + k), 8·(3 + k + 1)) (what each process recorded it read = what one process uninterrupted read
    = `hftrain data batch RUN --step k` = Pythia's own arithmetic), with the uninterrupted run's losses after the
    resume, and it learns."""
    import sys

    import hftrain

    from ..support.checks import assert_same_steps, steps, train_log
    from ..support.cli import kill_at_checkpoint
    from ..support.reference_runs import train

    prefix = tmp_path / "pile" / "document"
    _learnable(prefix, 8 * 16 + 4, shard_bytes=777)
    recipe = stored_recipe(tmp_path, prefix, word_tokenizer, start_step=3, record_batches=True)
    raw = yaml.safe_load(recipe.read_text())
    raw["training"].update(max_steps=12, save_steps=3, per_device_train_batch_size=2, learning_rate=1e-2)
    raw["model"].update(hidden_dropout=0, attention_dropout=0)
    recipe.write_text(yaml.safe_dump(raw))
    run_dir, straight = tmp_path / "killed", tmp_path / "straight"
    cmd = [sys.executable, "-m", "hftrain", "train", str(recipe), "--accelerate-config", "ddp", "--nproc", "2"]
    survivor = kill_at_checkpoint([*cmd, f"training.output_dir={run_dir}"], run_dir, 6)
    at = int(survivor.name.split("-")[1])
    assert f"resuming from {survivor}\n" in train(recipe, "ddp", 1, run_dir).stdout
    hftrain.train(load_recipe(recipe, [f"training.output_dir={straight}"]))  # one process, in this one
    assert_same_steps(steps(straight), steps(run_dir), range(at + 1, 13), "stored rows, kill -9, 2 -> 1")
    assert steps(straight)[1][0] - steps(straight)[12][0] > 1.0  # it learns the counting rows
    consumed = _consumed_steps(run_dir, 8)
    assert sorted(consumed) == list(range(12)) and _consumed_steps(straight, 8) == consumed
    for k in (0, at - 1, at, 11):
        printed = batch_of(capsys, run_dir, k)
        assert [r["sha256"] for r in printed] == consumed[k], k
        assert np.array_equal(np.array([r["input_ids"] for r in printed]), pythia_rows(prefix, 3 + k, 8, WIDTH))
    assert len(train_log(run_dir)) >= 12
    length = json.loads((straight / "results.json").read_text())["run_length"]
    assert length["start_step"] == 3 and "corpus steps 3 to 14" in length["note"], length


@pytest.mark.slow(seconds=10)
def test_every_source_kind_trains_on_what_data_batch_prints(tmp_path, word_tokenizer, capsys):
    """Text (JSONL, tokenized as read), instruction pairs (packed), a token folder, a Megatron corpus as documents, two
    by weight, and one as stored rows: what training recorded it consumed at each step is what `hftrain data batch`
    prints for that step, from the recipe and from the run directory."""
    import hftrain

    from ..support.data import make_documents, write_jsonl
    from .test_token_folders import _synthetic

    text = write_jsonl(tmp_path / "docs.jsonl", make_documents(300, seed=5))
    folder = _synthetic(tmp_path / "folder", 0, 2, 3000)
    corpus = tmp_path / "nemo" / "text_document"
    _learnable(corpus, 200, doc_ends=list(range(5, 201, 5)))
    other = tmp_path / "nemo" / "code_document"
    rows_corpus(other, 100, WIDTH, VOCAB - 1, dtype="<i4")
    examples = write_jsonl(tmp_path / "qa.jsonl", [], field="text")
    examples.write_text(
        "".join(json.dumps({"prompt": f"q{i} ", "completion": f"a{i % 7}"}) + "\n" for i in range(400)),
        encoding="utf-8",
    )
    kinds = {
        "text": {"train": {"path": str(text)}},
        "instructions": {"train": {"path": str(examples), "format": "prompt_completion"}},
        "token folder": {"train": {"pretokenized": str(folder)}},
        "megatron documents": {"train": {"megatron": str(corpus)}, "shuffle_window": 16},
        "megatron mixture": {"train": [{"megatron": str(corpus), "weight": 3}, {"megatron": str(other)}]},
        "megatron stored": {"train": {"megatron": str(corpus)}, "order": "stored"},
    }
    for name, data in kinds.items():
        raw = tiny_recipe(tmp_path / "unused", tmp_path / name / "run", max_steps=4, save_steps=100, eval_strategy="no")
        raw["data"] = {"seq_len": WIDTH - 1, "eval_blocks": 4, "holdout_every": 10, "record_batches": True, **data}
        if name not in ("text", "instructions"):
            raw["tokenizer"] = {"path": str(word_tokenizer)}
        raw["monitor"]["sample_max_new_tokens"] = 0
        recipe = tmp_path / name / "r.yaml"
        recipe.parent.mkdir()
        recipe.write_text(yaml.safe_dump(raw))
        hftrain.train(load_recipe(recipe))
        consumed = _consumed_steps(tmp_path / name / "run", 8)
        assert sorted(consumed) == [0, 1, 2, 3], name
        for step in (0, 3):
            for target in (recipe, tmp_path / name / "run"):
                assert [r["sha256"] for r in batch_of(capsys, target, step)] == consumed[step], (name, step, target)


def test_the_shipped_pythia_continuation_reads_pythias_rows(tmp_path, word_tokenizer, capsys):
    """recipes/pretrain/pythia-160m-continue.yaml as shipped, on a tiny corpus of 2,049-token rows in 3 shards (its
    data, tokenizer and start step overridden): step 1 is Pythia's step 3 = items [3,072, 4,096)."""
    from ..support.cli import ROOT

    prefix = tmp_path / "pile" / "document"
    rows_corpus(prefix, 1024 * 4 + 8, 2049, VOCAB - 1, shard_bytes=3_000_001)
    overrides = [f"data.train={{megatron: {prefix}}}", f"tokenizer.path={word_tokenizer}", "data.start_step=2"]
    overrides += ["data.validation=null", "data.eval_blocks=8", "training.max_steps=2"]
    recipe = ROOT / "recipes" / "pretrain" / "pythia-160m-continue.yaml"
    got = batch_of(capsys, recipe, 1, *overrides)
    assert [r["item"] for r in got] == list(range(3072, 4096))
    assert np.array_equal(np.array([r["input_ids"] for r in got]), pythia_rows(prefix, 3, 1024, 2049))


@pytest.mark.slow(seconds=8)
def test_a_sharded_corpus_on_s3_is_read_in_place_by_range(s3, tmp_path, word_tokenizer, capsys):
    """The 6 shards and the index on S3 (moto): the same rows as Pythia's arithmetic on the local copy."""
    prefix = tmp_path / "pile" / "document"
    rows_corpus(prefix, 80, WIDTH, VOCAB - 1, shard_bytes=1000)
    bucket, client = s3.make_bucket(), s3.client()
    for path in prefix.parent.iterdir():
        client.put_object(Bucket=bucket, Key=f"pile/{path.name}", Body=path.read_bytes())
    recipe = stored_recipe(tmp_path, f"s3://{bucket}/pile/document", word_tokenizer)
    got = batch_of(capsys, recipe, 5)
    assert np.array_equal(np.array([r["input_ids"] for r in got]), pythia_rows(prefix, 5, 8, WIDTH))
    _four_readers_read_each_row_once(f"s3://{bucket}/pile/document", prefix)
    client.delete_object(Bucket=bucket, Key="pile/document-00003-of-00005.bin")
    code, out = in_process(capsys, "data", "batch", str(recipe), "--step", "0")
    assert code == 2 and "the shards of s3://" in out and "are incomplete (missing 00003)" in out, out


class _CountingFS:
    """The corpus's filesystem, counting the bytes it serves from the .bin."""

    def __init__(self, fs):
        self.fs, self.bin_bytes = fs, 0

    def _count(self, paths, found):
        self.bin_bytes += sum(len(d) for p, d in zip(paths, found) if p.endswith(".bin"))
        return found

    def cat_file(self, path, start=None, end=None):
        return self._count([path], [self.fs.cat_file(path, start=start, end=end)])[0]

    def cat_ranges(self, paths, starts, ends, **kw):
        return self._count(paths, self.fs.cat_ranges(paths, starts, ends, **kw))


def _four_readers_read_each_row_once(url: str, local: Path) -> None:
    """Four logical readers (two processes of two loader workers) each take every 4th row, and together read each
    row's bytes once from S3: the .bin bytes fetched equal the corpus's (a reader that fetched its whole chunk and
    kept a quarter fetched 4x), and their rows dealt round-robin are the corpus in its stored order."""
    from dataclasses import replace

    from hftrain.data.megatron import open_megatron
    from hftrain.data.stored_rows import StoredRows
    from hftrain.data.stream import Worker

    corpus = open_megatron(url, {}, "data.train")
    fs = _CountingFS(corpus.fs())
    corpus = replace(corpus, _fs=fs)
    readers = [
        list(StoredRows(corpus, WIDTH - 1, Worker(i, 4), 0, corpus.items).blocks({"emitted": 0})) for i in range(4)
    ]
    dealt = [readers[g % 4][g // 4][0] for g in range(corpus.items)]
    assert [row.item for row in dealt] == list(range(corpus.items))
    assert np.array_equal(np.stack([row.tokens for row in dealt]), pythia_rows(local, 0, corpus.items, WIDTH))
    assert fs.bin_bytes == corpus.bin_bytes, (fs.bin_bytes, corpus.bin_bytes)
