"""Reading the files a run leaves behind (JSON state, safetensors weights) so that a truncated, corrupt or
placeholder file is a one-line message naming it, never a raw JSONDecodeError or SafetensorError from deep inside;
and writing a file where a user points (`write_new_file`), which changes nothing hftrain did not write.

``read_json`` is for every JSON file hftrain reads back (trainer_state.json, results.json, data positions);
``check_safetensors`` looks at a weights file's header and size before anything hands it to safetensors or
transformers: a git-lfs pointer (a repository cloned without `git lfs pull`) and a truncated copy are named.
"""

from __future__ import annotations

import json
import os
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
            raise CorruptFile(
                f"{path}: {size} bytes, too short for a safetensors file; it is truncated. Copy or download it again."
            )
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


def write_new_file(path: Path, text: str, flag: str, replace: bool = False, executable: bool = False) -> Path:
    """Write `text` to the file a user named with `flag` (e.g. "--out"): as a new regular file, created with its
    mode (a script executable, as the umask allows), or, with `replace` (the user said so: --force), in place of a
    regular file by one rename, which leaves the old file's inode, its other links and their mode as they were.
    Anything else that exists there (a device such as /dev/null, a FIFO, a directory, a link) is refused: hftrain
    never writes through it nor changes its mode. The text is whole before the name appears."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        kind = "a link" if path.is_symlink() else "a directory" if path.is_dir() else "not a regular file"
        raise HftrainError(f"{flag} {path}: exists and is {kind}; give the name of a new file.")
    if path.exists() and not replace:
        raise HftrainError(f"{flag} {path}: exists; give a new file name, or add --force to replace it.")
    if not path.parent.is_dir():
        raise HftrainError(f"{flag} {path}: its folder {path.parent} does not exist; create it or give another path.")
    staged = path.with_name(f".{path.name}.hftrain-{os.getpid()}")
    descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777 if executable else 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as f:
            f.write(text)
        if replace:
            os.replace(staged, path)
        else:
            _link_new(staged, path, flag)
    finally:
        staged.unlink(missing_ok=True)
    return path


def _link_new(staged: Path, path: Path, flag: str) -> None:
    """Give `staged` the name `path` only if nothing has it (a hard link fails where a name exists; a file system
    without hard links gets the rename, after a last look)."""
    try:
        os.link(staged, path)
    except FileExistsError:
        raise HftrainError(f"{flag} {path}: appeared while it was being written; give a new file name.") from None
    except OSError:
        if path.exists() or path.is_symlink():
            raise HftrainError(f"{flag} {path}: appeared while it was being written; give a new file name.") from None
        os.replace(staged, path)
