"""The record of a checkpoint's files in its completion marker, and the check of a checkpoint against it.

Every format the Trainer writes (one model.safetensors, FSDP's ``*.distcp`` shards, ZeRO-3's per-rank partitions,
a LoRA adapter) is a set of files whose loaders fail late, on every rank and with their own tracebacks (an
EOFError from a cut-short shard). So when a checkpoint (or final/) is published, once every process has written
its part, the publisher lists the directory into the marker: every file's size, and a sha256 for files under
``CHECKSUM_LIMIT`` (the JSON state, DeepSpeed's ``latest``, ``.metadata``, RNG and scheduler state), which are
cheap to hash, unlike gigabytes of weights at every save. ``check_files`` compares a checkpoint against that record
before resume or export: a missing, cut-short or changed file is one message naming it.

The record is keyed by who listed it (``rank0``): with a shared file system one process lists every rank's
files; with an output directory per node (node_disks.py), each node lists its own copy (``node1``), every node's
marker holds the merged record and names its own part (``lister``), and a node checks that part alone. Files added after
publishing (a ZeRO-3 ``universal/`` conversion) are not in the record and are not checked. Markers written by older
hftrain have no record: ``check_files`` accepts them and the content checks (``unreadable`` below) judge them alone.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hftrain.checkpoint.files import CorruptFile, read_json
from hftrain.checkpoint.layout import COMPLETE_MARKER, DATA_STATE_GLOB, TRAINER_STATE_FILE
from hftrain.errors import HftrainError

RECORD = "files"  # the marker's key: {lister: {relative path: {"size": bytes, "sha256": hex (small files only)}}}
CHECKSUM_LIMIT = 1 << 20  # bytes: files below this get a sha256 as well as a size


def lister(rank: int | None = None) -> str:
    """The name a record is filed under: the listing process's global rank (the launcher's RANK by default)."""
    return f"rank{os.environ.get('RANK', '0') if rank is None else rank}"


def list_files(directory: Path) -> dict[str, dict[str, Any]]:
    """{path relative to `directory` ("/"-separated): {"size": bytes[, "sha256": hex]}} for every file below it,
    the marker excepted; sha256 only for files smaller than CHECKSUM_LIMIT."""
    found: dict[str, dict[str, Any]] = {}
    for parent, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = Path(parent, name)
            relative = path.relative_to(directory).as_posix()
            if relative == COMPLETE_MARKER or not path.is_file():
                continue
            size = path.stat().st_size
            found[relative] = {"size": size, "sha256": _sha256(path)} if size < CHECKSUM_LIMIT else {"size": size}
    return found


def record(directory: Path, rank: int | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """This process's record of `directory` (for the marker's RECORD key)."""
    return {lister(rank): list_files(directory)}


def merge(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One record from several listers' (e.g. the list gather_object returns); a lister that lists nothing gives {}."""
    merged: dict[str, Any] = {}
    for one in records:
        merged.update(one or {})
    return merged


def recorded(checkpoint: Path) -> list[tuple[str, int, str | None]] | None:
    """(relative path, size, sha256 or None) of every file any lister in `checkpoint`'s marker recorded, each once;
    None without a record (a marker written by older hftrain, or a model directory hftrain did not write)."""
    if not (checkpoint / COMPLETE_MARKER).is_file():
        return None
    marker = read_json(checkpoint / COMPLETE_MARKER, "the completion marker")
    files = marker.get(RECORD) if isinstance(marker, dict) else None
    if files is None:
        return None
    entries: set[tuple[str, int, str | None]] = set()
    try:
        here = marker.get("lister")  # a node's own disk (node_disks.py): the part of the record on it
        for listed in [files[here]] if here else files.values():
            for relative, entry in listed.items():
                size, digest = entry["size"], entry.get("sha256")
                if not relative or not isinstance(size, int) or not isinstance(digest, (str, type(None))):
                    raise TypeError(relative)
                entries.add((relative, size, digest))
    except (AttributeError, TypeError, KeyError):
        raise CorruptFile(
            f"{checkpoint / COMPLETE_MARKER}: its record of the checkpoint's files is damaged. "
            "Restore the checkpoint from a copy, or remove it."
        ) from None
    return sorted(entries, key=lambda e: (e[0], e[1], e[2] or ""))


def check_files(checkpoint: Path) -> None:
    """Raise CorruptFile naming the first file of `checkpoint` that is missing, cut short or changed since its
    marker recorded it (sizes; sha256 where recorded). Nothing to check without a record (older hftrain)."""
    for relative, size, digest in recorded(checkpoint) or []:
        path = checkpoint.joinpath(*relative.split("/"))
        what = _difference(path, size, digest)
        if what is not None:
            raise CorruptFile(
                f"{path}: {what}. The checkpoint is damaged: restore "
                "the file from a copy, or use an earlier checkpoint."
            )


def _difference(path: Path, want: int, digest: str | None) -> str | None:
    """What is wrong with `path` against its record, in words (None: it matches)."""
    if not path.is_file():
        return f"missing ({COMPLETE_MARKER} lists it, {want:,} bytes)"
    size = path.stat().st_size
    if size < want:
        return f"truncated ({size:,} bytes of {want:,} recorded in {COMPLETE_MARKER})"
    if size > want:
        return f"{size:,} bytes, but {COMPLETE_MARKER} recorded {want:,}: it changed after the save"
    if digest is not None and _sha256(path) != digest:
        return f"changed after the save (its sha256 differs from the one recorded in {COMPLETE_MARKER})"
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------ whether a checkpoint reads back


def step_of(checkpoint: Path) -> int:
    """The optimizer step a checkpoint was written at (from the Trainer's state file)."""
    return int(read_json(checkpoint / TRAINER_STATE_FILE, "the Trainer's state")["global_step"])


def unreadable(checkpoint: Path) -> str | None:
    """Why a complete checkpoint's files cannot be read back (None when they can): first every file against the
    record in its marker (integrity.py: any format, FSDP shards and ZeRO partitions included), then the Trainer's
    state, the data positions, the weights (safetensors header and size) and the optimizer/scheduler/RNG archives."""
    import zipfile

    from hftrain.checkpoint.files import check_safetensors

    try:
        check_files(checkpoint)
        step_of(checkpoint)
        for state in sorted(checkpoint.glob(DATA_STATE_GLOB)):
            read_json(state)
        for weights in sorted(checkpoint.glob("*.safetensors")):
            check_safetensors(weights)
        for archive in sorted(checkpoint.glob("*.pt")) + sorted(checkpoint.glob("*.pth")):
            zipfile.ZipFile(archive).close()  # torch.save's format: a cut-short file has no central directory
    except (CorruptFile, KeyError, ValueError, zipfile.BadZipFile, OSError) as err:
        text = str(err) if isinstance(err, CorruptFile) else f"{type(err).__name__}: {err}"
        return text.replace(f"{checkpoint}{os.sep}", "").split(". ")[0]
    return None


def loadable(path: Path) -> Path:
    """training.resume_from_checkpoint's explicit `path`, refused (one message) unless it is a complete checkpoint
    whose files read back: there is no other checkpoint to fall back to."""
    if not (path / COMPLETE_MARKER).is_file():
        raise HftrainError(f"training.resume_from_checkpoint: {path} is not a complete hftrain checkpoint.")
    problem = unreadable(path)
    if problem is not None:
        raise HftrainError(f"training.resume_from_checkpoint: {path} cannot be loaded ({problem}).")
    return path
