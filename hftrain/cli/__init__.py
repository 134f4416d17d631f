"""`hftrain` command line: a table of commands, one module each (hftrain/cli/), over the same functions
the Python API uses; and the one place where hftrain's errors become a message and an exit code.

``key=value`` overrides may stand anywhere after a recipe command, mixed with options:
``hftrain train recipes/quickstart.yaml --help``, ``hftrain plan RECIPE training.max_steps=10``.
An override is a word of the form ``dotted.key=value``; other words (paths, URLs, options) go to argparse.
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
from types import ModuleType

from hftrain import _compat, progress

_compat.quiet_optional_warnings()  # the CLI is a program: before its commands import transformers (and bitsandbytes)
_compat.quiet_launcher_cpp_logs(sys.argv[1:])  # before torch is imported: a launcher's c10d backtraces

# the command modules import nothing heavy: torch and transformers load when a command needs them (its run)
from hftrain import network
from hftrain.cli import data, eval, explain, export, launch_script, parity, plan, presets, push, report, train
from hftrain.errors import NotShared, Stopped, as_user_error
from hftrain.parallel import child_errors

# name -> module, in the order `hftrain --help` lists them
COMMANDS: dict[str, ModuleType] = {
    "train": train,
    "plan": plan,
    "parity": parity,
    "data": data,
    "launch-script": launch_script,
    "push": push,
    "export": export,
    "explain": explain,
    "presets": presets,
    "eval": eval,
    "report": report,
}
_OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*=")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hftrain",
        description="Pretrain and fine-tune GPT-NeoX-style models on the Hugging Face stack.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Words shaped `dotted.key=value` after a recipe command are overrides; the rest goes to argparse."""
    module = COMMANDS.get(argv[0]) if argv else None
    if module is None or not getattr(module, "TAKES_OVERRIDES", True):
        return argv, []
    overrides = [word for word in argv[1:] if _OVERRIDE.match(word)]
    return [argv[0], *(word for word in argv[1:] if not _OVERRIDE.match(word))], overrides


def run(argv: list[str]) -> int:
    words, overrides = split_overrides(argv)
    args = build_parser().parse_args(words)
    args.argv = argv  # as typed: `train --max-restarts` re-runs it
    if isinstance(getattr(args, "recipe", None), str):  # a recipe file wrong on its face, said before any import
        from pathlib import Path

        from hftrain.recipe.yaml_io import read_recipe_file

        read_recipe_file(Path(args.recipe))
    if COMMANDS[args.command] is not presets:
        # the recipe's schema: TrainingArguments' fields from the table a machine's first read kept (loading
        # transformers only that first time: recipe/transformers_table.py); 20 s on a cold disk, said only when slow
        with progress.phase("reading the recipe's schema", after_s=6):
            import hftrain.recipe.schema  # noqa: F401
    return COMMANDS[args.command].run(args, overrides)


def main(argv: list[str] | None = None) -> int:
    """Run a command; hftrain's errors, and the exceptions a user can fix (errors.as_user_error), become one line and
    exit status 2. Anything else is a bug in hftrain and keeps its traceback. In a process that hftrain's launcher
    started, the line goes to the launcher, which says it once for all processes (parallel/child_errors.py)."""
    error_dir = child_errors.take_error_dir()
    try:
        network.configure()  # the default bound until a recipe gives its own (faults.network_timeout_s)
        return run(sys.argv[1:] if argv is None else argv)
    except (Stopped, NotShared) as err:  # preempted, a lost node, a service down: not the recipe's fault
        return child_errors.say(err.exit_code, str(err), error_dir)
    except KeyboardInterrupt:
        return child_errors.say(130, "interrupted", error_dir)
    except Exception as err:
        known = as_user_error(err, network.bound())
        if known is None:
            raise
        from hftrain.recipe.redaction import redact_value

        return child_errors.say(2, redact_value("", str(known)), error_dir)  # no URL's user:password@


def program(argv: list[str] | None = None) -> int:
    """`hftrain` as a program (the console script, `python -m hftrain`, so every launched process, and SageMaker's
    entry): `main`, then what it leaves frozen for the garbage collector. At exit CPython collects the whole heap,
    torch's and transformers' object graphs included: 2-2.5 s per process on 2 cores, three processes deep in a
    2-process launch. Frozen, the exit takes 0.3 s; atexit handlers (trackers, TensorBoard) run as before. Not in
    `main`: a notebook or a test that calls it keeps collecting its garbage. A process of a multi-process run ends
    after its exit handlers without tearing down its process group (parallel/process_end.py: gloo's teardown can
    deadlock)."""
    from hftrain.parallel import process_end

    process_end.register()  # first, so that it runs after every other exit handler (parallel/process_end.py)
    code = main(argv)
    process_end.set_exit_code(code)
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(program())
