"""The runtime speed levers: autocast and torch.compile decided by measurement (defaults.py, probe.py), what the
device can do (hardware.py), and the profiler (profiling.py). `hftrain plan`'s estimates on paper are plan/'s."""
