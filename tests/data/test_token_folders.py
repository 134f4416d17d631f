"""Token folders in datatrove's tokenized layout: `hftrain data prepare` writes them on datatrove (the same folder for
any workers, task split or resumed kill), training reads them (hftrain's own and datatrove's DocumentTokenizer's) at
any seq_len, mixes them by weight, and refuses a damaged or foreign one with one line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from datatrove.data import Document
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer, TokenizedFile

import hftrain
from hftrain.data.folder_stream import FolderMixture
from hftrain.data.loader import PackedDataset, ResumableLoader, plan_data, train_blocks, train_documents
from hftrain.data.part import DataPart
from hftrain.data.prepare import PrepareHow, prepare
from hftrain.data.stream import BlockStream, Worker
from hftrain.errors import HftrainError
from hftrain.model.tokenizer import gpt2_tokenizer
from hftrain.parallel.readers import ReaderLayout, merge_positions
from hftrain.recipe.load import load_recipe

from ..support.checks import losses, tree_digest
from ..support.data import make_documents, tiny_recipe, write_jsonl


def gpt2_recipe(data, out, **training):
    raw = tiny_recipe(data, out, **training)
    raw["tokenizer"] = {"builtin": "gpt2"}
    return raw


def corpus(root: Path, files: int = 3, docs: int = 600) -> Path:
    texts = make_documents(docs)
    for i in range(files):
        write_jsonl(root / "corpus" / f"part-{i}.jsonl", texts[i::files])
    return root / "corpus"


def folder_digest(root: Path) -> dict[str, str]:
    """The folder's bytes, but datatrove's logs (timestamps) and the lock file."""
    return {k: v for k, v in tree_digest(root).items() if not k.startswith("logs/") and k != ".hftrain.lock"}


def datatrove_folder(
    out: Path, texts: list[str], tokenizer_json: str, tasks: int = 2, eos: str = "<|endoftext|>"
) -> Path:
    """A folder written by datatrove's own DocumentTokenizer, as a user of another tool would write it."""

    def documents(data, rank: int = 0, world_size: int = 1):
        for i, text in enumerate(texts[rank::world_size]):
            yield Document(text=text, id=f"{rank}/{i}")

    steps = [documents, DocumentTokenizer(str(out), tokenizer_name_or_path=tokenizer_json, eos_token=eos, seed=7)]
    LocalPipelineExecutor(steps, tasks=tasks, workers=1, logging_dir=str(out.parent / f"{out.name}-logs")).run()
    return out


def test_a_prepared_folder_holds_the_tokens_training_would_read_at_any_seq_len(tmp_path):
    raw = gpt2_recipe(corpus(tmp_path), tmp_path / "unused")
    prepared = prepare(
        DataPart.of(load_recipe(None, raw)), str(tmp_path / "prep"), PrepareHow(workers=1), shuffle=False, task_mb=0
    )
    names = [f["name"] for f in prepared["files"]]
    assert prepared["tasks"] == 3 and len(names) == 3 and prepared["token_size"] == 2
    assert (tmp_path / "prep" / "tokenizer" / "tokenizer.json").is_file() and prepared["validation_tokens"] >= 8 * 32
    # unshuffled, the files one after another are the token stream training tokenizes on the fly
    stored = np.concatenate([np.fromfile(tmp_path / "prep" / n, dtype="<u2") for n in names])
    docs = train_documents(plan_data(load_recipe(None, raw).data, 0), loop=False, shuffle=False)
    live_stream = BlockStream(docs, gpt2_tokenizer(), 32, window=1)
    live = np.concatenate([b for b, _ in live_stream.blocks(live_stream.fresh_state())])
    assert len(stored) - len(live) < 32 and (stored[: len(live)] == live).all()
    # seq_len is chosen at training: blocks of 48 are each file's tokens 48 at a time
    raw["data"] = {"train": {"pretokenized": str(tmp_path / "prep")}, "seq_len": 48, "eval_blocks": 4}
    plan = plan_data(load_recipe(None, raw).data, 0)
    assert (
        plan.folders[0].validation is not None
        and plan.folder_tokens == sum(len(np.fromfile(tmp_path / "prep" / n, "<u2")) // 48 for n in names) * 48
    )
    stream = train_blocks(plan, gpt2_tokenizer(), Worker(), window=1)
    first = np.fromfile(tmp_path / "prep" / names[0], dtype="<u2")
    blocks = [b for _, (b, _) in zip(range(3), stream.blocks(stream.fresh_state()))]
    assert all((blocks[i] == first[48 * i : 48 * (i + 1)]).all() for i in range(3))


def test_a_prepare_that_skips_bad_input_counts_it(tmp_path, capsys):
    """Issue 63: with data.on_bad_record=skip, a binary file among the inputs was left out of the folder without a
    word (training counts it; the prepare did not). Now prepared.json and the summary count it."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, doc in enumerate(make_documents(200)[:6]):
        (texts / f"doc-{i}.txt").write_text(doc * 40, encoding="utf-8")
    (texts / "doc-6.txt").write_bytes(bytes(range(256)) * 64)  # NUL bytes: a binary file, not text
    raw = gpt2_recipe(texts, tmp_path / "unused")
    raw["data"].update(on_bad_record="skip", holdout_every=4, eval_blocks=1)  # files 0 and 4 held out
    prepared = prepare(DataPart.of(load_recipe(None, raw)), str(tmp_path / "prep"), PrepareHow(workers=1), task_mb=0)
    assert prepared["skipped_records"] == 1
    assert "data.on_bad_record=skip: 1 bad record(s) or file(s) left out" in capsys.readouterr().out


def test_tasks_group_input_files_by_size_and_never_split_one(tmp_path):
    from hftrain.data.prepare_steps import task_units

    for i, size in enumerate([30, 50, 10, 200, 5, 5]):
        (tmp_path / "c" / f"f{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "c" / f"f{i}.txt").write_text("x" * size)
    (tmp_path / "d.jsonl").write_text('{"text": "one"}\n')
    raw = tiny_recipe(tmp_path / "c", tmp_path / "u")
    raw["data"]["train"] = [{"path": str(tmp_path / "c")}, {"path": str(tmp_path / "d.jsonl")}]
    plan = plan_data(load_recipe(None, raw).data, 0)
    # a source starts a task
    assert task_units(plan, 60) == [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(0, 4), (0, 5)], [(1, 0)]]
    assert task_units(plan, 0) == [[(0, k)] for k in range(6)] + [[(1, 0)]]


@pytest.mark.slow
def test_the_folder_is_the_same_for_any_workers_task_split_and_killed_task(tmp_path, capsys):
    raw = gpt2_recipe(corpus(tmp_path), tmp_path / "unused")
    part = DataPart.of(load_recipe(None, raw))
    one = prepare(part, str(tmp_path / "one"), PrepareHow(workers=2), task_mb=0)  # a task per file
    # two machines sharing the task space: the first runs task 0, and leaves a folder training refuses
    split = tmp_path / "split"
    assert prepare(part, str(split), PrepareHow(workers=1, tasks=1), task_mb=0) is None
    assert "tasks 0..0 of 3 are done here (1 of 3 in all)" in capsys.readouterr().out
    with pytest.raises(HftrainError, match=r"is a prepare that did not finish \(tasks 1, 2 of 3 have not finished"):
        plan_data(load_recipe(None, {**raw, "data": {"train": {"pretokenized": str(split)}}}).data, 0)
    # the second was killed inside task 1: what it left is written over when the task runs again
    (split / "00001_unshuffled.ds").write_bytes(b"cut short")
    first_log = (split / "logs" / "logs" / "task_00000.log").read_bytes()
    two = prepare(part, str(split), PrepareHow(workers=1, tasks=2, task_offset=1), task_mb=0)
    assert "(2 of 3 task(s) run here" in capsys.readouterr().out
    assert (split / "logs" / "logs" / "task_00000.log").read_bytes() == first_log  # task 0 did not run again
    assert two == one and folder_digest(split) == folder_digest(tmp_path / "one")
    assert len(one["files"]) == 3 and one["shuffled"]
    with pytest.raises(HftrainError, match="already holds prepared data"):
        prepare(part, str(split), PrepareHow(workers=1), task_mb=0)
    other = DataPart.of(load_recipe(None, {**raw, "training": {**raw["training"], "seed": 5}}))
    (tmp_path / "half").mkdir()
    prepare(part, str(tmp_path / "half"), PrepareHow(workers=1, tasks=1), task_mb=0)
    with pytest.raises(
        HftrainError, match=r"holds an unfinished prepare of other data or settings \(seed differ"
    ) as info:
        prepare(other, str(tmp_path / "half"), PrepareHow(workers=1), task_mb=0)
    # issue 63: the advice must not be the one that fails again (a prepare refused for its settings, retried with
    # the advised ones, was told to run the failing settings again)
    assert f"delete {tmp_path / 'half'} (an unfinished prepare" in str(info.value) and "a new --out" in str(info.value)


@pytest.fixture(scope="module")
def made_by_datatrove(tmp_path_factory):
    """A folder of datatrove's own DocumentTokenizer (2 tasks) and the tokenizer.json it names (hftrain's trained
    one)."""
    root = tmp_path_factory.mktemp("datatrove")
    raw = tiny_recipe(corpus(root), root / "unused")
    from hftrain.data.loader import first_documents
    from hftrain.model.part import ModelPart
    from hftrain.model.tokenizer import load_tokenizer

    recipe = load_recipe(None, raw)
    plan = plan_data(recipe.data, 0)
    tokenizer, _ = load_tokenizer(ModelPart.of(recipe), root / "tok-work", lambda n: first_documents(plan, n))
    tokenizer.save_pretrained(root / "tokenizer")
    folder = datatrove_folder(
        root / "folder",
        make_documents(1200, seed=3),
        str(root / "tokenizer" / "tokenizer.json"),
        eos=tokenizer.eos_token,
    )
    return root, folder


def _bad(folder: Path, tmp_path: Path, damage) -> Path:
    copy = tmp_path / "bad"
    shutil.copytree(folder, copy)
    damage(copy)
    return copy


def _first(copy: Path, suffix: str = ".ds") -> Path:
    return sorted(copy.glob(f"*{suffix}"))[0]


def _cut(path: Path, n: int) -> None:
    path.write_bytes(path.read_bytes()[:-n])


BAD_FOLDERS = [
    (
        "old layout",
        lambda c: (c / "manifest.json").write_text("{}"),
        "holds packed blocks in the layout hftrain wrote before",
    ),
    (
        "no index",
        lambda c: (_first(c).parent / (_first(c).name + ".index")).unlink(),
        r"has no 00000_00000_doc_shuffled.ds.index: the task that wrote it did not finish",
    ),
    ("no metadata", lambda c: (_first(c).parent / (_first(c).name + ".metadata")).unlink(), r"has no .*\.ds\.metadata"),
    (
        "truncated",
        lambda c: _cut(_first(c), 4),
        r"00000_00000_doc_shuffled.ds is truncated: it holds [\d,]+ tokens, its index ends at",
    ),
    ("odd bytes", lambda c: _cut(_first(c), 1), r"is truncated \([\d]+ bytes is not a whole number of 2-byte tokens\)"),
    (
        "index",
        lambda c: (_first(c).parent / (_first(c).name + ".index")).write_bytes(np.array([5, 9], "<u8").tobytes()),
        "does not match its index",
    ),
    (
        "shuffle cut",
        lambda c: shutil.copy(_first(c), c / "00000_unshuffled.ds"),
        "task 0 of .* did not finish \\(both its unshuffled and its shuffled files",
    ),
    ("empty", lambda c: [p.unlink() for p in c.glob("*.ds*")], r"no tokenized files \(\*\.ds\) in"),
    (
        "unfinished prepare",
        lambda c: [
            (c / "logs" / "completions").mkdir(parents=True),
            (c / "logs" / "executor.json").write_text('{"world_size": 2}'),
            (c / "logs" / "completions" / "00000").touch(),
        ],
        r"is a prepare that did not finish \(tasks 1 of 2 have not "
        r"finished: no logs/completions marker\)\. Run the same",
    ),
]


@pytest.mark.parametrize("name, damage, message", BAD_FOLDERS, ids=[b[0] for b in BAD_FOLDERS])
def test_a_damaged_or_unfinished_folder_is_refused_with_one_line(made_by_datatrove, tmp_path, name, damage, message):
    root, folder = made_by_datatrove
    bad = _bad(folder, tmp_path, damage)
    raw = tiny_recipe(root / "corpus", tmp_path / "run")
    raw["data"]["train"] = {"pretokenized": str(bad)}
    with pytest.raises(HftrainError, match=message) as caught:
        plan_data(load_recipe(None, raw).data, 0)
    assert "\n" not in str(caught.value) and str(bad) in str(caught.value)


def test_a_folder_of_another_tokenizer_is_refused_before_training(made_by_datatrove, tmp_path, capsys):
    from hftrain.cli import main

    root, folder = made_by_datatrove
    raw = tiny_recipe(root / "corpus", tmp_path / "run", max_steps=2)
    raw["data"]["train"] = {"pretokenized": str(folder)}
    for tokenizer, said in [
        ({"builtin": "gpt2"}, f"hftrain: error: tokenizer: not the tokenizer the data in {folder} was tokenized with"),
        ({"path": str(root / "tokenizer")}, None),
    ]:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(yaml.safe_dump({**raw, "tokenizer": tokenizer}))
        code = main(["train", str(recipe), "training.max_steps=1"])
        printed = capsys.readouterr()
        if said:
            assert code == 2 and said in printed.err and "Traceback" not in printed.err, printed.err[-2000:]
        else:
            assert code == 0, printed.err[-2000:]
    # a wider vocabulary than the ids' 2 bytes: refused by the token size
    wide = _bad(folder, tmp_path, lambda c: None)
    from hftrain.data.token_folder import check_tokenizer, open_folder

    class Wide:
        eos_token = "<|endoftext|>"

        def __len__(self):
            return 70_000

    with pytest.raises(HftrainError, match="holds 2-byte tokens, but the recipe's tokenizer has 70,000 ids"):
        check_tokenizer(open_folder(str(wide), {}, "data.train.pretokenized"), Wide())


def test_an_id_outside_the_vocabulary_stops_the_read(made_by_datatrove, tmp_path):
    root, folder = made_by_datatrove
    raw = tiny_recipe(root / "corpus", tmp_path / "run")
    raw["data"]["train"] = {"pretokenized": str(folder)}
    plan = plan_data(load_recipe(None, raw).data, 0)

    class Small:
        def __len__(self):
            return 100

    stream = train_blocks(plan, Small(), Worker(), window=4)
    with pytest.raises(HftrainError, match=r"token id [\d,]+ is not in the recipe's tokenizer \(100 ids\)"):
        next(stream.blocks(stream.fresh_state()))


def _synthetic(out: Path, low: int, files: int, tokens: int) -> Path:
    """A folder of `files` files of ids in [low, low + 50), written with datatrove's TokenizedFile."""
    from datatrove.io import get_datafolder

    rng = np.random.default_rng(low)
    for f in range(files):
        file = TokenizedFile(
            get_datafolder(str(out)),
            f"{f:05d}_x.ds",
            tokenizer_name_or_path="some/hub-tokenizer",
            save_final_metadata=True,
        )
        file.write(rng.integers(low, low + 50, tokens).tolist(), None)
        file.close()
    return out


def test_a_mixture_of_folders_draws_by_weight_and_resumes_exactly(tmp_path):
    a, b = _synthetic(tmp_path / "a", 0, 3, 3200), _synthetic(tmp_path / "b", 100, 2, 3200)
    raw = tiny_recipe(tmp_path, tmp_path / "run")
    raw["data"] = {
        "train": [{"pretokenized": str(a), "weight": 3}, {"pretokenized": str(b), "weight": 1}],
        "seq_len": 16,
        "eval_blocks": 4,
    }
    plan = plan_data(load_recipe(None, raw).data, 0)
    layout = ReaderLayout(readers=2, processes=1, workers=1, window=8)
    straight = iter(ResumableLoader(PackedDataset(plan, None, 0, layout), 4, 0))
    expected = [next(straight)["input_ids"] for _ in range(100)]
    from_a = sum(int((batch < 100).all(dim=1).sum()) for batch in expected)
    assert 0.70 < from_a / 400 < 0.80  # 3:1
    first = ResumableLoader(PackedDataset(plan, None, 0, layout), 4, 0)
    it = iter(first)
    for _ in range(37):
        next(it)
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = iter(
        ResumableLoader(PackedDataset(plan, None, 0, layout, merge_positions([saved], layout, 16, "c")), 4, 0)
    )
    assert all((next(resumed)["input_ids"] == e).all() for e in expected[37:])
    assert isinstance(train_blocks(plan, None, Worker(), 8), FolderMixture)
    with pytest.raises(
        HftrainError, match=r"token folders \(pretokenized\) and Megatron corpora \(megatron\) mix only"
    ):
        load_recipe(
            None, {**raw, "data": {**raw["data"], "train": [{"pretokenized": str(a)}, {"path": str(tmp_path)}]}}
        )


@pytest.mark.slow
def test_prepare_to_s3_and_train_from_it(s3, tmp_path):
    bucket = s3.make_bucket()
    out = f"s3://{bucket}/tokenized/tiny"
    raw = gpt2_recipe(corpus(tmp_path, files=2, docs=400), tmp_path / "u")
    prepared = prepare(DataPart.of(load_recipe(None, raw)), out, PrepareHow(workers=1), task_mb=0)
    raw = gpt2_recipe(tmp_path, tmp_path / "run", max_steps=4, save_steps=4)
    raw["data"] = {"train": {"pretokenized": out}, "seq_len": 32, "eval_blocks": 4}
    run = hftrain.train(load_recipe(None, raw))
    assert run.trainer.state.global_step == 4 and prepared["tokens"] > 3000
    plan = plan_data(load_recipe(None, raw).data, 0)
    second = prepared["files"][1]["name"]
    s3.client().delete_object(Bucket=bucket, Key=f"tokenized/tiny/{second}")
    stream = train_blocks(plan, None, Worker(), 256)
    with pytest.raises(HftrainError, match=f"{second}: a file of the token folder is missing"):
        for _ in zip(range(100_000), stream.blocks(stream.fresh_state())):  # an endless stream: bounded
            pass


@pytest.mark.slow
def test_training_from_a_prepared_folder_learns(tmp_path):
    raw = tiny_recipe(corpus(tmp_path), tmp_path / "unused")
    prepare(DataPart.of(load_recipe(None, raw)), str(tmp_path / "prep"), PrepareHow(workers=1))
    raw = {
        **raw,
        "data": {"train": {"pretokenized": str(tmp_path / "prep")}, "seq_len": 32, "eval_blocks": 8},
        "tokenizer": {"path": str(tmp_path / "prep" / "tokenizer")},
    }
    raw["training"] = {**raw["training"], "output_dir": str(tmp_path / "a"), "max_steps": 10, "save_steps": 5}
    per_step = losses(hftrain.train(load_recipe(None, raw)))
    assert per_step[1] - per_step[10] > 1.0


@pytest.mark.slow(seconds=90)
def test_a_datatrove_folder_trains_and_resumes_after_kill_9_on_another_process_count(made_by_datatrove, tmp_path):
    """The folder datatrove's own DocumentTokenizer wrote: a 2-process DDP run killed (-9) after a checkpoint continues
    on 1 process with the uninterrupted run's losses, step for step (the reference runs on one process, in this one:
    a 2-process run gives the same losses, tests/parallel/test_distributed.py, and cost 30 s more here)."""
    from ..support.checks import assert_same_steps, steps, train_log
    from ..support.cli import kill_at_checkpoint
    from ..support.reference_runs import train

    root, folder = made_by_datatrove
    raw = tiny_recipe(
        root / "corpus",
        tmp_path / "unused",
        max_steps=18,
        save_steps=3,
        per_device_train_batch_size=2,
        eval_strategy="no",
    )
    raw["model"].update(hidden_dropout=0, attention_dropout=0)
    raw["monitor"]["sample_max_new_tokens"] = 0
    raw["parallelism"] = {"global_batch_size": 8}
    raw["data"] = {"train": {"pretokenized": str(folder)}, "seq_len": 32, "eval_blocks": 4, "shuffle_window": 4}
    raw["tokenizer"] = {"path": str(root / "tokenizer")}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    run_dir, straight = tmp_path / "killed", tmp_path / "straight"
    cmd = [
        sys.executable,
        "-m",
        "hftrain",
        "train",
        str(recipe),
        "--accelerate-config",
        "ddp",
        "--nproc",
        "2",
        f"training.output_dir={run_dir}",
    ]
    survivor = kill_at_checkpoint(cmd, run_dir, 6)
    at = int(survivor.name.split("-")[1])
    out = train(recipe, "ddp", 1, run_dir).stdout
    assert f"resuming from {survivor}\n" in out
    hftrain.train(load_recipe(recipe, [f"training.output_dir={straight}"]))
    resumed = {e["step"]: (e["loss"], e["grad_norm"]) for e in train_log(run_dir) if e["step"] > at}
    assert sorted(resumed) == list(range(at + 1, 19))
    assert_same_steps(steps(straight), resumed, range(at + 1, 19), "datatrove folder, kill -9, 2 -> 1")
    first, last = steps(straight)[1][0], steps(straight)[18][0]
    assert first - last > 1.0, (first, last)  # it learns from the folder


def test_executor_flags_that_cannot_work_get_one_line(tmp_path, monkeypatch):
    from importlib.util import find_spec

    raw = gpt2_recipe(corpus(tmp_path, files=2, docs=40), tmp_path / "unused")
    part = DataPart.of(load_recipe(None, raw))
    out = str(tmp_path / "out")
    for how, said in [
        (PrepareHow(executor="slurm"), "--executor slurm: give --partition"),
        (PrepareHow(tasks=2, task_offset=1), r"--tasks 2 --task-offset 1: this data has 2 task\(s\)"),
        (
            PrepareHow(executor="slurm", partition="p", task_offset=1),
            "--tasks/--task-offset share the task space between plain machines",
        ),
    ]:
        with pytest.raises(HftrainError, match=said):
            prepare(part, out, how, task_mb=0)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(HftrainError, match=r"--executor ray: Ray is not installed here; pip install 'hftrain\[ray\]'"):
        prepare(part, out, PrepareHow(executor="ray"), task_mb=0)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.slow(seconds=90)
def test_a_killed_prepare_takes_its_workers_with_it_and_runs_again_at_once(tmp_path):
    """Issue 63 class 1: kill -9 of `hftrain data prepare` left its pool workers finishing tasks and a child
    holding the folder's lock: the same command was refused for minutes, naming a pid already dead. Now the
    workers end with it (the kernel's parent-death signal) and hold no copy of the lock; the same command then
    does the tasks that had not finished."""
    import signal
    import subprocess
    import time

    import psutil

    from ..support.cli import ROOT

    for i in range(4):  # four input files: a task each, two at once
        write_jsonl(tmp_path / f"d{i}.jsonl", make_documents(8000, seed=i))
    raw = tiny_recipe(tmp_path / "d*.jsonl", tmp_path / "run")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    out = tmp_path / "tokens"
    argv = [sys.executable, "-m", "hftrain", "data", "prepare", str(tmp_path / "r.yaml"), "--out", str(out)]
    argv += ["--workers", "2", "--task-mb", "0.05"]
    prepare = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 240
    while len(list((out / "logs" / "logs").glob("task_*.log"))) < 2:  # two tasks at work, one in each worker
        assert prepare.poll() is None and time.monotonic() < deadline, "the prepare ended before its tasks started"
        time.sleep(0.05)
    time.sleep(1.0)  # into their documents (a spawned worker takes the signal as its task reads its first one)
    workers = psutil.Process(prepare.pid).children(recursive=True)
    prepare.send_signal(signal.SIGKILL)
    prepare.wait()
    _, alive = psutil.wait_procs(workers, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, "the workers outlived the prepare"
    again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"prepared {out}" in again.stdout, again.stderr[-2000:]
