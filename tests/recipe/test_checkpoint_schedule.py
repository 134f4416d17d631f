"""recipe.checkpoints: which steps a run keeps for study (Pythia's schedule, log-spaced, a list), and the refusals.
What a run does with them (saved, never rotated, pushed as revisions, kept across kill -9 and an elastic resume):
tests/integrations/test_hub.py and tests/checkpoint/test_elastic.py."""

from __future__ import annotations

import pytest

from hftrain.errors import HftrainError
from hftrain.recipe.load import load_recipe
from hftrain.recipe.sections import CheckpointsSection


def test_pythias_schedule_is_its_published_steps():
    kept = CheckpointsSection(schedule="pythia").kept_steps(143_000)
    assert kept[:12] == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000] and kept[12:14] == [2000, 3000]
    assert len(kept) == 154 and kept[-1] == 143_000  # Pythia's 154 revisions, step0 (the initialization) included


def test_a_log_schedule_with_an_end_then_every_and_a_list():
    section = CheckpointsSection(schedule="log", log_until=100, every=250, steps=[7, 3, 7])
    assert section.kept_steps(1000) == [0, 1, 2, 3, 4, 7, 8, 16, 32, 64, 250, 500, 750, 1000]
    assert section.kept_steps(1000) == [s for s in range(0, 1001) if section.keeps(s)]  # the two agree
    # no `every`: ends there
    assert CheckpointsSection(schedule="log", log_until=8).kept_steps(10**6) == [0, 1, 2, 4, 8]
    assert CheckpointsSection(steps=[5]).kept_steps(4) == [] and CheckpointsSection(steps=[0, 5]).kept_steps(9) == [
        0,
        5,
    ]
    assert not CheckpointsSection().keeps(0) and not CheckpointsSection().keeps(1)


def test_the_trainer_callback_saves_at_the_kept_steps_of_this_run():
    """The callback lists the kept steps once, at the run's start (its max_steps known), and asks for a save at
    each of them and no other step."""
    from types import SimpleNamespace

    from hftrain.checkpoint.manager import KeptCheckpointsCallback

    section = CheckpointsSection(schedule="log", log_until=16, every=10, steps=[13])
    callback = KeptCheckpointsCallback(section)
    callback.on_train_begin(None, SimpleNamespace(max_steps=35), None)
    asked = []
    for step in range(1, 36):
        control = SimpleNamespace(should_save=False)
        callback.on_step_end(None, SimpleNamespace(global_step=step), control)
        asked += [step] if control.should_save else []
    assert asked == [1, 2, 4, 8, 13, 16, 20, 30] == [s for s in range(1, 36) if section.keeps(s)]


@pytest.mark.parametrize(
    "checkpoints, training, message",
    [
        (
            {"schedule": "log"},
            {},
            "checkpoints: schedule: log needs log_until (the last log-spaced step), e.g. log_until: 512",
        ),
        ({"every": 1000}, {}, "log_until and every belong to schedule: log (pythia fixes them at 512 and 1000)"),
        ({"steps": [-1, 10]}, {}, "checkpoints.steps: steps are optimizer steps: 0 (the initialization) or more"),
        (
            {"schedule": "pythia", "push_revisions": True},
            {},
            "checkpoints.push_revisions pushes kept checkpoints as Hub branches: set training.push_to_hub: true and "
            "training.hub_model_id",
        ),
        ({"push_revisions": True}, {"push_to_hub": True}, "checkpoints.push_revisions: no checkpoint is kept"),
        ({"schedule": "daily"}, {}, "checkpoints.schedule"),
    ],
)
def test_a_schedule_that_cannot_work_is_refused_naming_the_key(tmp_path, checkpoints, training, message):
    with pytest.raises(HftrainError) as info:
        load_recipe(None, {"checkpoints": checkpoints, "training": {"output_dir": str(tmp_path), **training}})
    assert message in str(info.value), str(info.value)
