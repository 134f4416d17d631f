"""Long documents and messy files: text is read and tokenized in bounded pieces, and the tokens are those of
the whole document; positions inside a document resume exactly; non-text files are refused by name."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from hftrain.checkpoint.layout import RunLayout, data_state_file
from hftrain.data import chunking, text_pieces
from hftrain.data.builtin_corpus import module_docstrings, python_docs_files
from hftrain.data.loader import plan_data
from hftrain.data.sources import BadRecords
from hftrain.data.stream import BlockStream, DocumentStream
from hftrain.errors import HftrainError
from hftrain.model.tokenizer import gpt2_tokenizer, train_bpe
from hftrain.recipe.load import load_recipe

from ..support.checks import assert_resumed_matches, checkpoint_losses
from ..support.data import make_documents, tiny_recipe

TOKENIZERS = ["gpt2", "trained-bpe", "char"]


def long_text(chars: int, seed: int = 0) -> str:
    """Real prose and code docs, with what breaks naive cutting: unicode, runs of spaces and newlines, a very
    long word, digits, contractions."""
    rng = random.Random(seed)
    docs = [d for d in (module_docstrings(f) for f in python_docs_files()[:400]) if d]
    extras = [
        "  ",
        "\n\n\n",
        " \t ",
        "naïve café — 東京 🙂 ",
        "x" * 3000,
        " 1234567890 ",
        "it's don't ",
        "\r\n",
        "    ",
    ]
    parts, size = [], 0
    while size < chars:
        part = rng.choice(docs) if rng.random() < 0.7 else rng.choice(extras)
        parts.append(part)
        size += len(part)
    return "".join(parts)[:chars]


@pytest.fixture(scope="module")
def tokenizers():
    sample = [d for d in (module_docstrings(f) for f in python_docs_files()[:300]) if d]
    return {
        "gpt2": gpt2_tokenizer(),
        "trained-bpe": train_bpe(sample, 2000, 2, ["<|endoftext|>"]),
        "char": train_bpe(sample[:50], 257, 2, ["<|endoftext|>"]),  # byte-level, no merges: one token per byte
    }


def stream_tokens(path: Path, tok, seq_len: int = 64, **source) -> list[int]:
    section = load_recipe(None, {"data": {"train": {"path": str(path), **source}, "seq_len": seq_len}}).data
    plan = plan_data(section, 0)
    stream = BlockStream(DocumentStream(plan.train, seed=0, shuffle=False, loop=False), tok, seq_len, window=3)
    return np.concatenate([b for b, _ in stream.blocks(stream.fresh_state())]).tolist()


@pytest.fixture
def small_pieces(monkeypatch):
    """Cut often: pieces of a few KiB, a short pre-tokenizing window, a small tokenizer batch."""
    monkeypatch.setattr(text_pieces, "PIECE_BYTES", 4093)
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 3001)
    monkeypatch.setattr(text_pieces, "MAX_HELD_BYTES", 3 * 4093)
    monkeypatch.setattr(chunking, "CUT_WINDOW", 200)


@pytest.mark.slow
@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_long_document_gets_the_tokens_of_the_whole(tmp_path, tokenizers, small_pieces, name):
    tok = tokenizers[name]
    text = long_text(200_000)
    whole = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    txt = tmp_path / "book.txt"
    txt.write_text(text, encoding="utf-8", newline="")
    got = stream_tokens(txt, tok)
    assert len(whole) - len(got) < 64 and got == whole[: len(got)]
    record = tmp_path / "one.jsonl"  # the same text as one JSONL record, cut by characters
    record.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    assert stream_tokens(record, tok) == got


@pytest.mark.slow
def test_cutting_anywhere_would_change_the_tokens(tokenizers):
    """The check above can fail: tokenizing fixed-size parts (the silent fallback) gives other tokens."""
    tok = tokenizers["gpt2"]
    text = long_text(50_000)
    naive = [
        i for k in range(0, len(text), 4093) for i in tok(text[k : k + 4093], add_special_tokens=False)["input_ids"]
    ]
    assert naive != tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_any_safe_cut_keeps_the_tokens_of_the_whole(tokenizers):
    """The property itself, at random places: tokens(text[:cut]) + tokens(text[cut:]) == tokens(text)."""
    tok = tokenizers["gpt2"]
    cutter = chunking.SafeCut(tok)
    text = long_text(20_000, seed=3)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    for _ in range(200):
        cut = cutter.cut(text[: rng.randrange(1, len(text))])
        parts = tok([text[:cut], text[cut:]], add_special_tokens=False)["input_ids"]
        assert parts[0] + parts[1] == whole, (cut, text[max(0, cut - 20) : cut + 20])


def pieces_as_documents(stream: DocumentStream) -> list[str]:
    docs, parts = [], []
    for text, end in stream.pieces(stream.fresh_state()):
        parts.append(text)
        if end:
            docs.append("".join(parts))
            parts = []
    assert not parts
    return docs


@pytest.mark.parametrize("tiny", [False, True], ids=["default-pieces", "tiny-pieces"])
def test_document_boundaries_in_plain_text(tmp_path, monkeypatch, tiny):
    if tiny:
        monkeypatch.setattr(text_pieces, "PIECE_BYTES", 3)
        monkeypatch.setattr(text_pieces, "MAX_HELD_BYTES", 9)
    path = tmp_path / "t.txt"
    path.write_bytes(b"first doc\nstill first\n\nsecond\r\n \t\r\n\nthird one\n   \nfourth\n")
    expected = {
        "file": ["first doc\nstill first\n\nsecond\r\n \t\r\n\nthird one\n   \nfourth\n"],
        "blank_line": ["first doc\nstill first", "second", "third one", "fourth\n"],
        "line": ["first doc", "still first", "second", "third one", "fourth"],
    }
    for boundary, docs in expected.items():
        section = load_recipe(None, {"data": {"train": {"path": str(path), "document_boundary": boundary}}}).data
        stream = DocumentStream(plan_data(section, 0).train, seed=0, shuffle=False, loop=False)
        assert pieces_as_documents(stream) == docs, boundary


def test_a_file_is_read_in_bounded_pieces(tmp_path, monkeypatch):
    path = tmp_path / "big.txt"
    path.write_text("word " * 400_000, encoding="utf-8")  # 2 MB, one document
    section = load_recipe(None, {"data": {"train": {"path": str(path)}}}).data
    stream = DocumentStream(plan_data(section, 0).train, seed=0, shuffle=False, loop=False)
    sizes = [len(text) for text, _ in stream.pieces(stream.fresh_state())]
    assert (
        sum(sizes) == 2_000_000
        and max(sizes) <= max(text_pieces.PIECE_BYTES, text_pieces.SNIFF_BYTES)
        and len(sizes) >= 30
    )


@pytest.mark.slow
@pytest.mark.parametrize("source", [{}, {"document_boundary": "line"}], ids=["one-document", "lines"])
def test_positions_inside_a_long_document_resume_exactly(tmp_path, tokenizers, small_pieces, source):
    tok = tokenizers["gpt2"]
    path = tmp_path / "book.txt"
    path.write_text(long_text(120_000, seed=1).replace("\n", " ") + "\n" + long_text(30_000, seed=2), encoding="utf-8")
    section = load_recipe(None, {"data": {"train": {"path": str(path), **source}, "seq_len": 32}}).data
    plan = plan_data(section, 0)

    def stream() -> BlockStream:
        return BlockStream(DocumentStream(plan.train, seed=0, shuffle=True, loop=True), tok, 32, window=16)

    straight = [(b, p) for _, (b, p) in zip(range(400), stream().blocks(stream().fresh_state()))]
    inside = [k for k, (_, p) in enumerate(straight) if len(p["start"]["docs"]["cursors"][0]["pos"]) == 3]
    assert len(inside) > 50  # many saved positions fall inside a document
    for k in [inside[0], inside[len(inside) // 2], 123, 399 - 30]:
        saved = json.loads(json.dumps(straight[k][1]))
        resumed = [b for _, b in zip(range(30), (b for b, _ in stream().blocks(saved)))]
        expected = [b for b, _ in straight[k + 1 : k + 31]]
        assert all((a == b).all() for a, b in zip(resumed, expected)), k


# ------------------------------------------------------------------------------------------- not text at all
NOT_TEXT = {
    "random.txt": (bytes(random.Random(0).randrange(256) for _ in range(5000)), "is not UTF-8 text"),
    "utf16.txt": ("Hello, world. " * 200).encode("utf-16"),
    "nul.txt": (b"text\x00" * 500, "is not UTF-8 text (NUL bytes"),
    "blank.txt": (b"  \n\n\t \n" * 50, "holds only whitespace"),
}


@pytest.mark.parametrize("name", sorted(NOT_TEXT))
def test_a_file_that_is_not_text_is_named(tmp_path, tokenizers, name):
    case = NOT_TEXT[name]
    content, expected = (
        case
        if isinstance(case, tuple)
        else (case, "is not UTF-8 text (NUL bytes in its first 64 KiB: a binary file, or UTF-16/32 text)")
    )
    bad = tmp_path / name
    bad.write_bytes(content)
    with pytest.raises(HftrainError) as err:
        stream_tokens(bad, tokenizers["gpt2"])
    assert str(err.value).startswith(f"{bad}: {expected}")
    assert "data.on_bad_record=skip" in str(err.value)
    # skip mode: the bad file is counted and the good one read
    good = tmp_path / "good.txt"
    good.write_text("a good document " * 100, encoding="utf-8")
    section = load_recipe(None, {"data": {"train": {"path": str(tmp_path / "*.txt")}, "on_bad_record": "skip"}}).data
    stream = DocumentStream(plan_data(section, 0).train, seed=0, shuffle=False, loop=False, bad=BadRecords("skip"))
    assert pieces_as_documents(stream) == [good.read_text()] and stream.bad.skipped == 1


def test_globs_read_only_known_extensions_like_directories(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha text", encoding="utf-8")
    (folder / "b.csv").write_text("x,y\n1,2\n", encoding="utf-8")
    (folder / "c.pdf").write_bytes(b"%PDF-1.4 \x00\x01\x02")
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    for path in (folder, folder / "*"):
        section = load_recipe(None, {"data": {"train": {"path": str(path)}}}).data
        assert [Path(s).name for s in plan_data(section, 0).train[0].shards] == ["a.txt"]
    with pytest.raises(HftrainError) as err:
        plan_data(load_recipe(None, {"data": {"train": {"path": str(folder / "*.csv")}}}).data, 0)
    assert str(err.value) == (
        f"data.train[0].path: {str(folder / '*.csv')!r} matches 1 file(s) (.csv) but none with a known extension "
        "(.txt, .md, .text, .jsonl, .json, .ndjson, .parquet, optionally "
        "compressed); set data.train[0].format to read them anyway."
    )
    forced = load_recipe(None, {"data": {"train": {"path": str(folder / "*.csv"), "format": "txt"}}}).data
    assert [Path(s).name for s in plan_data(forced, 0).train[0].shards] == ["b.csv"]


# ------------------------------------------------------------------------------------ a run killed inside one
@pytest.mark.slow
def test_a_run_killed_inside_a_long_document_resumes_with_the_same_losses(tmp_path):
    """One 3 MB document: every checkpoint's data position is inside it; kill -9, resume, same losses."""
    book = tmp_path / "book.txt"
    book.write_text(" ".join(make_documents(12_000)), encoding="utf-8")
    recipe = tmp_path / "r.yaml"
    raw = tiny_recipe(book, tmp_path / "unused", max_steps=24, save_steps=8, logging_steps=1)
    raw["data"]["validation"] = {"path": str(book)}  # no holdout: the one document trains
    raw["data"]["shuffle_window"] = 4  # windows advance every few steps: saved positions move through the document
    recipe.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "hftrain", "train", str(recipe)]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [*cmd, f"training.output_dir={killed}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while not (killed / "checkpoint-16").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    position = json.loads((killed / "checkpoint-8" / data_state_file(0)).read_text())
    cursor = next(iter(position["positions"].values()))["start"]["docs"]["cursors"][0]
    assert len(cursor["pos"]) == 3 and cursor["pos"][2] > 0  # inside the document
    again = subprocess.run([*cmd, f"training.output_dir={killed}"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    straight = subprocess.run(
        [*cmd, f"training.output_dir={tmp_path / 'straight'}"], capture_output=True, text=True, timeout=600
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    resumed, reference = checkpoint_losses(killed), checkpoint_losses(tmp_path / "straight")
    assert sorted(resumed) == list(range(1, 25))
    assert_resumed_matches(reference, resumed, range(1, 25))
    assert not RunLayout(killed).final.is_symlink()
