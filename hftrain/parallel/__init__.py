"""Parallelism: the run's parallel dimensions resolved once (dims.py), launching processes for a backend, CPU
rehearsals of DDP/FSDP/ZeRO-3, multi-node launch scripts, and the parity checks between backends."""
