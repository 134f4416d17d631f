"""hftrain's cache: what it measured or read once per machine and library versions (the speed probe, the parsed
built-in corpus, the training libraries' memory, transformers' TrainingArguments fields), in HFTRAIN_CACHE_DIR, else
~/.cache/hftrain.

A cache is only ever a shortcut: an unreadable or partial file reads as missing, a file that cannot be written
(a read-only home) is not kept, and a concurrent process never reads half a file (written aside, then renamed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    return Path(os.environ.get("HFTRAIN_CACHE_DIR") or Path.home() / ".cache" / "hftrain")


def read_json(name: str) -> Any:
    """The cached JSON file `name`, or None when it is missing or unreadable."""
    try:
        return json.loads((cache_dir() / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_json(name: str, value: Any, indent: int | None = None) -> None:
    """Keep `value` as `name`, whole or not at all."""
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(value, indent=indent), encoding="utf-8")
        os.replace(partial, path)
    except OSError:
        pass  # a read-only home: measured or read again next time
