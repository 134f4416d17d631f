"""One training run: its builds top to bottom (run.py) from its resolved spec (resolve.py: each component's
part), the Trainer (trainer.py) with its callbacks, made in one function (trainer_build.py), what a step measures
(step_metrics.py) and its faults, agreed by every process (step_faults.py: the non-finite guard, preemption signals),
TrainingArguments (arguments.py), the objective (objectives.py, dpo.py), the input check before step 1 (input_check.py),
and what a finished run leaves behind (results.py, run_record.py, plot.py)."""
