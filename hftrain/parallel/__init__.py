"""The parallel plan: the run's parallel dimensions resolved once (dims.py: strategy, processes, batch, readers) and
the CPU rehearsals of DDP/FSDP/ZeRO-3 in gloo processes (rehearsal.py). Starting the processes is launch/'s."""
