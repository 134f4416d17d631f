"""A run's spine as a newcomer meets it (issue 54), measured rather than claimed:

1. the fields each step of training/run.py receives (its parameters; a parameter that is an hftrain dataclass counts
   its fields);
2. the hftrain files whose code runs in one optimizer step, traced in a 4-step run of a tiny model on this CPU: a
   plain step (its batch, forward, backward and optimizer step) and a step with a log line and a checkpoint;
3. the modules the whole recipe reaches: by its type, or by loading one (load_recipe, validate_recipe).

    python scripts/step_view.py                # this checkout (1, 2, 3)
    python scripts/step_view.py --rev 415ca7e  # 1 and 3 at another commit, read from git (2 runs this checkout)

tests/test_structure.py holds (3) to recipe/, cli/, the resolver and the parts' `of` with `receives_the_recipe` from
here.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = (
    "set_up",
    "prepare_output",
    "CheckpointPart.build",
    "ModelPart.build",
    "TrainerPart.build",
    "PublishPart.build",
    "fit",
    "finish",
)
# where each step lives: training/run.py unless named here (issue 61: each part builds its component, beside it)
STEP_MODULES = {
    "set_up": "hftrain.training.arguments",
    "CheckpointPart.build": "hftrain.checkpoint.part",
    "ModelPart.build": "hftrain.model.part",
    "TrainerPart.build": "hftrain.training.trainer_build",
    "PublishPart.build": "hftrain.integrations.publish",
}
RECIPE_LOADERS = ("load_recipe", "validate_recipe")  # hftrain/recipe/load.py: what makes a whole Recipe
# What each hftrain file a plain optimizer step runs is there for: the step's parts, one concern each. A file that
# enters the step must say which part it is; the limit is this list, not a count of today's files.
STEP_PARTS = {
    "hftrain/data/loader.py": "the batch: the loader that hands the Trainer its next batch",
    "hftrain/data/stream.py": "the batch: the readers' stream of token blocks",
    "hftrain/data/packed_batch.py": "the batch: blocks packed into input ids, labels and positions",
    "hftrain/model/attention.py": "the forward: the attention kernel's mask (none for plain causal blocks)",
    "hftrain/model/fused_loss.py": "the loss: cross-entropy in chunks",
    "hftrain/training/trainer.py": "the step: the Trainer's loss and optimizer step",
    "hftrain/training/step_faults.py": "the guard: non-finite losses and gradients, preemption",
    "hftrain/training/step_metrics.py": "the timing: the step's clock and its counted tokens",
    "hftrain/checkpoint/manager.py": "the kept checkpoints: one look-up of the step in their schedule",
}


def _names_recipe(node: ast.AST) -> bool:
    """The node names the Recipe type (a name, an attribute such as schema.Recipe, a quoted annotation)."""
    if isinstance(node, ast.Name):
        return node.id == "Recipe"
    if isinstance(node, ast.Attribute):
        return node.attr == "Recipe"
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"[\w.\[\] |]*\bRecipe\b[\w.\[\] |]*", node.value) is not None
    )


def _parts_of(tree: ast.AST) -> tuple[set[int], bool]:
    """ids of the nodes of each part's `of` (a classmethod `of` of a class named *Part): the one place that says
    what its component reads of a recipe; and whether an `of` keeps the recipe whole (hands it to the part itself,
    `cls(recipe)`, instead of reading its sections or passing it to another part's `of`)."""
    inside, keeps = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name.endswith("Part"):
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name == "of" and len(method.args.args) > 1:
                    inside |= {id(n) for n in ast.walk(method)}
                    keeps |= _keeps_whole(method, method.args.args[1].arg)
    return inside, keeps


def _keeps_whole(method: ast.FunctionDef, recipe: str) -> bool:
    """The recipe parameter used otherwise than as `recipe.attr` or as an argument of a call that is not `cls(...)`."""
    parents = {id(child): parent for parent in ast.walk(method) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(method):
        if isinstance(node, ast.Name) and node.id == recipe and isinstance(node.ctx, ast.Load):
            parent = parents.get(id(node))
            if isinstance(parent, ast.keyword):
                parent = parents.get(id(parent))
            if isinstance(parent, ast.Attribute):
                continue
            if isinstance(parent, ast.Call) and node is not parent.func and ast.unparse(parent.func) != "cls":
                continue
            return True
    return False


def receives_the_recipe(source: str) -> bool:
    """Whether the whole recipe reaches a module's code: it names the Recipe type (an annotation, quoted or not,
    under TYPE_CHECKING too, an attribute such as schema.Recipe) outside its parts' `of`, or makes one (imports or
    calls a loader: load_recipe, validate_recipe, hftrain.load_recipe). A part's `of` (`XPart.of(recipe)`, beside
    the component it builds) is where the recipe is cut: an import of Recipe that only `of` uses is allowed, unless an
    `of` keeps the recipe whole in its part."""
    tree = ast.parse(source)
    (cut, keeps), imported, used_in_of = _parts_of(tree), False, False
    if keeps:
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = {alias.name for alias in node.names}
            if names & set(RECIPE_LOADERS):
                return True
            imported |= "Recipe" in names
        elif isinstance(node, ast.Attribute) and node.attr in RECIPE_LOADERS:
            return True
        elif _names_recipe(node):
            if id(node) not in cut:
                return True
            used_in_of = True
    return imported and not used_in_of


def package_sources(rev: str | None) -> dict[str, str]:
    """{module name: source} of hftrain/, in this checkout or at a commit."""
    if rev is None:
        files = {
            p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in (ROOT / "hftrain").rglob("*.py")
        }
    else:
        listed = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", rev, "hftrain"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        names = [n for n in listed.stdout.split() if n.endswith(".py")]

        def show(name: str) -> str:
            return subprocess.run(
                ["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout

        files = {n: show(n) for n in names}
    return {n[:-3].replace("/", ".").removesuffix(".__init__"): text for n, text in files.items()}


def dataclass_fields(sources: dict[str, str]) -> dict[str, list[str]]:
    """{class name: its annotated fields} for every hftrain class with annotated fields (dataclasses)."""
    fields: dict[str, list[str]] = {}
    for text in sources.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                names = [
                    s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                ]
                if names:
                    fields.setdefault(node.name, names)
    return fields


def step_inputs(sources: dict[str, str]) -> list[tuple[str, list[str], int]]:
    """Per step of a run (training/run.py, and STEP_MODULES): its parameters (an hftrain dataclass shown with its field
    count) and the fields it receives in all (a dataclass counts its fields, anything else 1). A part's `build` is a
    step whose `self` is the part."""
    fields = dataclass_fields(sources)
    functions = {}
    for module in {"hftrain.training.run", *STEP_MODULES.values()} & set(sources):
        for node in ast.parse(sources[module]).body:
            if isinstance(node, ast.FunctionDef):
                functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                methods = (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "build")
                functions.update({f"{node.name}.{n.name}": n for n in methods})
    rows = []
    for name in (step for step in STEPS if step in functions):
        shown, total = [], 0
        for arg in functions[name].args.args:
            kind = ast.unparse(arg.annotation) if arg.annotation else name.split(".")[0] if arg.arg == "self" else "?"
            inner = fields.get(kind.strip("'\""))
            shown.append(f"{arg.arg}: {kind}" + (f" [{len(inner)} fields]" if inner else ""))
            total += len(inner) if inner else 1
        rows.append((name, shown, total))
    return rows


def trace_steps() -> dict[str, list[tuple[str, int]]]:
    """The hftrain files whose functions run in one optimizer step of a tiny 4-step run, with how many of their
    functions ran (the main thread: DataLoader workers are 0 on a CPU), each from the start of a step to the start of
    the next (its forward, backward, optimizer step and step-end events, and the next step's batch): "plain", step 2,
    and "log and save", step 3 (the same, and its log line and checkpoint). The run keeps a checkpoint at step 1."""
    sys.path.insert(0, str(ROOT))
    from transformers import TrainerCallback

    import hftrain
    from tests.support.data import make_documents, tiny_recipe, write_jsonl

    package = str(ROOT / "hftrain")
    windows: dict[str, dict[str, set[str]]] = {"plain": {}, "log and save": {}}
    names = {2: "plain", 3: "log and save"}  # the step each window traces
    active: list[dict[str, set[str]]] = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call" and frame.f_code.co_filename.startswith(package):
            for window in active:
                window.setdefault(frame.f_code.co_filename, set()).add(frame.f_code.co_qualname)

    class Window(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if state.global_step in names:  # step N's window closes where step N+1 begins (its batch fetched)
                active.remove(windows[names[state.global_step]])
            if state.global_step + 1 in names:  # and opens where step N begins (global_step is N-1 there)
                active.append(windows[names[state.global_step + 1]])
            sys.setprofile(profile if active else None)

    with tempfile.TemporaryDirectory() as tmp:
        data = write_jsonl(Path(tmp) / "d.jsonl", make_documents(300))
        raw = tiny_recipe(data, Path(tmp) / "run", max_steps=4, logging_steps=3, save_steps=3)
        raw["checkpoints"] = {"steps": [1]}  # a kept-checkpoint schedule, as Pythia's recipes have: its per-step check
        hftrain.train(hftrain.load_recipe(None, raw), callbacks=[Window()])
    sys.setprofile(None)
    return {
        name: sorted(
            ((Path(f).relative_to(ROOT).as_posix(), len(q)) for f, q in called.items()),
            key=lambda row: (-row[1], row[0]),
        )
        for name, called in windows.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="a git commit: report 1 and 3 there (read from git, nothing checked out)")
    parser.add_argument("--no-trace", action="store_true", help="skip 2 (it trains a tiny model for a few seconds)")
    a = parser.parse_args()
    sources = package_sources(a.rev)
    where = a.rev or "this checkout"
    print(f"1. fields each step of training/run.py receives ({where}):")
    for name, shown, total in step_inputs(sources):
        print(f"   {name}({', '.join(shown)})  -> {total} fields")
    receivers = sorted(name for name, text in sources.items() if receives_the_recipe(text))
    outside = [n for n in receivers if not re.match(r"^hftrain\.(recipe|cli)(\.|$)", n)]
    print(f"3. modules the whole recipe reaches ({where}): {len(receivers)}, outside recipe/ and cli/: {len(outside)}")
    for name in outside:
        print(f"   {name}")
    if not a.no_trace:
        for name, rows in trace_steps().items():
            print(f"2. hftrain files that run in one optimizer step, {name} (this checkout, traced): {len(rows)}")
            for path, count in rows:
                print(f"   {path}: {count} functions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
