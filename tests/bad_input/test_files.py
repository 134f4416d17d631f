"""Nothing lost: a folder, checkpoint or file hftrain did not write stays byte-identical; "start over" never mixes
two runs; a resume falls back past a checkpoint that does not load, and keeps it; two launches never share one
output. Each case through the CLI's own entry point in this process (exit 2 and one message where refused)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

import hftrain
from hftrain.checkpoint.layout import RunLayout
from hftrain.cli import main

from ..support.checks import tree_digest
from ..support.cli import in_process as cli
from ..support.data import make_documents, tiny_recipe, write_jsonl


def test_a_final_folder_hftrain_did_not_write_is_refused_and_untouched(capsys, recipe_file, tmp_path):
    final = RunLayout(tmp_path / "run").final
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"the user's own model")
    before = tree_digest(final)
    code, printed = cli(capsys, "train", str(recipe_file))
    assert code == 2 and f"training.output_dir: {final} was not written by hftrain" in printed
    assert tree_digest(final) == before


def test_start_over_moves_the_earlier_run_aside_and_never_mixes_them(capsys, recipe_file, tmp_path):
    """resume_from_checkpoint=false used to leave the old checkpoints beside the new ones: rotation then deleted
    the new run's, the next start resumed the old one, and the old weights became the new final model."""
    run_dir = tmp_path / "run"
    assert cli(capsys, "train", str(recipe_file))[0] == 0
    # issue 63: the earlier run was killed owing an upload (its outbox journal); before, the new run sent it as its
    # own (the discarded run's weights to main) and exited 76 over it
    owed = {
        "kind": "hub",
        "service": "the Hub",
        "what": "pushing checkpoint-4",
        "later": "",
        "checkpoint": "checkpoint-4",
    }
    (run_dir / RunLayout.OUTBOX).mkdir()
    (run_dir / RunLayout.OUTBOX / "pending.json").write_text(json.dumps([{**owed, "staged": None}]))
    earlier = tree_digest(run_dir)
    code, printed = cli(
        capsys, "train", str(recipe_file), "training.resume_from_checkpoint=false", "training.max_steps=6"
    )
    assert code == 0 and "moved the earlier run to" in printed
    assert "the earlier run's unsent uploads stay its own" in printed and "an earlier launch" not in printed
    (aside,) = run_dir.glob("previous-*")
    tokenizer = {k: v for k, v in earlier.items() if k.startswith(RunLayout.TOKENIZER_DIR + "/")}
    # the lock stays: the directory's
    own = {k: v for k, v in earlier.items() if k not in tokenizer and k != ".hftrain.lock"}
    assert tokenizer and tree_digest(aside) == own  # byte for byte
    assert {k: v for k, v in tree_digest(run_dir).items() if k in tokenizer} == tokenizer  # reused, not retrained
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    code, printed = cli(capsys, "train", str(recipe_file), "training.max_steps=8")  # resumes the new run, not the old
    assert code == 0 and f"resuming from {run_dir / 'checkpoint-6'}" in printed


def test_a_checkpoint_folder_hftrain_did_not_write_is_never_replaced(capsys, recipe_file, tmp_path):
    foreign = tmp_path / "run" / "checkpoint-2"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    code, printed = cli(capsys, "train", str(recipe_file))
    assert code == 2 and f"{foreign}: already exists and was not written by hftrain" in printed
    assert (foreign / "notes.txt").read_text() == "mine" and sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


# ------------------------------------------------------------------------------------------- resume fallback
# ------------------------------------------------------------------------------------------- resume fallback
def _losses(run_dir: Path) -> dict[int, float]:
    import json

    lines = [json.loads(line) for line in (run_dir / RunLayout.METRICS_FILE).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r and "step" in r}


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated weights", "truncated trainer_state.json"])
def test_resume_falls_back_to_the_newest_checkpoint_that_loads(capsys, recipe_file, tmp_path, damage):
    run_dir = tmp_path / "run"
    assert cli(capsys, "train", str(recipe_file))[0] == 0  # checkpoint-2, checkpoint-4, final/
    newest = run_dir / "checkpoint-4"
    name = "model.safetensors" if damage == "truncated weights" else "trainer_state.json"
    (newest / name).write_bytes((newest / name).read_bytes()[:200])
    damaged = tree_digest(newest)
    code, printed = cli(capsys, "train", str(recipe_file), "training.max_steps=6")
    aside = run_dir / "unreadable-checkpoint-4"
    assert code == 0 and f"hftrain: warning: {newest} cannot be loaded ({name}" in printed, printed[-3000:]
    assert f"kept as {aside}" in printed and f"resuming from {run_dir / 'checkpoint-2'}" in printed
    assert tree_digest(aside) == damaged  # nothing of it deleted or changed
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert set(_losses(run_dir)) >= {3, 4, 5, 6}  # the steps after checkpoint-2 trained again, to the new max_steps


def test_an_explicit_resume_path_that_does_not_load_is_refused(capsys, recipe_file, tmp_path):
    assert cli(capsys, "train", str(recipe_file))[0] == 0
    newest = tmp_path / "run" / "checkpoint-4"
    (newest / "trainer_state.json").write_text('{"global_step": 4, "log_hist')
    before = tree_digest(tmp_path / "run")
    code, printed = cli(
        capsys, "train", str(recipe_file), f"training.resume_from_checkpoint={newest}", "training.max_steps=6"
    )
    assert code == 2 and "Traceback" not in printed
    assert (
        f"training.resume_from_checkpoint: {newest} cannot be loaded (trainer_state.json: truncated (28 bytes of "
        in printed
    )
    assert tree_digest(tmp_path / "run") == before


# ------------------------------------------------------------------------ models, checkpoints and outputs on disk
# ------------------------------------------------------------------------------ the bad-input table, second part
@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A finished run (checkpoint-2, checkpoint-4, final/) whose files every case below must leave byte-identical."""
    root = tmp_path_factory.mktemp("earlier")
    data = write_jsonl(root / "good.jsonl", make_documents(300))
    recipe = root / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(data, root / "run", max_steps=4, save_steps=2)), encoding="utf-8")
    assert main(["train", str(recipe)]) == 0
    return root


def _damaged_copy(source: Path, target: Path, name: str, content: bytes | None) -> Path:
    import shutil

    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    (target / name).write_bytes(content if content is not None else (target / name).read_bytes()[:5000])
    return target


LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 599968\n"


_MODEL = ["tokenizer.train=null", "model.from_pretrained={model}"]


# (name, command and arguments with {run} {final} {model} {ckpt} {file} {tmp}, damage to {model}/{ckpt}, expected)
MORE_CASES = [
    (
        "negative learning rate",
        ["train", "{recipe}", "training.learning_rate=-0.001"],
        None,
        "training.learning_rate: Input should be greater than or equal to 0 (got -0.001)",
    ),
    (
        "batch size 0",
        ["train", "{recipe}", "training.per_device_train_batch_size=0"],
        None,
        "training.per_device_train_batch_size: Input should be greater than 0 (got 0)",
    ),
    (
        "preset null",
        ["train", "{recipe}", "model.preset=null"],
        None,
        "model: preset is null and from_pretrained is not set; give model.preset (see `hftrain presets`) or "
        "model.from_pretrained",
    ),
    (
        "no training data",
        ["plan", "{recipe}", "data.train=[]"],
        None,
        "data.train: an empty list: give at least one source, e.g. {{path: data.jsonl}} or {{builtin: python-docs}}",
    ),
    (
        "git-lfs pointer as weights",
        ["train", "{recipe}", *_MODEL],
        ("model.safetensors", LFS),
        "model.from_pretrained: {model}/model.safetensors: a git-lfs pointer, not the weights (the repository was "
        "cloned without its LFS files). Run `git lfs pull` in that repository, or download the model again.",
    ),
    (
        "truncated weights",
        ["plan", "{recipe}", *_MODEL],
        ("model.safetensors", None),
        "model.from_pretrained: {model}/model.safetensors: truncated (5,000 bytes of ",
    ),
    (
        "export of a truncated checkpoint",
        ["export", "{ckpt}", "--out", "{tmp}/exported"],
        ("model.safetensors", None),
        "{ckpt}/model.safetensors: truncated (5,000 bytes of ",
    ),
    (
        "export --out a file",
        ["export", "{run}/checkpoint-4", "--out", "{file}"],
        None,
        "--out {file}: is a file; give a new directory to write the model into.",
    ),
    (
        "output_dir a file",
        ["train", "{recipe}", "training.output_dir={file}"],
        None,
        "training.output_dir: {file} is a file, not a directory. Set training.output_dir to a directory path.",
    ),
    (
        "truncated results.json",
        ["report", "{broken_run}"],
        ("results.json", b'{"step": 4, "eval_lo'),
        "{broken_run}/results.json (the run's results): not valid JSON (line 1, column ",
    ),
    (
        "a different builtin tokenizer",
        ["plan", "{recipe}", *_MODEL, "tokenizer.builtin=gpt2"],
        None,
        "tokenizer: tokenizer.builtin gpt2 is not the tokenizer {model} "
        "was trained with (their vocabularies or merges differ)",
    ),
    (
        "a tokenizer trained anew",
        ["plan", "{recipe}", "model.from_pretrained={model}"],
        None,
        "tokenizer.train: a new tokenizer for {model}, whose embeddings "
        "were trained with its own; remove the tokenizer section",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, argv, damage, expected", MORE_CASES, ids=[c[0] for c in MORE_CASES])
def test_more_mistakes_get_their_message(capsys, earlier_run, tmp_path, name, argv, damage, expected):
    run = earlier_run / "run"
    before = tree_digest(run)
    fill = {
        "run": run,
        "recipe": earlier_run / "r.yaml",
        "tmp": tmp_path,
        "file": tmp_path / "a-file",
        "model": tmp_path / "model",
        "ckpt": tmp_path / "checkpoint-4",
        "broken_run": tmp_path / "broken-run",
    }
    (tmp_path / "a-file").write_text("mine")
    if damage is not None:
        source, target = {"export": (run / "checkpoint-4", fill["ckpt"]), "report": (run, fill["broken_run"])}.get(
            argv[0], (run / "final", fill["model"])
        )
        _damaged_copy(source, target, *damage)
    else:
        import shutil

        shutil.copytree(run / "final", fill["model"])
    code, printed = cli(capsys, *(word.format(**fill) for word in argv))
    assert code == 2 and expected.format(**fill) in printed, printed[-3000:]
    assert "Traceback" not in printed and "exported:" not in printed
    assert tree_digest(run) == before and (tmp_path / "a-file").read_text() == "mine"


def test_the_models_own_tokenizer_travels_with_it(capsys, earlier_run, tmp_path):
    final = earlier_run / "run" / "final"
    recipe = hftrain.load_recipe(None, {"model": {"from_pretrained": str(final)}, "training": {"max_steps": 1}})
    assert (recipe.tokenizer.path, recipe.tokenizer.builtin) == (str(final), None)  # no tokenizer section: the model's
    replaced = [
        str(earlier_run / "r.yaml"),
        "tokenizer.train=null",
        "tokenizer.builtin=gpt2",
        f"model.from_pretrained={final}",
        "tokenizer.replace_model_tokenizer=true",
        "model.trust_remote_code=true",
    ]
    code, printed = cli(capsys, "plan", *replaced)
    assert code == 0, printed[-2000:]  # a different tokenizer, intended: accepted
    assert f"hftrain: warning: model.trust_remote_code is on: Python code shipped with {final} will run" in printed


def test_an_output_dir_that_cannot_be_written(capsys, earlier_run, tmp_path):
    """Not as root: chmod does not stop root, so /sys (which refuses new directories to everyone) stands in."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        target = locked / "run"
    else:
        target = Path("/sys/hftrain-test-run")
    code, printed = cli(capsys, "train", str(earlier_run / "r.yaml"), f"training.output_dir={target}")
    assert code == 2 and "Traceback" not in printed
    assert f"training.output_dir: cannot write to {target} (" in printed and "writable file system" in printed, printed


# Class 1, two launches, one directory: a run and a prepare own their output while they work
# (hftrain/checkpoint/output_lock.py), and a prepare never writes into what it did not create (data/prepare.py).
# Class 1, two launches, one directory: a run and a prepare own their output while they work
# (hftrain/checkpoint/output_lock.py), and a prepare never writes into what it did not create (data/prepare.py).
OWNED = [
    (
        "train into a directory another launch owns",
        "held",
        ["train", "{recipe}"],
        "training.output_dir: {tmp}/run is in use by another hftrain process: pid {pid} on",
    ),
    (
        "prepare into a directory another prepare owns",
        "held",
        ["data", "prepare", "{recipe}", "--out", "{tmp}/run"],
        "--out: {tmp}/run is in use by another hftrain process: pid {pid} on",
    ),
    (
        "prepare over a finished prepare",
        "prepared.json",
        ["data", "prepare", "{recipe}", "--out", "{tmp}/run"],
        "--out {tmp}/run: already holds prepared data (prepared.json); nothing was changed. Prepare into a new "
        "directory, or delete {tmp}/run first to prepare it again.",
    ),
    (
        "prepare over the packed blocks of an older hftrain",
        "manifest.json",
        ["data", "prepare", "{recipe}", "--out", "{tmp}/run"],
        "--out {tmp}/run: already holds prepared data (manifest.json); nothing was changed.",
    ),
    (
        "prepare into a folder of other files",
        "notes.txt",
        ["data", "prepare", "{recipe}", "--out", "{tmp}/run"],
        "--out {tmp}/run: is not empty (notes.txt) and was not written by `hftrain data prepare`; nothing was changed.",
    ),
]


@pytest.mark.parametrize("name, there, argv, expected", OWNED, ids=[c[0] for c in OWNED])
def test_a_directory_owned_by_another_launch_or_not_by_hftrain_is_left_as_it_was(
    capsys, work, monkeypatch, name, there, argv, expected
):
    from ..checkpoint.test_output_lock import hold

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
    """A finished folder is never written into again; one whose task was killed (no completion marker, a file cut
    short, no prepared.json) is finished by the same command into the folder the first prepare made."""
    monkeypatch.delenv("HFTRAIN_RUN_TOKEN", raising=False)
    out = work / "shards"
    argv = ["data", "prepare", str(work / "r.yaml"), "--out", str(out), "--workers", "1"]
    assert main(argv) == 0
    done = tree_digest(work)
    capsys.readouterr()
    assert main(argv) == 2
    assert f"--out {out}: already holds prepared data (prepared.json); nothing was changed." in capsys.readouterr().err
    assert tree_digest(work) == done
    (out / "prepared.json").unlink()  # what a prepare killed inside its task leaves
    (out / "logs" / "completions" / "00000").unlink()
    first = sorted(out.glob("*.ds"))[0]
    first.write_bytes(first.read_bytes()[:-7])
    assert main(argv) == 0
    again = {k: v for k, v in tree_digest(work).items() if "/logs/" not in k}
    assert again == {k: v for k, v in done.items() if "/logs/" not in k}  # the same files as the prepare that finished
