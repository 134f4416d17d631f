"""Experiment trackers: what they report is sent in the background, retried while their server is down, and never
ends or slows the training.

Trackers are the Trainer's own integrations (`training.report_to`); hftrain adds two things:

* Each tracker callback (W&B, MLflow, trackio, TensorBoard, ...) gets its own queue and thread (`TrackerQueue`):
  a step only copies the event's small values (the state's counters, the logged numbers) into the queue. The
  thread sends the events in order; one that raises (the server down, a refused key, a full disk) is said once and
  tried again after RETRY_AFTER_S (30 s, 2 min, then every 10 min) while later reports wait behind it, so an outage
  of minutes or hours loses nothing. At most EVENT_LIMIT reports wait: beyond it the oldest metric report is
  dropped (metrics.jsonl keeps every one). When the run ends, what still waits is tried once more within the close
  bound (twice faults.network_timeout_s, which also bounds each client call: network.py); what is still not sent
  joins the run's failures to share (outbox.py), and the run exits 76 with its model saved.
* One MLflow run per training run: transformers' MLflow callback ends its run when training ends, so hftrain's final
  evaluation (after training) would open a second run. A run started first is one the callback leaves open; it is
  ended when the final evaluation is logged: FINISHED, or FAILED when the run raised. MLflow's active run belongs to
  a thread, so it is started, used and ended on the MLflow queue's thread (a notebook's own run is attached there
  and left to its owner).
"""

from __future__ import annotations

import collections
import copy
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hftrain.checkpoint.layout import RECIPE_FILE, RunLayout
from hftrain.integrations.outbox import Failure, Outbox, reason, send_later

RETRY_AFTER_S = (30.0, 120.0, 600.0)  # pauses before trying a failed report again; the last one repeats
EVENT_LIMIT = 5_000  # reports waiting per tracker; beyond it the oldest metric report is dropped
DROPPABLE = {"on_log", "on_step_begin", "on_step_end", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step"}


@dataclass
class _Event:
    what: str  # "reporting to mlflow at step 12"
    call: Callable[[], Any]
    droppable: bool


class TrackerQueue:
    """One tracker's reports, sent in order by its own thread; a failure holds the queue and is tried again."""

    def __init__(self, name: str, outbox: Outbox, later: str = ""):
        self.name, self.outbox, self.later = name, outbox, later  # later: how to send what was not sent
        self.dropped = 0
        self._events: collections.deque[_Event] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._tries = 0  # failed tries of the event at the head, in a row
        self._due = 0.0  # time.monotonic() when the head may be tried again
        self._gave_up = False
        self._error = ""  # the last failure's reason
        self._thread = threading.Thread(target=self._run, name=f"hftrain-{name}", daemon=True)
        self._thread.start()

    def put(self, what: str, call: Callable[[], Any], droppable: bool = False) -> None:
        """Queue one report; never blocks and never raises."""
        with self._cond:
            if self._closed:
                return
            if len(self._events) >= EVENT_LIMIT:
                # the head may be in flight: never the one dropped
                oldest = next((i for i, e in enumerate(self._events) if i > 0 and e.droppable), None)
                if oldest is not None:
                    del self._events[oldest]
                    self.dropped += 1
                elif droppable:
                    self.dropped += 1
                    return
            self._events.append(_Event(what, call, droppable))
            self._cond.notify()

    def stop(self) -> None:
        """No more reports: what still waits is tried once more now (a pause is cut short)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def close(self, deadline: float) -> None:
        """Stop, and by `deadline` (time.monotonic()) what waited is sent or kept as a failure."""
        self.stop()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            waiting, gave_up, head = len(self._events), self._gave_up, self._events[0] if self._events else None
            self._events.clear()
            self._gave_up = True  # a call still hanging is not reported twice
        if head is not None and not gave_up:
            error = (
                f"{self._error}; still failing when the run ended" if self._error else "no answer before the run ended"
            )
            self.outbox.fail(Failure(self.name, head.what + _after(waiting), error, self.later), training=False)
        if self.dropped:
            what = f"{self.dropped} metric report{'s' if self.dropped > 1 else ''} to {self.name}"
            error = f"dropped while {self.name} was down: at most {EVENT_LIMIT} reports wait"
            self.outbox.fail(Failure(self.name, what, error, self.later), training=False)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._events or (not self._closed and self._due > time.monotonic()):
                    if not self._events and self._closed:
                        return
                    self._cond.wait(None if not self._events else self._due - time.monotonic())
                event, closed = self._events[0], self._closed
            try:
                event.call()
            except Exception as err:  # never into a step: said, the queue held, tried again later
                if self._failed(event, err, closed):
                    return
                continue
            with self._cond:
                if self._events and self._events[0] is event:
                    self._events.popleft()
                if self._tries:
                    print(
                        f"hftrain: {self.name} answers again; its waiting reports are being sent.",
                        file=sys.stderr,
                        flush=True,
                    )
                self._tries = 0

    def _failed(self, event: _Event, err: Exception, closed: bool) -> bool:
        """A failed try: True when it was the last one (begun after the run ended), or when `close` gave up on it
        while it was being tried (already reported)."""
        with self._cond:
            self._error = reason(err)
            if self._gave_up:
                return True
            if closed:
                lost = len(self._events)
                self._events.clear()
                self._gave_up = True
            else:
                pause = RETRY_AFTER_S[min(self._tries, len(RETRY_AFTER_S) - 1)]
                self._tries += 1
                self._due = time.monotonic() + pause
        if closed:
            self.outbox.fail(Failure(self.name, event.what + _after(lost), reason(err), self.later), training=False)
            return True
        if self._tries <= len(RETRY_AFTER_S):  # said for each pause of the schedule, then quiet until it answers
            every = " (and every 10 min after)" if self._tries == len(RETRY_AFTER_S) else ""
            print(
                f"hftrain: warning: {event.what} failed ({reason(err)}); trying again in {pause:.0f} s{every}, "
                f"later reports wait in order; training goes on.",
                file=sys.stderr,
                flush=True,
            )
        return False


def _after(waiting: int) -> str:
    """What waited behind the first report not sent: " and 3 reports after it"."""
    return f" and {waiting - 1} report{'s' if waiting > 2 else ''} after it" if waiting > 1 else ""


class Trackers:
    """The Trainer's tracker callbacks, each behind its own queue (rank by rank: each process reports what its
    callbacks report, usually the main one only)."""

    def __init__(self, trainer: Any, outbox: Outbox, bound_s: float):
        from transformers.integrations import integration_utils

        self.outbox, self.bound_s = outbox, bound_s
        self.queues: dict[str, TrackerQueue] = {}
        handler = trainer.callback_handler
        handler.callbacks = [
            self._wrap(cb) if type(cb).__module__ == integration_utils.__name__ else cb for cb in handler.callbacks
        ]

    def _wrap(self, callback: Any) -> QueuedReporter:
        name = tracker_name(callback)
        run_dir = self.outbox.folder.parent
        later = f"its metrics are in {RunLayout(run_dir).metrics}; " + send_later(
            f"hftrain push {run_dir} --report-to {name}"
        )
        self.queues[name] = TrackerQueue(name, self.outbox, later)
        after = {"on_train_end": _reattach(os.environ.get("MLFLOW_RUN_ID"))} if name == "mlflow" else {}
        return QueuedReporter(callback, self.queues[name], after)

    @contextmanager
    def session(self, args: Any) -> Iterator[None]:
        """Around training and the final evaluation: one MLflow run, then every queue closed within the bound."""
        ending = self._start_mlflow(args)
        status = "FAILED"
        try:
            yield
            status = "FINISHED"
        finally:
            if ending is not None:
                ending(status)
            for name, queue in self.queues.items():
                if name in FINISH:  # on the tracker's thread, whose context holds its run
                    queue.put(f"finishing the {name} run", FINISH[name])
            self.close()

    def close(self) -> None:
        deadline = time.monotonic() + 2 * self.bound_s
        for queue in self.queues.values():
            queue.stop()  # all at once: the trackers try their last reports side by side
        for queue in self.queues.values():
            queue.close(deadline)

    def _start_mlflow(self, args: Any) -> Callable[[str], None] | None:
        """Queue the start of hftrain's MLflow run on the MLflow thread; the function that queues its end."""
        queue = self.queues.get("mlflow")
        if queue is None or args.process_index != 0:
            return None
        import mlflow

        caller = mlflow.active_run()  # a notebook's own run, in this thread: attached there, left to its owner
        if caller is not None:
            queue.put("attaching to the caller's mlflow run", lambda: mlflow.start_run(run_id=caller.info.run_id))
            return None

        def start() -> None:
            # MLFLOW_RUN_ID (resume that run): the callback starts it itself and ends it with training; it is
            # attached again for the final evaluation (QueuedReporter.after), and the end below ends it
            if mlflow.active_run() is not None or os.environ.get("MLFLOW_RUN_ID"):
                return
            if os.environ.get("MLFLOW_EXPERIMENT_NAME"):
                mlflow.set_experiment(os.environ["MLFLOW_EXPERIMENT_NAME"])
            mlflow.start_run(run_name=args.run_name)

        queue.put("starting the mlflow run", start)

        def end(status: str) -> None:
            queue.put(
                "ending the mlflow run", lambda: mlflow.active_run() is not None and mlflow.end_run(status=status)
            )

        return end


def _finish_trackio() -> None:
    """The final evaluation comes after on_train_end, which finished trackio's run: the callback started another
    for it, held in this thread's context, which trackio's own exit hook (in the main thread) cannot see."""
    import trackio

    try:
        trackio.finish()
    except RuntimeError:  # no run open: nothing was logged after training
        pass


FINISH: dict[str, Callable[[], None]] = {"trackio": _finish_trackio}


def tracker_name(callback: Any) -> str:
    """The report_to name of a tracker's callback ("comet_ml" for CometCallback)."""
    from transformers.integrations import integration_utils

    names = {cls: name for name, cls in getattr(integration_utils, "INTEGRATION_TO_CALLBACK", {}).items()}
    return names.get(type(callback), type(callback).__name__.removesuffix("Callback").lower())


def _reattach(run_id: str | None) -> Callable[[], None]:
    """After the callback ended the run it resumed for MLFLOW_RUN_ID (mlflow's end_run unsets the variable): that
    run again, for the final evaluation."""

    def attach() -> None:
        import mlflow

        if run_id and mlflow.active_run() is None:
            mlflow.start_run(run_id=run_id)

    return attach


class QueuedReporter(TrainerCallback):
    """Puts each event its tracker's callback handles on the tracker's queue, with a copy of what may change;
    `after[event]` runs on the tracker's thread once the callback handled that event."""

    def __init__(self, inner: Any, queue: TrackerQueue, after: dict[str, Callable[[], None]] | None = None):
        self.inner, self.queue, self.after = inner, queue, after or {}


def _forward(event: str) -> Callable[..., Any]:
    def call(self: QueuedReporter, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        handler = getattr(type(self.inner), event, None)
        if handler is None or handler is getattr(TrainerCallback, event):
            return None  # the tracker does nothing here: nothing queued (most step events)
        state, control = copy.copy(state), copy.copy(control)  # the counters as they are now
        kwargs = {k: dict(v) if isinstance(v, dict) else v for k, v in kwargs.items()}  # logs, metrics

        def send() -> None:
            getattr(self.inner, event)(args, state, control, **kwargs)
            if event in self.after:
                self.after[event]()

        self.queue.put(
            f"reporting to {self.queue.name} at step {state.global_step}", send, droppable=event in DROPPABLE
        )
        return None

    call.__name__ = event
    return call


for _event in [name for name in vars(TrainerCallback) if name.startswith("on_")]:
    setattr(QueuedReporter, _event, _forward(_event))


def report_run(run_dir: Path, names: list[str]) -> int:
    """`hftrain push RUN --report-to NAMES`: a finished run's metrics.jsonl sent to trackers through transformers'
    own callbacks (the ones training used), as one tracker run: what a tracker that was down never received. For
    MLflow, MLFLOW_RUN_ID sends it into an existing run. The records sent."""
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations import get_reporting_integration_callbacks

    from hftrain.errors import HftrainError

    asked = f"--report-to {','.join(names)}"
    try:
        kinds = get_reporting_integration_callbacks(names)
    except ValueError as err:  # a name transformers does not know: its message lists the ones it does
        raise HftrainError(f"{asked}: {err}") from None
    source = RunLayout(Path(run_dir)).metrics
    if not source.is_file():
        raise HftrainError(
            f"{source} not found: {asked} sends a run's metrics.jsonl; give the run's directory (training.output_dir)."
        )
    try:
        callbacks = [kind() for kind in kinds]
    except (RuntimeError, ImportError) as err:  # a tracker not installed
        raise HftrainError(f"{asked}: {err}") from None
    args = TrainingArguments(output_dir=str(run_dir), report_to=names, **_run_names(Path(run_dir)))
    state, control = TrainerState(), TrainerControl()
    records = _records(source)
    try:
        for callback in callbacks:
            callback.on_train_begin(args, state, control, model=None)
        for record in records:
            state.global_step = int(record.pop("step", 0))
            record.pop("time", None)
            for callback in callbacks:
                callback.on_log(args, state, control, logs=record)
        for callback in callbacks:
            callback.on_train_end(args, state, control)
        if "wandb" in names:  # the callback leaves its run to the process's exit: this command's caller may go on
            import wandb

            wandb.finish()
    except Exception as err:
        raise HftrainError(
            f"reporting {source} to {','.join(names)} failed "
            f"({reason(err)}); run the same command again once it answers."
        ) from None
    return len(records)


def _run_names(run_dir: Path) -> dict[str, str]:
    """The run's own run_name (and trackio's project, where this transformers has it) from its saved recipe, so
    the tracker files the metrics where training would have."""
    import dataclasses

    import yaml
    from transformers import TrainingArguments

    saved = RunLayout(run_dir).final / RECIPE_FILE
    training = (
        (yaml.safe_load(saved.read_text(encoding="utf-8")) or {}).get("training") or {} if saved.is_file() else {}
    )
    known = {f.name for f in dataclasses.fields(TrainingArguments)}
    names = {key: str(training[key]) for key in ("run_name", "project") if key in known and training.get(key)}
    return {"run_name": run_dir.resolve().name, **names}


def _records(source: Path) -> list[dict[str, Any]]:
    import json

    from hftrain.errors import HftrainError

    records = []
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(dict(json.loads(line)))
        except (ValueError, TypeError):  # a line cut short by a killed run
            raise HftrainError(f"{source}, line {number}: not a JSON object; remove that line and run again.") from None
    return records
