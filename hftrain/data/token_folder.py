"""Token folders in datatrove's tokenized layout, read as blocks of the run's seq_len without a tokenizer pass.

What `hftrain data prepare` writes, and what datatrove's own DocumentTokenizer writes for other tools (nanotron,
the SmolLM/FineWeb work). A folder, local or any fsspec URL (s3://bucket/tokenized/neox/):

  NNNNN_*.ds             tokens, little-endian uint16 (vocabularies up to 65,536) or uint32, documents one after
                         another, each ended by EOS (prepare with an eos_token for document masking to see them)
  NNNNN_*.ds.index       uint64 cumulative document ends, in tokens: its last entry is the file's token count
  NNNNN_*.ds.metadata    "tokenizer|token_size", the token count, the count for people
  tokenizer/             (hftrain) the tokenizer the tokens were made with
  validation/            (hftrain) held-out documents in the same layout
  logs/                  (hftrain) datatrove's logging dir: completions/NNNNN for each finished task
  prepared.json          (hftrain) written last, when every task has finished

seq_len is chosen at training: each file is cut into blocks of seq_len tokens from its start (the last < seq_len
tokens of a file are not trained on). Blocks are read by offset, so a reader reads only its own block ranges and a
resume seeks straight to its position. Opening a folder reads three small things per file (sizes, the index's last
entry, the metadata); nothing in memory grows with the folder's size but the file list.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from hftrain.errors import HftrainError
from hftrain.network import require_backend

PREPARED = "prepared.json"  # hftrain's "this folder is complete", written after every task finished
LOGS = "logs"  # datatrove's logging dir inside a folder hftrain prepares
OLD_MANIFEST = "manifest.json"  # the packed-block layout hftrain wrote before it prepared on datatrove
TASK_FILE = re.compile(r"^(?:(?P<prefix>.*?)_)??(?P<rank>\d{5})(?:_\d{5})?_(?P<step>[a-z_]+)\.ds$")


def token_dtype(token_size: int) -> np.dtype:
    return np.dtype("<u2") if token_size == 2 else np.dtype("<u4")


def token_size_for(vocab_size: int) -> int:
    """datatrove's rule: 4 bytes when ids do not fit in uint16."""
    return 4 if vocab_size > 2**16 else 2


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What makes two tokenizers give the same ids: vocabulary and special tokens."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items())
    payload = json.dumps({"vocab": vocab, "eos": tokenizer.eos_token}, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


@dataclass(frozen=True)
class TokenFile:
    name: str  # relative to the folder
    tokens: int


@dataclass(frozen=True)
class Shard:
    """Blocks [first, first + blocks) of one file, at the run's seq_len."""

    name: str
    first: int
    blocks: int


@dataclass(frozen=True)
class TokenFolder:
    """A checked folder: its files with their token counts, the token size and what the metadata says."""

    root: str
    where: str  # the recipe key, for messages
    options: dict[str, Any]
    token_size: int
    files: tuple[TokenFile, ...]
    tokenizer_name: str  # the metadata's "tokenizer" (datatrove: the name or path it was given)
    prepared: dict[str, Any] | None = None  # hftrain's prepared.json
    validation: TokenFolder | None = None  # hftrain's validation/
    tokenizer_dir: str | None = field(default=None, compare=False)

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.token_size)

    @property
    def tokens(self) -> int:
        return sum(f.tokens for f in self.files)

    def shards(self, seq_len: int) -> list[Shard]:
        return [Shard(f.name, 0, f.tokens // seq_len) for f in self.files]

    def blocks(self, seq_len: int) -> int:
        return sum(f.tokens // seq_len for f in self.files)

    def read_bytes(self, name: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of file `name` (fewer when the file has shrunk since it was opened)."""
        path = join(self.root, name)
        try:
            with fsspec.open(path, "rb", **self.options) as f:
                f.seek(start)
                return f.read(length)
        except FileNotFoundError:
            raise HftrainError(
                f"{path}: a file of the token folder is missing; restore it or prepare the data again."
            ) from None


def split_validation(folder: TokenFolder, seq_len: int, eval_blocks: int) -> tuple[list[Shard], list[Shard]]:
    """(training shards, validation shards) of a folder with no validation of its own: the last `eval_blocks`
    blocks (from its last files) are the validation set, and training never reads them."""
    shards, held, need = folder.shards(seq_len), [], min(eval_blocks, max(0, folder.blocks(seq_len) - 1))
    for i in range(len(shards) - 1, -1, -1):
        if need <= 0:
            break
        take = min(need, shards[i].blocks)
        s = shards[i]
        shards[i] = Shard(s.name, s.first, s.blocks - take)
        held.insert(0, Shard(s.name, s.first + s.blocks - take, take))
        need -= take
    return shards, held


def open_folder(root: str, options: dict[str, Any], where: str) -> TokenFolder:
    """The folder at `root`, checked: every task finished, every file whole and matching its index and metadata."""
    require_backend(root, where)
    fs, path = fsspec.core.url_to_fs(root, **options)
    try:
        listing = {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry for entry in fs.ls(path, detail=True)}
    except FileNotFoundError:
        raise HftrainError(
            f"{where}: {root} does not exist; prepare it with `hftrain data prepare RECIPE --out {root}`."
        ) from None
    if OLD_MANIFEST in listing:
        raise HftrainError(
            f"{where}: {root} holds packed blocks in the layout hftrain "
            f"wrote before it prepared on datatrove ({OLD_MANIFEST}); "
            f"hftrain no longer reads it. Prepare the data again: `hftrain data prepare RECIPE --out NEW_DIR`."
        )
    prepared = json.loads(fs.cat_file(join(path, PREPARED))) if PREPARED in listing else None
    if prepared is None and LOGS in listing:
        _refuse_unfinished(fs, path, root, where)
    names = sorted(n for n in listing if n.endswith(".ds"))
    if not names:
        raise HftrainError(
            f"{where}: no tokenized files (*.ds) in {root}; give a folder written by `hftrain data prepare` or by "
            "datatrove's DocumentTokenizer."
        )
    _refuse_interrupted_shuffles(names, root, where)
    files, sizes, tokenizer_name = [], set(), ""
    for name in names:
        file, size, tok = _check_file(fs, path, name, listing, root, where)
        files.append(file)
        sizes.add(size)
        tokenizer_name = tokenizer_name or tok
    if len(sizes) > 1:
        raise HftrainError(
            f"{where}: the files in {root} disagree on the token size ({sorted(sizes)} bytes); its files come from "
            "different tokenizers."
        )
    if prepared is not None:
        listed = {f["name"]: int(f["tokens"]) for f in prepared["files"]}
        found = {f.name: f.tokens for f in files}
        if listed != found:
            missing = sorted(set(listed) - set(found)) or sorted(n for n in listed if listed[n] != found.get(n))
            extra = sorted(set(found) - set(listed))
            what = (
                f"{', '.join(missing[:3])} missing or changed"
                if missing
                else f"{', '.join(extra[:3])} not written by the prepare"
            )
            raise HftrainError(
                f"{where}: {root} is not as `hftrain data prepare` left "
                f"it ({what}); restore it or prepare the data again."
            )
    validation = None
    if "validation" in listing and listing["validation"].get("type") == "directory":
        validation = open_folder(join(root, "validation"), options, f"{where} (its validation/)")
    tokenizer_dir = join(root, "tokenizer") if "tokenizer" in listing else None
    return TokenFolder(
        root, where, dict(options), sizes.pop(), tuple(files), tokenizer_name, prepared, validation, tokenizer_dir
    )


def _refuse_unfinished(fs: Any, path: str, root: str, where: str) -> None:
    """A folder with datatrove's logs and no prepared.json: a prepare still running, or killed."""
    try:
        executor = json.loads(fs.cat_file(join(path, f"{LOGS}/executor.json")))
        tasks = int(executor.get("world_size") or executor.get("tasks"))
    except (FileNotFoundError, ValueError, TypeError):
        tasks = None
    done = (
        {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(join(path, f"{LOGS}/completions"), detail=False)}
        if fs.isdir(join(path, f"{LOGS}/completions"))
        else set()
    )
    missing = [r for r in range(tasks or 0) if f"{r:05d}" not in done]
    said = (
        f"tasks {', '.join(map(str, missing[:5]))}{', ...' if len(missing) > 5 else ''} of {tasks} have not finished"
        if missing
        else "its last step (validation and prepared.json) has not run"
    )
    raise HftrainError(
        f"{where}: {root} is a prepare that did not finish ({said}: no {LOGS}/completions marker). Run the same "
        "`hftrain data prepare` again to finish it (only the unfinished tasks run)."
    )


def _refuse_interrupted_shuffles(names: list[str], root: str, where: str) -> None:
    """datatrove writes a task's documents unshuffled, copies them shuffled, then removes the first file: both there
    means the task stopped in between, and reading both would train on its documents twice."""
    steps: dict[tuple[str, str], set[str]] = {}
    for name in names:
        m = TASK_FILE.match(name)
        if m:
            steps.setdefault((m["prefix"] or "", m["rank"]), set()).add(m["step"])
    for (_, rank), kinds in sorted(steps.items()):
        if "unshuffled" in kinds and len(kinds) > 1:
            raise HftrainError(
                f"{where}: task {int(rank)} of {root} did not finish (both its unshuffled and its shuffled files are "
                "there); run the prepare again to finish it."
            )


def _check_file(
    fs: Any, path: str, name: str, listing: dict[str, Any], root: str, where: str
) -> tuple[TokenFile, int, str]:
    """One .ds file with its index and metadata: (the file, its token size, the metadata's tokenizer)."""
    here = join(root, name)
    for ext in (".index", ".metadata"):
        if name + ext not in listing:
            raise HftrainError(
                f"{where}: {here} has no {name}{ext}: the task that wrote it did not finish (or the file was copied "
                "alone); run the prepare again."
            )
    try:
        head, count = fs.cat_file(join(path, name + ".metadata")).decode().splitlines()[:2]
        tokenizer_name, _, size_text = head.rpartition("|")
        token_size, expected = int(size_text), int(count)
    except (ValueError, UnicodeDecodeError):
        raise HftrainError(
            f"{where}: {here}.metadata is not datatrove's metadata (tokenizer|token_size, token count); prepare again."
        ) from None
    if token_size not in (2, 4):
        raise HftrainError(f"{where}: {here}.metadata says {token_size}-byte tokens; datatrove writes 2 or 4.")
    size = int(listing[name]["size"])
    if size % token_size:
        raise HftrainError(
            f"{where}: {here} is truncated ({size} bytes is not a "
            f"whole number of {token_size}-byte tokens); prepare again."
        )
    tokens = size // token_size
    index_size = int(listing[name + ".index"]["size"])
    if index_size % 8:
        raise HftrainError(
            f"{where}: {here}.index is truncated ({index_size} bytes "
            "is not a whole number of uint64 ends); prepare again."
        )
    last = (
        int(np.frombuffer(fs.cat_file(join(path, name + ".index"), start=index_size - 8, end=index_size), "<u8")[0])
        if index_size
        else 0
    )
    if last != tokens or expected != tokens:
        cut = tokens < max(last, expected)
        raise HftrainError(
            f"{where}: {here} {'is truncated' if cut else 'does not match its index'}: it holds {tokens:,} tokens, its "
            f"index ends at {last:,} and its metadata says {expected:,}; prepare again (or restore the file)."
        )
    return TokenFile(name, tokens), token_size, tokenizer_name


def check_tokenizer(folder: TokenFolder, tokenizer: Any) -> str | None:
    """Refuse a folder made with another tokenizer: the token size, then hftrain's fingerprint (prepared.json or
    the metadata) or the tokenizer.json the metadata names. Returns a note when its tokenizer cannot be told apart
    (a hub name): the stream then checks every id against the vocabulary."""
    vocab, where = len(tokenizer), folder.where
    fix = (
        f"Use tokenizer.path: {folder.tokenizer_dir} (copied locally if remote)"
        if folder.tokenizer_dir
        else "Use the tokenizer it was made with"
    )
    if folder.token_size != token_size_for(vocab):
        raise HftrainError(
            f"{where}: {folder.root} holds {folder.token_size}-byte tokens, but the recipe's tokenizer has {vocab:,} "
            f"ids ({token_size_for(vocab)}-byte tokens): it was made "
            f"with another tokenizer. {fix}, or prepare the data again."
        )
    theirs = (folder.prepared or {}).get("tokenizer", {}).get("fingerprint")
    if theirs is None and folder.tokenizer_name.startswith("hftrain:"):
        theirs = folder.tokenizer_name.split(":", 1)[1]
    if theirs is None:
        import os

        if os.path.isfile(folder.tokenizer_name):
            from transformers import PreTrainedTokenizerFast

            theirs = tokenizer_fingerprint(
                PreTrainedTokenizerFast(tokenizer_file=folder.tokenizer_name, eos_token=tokenizer.eos_token)
            )
    if theirs is None:
        return (
            f"{where}: {folder.root} was tokenized with {folder.tokenizer_name or 'an unnamed tokenizer'!r}, which "
            "hftrain cannot compare with the recipe's; every token id read is checked against its vocabulary."
        )
    if theirs != tokenizer_fingerprint(tokenizer):
        raise HftrainError(
            f"tokenizer: not the tokenizer the data in {folder.root} was tokenized with (fingerprint {theirs}). {fix}, "
            "or prepare the data again with this tokenizer."
        )
    return None
