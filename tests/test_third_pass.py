"""The third bad-input pass (issue 33), by class. Each case runs through the CLI's own entry point and checks the
exit code, the exact message, that no traceback is printed, the time it took, and that every file that existed
before is byte-identical after.

- Class 6, arguments and values that cannot work: bounds live where a value is parsed (hftrain/cli/numbers.py for
  the commands' numbers, the recipe schema for data.seq_len and data.train_tokens), so nothing starts with them.
- Class 4, every network client bounded: http(s) sources too (integrations/network.py).
- Class 2, secrets by value (recipe/load.py: storage options are saved only when they are known settings, and a
  URL's user info never), across the saved recipe, the model card and error messages.
(Class 7: tests/training/test_faults.py, full disk whatever the writer raises; tests/eval/test_report.py, a report of
a run that went on.)"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import yaml

from hftrain.cli import main

from .support.data import make_documents, tiny_recipe, write_jsonl
from .test_mistakes import tree_digest

ROOT = Path(__file__).resolve().parents[1]

# (name, argv with {recipe} and {tmp}, expected message)
VALUES = [
    ("launch-script --nodes 0", ["launch-script", "{recipe}", "--nodes", "0"], "argument --nodes: 0 cannot work: give a whole number of 1 or more"),
    ("--gpus-per-node -1", ["launch-script", "{recipe}", "--gpus-per-node", "-1"], "argument --gpus-per-node: -1 cannot work"),
    ("--instance-count 0", ["launch-script", "{recipe}", "--kind", "sagemaker", "--instance-count", "0"], "argument --instance-count: 0 cannot work"),
    ("train --nproc 0", ["train", "{recipe}", "--accelerate-config", "ddp", "--nproc", "0"], "argument --nproc: 0 cannot work: give a whole number of 1 or more"),
    ("train --nproc -1", ["train", "{recipe}", "--accelerate-config", "ddp", "--nproc", "-1"], "argument --nproc: -1 cannot work"),
    ("--max-restarts -1", ["train", "{recipe}", "--max-restarts", "-1"], "argument --max-restarts: -1 cannot work: give a whole number of 0 or more"),
    ("--max-restarts two", ["train", "{recipe}", "--max-restarts", "two"], "argument --max-restarts: 'two' is not a whole number"),
    ("plan --mfu 35", ["plan", "{recipe}", "--mfu", "35"], "argument --mfu: 35 cannot work: give a number above 0 and at most 1"),
    ("plan --gpus 0", ["plan", "{recipe}", "--gpus", "0"], "argument --gpus: 0 cannot work"),
    ("plan --gpu-mem-gb nan", ["plan", "{recipe}", "--gpus", "8", "--gpu-mem-gb", "nan"], "argument --gpu-mem-gb: nan cannot work: give a number above 0"),
    ("parity --steps 0", ["parity", "{recipe}", "--steps", "0"], "argument --steps: 0 cannot work"),
    ("data prepare --processes 0", ["data", "prepare", "{recipe}", "--out", "{tmp}/shards", "--processes", "0"], "argument --processes: 0 cannot work"),
    ("eval --stride 0", ["eval", "{tmp}", "--stride", "0"], "argument --stride: 0 cannot work"),
    ("train_tokens 10^30", ["train", "{recipe}", "training.max_steps=-1", "data.train_tokens=1000000000000000000000000000000"],
     "data.train_tokens: 1,000,000,000,000,000,000,000,000,000,000 training tokens is more than hftrain trains (at most 1,000,000,000,000,000)"),
    ("seq_len 10^9", ["train", "{recipe}", "data.seq_len=1000000000"],
     "data.seq_len: 1,000,000,000 tokens per sequence is more than hftrain trains (at most 1,048,576); check the number"),
    ("seq_len 10^9 in plan", ["plan", "{recipe}", "data.seq_len=1000000000"], "data.seq_len: 1,000,000,000 tokens per sequence"),
]  # fmt: skip


@pytest.fixture
def work(tmp_path: Path) -> Path:
    data = write_jsonl(tmp_path / "good.jsonl", make_documents(100))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tiny_recipe(data, tmp_path / "run", max_steps=4)), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("name, argv, expected", VALUES, ids=[c[0] for c in VALUES])
def test_a_value_that_cannot_work_is_refused_where_it_is_parsed(capsys, work, name, argv, expected):
    before = tree_digest(work)
    started = time.monotonic()
    try:
        code = main([a.format(recipe=work / "r.yaml", tmp=work) for a in argv])
    except SystemExit as exit_:  # argparse's own refusal
        code = exit_.code
    took = time.monotonic() - started
    printed = capsys.readouterr()
    assert code == 2, (code, printed.err[-2000:])
    assert expected in printed.err and "Traceback" not in printed.err + printed.out, printed.err[-2000:]
    assert took < 10, took
    assert tree_digest(work) == before  # nothing written, nothing started


def test_every_numeric_option_is_bounded():
    """A plain type=int / type=float option would take 0 or -1 again; the check can fail (see the last line)."""

    def plain_numbers(source: str) -> list[int]:
        return [kw.value.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
                for kw in node.keywords if kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float")]  # fmt: skip

    found = {p.name: plain_numbers(p.read_text()) for p in (ROOT / "hftrain" / "cli").glob("*.py")}
    assert not any(found.values()), found
    assert plain_numbers('p.add_argument("--nodes", type=int, default=2)') == [1]


# Class 4, every network client bounded: an http(s):// data source at a server that accepts and never answers is an
# error within faults.network_timeout_s (it hung before: aiohttp's default has no read limit).
@pytest.mark.parametrize("scheme, command", [("http", "train"), ("https", "train"), ("http", "data")])
def test_a_silent_http_source_is_an_error_within_the_bound(capsys, work, silent_server, scheme, command):
    from hftrain.integrations import network

    url = silent_server.url.replace("http://", f"{scheme}://") + "/corpus/part-0.jsonl"
    raw = yaml.safe_load((work / "r.yaml").read_text())
    raw["data"]["train"] = {"path": url}
    raw["faults"] = {"network_timeout_s": 2}
    (work / "r.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    before = tree_digest(work)
    argv = ["train", str(work / "r.yaml")] if command == "train" else ["data", "inspect", str(work / "r.yaml")]
    started = time.monotonic()
    try:
        code = main(argv)
    finally:
        network.configure()  # this process's default bound again
    took = time.monotonic() - started
    printed = capsys.readouterr()
    assert code == 2, printed.err[-2000:]
    assert f"cannot list {url!r}: the endpoint: no answer within the network time limit (2 s, retries included)" in printed.err
    assert "Traceback" not in printed.err + printed.out and silent_server.connections
    assert took < 15, took
    assert tree_digest(work) == before


# Class 2, secrets by value: what may be saved is decided by what the field is. Planted values of every kind, under
# names that do not look secret, never reach a saved recipe, a model card or an error message.
PLANTED = {
    "header": ("storage_options", {"client_kwargs": {"headers": {"Authorization": "Bearer PLANTEDheader0123"}}}),
    "custom credential field": ("storage_options", {"account_key": "PLANTEDaccountKEY0123"}),
    "access key id": ("storage_options", {"key": "AKIAPLANTEDKEYID0123"}),
    "endpoint with user info": ("storage_options", {"endpoint_url": "https://admin:PLANTEDendpointPW@store.example:9000"}),
    "data URL with user info": ("path", "https://reader:PLANTEDpathPW@data.example/corpus.jsonl"),
}  # fmt: skip


@pytest.mark.parametrize("kind", PLANTED)
def test_a_planted_secret_of_any_kind_is_never_saved_or_printed(capsys, work, kind):
    from hftrain.integrations.hub import model_card
    from hftrain.recipe.load import load_recipe, save_recipe

    where, value = PLANTED[kind]
    secret = next(word for word in str(value).replace("'", " ").replace(":", " ").replace("@", " ").split() if "PLANTED" in word)
    raw = yaml.safe_load((work / "r.yaml").read_text())
    raw["data"]["train"] = {"path": str(work / "good.jsonl"), "storage_options": {"anon": True, "config_kwargs": {"read_timeout": 7}}}
    if where == "path":
        raw["data"]["train"]["path"] = value
    else:
        raw["data"]["train"]["storage_options"].update(value)
    recipe = load_recipe(None, raw)
    save_recipe(recipe, work / "saved.yaml")
    saved = (work / "saved.yaml").read_text()
    assert secret not in saved and secret not in model_card(recipe, {}, "me/model", False)
    kept = yaml.safe_load(saved)["data"]["train"][0]["storage_options"]
    assert kept["anon"] is True and kept["config_kwargs"] == {"read_timeout": 7}  # settings stay, to explain the run
    if kind == "data URL with user info":  # the error that names the path keeps its host, not its password
        raw["faults"] = {"network_timeout_s": 1}
        (work / "r.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
        code = main(["data", "inspect", str(work / "r.yaml")])
        printed = capsys.readouterr()
        assert code == 2 and secret not in printed.err + printed.out and "https://***@data.example" in printed.err, printed.err


# Class 1, two launches, one directory: a run and a prepare own their output while they work
# (hftrain/checkpoint/output_lock.py), and a prepare never writes into what it did not create (data/prepare.py).
OWNED = [
    ("train into a directory another launch owns", "held", ["train", "{recipe}"],
     "training.output_dir: {tmp}/run is in use by another hftrain process: pid {pid} on"),
    ("prepare into a directory another prepare owns", "held", ["data", "prepare", "{recipe}", "--out", "{tmp}/run"],
     "--out: {tmp}/run is in use by another hftrain process: pid {pid} on"),
    ("prepare over a manifest.json that was there", "manifest.json", ["data", "prepare", "{recipe}", "--out", "{tmp}/run"],
     "--out {tmp}/run: already holds prepared data (manifest.json); nothing was changed. Prepare into a new directory, "
     "or delete {tmp}/run first to prepare it again."),
    ("prepare into a folder of other files", "notes.txt", ["data", "prepare", "{recipe}", "--out", "{tmp}/run"],
     "--out {tmp}/run: is not empty (notes.txt) and was not written by `hftrain data prepare`; nothing was changed."),
]  # fmt: skip


@pytest.mark.parametrize("name, there, argv, expected", OWNED, ids=[c[0] for c in OWNED])
def test_a_directory_owned_by_another_launch_or_not_by_hftrain_is_left_as_it_was(capsys, work, monkeypatch, name, there, argv, expected):
    from .checkpoint.test_output_lock import hold

    monkeypatch.delenv("HFTRAIN_RUN_TOKEN", raising=False)
    (work / "run").mkdir()
    if there == "held":  # what a prepare (or run) at work has written so far
        (work / "run" / "train-s0-00000-00000.bin").write_bytes(b"\0" * 64)
    else:
        (work / "run" / there).write_text('{"version": 1, "shards": []}')
    holder = hold(work / "run", "--out" if "prepare" in argv else "training.output_dir") if there == "held" else None
    try:
        before = tree_digest(work)
        started = time.monotonic()
        code = main([a.format(recipe=work / "r.yaml", tmp=work) for a in argv])
        took = time.monotonic() - started
        printed = capsys.readouterr()
        assert code == 2, printed.err[-2000:]
        assert expected.format(tmp=work, pid=holder.pid if holder else "") in printed.err, printed.err[-2000:]
        assert "Traceback" not in printed.err + printed.out and took < 10, took
        assert tree_digest(work) == before
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()


def test_a_second_prepare_into_its_own_folder_is_refused_and_a_killed_one_is_redone(capsys, work, monkeypatch):
    """Before: the second prepare nested the tokenizer one level down (tokenizer/tok) and failed."""
    monkeypatch.delenv("HFTRAIN_RUN_TOKEN", raising=False)
    out = work / "shards"
    argv = ["data", "prepare", str(work / "r.yaml"), "--out", str(out), "--processes", "1"]
    assert main(argv) == 0
    done = tree_digest(work)
    capsys.readouterr()
    assert main(argv) == 2
    assert f"--out {out}: already holds prepared data (manifest.json); nothing was changed." in capsys.readouterr().err
    assert tree_digest(work) == done
    (out / "manifest.json").unlink()  # what a prepare killed before its last write leaves: shards, no manifest
    (out / "train-s0-00000-00000.bin").write_bytes(b"cut short")
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "hftrain: removed" in printed and f"an interrupted prepare left in {out}" in printed
    assert tree_digest(work) == done  # the same shards, manifest and tokenizer as the prepare that finished
