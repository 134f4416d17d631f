"""End-to-end training on a tiny NeoX: learning, exact resume, standard checkpoints, and refusals."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hftrain
from hftrain.checkpoint import layout
from hftrain.checkpoint import manager as ckpt
from hftrain.checkpoint.layout import RunLayout
from hftrain.errors import HftrainError

from ..support.checks import assert_resumed_matches, copy_checkpoint, loss_records, losses, train_log
from ..support.data import make_documents, tiny_recipe, write_jsonl


def test_loss_falls_and_outputs_are_written(pretrained_run):
    run = pretrained_run
    per_step = losses(run)
    assert len(per_step) == 30
    first, last = per_step[1], sum(per_step[s] for s in range(26, 31)) / 5
    assert first > 5.0  # ~ln(320) from a fresh model
    assert last < first - 2.0, (first, last)  # templated sentences: 30 steps remove >2 nats
    assert run.metrics["eval_loss"] < first - 2.0
    assert run.metrics["eval_perplexity"] == pytest.approx(2.718281828 ** run.metrics["eval_loss"], rel=1e-6)
    out = run.output_dir
    train_lines = train_log(out)
    assert {"tokens_seen", "tokens_per_s", "mfu", "grad_norm", "learning_rate"} <= set(train_lines[-1])
    assert train_lines[-1]["tokens_seen"] == 30 * 8 * 32
    results = json.loads(RunLayout(out).results.read_text())
    assert results["eval_loss"] == pytest.approx(run.metrics["eval_loss"])
    assert run.sample.startswith("The ")
    became = run.as_run  # what the run became, for the caller (README's Python example)
    assert (became.strategy, became.processes, became.global_batch, became.max_steps) == ("single", 1, 8, 30)
    assert hftrain.load_recipe(run.recipe_file).training.max_steps == 30  # the recipe as run, saved with the model


def test_checkpoints_are_complete_and_rotated(pretrained_run):
    out = pretrained_run.output_dir
    kept = [p.name for p in ckpt.complete_checkpoints(out)]
    assert kept == ["checkpoint-20", "checkpoint-30"]  # save_total_limit 2 (hftrain default)
    last = out / "checkpoint-30"
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "trainer_state.json",
        "optimizer.pt",
        "scheduler.pt",
        layout.RECIPE_FILE,
        layout.data_state_file(0),
        layout.COMPLETE_MARKER,
    ):
        assert (last / name).is_file(), name
    assert not list(out.rglob("pytorch_model*.bin"))  # weights only as safetensors
    assert not (pretrained_run.final_dir / "training_args.bin").exists()  # no pickles in the shareable model
    assert not (out / RunLayout.STAGING).exists() or not any((out / RunLayout.STAGING).iterdir())


def test_final_model_loads_in_plain_transformers(pretrained_run, tmp_path):
    """A subprocess that never imports hftrain loads the final model and gets the same logits."""
    final = pretrained_run.final_dir
    config = json.loads((final / "config.json").read_text())
    assert config["model_type"] == "gpt_neox"
    ids = [[5, 17, 42, 99, 3, 250, 7]]
    # without accelerate's mixed-precision forward wrapper: where the speed defaults chose bf16 (measured on this
    # CPU), the trained model's forward runs under bf16 autocast, ~1e-2 from the fp32 forward of the same weights
    model = pretrained_run.trainer.accelerator.unwrap_model(
        pretrained_run.trainer.model, keep_fp32_wrapper=False
    ).eval()
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits
    script = (
        "import sys, json, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(final)!r}).eval()\n"
        f"t = AutoTokenizer.from_pretrained({str(final)!r})\n"
        "assert 'hftrain' not in sys.modules\n"
        f"logits = m(torch.tensor({ids})).logits\n"
        f"torch.save(logits, {str(tmp_path / 'logits.pt')!r})\n"
        "print(json.dumps({'cls': type(m).__name__, 'vocab': len(t), 'text': t.decode(t('the cat')['input_ids'])}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["cls"] == "GPTNeoXForCausalLM" and info["text"] == "the cat"
    got = torch.load(tmp_path / "logits.pt")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _run(data, out, data_keys=None, **training):
    raw = tiny_recipe(data, out, **training)
    raw["data"].update(data_keys or {})
    return hftrain.train(hftrain.load_recipe(None, raw))


def test_resume_is_exact(tmp_path, capsys):
    """2N steps straight == N steps, stop, resume, N more: the per-step losses after the resume match.

    The run that stops is the straight run's own state at step N (its checkpoint-N, copied into a fresh
    directory as a killed run would have left it), so the schedule and everything else is the same run's.
    With document masking on (its batches are made from each block alone, so they resume as the blocks do).
    """
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(300, seed=3))
    settings = dict(max_steps=16, save_steps=8, logging_steps=1, learning_rate=2e-3, warmup_steps=2)
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight = losses(_run(data, straight_dir, {"document_masking": True}, **settings))
    assert (
        "hftrain: documents kept apart by sdpa: a block-causal mask of 8 x 32 x 32 bool (8 KiB) per forward"
        in capsys.readouterr().out
    )
    copy_checkpoint(straight_dir, split_dir, "checkpoint-8")
    resumed = losses(_run(data, split_dir, {"document_masking": True}, **settings))
    assert sorted(resumed) == list(range(1, 17))
    assert_resumed_matches(straight, resumed, range(9, 17))


@pytest.mark.slow
def test_interrupted_save_is_ignored_and_cleaned(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(200))
    out = tmp_path / "run"
    _run(data, out, max_steps=10, save_steps=5)
    # a kill during a save leaves a staging dir; a hand-copied checkpoint without marker is not trusted
    (out / RunLayout.STAGING / "checkpoint-15").mkdir(parents=True)
    (out / RunLayout.STAGING / "checkpoint-15" / "model.safetensors").write_bytes(b"partial")
    shutil.copytree(out / "checkpoint-10", out / "checkpoint-99")
    (out / "checkpoint-99" / layout.COMPLETE_MARKER).unlink()
    assert ckpt.latest_checkpoint(out) == out / "checkpoint-10"
    run = _run(data, out, max_steps=12, save_steps=5)
    assert run.trainer.state.global_step == 12
    assert not (out / RunLayout.STAGING / "checkpoint-15").exists()


@pytest.mark.slow
def test_output_dir_of_another_run_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(200))
    out = tmp_path / "run"
    _run(data, out, max_steps=5, save_steps=5)
    raw = tiny_recipe(data, out, max_steps=6)
    raw["model"]["hidden_size"] = 32
    with pytest.raises(HftrainError) as info:
        hftrain.train(hftrain.load_recipe(None, raw))
    message = str(info.value)
    assert f"training.output_dir: {out} holds a run whose model differ" in message
    assert "delete" in message and "new directory" in message


@pytest.mark.slow
def test_trained_tokenizer_is_reused_not_retrained(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(200))
    out = tmp_path / "run"
    _run(data, out, max_steps=4, save_steps=4)
    saved = (out / "tokenizer" / "tokenizer.json").read_bytes()
    write_jsonl(data, ["completely different words now " * 20] * 50)  # new text would give another BPE
    _run(data, out, max_steps=5, save_steps=5, resume_from_checkpoint=False)
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == saved


def test_continued_pretraining_from_pretrained(pretrained_run, tmp_path, corpus):
    raw = tiny_recipe(corpus, tmp_path / "cont", max_steps=3)
    raw["model"] = {"from_pretrained": str(pretrained_run.final_dir)}
    raw["tokenizer"] = {"path": str(pretrained_run.final_dir)}
    run = hftrain.train(hftrain.load_recipe(None, raw))
    first = losses(run)[1]
    assert first < losses(pretrained_run)[1] - 2.0  # starts from the trained weights, not from scratch


def test_missing_pretrained_model_message(tmp_path, corpus):
    raw = tiny_recipe(corpus, tmp_path / "x")
    raw["model"] = {"from_pretrained": str(tmp_path / "no-such-model")}
    raw["tokenizer"] = {"builtin": "gpt2"}
    with pytest.raises(HftrainError, match="model.from_pretrained: cannot load"):
        hftrain.train(hftrain.load_recipe(None, raw))


@pytest.mark.slow
def test_tokens_per_usd_when_priced(tmp_path, corpus):
    raw = tiny_recipe(corpus, tmp_path / "p", max_steps=4, logging_steps=2)
    raw["monitor"]["price_per_hour"] = 3.6
    run = hftrain.train(hftrain.load_recipe(None, raw))
    last = loss_records(run.log_history)[-1]
    assert last["tokens_per_usd"] == pytest.approx(last["tokens_per_s"] * 1000, rel=1e-3)


@pytest.mark.slow
def test_bf16_and_gradient_accumulation(tmp_path, corpus):
    """bf16 autocast trains on this CPU; 2 x 4 accumulated sequences count as one step of 8."""
    run = _run(
        corpus,
        tmp_path / "bf16",
        max_steps=12,
        bf16=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=4,
    )
    per_step = losses(run)
    assert per_step[12] < per_step[4] - 0.5
    last = loss_records(run.log_history)[-1]
    assert last["tokens_seen"] == 12 * 2 * 4 * 32


def test_rerunning_a_finished_run_trains_nothing_more(pretrained_run, tmp_path):
    run_dir = tmp_path / "run"  # a copy: the shared run's own results.json stays what its training wrote
    shutil.copytree(pretrained_run.output_dir, run_dir)
    raw = tiny_recipe(Path(hftrain.load_recipe(pretrained_run.recipe_file).data.train[0].path), run_dir)
    again = hftrain.train(hftrain.load_recipe(None, raw))
    assert again.trainer.state.global_step == 30
    assert [p.name for p in ckpt.complete_checkpoints(run_dir)] == ["checkpoint-20", "checkpoint-30"]
    assert again.metrics["eval_loss"] == pytest.approx(pretrained_run.metrics["eval_loss"], rel=1e-6)


def test_a_finished_run_continued_takes_the_recipes_rate_and_refuses_another_seed(pretrained_run, tmp_path, capsys):
    """Issue 63: continued for 4 more steps at 10x the learning rate, the run trains at the recipe's rate on the
    recipe's 34-step cosine schedule from step 31 (before: the checkpoint's rate, and step 31 at lr 0, the end of
    the finished schedule) and saves at the recipe's save_steps; another seed, from which the data order is drawn,
    is refused before anything loads."""
    run_dir = tmp_path / "run"
    shutil.copytree(pretrained_run.output_dir, run_dir)
    data = Path(hftrain.load_recipe(pretrained_run.recipe_file).data.train[0].path)
    with pytest.raises(HftrainError, match=r"^training.seed: 7 given, but checkpoint-30 was trained with 1234 \("):
        hftrain.train(hftrain.load_recipe(None, tiny_recipe(data, run_dir, seed=7, max_steps=34)))
    continued = tiny_recipe(data, run_dir, learning_rate=3e-2, max_steps=34, save_steps=2)
    more = hftrain.train(hftrain.load_recipe(None, continued))
    printed = capsys.readouterr().out
    assert (
        "hftrain: resumed at step 30 with the recipe's settings from step 31: training.save_steps 10 -> 2; "
        "training.learning_rate 0.003 -> 0.03" in printed
    ), printed
    # saved at the recipe's interval (before: trainer_state.json's 10, so no checkpoint-32)
    assert {"checkpoint-32", "checkpoint-34"} <= {p.name for p in ckpt.complete_checkpoints(run_dir)}
    rates = {e["step"]: e["learning_rate"] for e in more.log_history if "learning_rate" in e}
    cosine = [3e-2 * (1 + math.cos(math.pi * step / 34)) / 2 for step in range(34)]  # the recipe's, at 10x
    assert [rates[step] for step in (31, 32, 34)] == pytest.approx([cosine[30], cosine[31], cosine[33]], rel=1e-6)
