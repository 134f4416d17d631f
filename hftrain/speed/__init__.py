"""The runtime speed levers: autocast and torch.compile decided by measurement (defaults.py, probe.py), FP8 matmuls
through torchao (fp8.py, opt-in), what the device can do (hardware.py), and the profiler (profiling.py). `hftrain
plan`'s estimates on paper are planning/'s."""
