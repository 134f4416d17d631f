"""Speed and size: measured speed defaults (autocast, compile), the step probe, the device's peak, `hftrain plan`'s
estimates, and the profiler."""
