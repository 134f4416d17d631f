"""Measuring a model: perplexity, bits per byte and tasks (text_metrics.py, `hftrain eval`), the metrics added to
every evaluation during training, and the HTML report of a run. Shipped lm-eval tasks live in tasks/."""
