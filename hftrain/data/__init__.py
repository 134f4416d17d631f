"""Training data: sources (files, fsspec URLs, HF datasets, built-in text), the run's reading order (logical readers,
shares), tokenizing and packing into fixed-length blocks, instruction data, and prepared (pre-tokenized) shards."""
