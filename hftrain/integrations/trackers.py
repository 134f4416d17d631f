"""Experiment trackers: one tracker run per training run, and a tracker that fails never ends the training.

Trackers are the Trainer's own integrations (`training.report_to`); hftrain adds two things:

* ``guard_reporters``: each tracker callback (W&B, MLflow, trackio, TensorBoard, ...) whose event raises (its server
  down, a refused key, a full disk) is reported once, joins the run's failures to share (outbox.py) and stops
  reporting; the run goes on, and its metrics stay in metrics.jsonl. How long a tracker's client waits before it
  raises is bounded by faults.network_timeout_s (network.py), so a server that is down costs one bound, not a stall.
* ``one_run``: transformers' MLflow callback ends its run when training ends, so hftrain's final evaluation (after
  training) would open a second, separate run. A run started here first is one the callback leaves open (it ends
  only runs it started itself); it is ended here once the final evaluation is logged: FINISHED, or FAILED when the
  run raised. A tracking server that cannot start it is one failure, as above.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any
from collections.abc import Callable, Iterator

from transformers import TrainerCallback

from hftrain.integrations.outbox import Failure, Outbox, reason

NOT_LOST = "its metrics are in the run's metrics.jsonl"


def guard_reporters(trainer: Any, outbox: Outbox) -> None:
    """Wrap the Trainer's tracker callbacks (transformers' integrations, one per report_to entry)."""
    from transformers.integrations import integration_utils

    handler = trainer.callback_handler
    handler.callbacks = [
        GuardedReporter(cb, outbox) if type(cb).__module__ == integration_utils.__name__ else cb for cb in handler.callbacks
    ]


def tracker_name(callback: Any) -> str:
    return type(callback).__name__.removesuffix("Callback").lower()


class GuardedReporter(TrainerCallback):
    """Forwards every event to a tracker's callback until it raises once."""

    def __init__(self, inner: Any, outbox: Outbox):
        self.inner, self.outbox = inner, outbox

    @property
    def name(self) -> str:
        return tracker_name(self.inner)


def _forward(event: str) -> Callable[..., Any]:
    def call(self: GuardedReporter, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.name in self.outbox.trackers_off:
            return None
        try:
            return getattr(self.inner, event)(args, state, control, **kwargs)
        except Exception as err:
            self.outbox.trackers_off.add(self.name)
            self.outbox.fail(Failure(self.name, f"reporting to {self.name} at step {state.global_step}", reason(err), NOT_LOST))
            return None

    call.__name__ = event
    return call


for _event in [name for name in vars(TrainerCallback) if name.startswith("on_")]:
    setattr(GuardedReporter, _event, _forward(_event))


@contextmanager
def one_run(args: Any, outbox: Outbox | None = None) -> Iterator[None]:
    """Keep one MLflow run open around training and the final evaluation (main process, report_to mlflow)."""
    if "mlflow" not in (args.report_to or []) or args.process_index != 0:
        yield
        return
    import mlflow

    if mlflow.active_run() is not None:  # the caller's own run (a notebook): theirs to end
        yield
        return
    try:
        if os.environ.get("MLFLOW_EXPERIMENT_NAME"):
            mlflow.set_experiment(os.environ["MLFLOW_EXPERIMENT_NAME"])
        run_id = os.environ.get("MLFLOW_RUN_ID")
        mlflow.start_run(run_id=run_id, run_name=None if run_id else args.run_name)
    except Exception as err:  # the tracking server is down: training goes on, and the callback stays quiet
        if outbox is not None:
            outbox.trackers_off.add("mlflow")
            outbox.fail(Failure("mlflow", "starting the mlflow run", reason(err), NOT_LOST))
        yield
        return
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    finally:
        try:
            mlflow.end_run(status=status)
        except Exception as err:
            if outbox is not None:
                outbox.fail(Failure("mlflow", "ending the mlflow run", reason(err), NOT_LOST), training=False)
