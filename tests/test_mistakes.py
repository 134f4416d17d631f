"""The second bad-input pass: mistakes new users make, each with its own message (exit 2, no traceback), and
nothing lost: a folder hftrain did not write stays byte-identical, "start over" never mixes two runs.

Cases run in-process through the CLI's own entry point (`hftrain.cli.main`): an exception other than hftrain's
one-line error would escape it and fail the test, as a traceback would in a terminal."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import hftrain
from hftrain.cli import main
from hftrain.checkpoint.layout import RunLayout

from .support.data import make_documents, tiny_recipe, write_jsonl


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err + captured.out


@pytest.fixture
def recipe_file(tmp_path: Path) -> Path:
    data = write_jsonl(tmp_path / "good.jsonl", make_documents(300))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(data, tmp_path / "run", max_steps=4, save_steps=2)), encoding="utf-8")
    return path


# (name, file text replacing the recipe or None, overrides, command, expected message)
CASES = [
    ("number given as true", None, ["training.max_steps=true"], "plan", "training.max_steps: true is not a number; give a number here"),
    ("duplicate key", "model: {preset: cpu-tiny}\ntraining:\n  max_steps: 5\n  max_steps: 50\n", [], "plan",
     "line 4, column 3: not valid YAML (duplicate key 'max_steps' (first given on line 3); keep one of them)"),
    ("alias bomb", "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n", [], "plan",
     "not valid YAML (aliases expand it to more than 100,000 values; write the values out)"),
    ("non-UTF-8 recipe", b"model: {preset: cpu-tiny}\n# caf\xe9\n", [], "plan", "not UTF-8 text (byte 31); save the recipe as UTF-8"),
    ("plan: seq_len past the context", None, ["data.seq_len=4096"], "plan",
     "data.seq_len: 4096 is longer than the model's context (max_position_embeddings = 512)"),
    ("key of a list", None, ["data.train=[{path: a.jsonl}]", "data.train.path=b.jsonl"], "plan",
     "data.train is a list here, not a section with keys; give it whole (data.train=...)"),
]  # fmt: skip


@pytest.mark.parametrize("name, text, overrides, command, expected", CASES, ids=[c[0] for c in CASES])
def test_mistake_gets_its_message(capsys, recipe_file, name, text, overrides, command, expected):
    if text is not None:
        (recipe_file.write_bytes if isinstance(text, bytes) else recipe_file.write_text)(text)
    code, printed = cli(capsys, command, str(recipe_file), *overrides)
    assert code == 2 and expected in printed, printed
    assert "Traceback" not in printed


def test_a_whole_value_replaces_and_a_dotted_key_edits(recipe_file):
    """The README's S3 example gave "exactly one of path, dataset, builtin" when data.train={...} was merged."""
    quick = hftrain.load_recipe("recipes/quickstart.yaml", ['data.train={path: "s3://corpus/*.jsonl.gz"}'])
    assert [s.path for s in quick.data.train] == ["s3://corpus/*.jsonl.gz"] and quick.data.train[0].builtin is None
    later = hftrain.load_recipe(recipe_file, ["data.train={path: a.jsonl, text_field: body}", "data.train.path=b.jsonl"])
    assert (later.data.train[0].path, later.data.train[0].text_field) == ("b.jsonl", "body")  # the new value, edited
    twice = hftrain.load_recipe(recipe_file, ["training.max_steps=5", "training.max_steps=7"])
    assert twice.training.max_steps == 7  # left to right, the later one wins
    section = hftrain.load_recipe(recipe_file, ["training={max_steps: 9}"])
    assert section.training.max_steps == 9 and section.training.learning_rate == 6e-4  # hftrain's defaults stay below


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
    earlier = tree_digest(run_dir)
    code, printed = cli(capsys, "train", str(recipe_file), "training.resume_from_checkpoint=false", "training.max_steps=6")
    assert code == 0 and "moved the earlier run to" in printed
    (aside,) = run_dir.glob("previous-*")
    tokenizer = {k: v for k, v in earlier.items() if k.startswith(RunLayout.TOKENIZER_DIR + "/")}
    own = {k: v for k, v in earlier.items() if k not in tokenizer and k != ".hftrain.lock"}  # the lock stays: the directory's
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


# ------------------------------------------------------------------------------------------- --max-restarts
_CHILD = """import os, signal, sys
from pathlib import Path
log = Path(sys.argv[1]); codes = sys.argv[2].split(",")
runs = len(log.read_text().split()) if log.exists() else 0
log.write_text(log.read_text() + " run" if log.exists() else "run")
code = codes[min(runs, len(codes) - 1)]
if code == "KILL":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(code))
"""


@pytest.mark.parametrize("codes, expected_runs, expected_exit", [
    ("2", 1, 2),  # a configuration error fails the same way every time: never restarted
    ("0", 1, 0), ("130", 1, 130),
    ("KILL,0", 2, 0), ("75,0", 2, 0), ("1,1,0", 3, 0),  # a crash, a preemption of the child alone, a bug: restarted
    ("KILL,2", 2, 2),  # restarted after the crash, then the configuration error is final
    ("1,1,1,1", 3, 1),  # no restarts left
])  # fmt: skip
def test_max_restarts_restarts_only_what_a_restart_can_fix(tmp_path, capsys, codes, expected_runs, expected_exit):
    from hftrain.parallel.launch import supervise

    log = tmp_path / "runs.txt"
    code = supervise([str(log), codes], 2, command=[sys.executable, "-c", _CHILD])
    assert (code, len(log.read_text().split())) == (expected_exit, expected_runs)
    err = capsys.readouterr().err
    if codes == "2":
        assert "hftrain: not restarted: a problem in the recipe or data (a restart would fail the same way)." in err
        assert "restart 1" not in err


@pytest.mark.slow
def test_max_restarts_does_not_rerun_a_configuration_error(tmp_path, recipe_file):
    """Found by the child process (the recipe itself is valid: the data file's first record is not JSON): exit 2
    once, not N + 1 times."""
    data = tmp_path / "good.jsonl"
    data.write_text("{not json\n" + data.read_text(encoding="utf-8"), encoding="utf-8")
    before = data.read_bytes()
    result = subprocess.run([sys.executable, "-m", "hftrain", "train", str(recipe_file), "--max-restarts", "3"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2 and result.stderr.count(f"{data}:1: not valid JSON") == 1, result.stderr[-2000:]
    assert "hftrain: not restarted: a problem in the recipe or data" in result.stderr and "restart 1 of" not in result.stderr
    assert "Traceback" not in result.stderr and data.read_bytes() == before


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
    code, printed = cli(capsys, "train", str(recipe_file), f"training.resume_from_checkpoint={newest}", "training.max_steps=6")
    assert code == 2 and "Traceback" not in printed
    assert f"training.resume_from_checkpoint: {newest} cannot be loaded (trainer_state.json: truncated (28 bytes of " in printed
    assert tree_digest(tmp_path / "run") == before


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
    ("negative learning rate", ["train", "{recipe}", "training.learning_rate=-0.001"], None,
     "training.learning_rate: Input should be greater than or equal to 0 (got -0.001)"),
    ("batch size 0", ["train", "{recipe}", "training.per_device_train_batch_size=0"], None,
     "training.per_device_train_batch_size: Input should be greater than 0 (got 0)"),
    ("preset null", ["train", "{recipe}", "model.preset=null"], None,
     "model: preset is null and from_pretrained is not set; give model.preset (see `hftrain presets`) or model.from_pretrained"),
    ("no training data", ["plan", "{recipe}", "data.train=[]"], None,
     "data.train: an empty list: give at least one source, e.g. {{path: data.jsonl}} or {{builtin: python-docs}}"),
    ("git-lfs pointer as weights", ["train", "{recipe}", *_MODEL], ("model.safetensors", LFS),
     "model.from_pretrained: {model}/model.safetensors: a git-lfs pointer, not the weights (the repository was cloned "
     "without its LFS files). Run `git lfs pull` in that repository, or download the model again."),
    ("truncated weights", ["plan", "{recipe}", *_MODEL], ("model.safetensors", None),
     "model.from_pretrained: {model}/model.safetensors: truncated (5,000 bytes of "),
    ("export of a truncated checkpoint", ["export", "{ckpt}", "--out", "{tmp}/exported"], ("model.safetensors", None),
     "{ckpt}/model.safetensors: truncated (5,000 bytes of "),
    ("export --out a file", ["export", "{run}/checkpoint-4", "--out", "{file}"], None,
     "--out {file}: is a file; give a new directory to write the model into."),
    ("output_dir a file", ["train", "{recipe}", "training.output_dir={file}"], None,
     "training.output_dir: {file} is a file, not a directory. Set training.output_dir to a directory path."),
    ("truncated results.json", ["report", "{broken_run}"], ("results.json", b'{"step": 4, "eval_lo'),
     "{broken_run}/results.json (the run's results): not valid JSON (line 1, column "),
    ("a different builtin tokenizer", ["plan", "{recipe}", *_MODEL, "tokenizer.builtin=gpt2"], None,
     "tokenizer: tokenizer.builtin gpt2 is not the tokenizer {model} was trained with (their vocabularies or merges differ)"),
    ("a tokenizer trained anew", ["plan", "{recipe}", "model.from_pretrained={model}"], None,
     "tokenizer.train: a new tokenizer for {model}, whose embeddings were trained with its own; remove the tokenizer section"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name, argv, damage, expected", MORE_CASES, ids=[c[0] for c in MORE_CASES])
def test_more_mistakes_get_their_message(capsys, earlier_run, tmp_path, name, argv, damage, expected):
    run = earlier_run / "run"
    before = tree_digest(run)
    fill = {"run": run, "recipe": earlier_run / "r.yaml", "tmp": tmp_path, "file": tmp_path / "a-file",
            "model": tmp_path / "model", "ckpt": tmp_path / "checkpoint-4", "broken_run": tmp_path / "broken-run"}  # fmt: skip
    (tmp_path / "a-file").write_text("mine")
    if damage is not None:
        source, target = {"export": (run / "checkpoint-4", fill["ckpt"]), "report": (run, fill["broken_run"])}.get(
            argv[0], (run / "final", fill["model"]))
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
    replaced = [str(earlier_run / "r.yaml"), "tokenizer.train=null", "tokenizer.builtin=gpt2", f"model.from_pretrained={final}",
                "tokenizer.replace_model_tokenizer=true", "model.trust_remote_code=true"]  # fmt: skip
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
