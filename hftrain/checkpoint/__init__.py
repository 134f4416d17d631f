"""Saved state: the CheckpointManager (staging, completion marker, rotation), the run directory's layout, weights in and
out, resuming on another process count (elastic), LoRA adapters, and export to one standard model directory."""
