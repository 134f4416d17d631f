"""Saved state: the CheckpointManager (staging, completion marker, rotation), the run directory's layout, weights in and
out, resuming on another process count (elastic), LoRA adapters, node-local disks and the output directory's owner.
Exporting a checkpoint for use elsewhere is export/'s."""
