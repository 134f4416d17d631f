"""Measuring a model: perplexity, bits per byte and tasks (text_metrics.py, `hftrain eval`), the metrics added to
every evaluation during training, and the HTML report of a run. Shipped lm-eval tasks live in tasks/."""

# `hftrain eval --metric`: text_metrics.py measures them
METRICS = ("perplexity", "bits_per_byte", "last_word_accuracy")
