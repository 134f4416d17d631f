"""One experiment-tracker run per training run.

Trackers are the Trainer's own integrations (`training.report_to`); hftrain adds only this. transformers' MLflow
callback ends its run when training ends, so hftrain's final evaluation (after training) would open a second,
separate run. A run started here first is one the callback leaves open (it ends only runs it started itself);
it is ended here once the final evaluation is logged: FINISHED, or FAILED when the run raised.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def one_run(args: Any) -> Iterator[None]:
    """Keep one MLflow run open around training and the final evaluation (main process, report_to mlflow)."""
    if "mlflow" not in (args.report_to or []) or args.process_index != 0:
        yield
        return
    import mlflow

    if mlflow.active_run() is not None:  # the caller's own run (a notebook): theirs to end
        yield
        return
    if os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        mlflow.set_experiment(os.environ["MLFLOW_EXPERIMENT_NAME"])
    run_id = os.environ.get("MLFLOW_RUN_ID")
    mlflow.start_run(run_id=run_id, run_name=None if run_id else args.run_name)
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    finally:
        mlflow.end_run(status=status)
