"""lr_schedule: gpt_neox_annealing is gpt-neox v1.0's AnnealingLR (Pythia's schedule), step for step: the formula
against a copy of gpt-neox's own class, the LambdaLR a run gets (from any first step), a real run's logged rates, and
the recipe keys it refuses beside it."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import hftrain
from hftrain.errors import HftrainError
from hftrain.recipe.docs import explain
from hftrain.recipe.load import load_recipe
from hftrain.recipe.sections import LrScheduleSection
from hftrain.training.schedules import gpt_neox_annealing, gpt_neox_annealing_lr

from ..support.checks import train_log
from ..support.data import tiny_recipe


class AnnealingLR:
    """gpt-neox v1.0's AnnealingLR, its schedule copied as it stands (the optimizer's groups, printing and checkpoint
    checks left out; `lr` holds what step() set in the groups). Source:
    https://github.com/EleutherAI/gpt-neox/blob/v1.0/megatron/learning_rates.py (tag v1.0)."""

    def __init__(self, start_lr, warmup_iter, total_iters, decay_style, last_iter, min_lr=0.0):
        self.start_lr = start_lr
        self.min_lr = min_lr
        self.warmup_iter = warmup_iter
        self.num_iters = last_iter
        self.end_iter = total_iters
        assert self.end_iter > 0
        self.decay_style = decay_style
        self.step(self.num_iters)

    def get_lr(self):
        num_iters_ = min(self.num_iters, self.end_iter - self.warmup_iter)
        # Warmup.
        if self.warmup_iter > 0 and self.num_iters <= self.warmup_iter:
            return float(self.start_lr) * num_iters_ / self.warmup_iter

        num_iters_ = num_iters_ - self.warmup_iter
        if self.decay_style == "linear":
            lr = self.start_lr * (self.end_iter - num_iters_) / self.end_iter
        elif self.decay_style == "cosine":
            lr = self.start_lr / 2.0 * (math.cos(math.pi * num_iters_ / self.end_iter) + 1)
        elif self.decay_style == "exponential":
            # exp(-0.693) = 1/2
            lr = self.start_lr * math.exp(-0.693 * num_iters_ / self.end_iter)
        else:
            lr = self.start_lr
        return max(lr, self.min_lr)

    def step(self, step_num=None):
        if step_num is None:
            step_num = self.num_iters + 1
        self.num_iters = step_num
        self.lr = self.get_lr()


def neox_schedule(lr, min_lr, warmup, lr_decay_iters):
    """gpt-neox v1.0's get_learning_rate_scheduler (megatron/training.py, same tag): lr_decay_style cosine."""
    num_iters = max(1, lr_decay_iters)
    init_step = 0
    warmup_iter = warmup * num_iters
    return AnnealingLR(lr, warmup_iter, num_iters, "cosine", init_step, min_lr)


PYTHIA = {"lr": 6e-4, "min_lr": 6e-5, "warmup": 0.01, "lr_decay_iters": 143000}  # models/160M/pythia-160m.yml
PYTHIA_STEPS = (0, 1, 1429, 1430, 1431, 71500, 141570, 142999, 143000, 150000)


def ours(step, lr, min_lr, warmup, lr_decay_iters):
    return gpt_neox_annealing_lr(step, lr, warmup * lr_decay_iters, lr_decay_iters, min_lr)


def test_the_formula_is_gpt_neox_at_every_step_and_at_pythias():
    """The k-th optimizer step's rate: gpt-neox's after k scheduler steps (DeepSpeed steps it after each one)."""
    small = {"lr": 1e-3, "min_lr": 1e-4, "warmup": 0.01, "lr_decay_iters": 200}  # warmup 2 steps, held after 198
    reference = neox_schedule(**small)
    for k in range(0, 221):
        assert ours(k, **small) == pytest.approx(reference.lr, rel=1e-12, abs=0), k
        reference.step()
    pythia = neox_schedule(**PYTHIA)
    for k in PYTHIA_STEPS:
        pythia.step(k)
        assert ours(k, **PYTHIA) == pytest.approx(pythia.lr, rel=1e-12, abs=0), k
    at = {k: ours(k, **PYTHIA) for k in PYTHIA_STEPS}
    assert at[0] == 0.0 and at[1430] == 6e-4 and at[143000] == at[150000] == 6e-5  # warmup from 0; the floor
    assert at[1431] < 6e-4 and at[71500] == pytest.approx(6e-4 / 2 * (math.cos(math.pi * 70070 / 143000) + 1))


def test_it_is_not_transformers_cosine_with_min_lr():
    """The divisor is decay_steps (not decay_steps - warmup) and the floor a cut (not a squeeze): mid-run, 8% apart."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=6e-4)
    hf = get_scheduler("cosine_with_min_lr", optimizer, 1430, 143000, scheduler_specific_kwargs={"min_lr_rate": 0.1})
    theirs = 6e-4 * hf.lr_lambdas[0](71500)
    assert theirs / ours(71500, **PYTHIA) - 1 == pytest.approx(0.080, abs=0.001)


def schedule_rates(schedule, optimizer, steps):
    """The rate each of `steps` optimizer steps runs at, the schedule stepped after each as the Trainer does."""
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step(), schedule.step()
    return rates


@pytest.mark.parametrize("first_step", [0, 1, 57, 190])
def test_the_runs_schedule_from_any_first_step(first_step):
    """The LambdaLR a run gets: its k-th optimizer step at gpt-neox's step first_step + k (a run continuing another at
    step N passes N), the peak from the optimizer's groups, the floor min_lr_rate of it."""
    section = LrScheduleSection(type="gpt_neox_annealing", decay_steps=200, warmup_fraction=0.05, min_lr_rate=0.1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    got = schedule_rates(gpt_neox_annealing(optimizer, section, max_steps=30, first_step=first_step), optimizer, 30)
    reference = neox_schedule(1e-3, 1e-4, 0.05, 200)
    reference.step(first_step)
    for k, rate in enumerate(got):
        assert rate == pytest.approx(reference.lr, rel=1e-12, abs=0), (first_step, k)
        reference.step()


def test_decay_steps_default_to_the_runs_last_step():
    section = LrScheduleSection(type="gpt_neox_annealing", min_lr_rate=0.0)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    got = schedule_rates(gpt_neox_annealing(optimizer, section, max_steps=100, first_step=100), optimizer, 100)
    assert got == pytest.approx([gpt_neox_annealing_lr(100 + k, 1.0, 2.0, 200, 0.0) for k in range(100)], rel=1e-12)


def test_a_run_logs_the_formulas_rates_and_resumes_on_them_exactly(pretrained_run, tmp_path, capsys):
    """The shared 30-step run continued to step 36 on gpt_neox_annealing (decay 60, warmup 3): metrics.jsonl's rate at
    step s is the formula's at s - 1, from step 31 (a resume into the new schedule); continued again from its
    checkpoint-36 to step 40, on it to the bit. Without HftrainTrainer.create_scheduler's branch the Trainer's own
    cosine over 36 steps (training.lr_scheduler_type) logs rates 5-200x lower."""
    run_dir = tmp_path / "run"
    shutil.copytree(pretrained_run.output_dir, run_dir)
    data = Path(hftrain.load_recipe(pretrained_run.recipe_file).data.train[0].path)

    def train_to(max_steps: int) -> dict[int, float]:
        raw = tiny_recipe(data, run_dir, max_steps=max_steps)
        del raw["training"]["warmup_steps"]  # lr_schedule brings its own warmup (given too, it is refused)
        raw["lr_schedule"] = {"type": "gpt_neox_annealing", "decay_steps": 60, "warmup_fraction": 0.05}
        raw["monitor"]["sample_max_new_tokens"] = 0
        hftrain.train(hftrain.load_recipe(None, raw))
        return {e["step"]: e["learning_rate"] for e in train_log(run_dir)}

    peak = pretrained_run.trainer.args.learning_rate
    formula = {s: gpt_neox_annealing_lr(s - 1, peak, 3.0, 60, 0.1 * peak) for s in range(31, 41)}
    as_run = {s: peak * gpt_neox_annealing_lr(s - 1, 1.0, 3.0, 60, 0.1) for s in range(31, 41)}  # base x factor
    rates = train_to(36)
    assert {s: rates[s] for s in range(31, 37)} == pytest.approx({s: formula[s] for s in range(31, 37)}, rel=1e-12)
    cosine = {s: peak * (1 + math.cos(math.pi * (s - 1 - 2) / 34)) / 2 for s in range(31, 37)}  # warmup 2 of 36
    assert all(rates[s] > 5 * cosine[s] for s in range(31, 37)), (rates, cosine)
    assert "learning rate at step 31: " in capsys.readouterr().out  # the checkpoint's cosine had left 0.0
    rates = train_to(40)
    assert {s: rates[s] for s in range(31, 41)} == as_run  # the resumed steps 37-40 too, exactly
    assert "learning rate at step 37" not in capsys.readouterr().out  # the same schedule: nothing to put right


@pytest.mark.parametrize(
    "schedule, training, message",
    [
        (
            {"type": "gpt_neox_annealing"},
            {"lr_scheduler_type": "linear"},
            "recipe: lr_schedule.type gpt_neox_annealing replaces training's schedule, so training.lr_scheduler_type "
            "would be ignored; remove them (its warmup is lr_schedule.warmup_fraction), or remove lr_schedule.type",
        ),
        (
            {"type": "gpt_neox_annealing"},
            {"warmup_steps": 0, "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
            "so training.warmup_steps and training.lr_scheduler_kwargs would be ignored; remove them",
        ),
        (
            {"decay_steps": 1000},
            {},
            "lr_schedule: decay_steps would be ignored without a type; set type: gpt_neox_annealing",
        ),
        ({"type": "gpt_neox_annealing", "warmup_fraction": 0.5}, {}, "lr_schedule.warmup_fraction: Input should be"),
        ({"type": "cosine"}, {}, "lr_schedule.type: Input should be 'gpt_neox_annealing'"),
    ],
)
def test_a_schedule_the_recipe_would_ignore_is_refused_naming_the_keys(tmp_path, schedule, training, message):
    with pytest.raises(HftrainError) as info:
        load_recipe(None, {"lr_schedule": schedule, "training": {"output_dir": str(tmp_path), **training}})
    assert message in str(info.value), str(info.value)


def test_hftrain_defaults_and_pythias_values_are_accepted(tmp_path):
    """hftrain's own training defaults (cosine, warmup 0.05) are not the user's: they stay, unused, and are saved."""
    recipe = load_recipe(
        None,
        {
            "lr_schedule": {"type": "gpt_neox_annealing", "decay_steps": 143000},
            "training": {"output_dir": str(tmp_path), "learning_rate": 6e-4, "max_steps": 143000},
        },
    )
    assert (recipe.lr_schedule.warmup_fraction, recipe.lr_schedule.min_lr_rate) == (0.01, 0.1)
    text = explain("lr_schedule")
    assert all(f"  {key}: " in text for key in LrScheduleSection.model_fields)
    assert "cosine_with_min_lr" in text and "lr_decay_iters" in text
