"""One training run: its steps top to bottom (run.py) from its resolved spec (resolve.py), the Trainer and its
callbacks (trainer.py, callbacks.py), TrainingArguments (arguments.py), the objective (objectives.py, preference.py),
step metrics, timing and flags (step_*.py, input_check.py), the non-finite guard (nonfinite.py), and what a finished
run leaves behind (results.py, run_record.py, plot.py)."""
