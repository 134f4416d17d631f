"""A layout the plan knows cannot fit is refused before anything is loaded (issue 55, class 2): with
parallelism.fit_memory the smallest layout, without it the recipe's own micro-batch, when its predicted peak is over
a process's whole memory by more than the plan's measured error (fit.PLAN_ERROR); a near miss is a warning and
the run goes on; parallelism.memory_check: warn insists. In this process, through the CLI's entry point, with the
machine's memory given (never this machine's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hftrain.errors import HftrainError
from hftrain.planning import fit as fitting
from hftrain.planning.estimates import plan
from hftrain.planning.memory import GB
from hftrain.planning.part import PlanPart
from hftrain.recipe.load import load_recipe

from ..support.cli import in_process
from ..support.data import make_documents, tiny_recipe, write_jsonl

LAUNCH = ["--accelerate-config", "ddp", "--cpu"]  # `hftrain train --accelerate-config`: 2 CPU processes
REFUSED = "refused"
PROCEEDS = "proceeds"

# (name, recipe keys, launcher arguments, memory per process = the predicted peak of (configured | smallest) / this,
#  outcome, what the output says: templates filled from the predicted numbers)
ROWS = [
    (
        "fit_memory: nothing fits by far",
        {"parallelism": {"fit_memory": True}},
        [],
        ("smallest", 2.0),
        REFUSED,
        [
            "parallelism.fit_memory: nothing fits: the smallest layout (single, micro-batch 1 x accumulation 512",
            "needs {smallest} per process, over the {memory} a process "
            "has on a test machine by more than the plan's 12% error",
            "what would fit: a process with {needed} of memory",
            "To try anyway: parallelism.memory_check: warn.",
        ],
    ),
    (
        "own micro-batch far over, a smaller layout fits",
        {},
        [],
        ("configured", 1.3),
        REFUSED,
        [
            "training.per_device_train_batch_size=512 with gradient "
            "checkpointing off needs about {configured:,.2f} GB per process",
            "over the {memory} a process has on a test machine by more than the plan's 12% error",
            "parallelism.fit_memory: true would take single, micro-batch {micro} x accumulation {accumulation}",
            "(training.per_device_train_batch_size: {micro}, training.gradient_accumulation_steps: {accumulation})",
            "to train as the recipe says anyway: parallelism.memory_check: warn.",
        ],
    ),
    (
        "own micro-batch a near miss",
        {},
        [],
        ("configured", 1.05),
        PROCEEDS,
        ["hftrain: warning: training.per_device_train_batch_size=512", "needs about {configured:,.2f} GB per process"],
    ),
    (
        "fit_memory: the smallest layout a near miss",
        {"parallelism": {"fit_memory": True}},
        [],
        ("smallest", 1.05),
        PROCEEDS,
        [
            "hftrain: warning: parallelism.fit_memory: nothing fits",
            "training with that smallest layout, within the plan's 12% error",
        ],
    ),
    (
        "memory_check: warn insists",
        {"parallelism": {"memory_check": "warn"}},
        [],
        ("configured", 1.3),
        PROCEEDS,
        [
            "hftrain: warning: training.per_device_train_batch_size=512",
            "by more than the plan's 12% error",
            "training anyway, as parallelism.memory_check: warn says.",
        ],
    ),
    (
        "launcher: fit_memory, nothing fits by far",
        {"parallelism": {"fit_memory": True}},
        LAUNCH,
        ("smallest", 2.0),
        REFUSED,
        [
            "parallelism.fit_memory: nothing fits: the smallest layout (ddp, micro-batch 1",
            "over the {memory} a process has",
        ],
    ),
    (
        "launcher: own micro-batch far over",
        {},
        LAUNCH,
        ("configured", 1.3),
        REFUSED,
        [
            "training.per_device_train_batch_size=512",
            "parallelism.fit_memory: true would take ddp, micro-batch {micro}",
        ],
    ),
]


def gb(n: float) -> str:
    """GB as the refusals print them: two decimals below 10 GB, one above."""
    return f"{n / GB:,.2f} GB" if n < 10 * GB else f"{n / GB:,.1f} GB"


class Loaded(HftrainError):
    """Raised where the run would load its tokenizer: it got past the memory check."""


@pytest.mark.parametrize("name, keys, launcher, memory, outcome, expected", ROWS, ids=[r[0] for r in ROWS])
def test_a_certain_out_of_memory_is_refused_before_anything_loads(
    capsys, monkeypatch, tmp_path: Path, name, keys, launcher, memory, outcome, expected
):
    from hftrain.model import build as model_build
    from hftrain.parallel import rehearsal
    from hftrain.training import resolve as resolving
    from hftrain.training import run as training_run

    raw = tiny_recipe(
        write_jsonl(tmp_path / "d.jsonl", make_documents(300)), tmp_path / "run", per_device_train_batch_size=512
    )
    for section, values in keys.items():
        raw.setdefault(section, {}).update(values)
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump(raw), encoding="utf-8")

    # the machine's memory is given: the predicted peak (on a test machine of any memory) over a factor of it
    processes, strategy = (2, "ddp") if launcher else (1, "single")
    part = PlanPart.of(load_recipe(str(recipe_file), []))
    info = plan(part)
    monkeypatch.setattr(fitting, "library_footprint", lambda: 0.0)
    probe = fitting.Machine("cpu", processes, 1.0, "a test machine")
    configured = fitting.as_configured(part, info, probe, strategy, 0.0).peak.total
    smallest = fitting.choose(part, info, probe, 0.0, strategy).peak.total  # nothing fits 1 byte: the smallest
    per_process = {"configured": configured, "smallest": smallest}[memory[0]] / memory[1]
    machine = fitting.Machine("cpu", processes, per_process, "a test machine")
    monkeypatch.setattr(fitting, "this_machine", lambda local=1: machine)
    chosen = fitting.choose(part, info, machine, 0.0, strategy)
    numbers = {
        "configured": configured / GB,
        "smallest": gb(smallest),
        "memory": gb(per_process),
        "needed": gb(smallest / (1 - fitting.MARGIN)),
        "micro": chosen.shape.micro_batch,
        "accumulation": chosen.accumulation,
    }

    loaded: list[str] = []

    def record(what: str, real=None):
        def step(*args, **kwargs):
            loaded.append(what)
            if real is None:
                raise Loaded(f"stopped by the test: the run would load its {what} here")
            return real(*args, **kwargs)

        return step

    monkeypatch.setattr(resolving, "plan_data", record("data", resolving.plan_data))
    monkeypatch.setattr(training_run, "load_tokenizer", record("tokenizer"))
    monkeypatch.setattr(model_build, "build_model", record("model"))
    started: list[dict] = []
    monkeypatch.setattr(rehearsal, "launch_processes", lambda *args, env=None: started.append(env or {}) or 0)

    code, printed = in_process(capsys, "train", str(recipe_file), *launcher)

    for template in expected:
        assert template.format(**numbers) in printed, (template.format(**numbers), printed[-3000:])
    assert "Traceback" not in printed, printed[-3000:]
    if outcome == REFUSED:
        assert code == 2, (code, printed[-3000:])
        assert loaded == [] and started == [], (loaded, started)  # no data listed, no tokenizer, no model, no process
        assert not list((tmp_path / "run").rglob("tokenizer*")), list((tmp_path / "run").rglob("*"))
    else:
        assert "warning" in printed and (code, loaded) == (2, ["data", "tokenizer"]), (code, loaded, printed[-3000:])
        assert "stopped by the test: the run would load its tokenizer here" in printed
