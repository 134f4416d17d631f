"""Text that is on every machine with Python: the docstrings of the standard library.

Used by the quickstart so that training needs no download. One document per module: its module, class and
function docstrings joined by blank lines. The text is the CPython standard library's, under the Python
Software Foundation License; which modules exist depends on the Python version.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

# Trees that are tests, demos or tooling rather than library documentation.
_SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "turtledemo",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib2to3",
    "ensurepip",
}


def python_docs_files() -> list[str]:
    """The standard library's .py files, sorted, so the corpus order is the same on every run."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(str(p) for p in files)


def module_docstrings(path: str) -> str:
    """All docstrings of one module, in source order ('' for a module without any, or that does not parse); from
    this machine's copy of the corpus (`corpus_copy`) when the module is in it."""
    copied = corpus_copy().get(path)
    return copied if copied is not None else _parse(path)


@functools.lru_cache(maxsize=1)
def corpus_copy() -> dict[str, str]:
    """Every module's docstrings, parsed once per machine and Python and kept beside the speed probe's cache
    (HFTRAIN_CACHE_DIR, else ~/.cache/hftrain): parsing the whole standard library takes seconds, and a run reads
    the corpus three times before its first step (tokenizer, validation set, first shuffle window), in every
    process. A changed standard library (new files, sizes or times) gets a new copy."""
    from hftrain import _cache

    files = python_docs_files()
    stamp = json.dumps([sys.version, *((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files)])
    name = f"python-docs-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.json"
    cached = _cache.read_json(name)
    if isinstance(cached, dict):
        return cached
    from hftrain.progress import phase

    with phase(
        f"reading the docstrings of {len(files)} standard-library modules (once per machine, kept in "
        f"{_cache.cache_dir()})"
    ):
        corpus = dict(zip(files, _parse_all(files)))
    _cache.write_json(name, corpus)
    return corpus


def _parse_all(files: list[str]) -> list[str]:
    """_parse of every file, on every core (seconds of CPU on a fresh machine, before the first step); forked
    workers, since this process has loaded torch already (a spawned one would import it again). One core, a
    DataLoader worker (daemonic: no children) or a pool that cannot start: in this process."""
    import multiprocessing

    workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8)
    if (
        workers > 1
        and "fork" in multiprocessing.get_all_start_methods()
        and not multiprocessing.current_process().daemon
    ):
        try:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                return pool.map(_parse, files, chunksize=8)
        except OSError:
            pass
    return [_parse(f) for f in files]


def _parse(path: str) -> str:
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 20:
                docs.append(doc.strip())
    return "\n\n".join(docs)
