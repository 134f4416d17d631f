"""One training run: its steps top to bottom (run.py), the Trainer and its callbacks, TrainingArguments, run length,
step metrics and timing, the non-finite guard, and what a finished run leaves behind."""
