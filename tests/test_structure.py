"""The shape of the code base, checked so that it stays readable as it grows.

Rules (they hold for all later work too):
1. No import cycle inside hftrain/, between modules nor between packages (hftrain/X/ as one node, each top-level
   module as its own). Every import counts: module level, inside functions (lazy), inside try blocks; only imports
   under ``if TYPE_CHECKING:`` are exempt.
2. Library modules never import command modules. Command modules are hftrain/cli/__init__.py, hftrain/__main__.py and
   everything in hftrain/cli/; every other module under hftrain/ is a library module.
3. No module in hftrain/ over 400 lines (as `wc -l` counts them) and no function over 60 lines.
4. `hftrain explain SECTION` works for every section of the recipe schema.
5. The Trainer private methods HftrainTrainer overrides exist, with the parameters it relies on, in the
   installed transformers (the lowest-versions CI step runs this at pyproject.toml's floor), each with its reason.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest

from .support.cli import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import layers_view  # noqa: E402
import step_view  # noqa: E402

PACKAGE = ROOT / "hftrain"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
COMMAND_MODULES = re.compile(r"^hftrain\.(cli(\..*)?|__main__)$")


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    exempt = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            exempt |= {id(n) for child in node.body for n in ast.walk(child)}
    return exempt


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The hftrain modules `name` imports. `from PKG import X` counts as importing PKG.X when X is a module
    (the package itself is already initialised by then), else as importing PKG."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    exempt, found = _type_checking_nodes(tree), set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules}
            found |= subs if len(subs) == len(node.names) else subs | {target}
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycle_inside_hftrain():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded by package: hftrain.data.loader -> data; hftrain.errors -> errors."""

    def unit(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        packages.setdefault(unit(module), set()).update(unit(m) for m in imported if unit(m) != unit(module))
    return packages


def test_no_import_cycle_between_packages():
    """The packages form layers: recipe, parallel, checkpoint, model, speed, data, eval, planning, export, launch,
    integrations, training, cli (each imports only packages before it)."""
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_can_fail(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    folded = package_graph(
        {
            "hftrain.a.x": {"hftrain.b.y"},
            "hftrain.b.y": {"hftrain.b.z"},
            "hftrain.b.z": {"hftrain.a.w"},
            "hftrain.a.w": set(),
        }
    )
    assert find_cycle(folded) == ["a", "b", "a"]  # no module cycle, but a package one
    probe = tmp_path / "probe.py"  # a lazy import inside a function counts
    probe.write_text("def f():\n    from . import train\n    from .cli import plan\n", encoding="utf-8")
    modules = {"hftrain.train": Path(), "hftrain.cli": Path(), "hftrain.cli.plan": Path()}
    assert imported_modules("hftrain.probe", probe, modules) == {"hftrain.train", "hftrain.cli.plan"}


def test_library_modules_never_import_command_modules():
    offenders = [
        f"{lib} imports {dep}"
        for lib, deps in import_graph().items()
        if not COMMAND_MODULES.match(lib)
        for dep in deps
        if COMMAND_MODULES.match(dep)
    ]
    assert offenders == []


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_no_module_over_400_lines_and_no_function_over_60():
    sizes = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in PACKAGE.rglob("*.py")}
    too_long = [f"{p.relative_to(ROOT)} ({n} lines)" for p, n in sizes.items() if n > MAX_MODULE_LINES]
    assert too_long == []
    assert [f for path in sizes for f in _long_functions(path)] == []


def test_sections_of_explain_come_from_the_schema(capsys):
    from hftrain.cli import main
    from hftrain.recipe.docs import recipe_sections
    from hftrain.recipe.load import inner_model
    from hftrain.recipe.schema import Recipe

    sections = recipe_sections()
    assert (
        sections == [n for n, f in Recipe.model_fields.items() if inner_model(f.annotation)] and "profile" in sections
    )
    for section in sections:
        assert main(["explain", section]) == 0
        out = capsys.readouterr().out
        first_key = next(iter(inner_model(Recipe.model_fields[section].annotation).model_fields))
        assert out.startswith(f"{section}:") and f"  {first_key}: " in out


@pytest.mark.parametrize(
    "word, override",
    [
        ("training.max_steps=5", True),
        ("data.train={path: s3://b/x.jsonl}", True),
        ("model.preset=pythia-14m", True),
        ("runs/year=2024", False),
        ("s3://bucket/year=2024/x.jsonl", False),
        ("--out=x", False),
    ],
)
def test_only_dotted_keys_are_overrides(word, override):
    from hftrain.cli import split_overrides

    assert split_overrides(["plan", "recipe.yaml", word])[1] == ([word] if override else [])
    assert split_overrides(["report", word])[1] == []  # commands without a recipe take no overrides


def test_trainer_private_overrides_match_the_installed_transformers():
    import transformers
    from transformers import Trainer

    from hftrain.training.trainer import PRIVATE_OVERRIDES, HftrainTrainer

    own = {
        name
        for name, value in vars(HftrainTrainer).items()
        if name.startswith("_") and not name.startswith("__") and callable(value) and hasattr(Trainer, name)
    }
    assert own == set(PRIVATE_OVERRIDES), "list every overridden private Trainer method in PRIVATE_OVERRIDES"
    for name in PRIVATE_OVERRIDES:
        ours = list(inspect.signature(getattr(HftrainTrainer, name)).parameters)
        theirs = list(inspect.signature(getattr(Trainer, name)).parameters)
        assert ours == theirs, f"Trainer.{name}{theirs} changed in transformers {transformers.__version__}"
    for name, reason in PRIVATE_OVERRIDES.items():
        assert "(" in reason and len(reason) > 40, (
            f"{name}: give the reason no public hook serves and the upstream issue"
        )


IMPORT_PROBE = """
import json, logging, os, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
env = dict(os.environ)
import hftrain
print(json.dumps({
    "env": sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)),
    "custom_exceptions": [c.__name__ for c in shell.custom_exceptions],
    "logger_levels": {n: logging.getLogger(n).level for n in ("bitsandbytes.backends.cpu.ops", "transformers")},
    "heavy": [m for m in ("torch", "transformers", "accelerate", "deepspeed", "bitsandbytes") if m in sys.modules],
}))
"""


def test_import_hftrain_changes_nothing_global():
    """`import hftrain` patches nothing, sets no variable, logger or IPython handler, and loads no ML library: a run
    applies what it needs when it starts (_compat.py), a notebook calls show_errors_plainly() itself. (Before, the
    import installed the IPython handler and a logger level: custom_exceptions was ['HftrainError'].)"""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "env": [],
        "custom_exceptions": [],
        "logger_levels": {"bitsandbytes.backends.cpu.ops": 0, "transformers": 0},
        "heavy": [],
    }, seen


API_PROBE = """
import hftrain, hftrain.planning.fit, hftrain.training.run  # what hftrain.train() imports
recipe = hftrain.load_recipe("recipes/quickstart.yaml")
print(type(hftrain.plan).__name__, sorted(hftrain.plan(recipe))[:3], callable(hftrain.train))
"""


def test_the_api_functions_stay_functions_after_their_packages_load():
    """`hftrain.plan(recipe)` after the packages hftrain.train() imports: before, the subpackage hftrain/plan/ took the
    name (`module object is not callable`); it is hftrain/planning/ now."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", API_PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == "function ['config', 'finetune_bytes', 'finetune_method'] True", done.stdout[-500:]


CHEAP_COMMANDS_PROBE = """
import contextlib, io, json, sys
from hftrain.cli import main
said = {}
for argv in (
    ["--help"],
    ["presets"],
    ["train", "no/such/recipe.yaml"],
    ["plan", "README.md"],
    ["explain", "training"],
    ["train", "recipes/quickstart.yaml", "training.max_step=5"],
):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    said[argv[-1]] = [code, err.getvalue().strip().splitlines()[-1:]]
heavy = lambda: sorted(m for m in ("torch", "transformers", "peft", "bitsandbytes") if m in sys.modules)
before_plan = heavy()
with contextlib.redirect_stdout(io.StringIO()) as out:
    planned = main(["plan", "recipes/quickstart.yaml"])
after_plan = heavy()
import hftrain  # noqa: E402  (issue 61 part 5: the Python API's plan is planning's, as the command's is)
api = sorted(hftrain.plan(hftrain.load_recipe("recipes/quickstart.yaml")))[:3]
api_heavy = sorted(m for m in ("transformers.trainer", "peft", "bitsandbytes", "trl", "deepspeed") if m in sys.modules)
print(json.dumps({
    "said": said, "heavy": before_plan, "plan": [planned, after_plan, out.getvalue().splitlines()[0]],
    "api": [api, api_heavy],
}))
"""


def test_cheap_commands_answer_without_the_trainer_stack(tmp_path):
    """Issue 54 part 7: `hftrain --help`, `presets`, `explain`, a recipe file wrong on its face (missing, not a mapping
    of sections) and a recipe key wrong on its face answer without importing torch, transformers, peft or
    bitsandbytes, and `plan` imports torch alone (before: every command imported the whole Trainer stack first, 4.4x
    the time of `import torch`;
    benchmarks/cli_start.py measures it). The recipe schema reads TrainingArguments' fields from the table the
    first recipe read on this machine kept (recipe/transformers_table.py): made here first, as a first run does."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "HFTRAIN_CACHE_DIR": str(tmp_path)}
    make = (  # what a machine's first recipe read and first `plan` keep: transformers' table, the libraries' memory
        "import sys; from hftrain.recipe.transformers_table import table; table(); print('transformers' in "
        "sys.modules); from hftrain.planning.memory import library_footprint; library_footprint(measure=True)"
    )
    first = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert first.stdout.split()[-1:] == ["True"], first.stderr[-2000:]  # the first read imports transformers, once
    done = subprocess.run(
        [sys.executable, "-c", CHEAP_COMMANDS_PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["heavy"] == [], seen
    assert seen["said"]["--help"][0] == 0 and seen["said"]["presets"][0] == 0, seen
    assert seen["said"]["no/such/recipe.yaml"] == [
        2,
        [
            "hftrain: error: no/such/recipe.yaml: recipe file not found. Shipped recipes live in recipes/ (try "
            "recipes/quickstart.yaml)."
        ],
    ]
    assert seen["said"]["README.md"][0] == 2 and "README.md: " in seen["said"]["README.md"][1][0], seen
    assert seen["said"]["training"][0] == 0, seen  # explain training: every TrainingArguments key, from the table
    assert seen["said"]["training.max_step=5"] == [
        2,
        ["  - training.max_step: unknown key; did you mean training.max_steps?"],
    ], seen
    # `plan` of a preset recipe counts its model from the recipe's fields (model/shape.py): torch for the matmul peak,
    # no transformers (it was 3.45x `import torch` with transformers' modeling stack for a meta model)
    assert seen["plan"] == [
        0,
        ["torch"],
        "model cpu-small: 4 layers, hidden 128, 4 heads, vocab 4,096, context 1,024",
    ], seen
    # `hftrain.plan(recipe)`: no Trainer, peft, bitsandbytes, TRL or DeepSpeed (before issue 61 it was the resolver's,
    # which imports the Trainer stack: ['bitsandbytes', 'peft', 'transformers.trainer'])
    assert seen["api"] == [["config", "finetune_bytes", "finetune_method"], []], seen


# Settings the libraries document for users to assign (not patches): fsspec's default options per protocol, torch's
# backend switches (the speed probe sets TF32 while it times it, and restores it).
PUBLIC_SETTINGS = ("fsspec.config.conf", "torch.backends.")


def test_every_patch_of_another_library_lives_in_compat():
    """Assignments into another library's modules or classes (monkeypatches) appear in _compat.py alone."""
    libraries = (
        "accelerate",
        "transformers",
        "torch",
        "deepspeed",
        "bitsandbytes",
        "peft",
        "datasets",
        "huggingface_hub",
        "fsspec",
        "s3fs",
        "gcsfs",
        "IPython",
        "logging",
    )
    offenders = []
    for name, path in module_names().items():
        if name == "hftrain._compat":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = set()  # local names bound to another library's modules or objects
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                source = node.module if isinstance(node, ast.ImportFrom) else None
                for alias in node.names:
                    if ((source or alias.name) or "").split(".")[0] in libraries:
                        imported.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign)
                else []
            )
            for target in targets:
                root = target
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                text = ast.unparse(target)
                if (
                    isinstance(root, ast.Name)
                    and root.id in imported
                    and root is not target
                    and not text.startswith(PUBLIC_SETTINGS)
                ):
                    offenders.append(f"{name}:{node.lineno} {text}")
    assert not offenders, f"patches of other libraries outside hftrain/_compat.py: {offenders}"


PACKAGE_DATA = {"accelerate_configs"}  # folders shipped as data, not code


def test_the_top_of_the_package_shows_the_concepts():
    """`ls hftrain/` is the architecture: at most 16 subpackages and public modules (private _x.py, dunder files and
    package data aside); every subpackage says what it holds; tests/ mirrors the subpackages."""
    public = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if not p.name.startswith("_")
        and p.name not in PACKAGE_DATA
        and (p.suffix == ".py" or (p / "__init__.py").is_file())
    )
    assert len(public) <= 16, public
    subpackages = [name for name in public if (PACKAGE / name).is_dir()]
    for name in subpackages:
        assert ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text(encoding="utf-8"))), (
            f"hftrain/{name}/__init__.py: say what it holds"
        )
    tests = ROOT / "tests"
    # support: helpers; gpu: the GPU tier; bad_input: one contract (a mistake gets its message, nothing is lost) tested
    # across every package, one module per area
    mirrored = {p.name for p in tests.iterdir() if p.is_dir() and (p / "__init__.py").is_file()} - {
        "support",
        "gpu",
        "bad_input",
    }
    assert mirrored <= set(subpackages), f"tests/ folders without a package: {mirrored - set(subpackages)}"
    assert set(subpackages) - mirrored <= set(), f"packages without tests/<name>/: {set(subpackages) - mirrored}"


def test_version_bounds_are_floors_unless_a_break_is_recorded():
    """No upper bound without the break it avoids written next to it; torch 2.15 (what GPU images ship now) and the
    lent GPU image's torch 2.11 / transformers 5.17 satisfy the requirements, so pip never replaces them."""
    import tomllib
    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    project = tomllib.loads(text)["project"]
    lines = text.splitlines()
    for spec in [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]:
        req = Requirement(spec)
        if any(c.operator in ("<", "<=", "==", "~=") for c in req.specifier):
            at = next(i for i, line in enumerate(lines) if f'"{spec}"' in line)
            context = " ".join(lines[max(0, at - 2) : at + 1]).lower()
            assert "break" in context or "broke" in context, (
                f"{spec}: an upper bound needs the break it avoids next to it"
            )
    deps = {Requirement(s).name.lower(): Requirement(s) for s in project["dependencies"]}
    for name, version in (
        ("torch", "2.15.0"),
        ("torch", "2.11.0"),
        ("transformers", "5.17.0"),
        ("transformers", "5.24.0"),
        ("accelerate", "1.15.0"),
        ("huggingface_hub", "1.33.0"),
        ("tokenizers", "0.23.2"),
    ):
        assert deps[name].specifier.contains(version), f"{name} {version} is refused by {deps[name]}"


def test_ruff_formats_and_lints_the_tree():
    """pyproject.toml's [tool.ruff] (line length 120, pycodestyle, pyflakes, pyupgrade): `ruff format --check` and
    `ruff check` pass on the whole tree, with no `# fmt: skip` left to dodge the formatter."""
    import subprocess
    import sys

    for command in (["format", "--check"], ["check"]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *command, "."], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout[-3000:]}{result.stderr[-2000:]}"
    skipped = [
        f"{p.relative_to(ROOT)}:{n}"
        for d in ("hftrain", "tests", "benchmarks", "scripts")
        for p in (ROOT / d).rglob("*.py")
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if line.rstrip().endswith(("fmt: skip", "fmt: off"))
    ]
    assert not skipped, skipped


# Issue 43 part 2, issue 54 part 5, issue 61 part 1: components take their part of the recipe, never the whole Recipe:
# not by its type, and not by loading one (a checkpoint's saved recipe is read through recipe.load.read_part or
# read_sections). Each part's `of` (beside the component the part builds) is the one place that reads a Recipe.
RECIPE_HOLDERS = re.compile(r"^hftrain\.(recipe(\..*)?|cli(\..*)?|training\.resolve|__main__)$")
RECIPE_ENTRIES = {
    "hftrain.training.run": "train(recipe), the Python API's entry, hands the recipe to resolve() and reads none of it",
    "hftrain.planning": "plan(recipe), the Python API's entry, hands the recipe's PlanPart to planning/estimates.py",
}


def receives_the_recipe(path: Path) -> bool:
    """scripts/step_view.py's check (its part 3), on a file."""
    return step_view.receives_the_recipe(path.read_text(encoding="utf-8"))


def sections_read(path: Path, name: str = "recipe") -> list[str]:
    """`recipe.<attribute>` reads in a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name
    ]


def test_components_take_their_part_of_the_recipe_never_the_whole():
    holders = {name for name, path in module_names().items() if receives_the_recipe(path)}
    allowed = {name for name in holders if RECIPE_HOLDERS.match(name)} | set(RECIPE_ENTRIES)
    assert sorted(holders - allowed) == [], "take a part (its `of` reads the recipe), not the Recipe"
    assert "hftrain.model.build" not in allowed and "hftrain.training.run" in holders  # the check sees what it checks


def test_each_step_of_a_run_receives_its_part_not_the_resolved_run():
    """Issue 54 part 1 (scripts/step_view.py, part 1): no step of training/run.py takes the whole RunSpec, and none
    takes more than its part, the settings and what the steps before it built."""
    rows = step_view.step_inputs(step_view.package_sources(None))
    assert [name for name, _, _ in rows] == list(step_view.STEPS)
    assert not [(name, shown) for name, shown, _ in rows if any("RunSpec" in s for s in shown)]
    assert sections_read(PACKAGE / "training" / "run.py") == [], "train() resolves the recipe; the run reads its spec"


def test_one_layer_between_the_recipe_and_its_components():
    """Issue 61 parts 1-4 (scripts/layers_view.py): at most 15 configuration records between the recipe and the
    components (30 before: step parts, Trainer records, parts that repackaged another's fields); the Trainer's
    callbacks made in one function (training/trainer_build.py; the trackers' queues wrap, right there, the callbacks
    transformers makes from report_to inside Trainer.__init__); nothing changes TrainingArguments once they are made
    (before: 4 places, among them the Trainer's own __init__ setting logging_nan_inf_filter)."""
    package = layers_view.sources(None)
    records = layers_view.records(package)
    assert len(records) <= 15, records
    wiring = {(path, function) for path, function, _ in layers_view.trainer_wiring(package)}
    assert wiring == {
        ("hftrain/training/trainer_build.py", "build"),
        ("hftrain/integrations/trackers.py", "__init__"),
    }, wiring
    assert layers_view.argument_changes(package) == []
    tree = layers_view.sources(None, ("hftrain", "tests", "benchmarks", "scripts"))
    assert layers_view.long_lines(tree) == []  # part 4: ruff's E501 at 120, and no pragma comment past it either


def test_the_layer_checks_can_fail():
    """Each rule of scripts/layers_view.py finds what it looks for (the code before issue 61, in small)."""
    before = {
        "hftrain/training/run_parts.py": "@dataclass\nclass SetUpPart:\n    dims: int\n",
        "hftrain/training/run.py": (
            "def fit(trainer):\n    trainer.add_callback(PreemptionCallback())\n"
            "def build(options):\n    options.evaluation = 1\n    return [MetricsFileCallback()]\n"
        ),
        "hftrain/training/trainer.py": (
            "class T:\n    def __init__(self):\n        self.args.logging_nan_inf_filter = False\n"
        ),
        "hftrain/checkpoint/node_disks.py": "def storage_settings(kwargs):\n    kwargs['save_on_each_node'] = True\n",
        "hftrain/parallel/rehearsal.py": (
            "def training_kwargs(kwargs):\n    kwargs = dict(kwargs)\n    kwargs['x'] = 1\n"
        ),
    }
    assert [name for _, name, _ in layers_view.records(before)] == ["SetUpPart"]
    assert {(f, w) for _, f, w in layers_view.trainer_wiring(before)} == {
        ("fit", "adds a callback"),
        ("build", "makes the callback list"),
        ("build", "sets options.evaluation after construction"),
    }
    changes = {(f, w) for _, f, w in layers_view.argument_changes(before)}
    assert changes == {
        ("__init__", "sets self.args.logging_nan_inf_filter"),
        ("storage_settings", "sets kwargs[...] in place"),
    }


def test_one_optimizer_step_runs_only_the_files_of_its_parts():
    """Issue 54 part 4, issue 61 part 6 (scripts/step_view.py, part 2, traced in a 4-step run of a tiny model that
    keeps checkpoints on a schedule, as Pythia's recipes do): every hftrain file a plain step (its batch, forward,
    loss, backward, guard, timing and optimizer step) runs is one of the step's parts in step_view.STEP_PARTS, each
    of them one concern; the kept checkpoints' part is a single look-up. Before: at most 8 files, which held only
    with no checkpoint schedule (with one: 9)."""
    traced = dict(step_view.trace_steps()["plain"])
    assert set(traced) <= set(step_view.STEP_PARTS), sorted(set(traced) - set(step_view.STEP_PARTS))
    assert set(step_view.STEP_PARTS) <= set(traced), "a part listed that the step no longer runs: remove it"
    assert traced["hftrain/checkpoint/manager.py"] == 1, traced  # KeptCheckpointsCallback.on_step_end alone


PART_OF = (
    "if TYPE_CHECKING:\n    from hftrain.recipe.schema import Recipe\n"
    "class ModelPart:\n    @classmethod\n"
    "    def of(cls, recipe: Recipe) -> ModelPart:\n        return cls(recipe.model)\n"
)


def test_the_recipe_check_can_fail(tmp_path):
    for source in (
        PART_OF + "def build(recipe: Recipe): ...\n",  # the component itself takes the Recipe
        PART_OF.replace("class ModelPart", "class ModelSettings"),  # an `of` of a class that is not a part
        PART_OF.replace("cls(recipe.model)", "cls(recipe)"),  # a part that keeps the whole recipe
        PART_OF.replace("cls(recipe.model)", "cls(whole=recipe)"),
        "from hftrain.recipe.schema import Recipe\n",
        "def f(r: 'Recipe'): ...\n",
        "x = schema.Recipe\n",
        "from hftrain.recipe.load import load_recipe\n",  # how checkpoint/adapter.py read a checkpoint's recipe
        "import hftrain\nr = hftrain.load_recipe(path)\n",
    ):
        (tmp_path / "m.py").write_text(source)
        assert receives_the_recipe(tmp_path / "m.py"), source
    for source in (
        "def f(part: ModelPart):\n    return part.model  # not a Recipe\n",
        "from hftrain.recipe.load import read_part\npart = read_part(ModelPart.of, path)\n",
        PART_OF,  # a part's `of` cuts the recipe, beside its component
    ):
        (tmp_path / "m.py").write_text(source)
        assert not receives_the_recipe(tmp_path / "m.py"), source
    (tmp_path / "m.py").write_text("def f(recipe):\n    return recipe.data.seq_len\n")
    assert sections_read(tmp_path / "m.py") == ["data"]
