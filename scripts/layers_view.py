"""The layers between a recipe and the components it builds (issue 61), measured rather than claimed:

1. configuration records: the dataclasses that carry recipe values (or other records' fields) towards a component,
   i.e. every dataclass in training/resolve.py (and training/run_parts.py, at the commits that had it), and every
   dataclass named *Part, *Parts, *Options, *Inputs, *Settings, *Spec or Finishing anywhere in hftrain/;
2. the places that wire the Trainer: functions that make its callback list, construct a Trainer with callbacks they
   did not receive, add or insert a callback into a built Trainer (add_callback, callback_handler) or set its
   options after construction;
3. the places that change TrainingArguments after they are made: an attribute assigned on `args`, `self.args` or
   `trainer.args`, and a function that edits in place a dict of argument values it was handed (a parameter named
   kwargs, values or resolved: item assignment, update, setdefault, pop);
4. the lines over 120 characters in hftrain/, tests/, benchmarks/ and scripts/;
5. the parts (a *Part class with an `of`, what its component reads of a recipe): where each is defined, and which
   build their component (a `build` method) rather than being handed to a function that builds it.

    python scripts/layers_view.py              # this checkout
    python scripts/layers_view.py --rev d2ba4c2 # another commit, read from git

tests/test_structure.py holds 1-3 to their targets with the functions here.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD_MODULES = ("hftrain/training/run_parts.py", "hftrain/training/resolve.py")
RECORD_NAME = re.compile(r".*(Part|Parts|Options|Inputs|Settings|Spec)$|^Finishing$")
ARGUMENT_DICTS = ("kwargs", "values", "resolved")
TRAINER_CLASSES = re.compile(r"^(HftrainTrainer|\w*DPOTrainer\w*|Trainer)$")
WIDTH = 120


def sources(rev: str | None, folders: tuple[str, ...] = ("hftrain",)) -> dict[str, str]:
    """{path: source} of the .py files under `folders`, in this checkout or at a commit."""
    if rev is None:
        return {
            p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
            for folder in folders
            for p in sorted((ROOT / folder).rglob("*.py"))
        }
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, *folders], cwd=ROOT, capture_output=True, text=True, check=True
    )

    def show(name: str) -> str:
        done = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True, text=True, check=True)
        return done.stdout

    return {n: show(n) for n in listed.stdout.split() if n.endswith(".py")}


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in node.decorator_list)


def records(files: dict[str, str]) -> list[tuple[str, str, int]]:
    """(path, name, fields) of each configuration record (rule 1 of the module docstring)."""
    found = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and _is_dataclass(node):
                if path in RECORD_MODULES or RECORD_NAME.match(node.name):
                    fields = sum(isinstance(b, ast.AnnAssign) for b in node.body)
                    found.append((path, node.name, fields))
    return found


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _own_nodes(function: ast.AST) -> list[ast.AST]:
    """The nodes of a function body, without those of functions nested in it (counted on their own)."""
    nodes, todo = [], list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        nodes.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _makes_callback_list(node: ast.AST) -> bool:
    """A list literal holding a callback made on the spot (SomethingCallback(...))."""
    return isinstance(node, ast.List) and any(
        isinstance(e, ast.Call) and ast.unparse(e.func).split(".")[-1].endswith("Callback") for e in node.elts
    )


def trainer_wiring(files: dict[str, str]) -> list[tuple[str, str, str]]:
    """(path, function, what) for each place that wires the Trainer (rule 2): makes its callback list, passes a
    Trainer callbacks it did not receive, adds or inserts a callback into a built Trainer, or sets its options
    after construction."""
    found = []
    for path, text in files.items():
        for function in _functions(ast.parse(text)):
            params = {a.arg for a in (*function.args.args, *function.args.kwonlyargs)}
            whats = set()
            for node in _own_nodes(function):
                if _makes_callback_list(node):
                    whats.add("makes the callback list")
                if isinstance(node, ast.Call):
                    name = ast.unparse(node.func).split(".")[-1]
                    if name == "add_callback":
                        whats.add("adds a callback")
                    elif TRAINER_CLASSES.match(name):
                        given = [k.value for k in node.keywords if k.arg == "callbacks"]
                        if given and not (isinstance(given[0], ast.Name) and given[0].id in params):
                            whats.add("constructs a Trainer with callbacks of its own")
                if isinstance(node, ast.Attribute) and node.attr == "callback_handler":
                    whats.add("changes the callback handler")
                if isinstance(node, (ast.Assign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        if re.match(r"^(self\.)?options\.\w+", ast.unparse(target)):
                            whats.add(f"sets {ast.unparse(target)} after construction")
            found.extend((path, function.name, what) for what in sorted(whats))
    return found


def argument_changes(files: dict[str, str]) -> list[tuple[str, str, str]]:
    """(path, function, what) for each change of TrainingArguments after they are made (rule 3)."""
    found = []
    for path, text in files.items():
        if path.startswith("hftrain/cli/"):  # there `args` are the command line's (argparse)
            continue
        for function in _functions(ast.parse(text)):
            params = {a.arg for a in (*function.args.args, *function.args.kwonlyargs)} & set(ARGUMENT_DICTS)
            rebound = {  # `kwargs = dict(kwargs)`: a copy of its own, not the caller's
                t.id
                for n in _own_nodes(function)
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            params -= rebound
            whats = set()
            for node in _own_nodes(function):
                if isinstance(node, (ast.Assign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in (t for tg in targets for t in (tg.elts if isinstance(tg, ast.Tuple) else [tg])):
                        text_ = ast.unparse(target)
                        if re.match(r"^((self|trainer)\.)?args\.\w+$", text_):
                            whats.add(f"sets {text_}")
                        if isinstance(target, ast.Subscript) and ast.unparse(target.value) in params:
                            whats.add(f"sets {ast.unparse(target.value)}[...] in place")
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    owner = ast.unparse(node.func.value)
                    if owner in params and node.func.attr in ("update", "setdefault", "pop"):
                        whats.add(f"{owner}.{node.func.attr}(...) in place")
            found.extend((path, function.name, what) for what in sorted(whats))
    return found


def long_lines(files: dict[str, str], width: int = WIDTH) -> list[tuple[str, int, int]]:
    """(path, line number, length) of each line over `width`."""
    return [
        (path, number, len(line))
        for path, text in files.items()
        for number, line in enumerate(text.splitlines(), 1)
        if len(line) > width
    ]


def parts(files: dict[str, str]) -> list[tuple[str, str, str]]:
    """(path, part, "builds its component" or "read by its components") for each part (rule 5)."""
    found = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Part"):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                if "of" in methods:
                    found.append((path, node.name, "builds" if "build" in methods else "read"))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="a commit to read from git instead of this checkout")
    parser.add_argument("--list", action="store_true", help="list every record, place and long line")
    args = parser.parse_args()
    package = sources(args.rev)
    tree = sources(args.rev, ("hftrain", "tests", "benchmarks", "scripts"))
    rows = [
        ("configuration records", records(package)),
        ("places that wire the Trainer", trainer_wiring(package)),
        ("places that change TrainingArguments after they are made", argument_changes(package)),
        (f"lines over {WIDTH} characters (hftrain/)", long_lines(package)),
        (f"lines over {WIDTH} characters (hftrain/, tests/, benchmarks/, scripts/)", long_lines(tree)),
        ("parts (`of`), and whether each builds its component (`build`)", parts(package)),
    ]
    print(f"at {args.rev or 'this checkout'}")
    for title, found in rows:
        print(f"{len(found):5d}  {title}")
        if args.list or len(found) <= 12:
            for row in found:
                print("         " + " ".join(str(x) for x in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
