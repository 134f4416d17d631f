"""Sources: turn one recipe `Source` into a resumable stream of documents.

A source is a list of *shards* (files, or one streamed dataset) and a reader per format. Every document (or
piece of a long one: text_pieces.py) comes with the position just after it, so a stream can restart there
without re-reading what came before: a byte offset in plain text/JSONL, a row in parquet, a record count in
compressed JSONL or streamed data.
Files are opened through fsspec, so local paths, file://, s3://, gs:// and other fsspec URLs share one code path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import fsspec

from hftrain import network
from hftrain.data import jsonl
from hftrain.data.builtin_corpus import module_docstrings, python_docs_files
from hftrain.data.shares import ShardSlice, span
from hftrain.data.text_pieces import Record, record_pieces, text_pieces
from hftrain.errors import HftrainError, as_user_error
from hftrain.recipe.data_section import Source, data_kind

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}


class BadRecords:
    """Malformed records and unreadable shards: raise naming the file and line (fail), or count them (skip)."""

    def __init__(self, mode: str):
        self.mode = mode
        self.skipped = 0

    @property
    def fails(self) -> bool:
        """A bad record raises (its message is shown) rather than being counted."""
        return self.mode == "fail"

    def __call__(self, where: str, problem: str, fix: str) -> None:
        if self.mode == "fail":
            raise HftrainError(
                f"{where}: {problem}. {fix}, or set data.on_bad_record=skip to skip and count such records."
            )
        self.skipped += 1


def shard_problem(err: BaseException) -> str | None:
    """Sort a read error: 'missing', 'changed' or 'corrupt' shard (final), 'transient' (retry), or None (not ours)."""
    import gzip
    import zlib

    if isinstance(err, HftrainError):
        return None
    if isinstance(err, FileNotFoundError):
        return "missing"
    if type(err).__name__ == "FileExpired":  # s3fs: the object's ETag changed since it was listed
        return "changed"
    corrupt: tuple[type[BaseException], ...] = (gzip.BadGzipFile, EOFError, zlib.error)
    try:
        import pyarrow
        import zstandard

        corrupt += (zstandard.ZstdError, pyarrow.ArrowInvalid)
    except ImportError:
        pass
    if isinstance(err, corrupt):
        return "corrupt"
    transient: tuple[type[BaseException], ...] = (OSError, ConnectionError, TimeoutError)
    try:
        import aiohttp
        import botocore.exceptions

        transient += (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, aiohttp.ClientError)
    except ImportError:
        pass
    gcs_retry = sys.modules.get("gcsfs.retry")  # only loaded (and only the cause) when reading gs://
    if gcs_retry is not None:
        if isinstance(err, gcs_retry.HttpError):  # 5xx and throttling are worth retrying; 4xx are not
            return "transient" if err.code in (408, 429) or (err.code or 0) >= 500 else None
        transient += (gcs_retry.ChecksumError,)
    return "transient" if isinstance(err, transient) else None


def _split_compression(path: str) -> tuple[str, str | None]:
    for suffix, codec in COMPRESSION.items():
        if path.endswith(suffix):
            return path[: -len(suffix)], codec
    return path, None


def file_format(path: str, declared: str) -> str:
    if declared != "auto":
        return declared
    stem, _ = _split_compression(path.lower())
    if data_kind(declared) != "text" or stem.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if stem.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "txt"


def _readable(path: str, fmt: str) -> bool:
    stem, _ = _split_compression(path.lower())
    return stem.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES) or fmt != "auto"


def list_shards(source: Source, where: str) -> list[str]:
    """The files of a path/glob/directory source, sorted (or the stdlib modules for builtin: python-docs)."""
    return [name for name, _ in list_shard_sizes(source, where)]


def list_shard_sizes(source: Source, where: str) -> list[tuple[str, int]]:
    """(file, bytes) for each shard of a source, sorted by name; sizes come from the listing itself (no request
    per file). A streamed dataset is one shard of unknown size (0)."""
    if source.builtin == "python-docs":
        return [(name, os.path.getsize(name)) for name in python_docs_files()]
    if source.dataset is not None:
        return [(source.dataset, 0)]
    path = source.path
    assert path is not None
    network.require_backend(path, f"{where}.path")
    try:
        fs, _, _ = fsspec.get_fs_token_paths(
            path, storage_options=network.storage_options_with_timeouts(path, source.storage_options) or None
        )
        protocol = path.split("://", 1)[0] + "://" if "://" in path else ""
        if fs.isdir(path):
            listed = {p: info for p, info in fs.find(path, detail=True).items() if info.get("type") != "directory"}
        elif any(ch in path for ch in "*?["):
            listed = {p: info for p, info in fs.glob(path, detail=True).items() if info.get("type") != "directory"}
        else:
            listed = {path: fs.info(path)} if fs.exists(path) else {}
            found = list(listed)  # a file named on its own is read whatever its extension
        if fs.isdir(path) or any(ch in path for ch in "*?["):
            found = [p for p in listed if _readable(p, source.format)]
            _check_extensions(list(listed), found, path, where)
    except FileNotFoundError:  # e.g. gcsfs listing a bucket that does not exist
        found = []
    except (OSError, ValueError, ImportError, TypeError) as err:
        known = as_user_error(err, network.bound())  # a silent or refused endpoint says so
        if known is not None:
            raise HftrainError(f"{where}.path: cannot list {path!r}: {known}") from None
        raise HftrainError(
            f"{where}.path: cannot list {path!r} ({err}). Check the path, the endpoint and the credentials."
        ) from None
    if not found:
        raise HftrainError(
            f"{where}.path: no file matches {path!r}. Check the path (relative paths start at the current directory)."
        )
    named = ((p if "://" in p or not protocol else protocol + p, int(listed[p].get("size") or 0)) for p in found)
    return sorted(named)


def splittable(source: Source, shard: str) -> bool:
    """Whether readers can start inside this shard: an uncompressed JSONL file (at a line), a parquet file
    (at a row). Compressed files, a text file's documents and streamed datasets are read from their start."""
    if source.path is None or _split_compression(shard.lower())[1] is not None:
        return False
    return file_format(shard, source.format) in ("jsonl", "parquet")


def lines_in_every_part(source: Source, shard: str, size: int | None, count: int) -> bool:
    """Whether readers can take a byte range each of this shard (jsonl.ranges_hold_lines); other splittable
    formats split at rows or blocks and always can."""
    if not _reads_as_jsonl(source, shard):
        return True
    return jsonl.ranges_hold_lines(
        shard, network.storage_options_with_timeouts(shard, source.storage_options), size, count
    )


def _reads_as_jsonl(source: Source, shard: str) -> bool:
    """A JSON record per line: text records (.jsonl or format: jsonl) or examples (prompt_completion, chat)."""
    return data_kind(source.format) != "text" or file_format(shard, source.format) == "jsonl"


def _check_extensions(listed: list[str], found: list[str], path: str, where: str) -> None:
    """A directory or glob reads only files with a known extension; say so when that leaves nothing."""
    if listed and not found:
        sample = ", ".join(
            sorted(
                {"." + p.rsplit(".", 1)[-1] if "." in p.rsplit("/", 1)[-1] else p.rsplit("/", 1)[-1] for p in listed}
            )[:5]
        )
        raise HftrainError(
            f"{where}.path: {path!r} matches {len(listed)} file(s) ({sample}) but none with a known extension "
            f"({', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)}, optionally compressed); "
            f"set {where}.format to read them anyway."
        )


def read_shard(
    source: Source,
    shard: str,
    pos: tuple[int, ...],
    bad: BadRecords,
    part: ShardSlice | None = None,
    size: int | None = None,
) -> Iterator[Record]:
    """Documents (or pieces of long ones) of one shard from `pos` on ((0, 0) for the start, else a previous
    Record's pos). `part`: only this reader's part of a splittable shard of `size` bytes (shares.py)."""
    if source.builtin == "python-docs":
        if pos[1] == 0:
            yield Record(module_docstrings(shard), (1, 1))
        return
    if source.dataset is not None:
        yield from _read_dataset(source, pos)
        return
    options, codec = source.storage_options, _split_compression(shard)[1]
    if _reads_as_jsonl(source, shard):
        take = _example_reader(source) if data_kind(source.format) != "text" else _text_reader(source.text_field)
        yield from jsonl.read_jsonl(_open(shard, options), shard, codec, take, pos, bad, part, size)
    elif file_format(shard, source.format) == "parquet":
        yield from _read_parquet(_open(shard, options), shard, source.text_field, pos, bad, part)
    else:
        with _open(shard, options) as f:
            yield from text_pieces(
                f,
                codec is None,
                pos,
                source.document_boundary,
                lambda problem: bad(shard, problem, "Convert it to UTF-8 text or remove it"),
            )


def _open(shard: str, options: dict[str, Any]) -> Any:
    return fsspec.open(
        shard, mode="rb", compression="infer", **network.storage_options_with_timeouts(shard, options)
    ).open()


def _text_reader(field: str) -> Any:
    def take(obj: Any) -> tuple[Any, str | None]:
        text = obj.get(field) if isinstance(obj, dict) else None
        if isinstance(text, str):
            return text, None
        keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
        return None, f"no string field {field!r} (has: {keys})"

    return take


def _example_reader(source: Source) -> Any:
    """prompt_completion -> {"prompt", "completion"}; chat -> {"messages": [{role, content}, ...]};
    preference -> {"prompt", "chosen", "rejected"} (strings, or message lists; the prompt may be absent from a
    conversation, and TRL's extract_prompt then takes the turns the two share)."""

    def take(obj: Any) -> tuple[Any, str | None]:
        if not isinstance(obj, dict):
            return None, f"not a JSON object ({type(obj).__name__})"
        if source.format == "preference":
            return _preference(obj, source)
        if source.format == "prompt_completion":
            p, c = obj.get(source.prompt_field), obj.get(source.completion_field)
            if isinstance(p, str) and isinstance(c, str):
                return {"prompt": p, "completion": c}, None
            return (
                None,
                f"needs string fields {source.prompt_field!r} and {source.completion_field!r} (has: {', '.join(obj)})",
            )
        messages = obj.get(source.messages_field)
        ok = (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in messages)
        )
        if ok and any(m["role"] == "assistant" for m in messages):
            return {"messages": messages}, None
        return None, f"needs {source.messages_field!r}: a list of {{role, content}} with at least one assistant message"

    return take


def _messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in value
        )
    )


def _preference(obj: dict[str, Any], source: Source) -> tuple[Any, str | None]:
    """One preference pair, or what is wrong with it."""
    p, c, r = obj.get(source.prompt_field), obj.get(source.chosen_field), obj.get(source.rejected_field)
    fields = f"{source.prompt_field!r}, {source.chosen_field!r} and {source.rejected_field!r}"
    if isinstance(c, str) and isinstance(r, str):
        if isinstance(p, str):
            return {"prompt": p, "chosen": c, "rejected": r}, None
        return (
            None,
            f"needs a string {source.prompt_field!r} beside string {source.chosen_field!r} and "
            f"{source.rejected_field!r} (has: {', '.join(obj) or 'nothing'})",
        )
    if _messages(c) and _messages(r) and (p is None or _messages(p)):
        pair = {"chosen": c, "rejected": r}
        return (pair if p is None else {"prompt": p, **pair}), None
    return None, (
        f"needs {fields}: three strings, or message lists of {{role, content}} (the prompt list optional) "
        f"(has: {', '.join(obj) or 'nothing'})"
    )


def _read_parquet(
    f: Any, shard: str, field: str, pos: tuple[int, ...], bad: BadRecords, part: ShardSlice | None = None
) -> Iterator[Record]:
    """pos[0]: the row index of the next row (row groups before it are not read); pos[2], when given, the
    characters of that row's text read already. `part`: only this reader's range of rows."""
    import pyarrow.parquet as pq

    skip = pos[2] if len(pos) > 2 else 0
    with f:
        pf = pq.ParquetFile(f)
        if field not in pf.schema_arrow.names:
            bad(
                shard,
                f"no column {field!r} (has: {', '.join(pf.schema_arrow.names)})",
                "Set text_field on this source to the right column",
            )
            return
        first, stop = span(part, pf.metadata.num_rows)
        offset = max(pos[0], first)
        start = 0
        for group in range(pf.num_row_groups):
            rows = pf.metadata.row_group(group).num_rows
            if start >= stop:
                return
            if start + rows <= offset:
                start += rows
                continue
            column = pf.read_row_group(group, columns=[field]).column(0).to_pylist()
            for i, text in enumerate(column):
                row = start + i
                if row >= stop:
                    return
                if row < offset:
                    continue
                if isinstance(text, str):
                    if not text.strip():
                        continue
                    yield from record_pieces(text, (row, row), (row + 1, row + 1), skip if row == offset else 0)
                else:
                    bad(f"{shard} (row {row})", f"{field!r} is not a string", "Clean that row")
            start += rows


def _read_dataset(source: Source, pos: tuple[int, ...]) -> Iterator[Record]:
    """A Hugging Face dataset streamed with `datasets`; pos[1] = records already read (skipped by streaming),
    pos[2] when given: characters of the next record's text read already."""
    import datasets

    offset, skip = pos[1], (pos[2] if len(pos) > 2 else 0)
    try:
        stream = datasets.load_dataset(source.dataset, source.dataset_config, split=source.split, streaming=True)
    except Exception as err:  # datasets raises many types for "not found / no network"
        raise HftrainError(f"data: cannot open dataset {source.dataset!r} ({str(err).splitlines()[0]}).") from None
    take = _example_reader(source) if data_kind(source.format) != "text" else None
    for index, row in enumerate(stream.skip(offset) if offset else stream, start=offset):
        if take is not None:  # an example or a pair: one record, never cut
            example, problem = take(dict(row))
            if problem is not None:
                raise HftrainError(
                    f"data: dataset {source.dataset!r} row {index}: {problem}. "
                    "Set the source's field names, or fix that row."
                )
            yield Record(example, (index + 1, index + 1))
            continue
        text = row.get(source.text_field)
        if not isinstance(text, str):
            raise HftrainError(
                f"data: dataset {source.dataset!r} row {index} has no string field {source.text_field!r} "
                f"(has: {', '.join(row)}). Set text_field on this source."
            )
        yield from record_pieces(text, (index, index), (index + 1, index + 1), skip if index == offset else 0)
