"""Issue 63, class 2: a resumed run does what its recipe says. Each key a user may change on a resume is applied from
the resume step (the optimizer's settings and rate equal those of a run that had the recipe's values all along) or
refused naming the key and both values; the table (resumed_settings.ON_RESUME) says which, and nothing else."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import torch
import yaml
from transformers import TrainerControl, TrainerState, get_scheduler

from hftrain.checkpoint.layout import RECIPE_FILE
from hftrain.errors import HftrainError
from hftrain.recipe.sections import LrScheduleSection, SpeedSection
from hftrain.recipe.transformers_table import training_fields
from hftrain.training.resumed_settings import ON_RESUME, ResumedSettings, check_unchanged
from hftrain.training.schedules import gpt_neox_annealing

STEPS = 8  # the checkpoint's step: the end of the first run's 8-step schedule (a finished linear or cosine)


@dataclasses.dataclass(frozen=True)
class Settings:
    learning_rate: float = 1e-3
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr_scheduler_type: str = "linear"
    max_steps: int = STEPS
    warmup_steps: int = 2
    lr_scheduler_kwargs: tuple = ()
    lr_schedule: tuple = ()  # the lr_schedule section's keys: set, it replaces transformers' schedule


def optimizer_and_schedule(model: torch.nn.Module, s: Settings):
    """As the Trainer builds them: AdamW, a decay group and a no-decay group (biases), transformers' schedule (or the
    recipe's lr_schedule, as HftrainTrainer.create_scheduler builds it)."""
    groups = [{"params": [model.weight], "weight_decay": s.weight_decay}, {"params": [model.bias], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=s.learning_rate, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_epsilon)
    if s.lr_schedule:
        return optimizer, gpt_neox_annealing(optimizer, LrScheduleSection(**dict(s.lr_schedule)), s.max_steps)
    schedule = get_scheduler(
        s.lr_scheduler_type,
        optimizer,
        s.warmup_steps,
        s.max_steps,
        scheduler_specific_kwargs=dict(s.lr_scheduler_kwargs),
    )
    return optimizer, schedule


def train(model: torch.nn.Module, optimizer, schedule, steps: int) -> None:
    for _ in range(steps):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step(), schedule.step(), optimizer.zero_grad()


def settings_of(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in optimizer.param_groups]


ANNEALING = {"type": "gpt_neox_annealing", "decay_steps": 3 * STEPS, "warmup_fraction": 0.1}  # warmup 2.4 steps


def annealing(**changed) -> dict:
    """Settings on the lr_schedule section's gpt_neox_annealing, with `changed` keys of it."""
    return {"lr_schedule": tuple({**ANNEALING, **changed}.items()), "max_steps": 2 * STEPS}


CHANGES = {  # recipe key -> the changed value on resume
    "training.learning_rate": {"learning_rate": 1e-2},  # 10x: the checkpoint's rate was kept
    "training.weight_decay": {"weight_decay": 0.0},
    "training.adam_beta1": {"adam_beta1": 0.8},
    "training.adam_beta2": {"adam_beta2": 0.95},
    "training.adam_epsilon": {"adam_epsilon": 1e-6},
    "training.max_steps": {"max_steps": 2 * STEPS},  # a finished schedule continued: its first step ran at lr 0
    "training.lr_scheduler_type": {"lr_scheduler_type": "cosine", "max_steps": 2 * STEPS},
    "training.warmup_steps": {"warmup_steps": 12, "max_steps": 2 * STEPS},  # still warming up at step 8
    "training.lr_scheduler_kwargs": {
        "lr_scheduler_type": "cosine_with_min_lr",
        "max_steps": 2 * STEPS,
        "lr_scheduler_kwargs": (("min_lr", 5e-4),),
    },
    "lr_schedule.type": annealing(),  # from the checkpoint's finished linear schedule
    "lr_schedule.decay_steps": annealing(decay_steps=4 * STEPS),
    "lr_schedule.warmup_fraction": annealing(warmup_fraction=0.2),
    "lr_schedule.min_lr_rate": annealing(min_lr_rate=0.9),  # the floor at step 9: 0.9 of the peak
}
FROM = {key: annealing() for key in CHANGES if key.startswith("lr_schedule.") and key != "lr_schedule.type"}


@pytest.mark.parametrize("key", list(CHANGES))
def test_a_changed_optimizer_setting_or_schedule_applies_from_the_resume_step(key, capsys):
    """The resumed optimizer's settings and rate for step 9 equal those of a run made with the recipe's values
    from step 1; before, the checkpoint's settings and base rate came back with its optimizer.pt and scheduler.pt."""
    assert ON_RESUME[key].applied
    old = dataclasses.replace(Settings(), **FROM.get(key, {}))  # the checkpoint's
    new = dataclasses.replace(Settings(), **CHANGES[key])
    torch.manual_seed(0)
    first = torch.nn.Linear(4, 1)
    optimizer, schedule = optimizer_and_schedule(first, old)
    train(first, optimizer, schedule, STEPS)
    saved_optimizer, saved_schedule = optimizer.state_dict(), schedule.state_dict()

    resumed_model = torch.nn.Linear(4, 1)
    optimizer, schedule = optimizer_and_schedule(resumed_model, new)  # the Trainer, from the changed recipe
    settings = ResumedSettings()
    settings.remember(optimizer)  # HftrainTrainer.create_scheduler
    optimizer.load_state_dict(saved_optimizer), schedule.load_state_dict(saved_schedule)  # the Trainer's load
    state = TrainerState(global_step=STEPS)
    settings.on_train_begin(None, state, TrainerControl(), optimizer=optimizer, lr_scheduler=schedule)

    all_along = torch.nn.Linear(4, 1)
    reference, reference_schedule = optimizer_and_schedule(all_along, new)
    train(all_along, reference, reference_schedule, STEPS)
    assert settings_of(optimizer) == settings_of(reference), key
    printed = capsys.readouterr().out
    assert printed.startswith(f"hftrain: resumed at step {STEPS} with the recipe's settings from step {STEPS + 1}: ")
    if key.startswith("training.adam_beta"):
        assert "training.adam_beta1 / adam_beta2 (0.9, 0.999) -> " in printed, printed
    elif key in ("training.learning_rate", "training.weight_decay", "training.adam_epsilon"):
        assert f"{key} " in printed, printed
    else:
        assert f"learning rate at step {STEPS + 1}: " in printed, printed
    train(resumed_model, optimizer, schedule, 1)  # and the schedule goes on as the reference's
    train(all_along, reference, reference_schedule, 1)
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in reference.param_groups]


@pytest.mark.parametrize("keys", [{"max_steps": 2 * STEPS}, annealing()], ids=["linear", "gpt_neox_annealing"])
def test_an_unchanged_resume_says_nothing(keys, capsys):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer, schedule = optimizer_and_schedule(model, Settings(**keys))
    train(model, optimizer, schedule, STEPS)
    saved = optimizer.state_dict(), schedule.state_dict()
    optimizer, schedule = optimizer_and_schedule(torch.nn.Linear(4, 1), Settings(**keys))
    settings = ResumedSettings()
    settings.remember(optimizer)
    optimizer.load_state_dict(saved[0]), schedule.load_state_dict(saved[1])
    rates = [g["lr"] for g in optimizer.param_groups]
    settings.on_train_begin(
        None, TrainerState(global_step=STEPS), TrainerControl(), optimizer=optimizer, lr_scheduler=schedule
    )
    assert capsys.readouterr().out == ""
    assert [g["lr"] for g in optimizer.param_groups] == rates


REFUSED = {
    "training.optim": ("adamw_torch", "adafactor"),
    "training.optim_args": (None, "amsgrad=True"),
    "training.seed": (42, 7),
}


@pytest.mark.parametrize("key", list(REFUSED))
def test_a_change_the_checkpoint_cannot_carry_is_refused_with_both_values(key, tmp_path):
    assert not ON_RESUME[key].applied
    name = key.split(".", 1)[1]
    recorded, given = REFUSED[key]
    checkpoint = tmp_path / "checkpoint-8"
    checkpoint.mkdir()
    (checkpoint / RECIPE_FILE).write_text(yaml.safe_dump({"training": {"max_steps": 8, name: recorded}}))
    check_unchanged({"max_steps": 16, name: recorded, "learning_rate": 1.0}, checkpoint)  # only applied keys changed
    with pytest.raises(HftrainError) as refused:
        check_unchanged({name: given}, checkpoint)
    message = str(refused.value)
    assert message.startswith(f"{key}: {given!r} given, but checkpoint-8 was trained with {recorded!r} ("), message
    assert "training.resume_from_checkpoint=false" in message and "\n" not in message


def test_the_table_names_real_keys_and_every_group_setting():
    """A key the table names is a TrainingArguments field, a speed or an lr_schedule key (no ghost rows), and each row
    says how."""
    fields = {f"training.{f.name}" for f in training_fields()} | {f"speed.{k}" for k in SpeedSection.model_fields}
    fields |= {f"lr_schedule.{k}" for k in LrScheduleSection.model_fields}
    assert set(ON_RESUME) <= fields, set(ON_RESUME) - fields
    assert all(rule.how for rule in ON_RESUME.values())
    assert set(CHANGES) | set(REFUSED) <= set(ON_RESUME)
    docs = (Path(__file__).parents[2] / "docs" / "operations.md").read_text(encoding="utf-8")
    rows = {line for line in docs.splitlines() if line.startswith("| `")}
    for key, rule in ON_RESUME.items():  # the docs' table says the same of each key
        row = next((line for line in rows if f"`{key}`" in line), None)
        assert (
            row is not None
            and ("**refused**" in row) is (not rule.applied)
            and rule.how.removeprefix("applied: ") in row
        ), key


def test_the_recipes_intervals_replace_those_of_trainer_state_json(capsys):
    """The Trainer loads logging, eval and save intervals with trainer_state.json (and only warns): the recipe's,
    a fraction of the run included, come back at train begin and are said; unchanged ones are not."""
    args = types.SimpleNamespace(logging_steps=1, eval_steps=0.25, save_steps=10)
    state = TrainerState(global_step=STEPS, max_steps=2 * STEPS, logging_steps=1, eval_steps=8, save_steps=5)
    ResumedSettings().on_train_begin(args, state, TrainerControl())
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (1, 4, 10)
    assert capsys.readouterr().out == (
        f"hftrain: resumed at step {STEPS} with the recipe's settings from step {STEPS + 1}: "
        "training.eval_steps 8 -> 4; training.save_steps 5 -> 10\n"
    )
    ResumedSettings().on_train_begin(args, state, TrainerControl())
    assert capsys.readouterr().out == ""
