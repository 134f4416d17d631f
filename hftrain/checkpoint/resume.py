"""Where a run resumes: training.resume_from_checkpoint parsed once (ResumeSetting: the latest complete
checkpoint, never, or a path) and the complete checkpoints of a run directory, newest last. The CheckpointManager
(manager.py) picks the resume point from these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftrain.checkpoint.layout import COMPLETE_MARKER, checkpoint_step


# --------------------------------------------------------------------------------------- discovery
@dataclass(frozen=True)
class ResumeSetting:
    """training.resume_from_checkpoint, read once (``of``): unset = the newest complete checkpoint if there is one;
    true = the newest, and there must be one; false = never (an earlier run is moved aside); else a checkpoint path."""

    mode: str  # newest | required | never | path
    path: Path | None = None

    @classmethod
    def of(cls, value: Any) -> ResumeSetting:
        text = str(value).lower() if isinstance(value, (bool, str)) else None
        if value is None:
            return cls("newest")
        if text == "true":
            return cls("required")
        if text == "false":
            return cls("never")
        return cls("path", Path(str(value)))

    def checkpoint_in(self, output_dir: Path) -> Path | None:
        """Without side effects: the checkpoint a run would resume (None for none), for checks before launching."""
        if self.mode == "never":
            return None
        if self.mode == "path":
            return self.path if (self.path / COMPLETE_MARKER).is_file() else None
        return latest_checkpoint(output_dir)


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest step first."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        step = checkpoint_step(child)
        if step is not None and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((step, child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None
