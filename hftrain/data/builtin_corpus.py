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
    """_parse of every file, in this process: about 2 s of one core, once per machine. A pool of forked workers saved
    a second and once hung a run for good: this process has loaded torch, and a child forked from a process with
    threads can inherit a lock one of them held (a calibration run in the suite waited 860 s here, then was
    killed). Spawned workers would import torch again, which costs more than the parse."""
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
