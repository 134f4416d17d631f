"""Text that is on every machine with Python: the docstrings of the standard library.

Used by the quickstart so that training needs no download. One document per module: its module, class and
function docstrings joined by blank lines. The text is the CPython standard library's, under the Python
Software Foundation License; which modules exist depends on the Python version.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

# Trees that are tests, demos or tooling rather than library documentation.
_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__", "lib2to3", "ensurepip"}


def python_docs_files() -> list[str]:
    """The standard library's .py files, sorted, so the corpus order is the same on every run."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(str(p) for p in files)


def module_docstrings(path: str) -> str:
    """All docstrings of one module, in source order ('' for a module without any, or that does not parse)."""
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
