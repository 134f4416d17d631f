"""Reading the files a run leaves behind (JSON state, safetensors weights) so that a truncated, corrupt or
placeholder file is a one-line message naming it, never a raw JSONDecodeError or SafetensorError from deep inside.

``read_json`` is for every JSON file hftrain reads back (trainer_state.json, results.json, data positions);
``check_safetensors`` looks at a weights file's header and size before anything hands it to safetensors or
transformers: a git-lfs pointer (a repository cloned without `git lfs pull`) and a truncated copy are named.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from hftrain.errors import HftrainError

LFS_POINTER = b"version https://git-lfs.github.com/spec/"


class CorruptFile(HftrainError):
    """A file hftrain (or the Trainer) wrote cannot be read back: truncated, corrupt or a placeholder."""


def read_json(path: Path, what: str = "") -> Any:
    """The JSON in `path`; a file cut short or otherwise not JSON raises CorruptFile naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        problem = f"not UTF-8 text (byte {err.start})"
    except json.JSONDecodeError as err:
        problem = f"not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
    kind = f" ({what})" if what else ""
    raise CorruptFile(f"{path}{kind}: {problem}; the file is truncated or corrupt. Restore it, or remove its folder.")


def check_safetensors(path: Path) -> None:
    """Raise CorruptFile unless `path` is a complete safetensors file (header readable, every tensor's bytes there)."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(len(LFS_POINTER)) == LFS_POINTER:
            raise CorruptFile(
                f"{path}: a git-lfs pointer, not the weights (the repository was cloned without its LFS files). "
                "Run `git lfs pull` in that repository, or download the model again."
            )
        f.seek(0)
        head = f.read(8)
        if len(head) < 8:
            raise CorruptFile(f"{path}: {size} bytes, too short for a safetensors file; it is truncated. Copy or download it again.")
        (header_len,) = struct.unpack("<Q", head)
        header = f.read(header_len) if header_len <= min(size, 100_000_000) else b""
    try:
        meta = json.loads(header)
        end = max((int(v["data_offsets"][1]) for k, v in meta.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError):
        raise CorruptFile(
            f"{path}: not a readable safetensors file (its header is damaged or cut short). Copy or download it again."
        ) from None
    if 8 + header_len + end > size:
        raise CorruptFile(f"{path}: truncated ({size:,} bytes of {8 + header_len + end:,}). Copy or download it again.")


def check_weights(directory: Path) -> None:
    """check_safetensors for every model*.safetensors / adapter_model.safetensors in a local model directory."""
    for file in sorted(Path(directory).glob("*.safetensors")):
        check_safetensors(file)
