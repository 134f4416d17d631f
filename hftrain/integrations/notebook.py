"""Notebook conveniences: hftrain errors shown as one clear line, and multi-process training from a cell.

`import hftrain` in IPython/Jupyter installs the error display. `hftrain.integrations.notebook.launch(recipe, 2)` trains
in 2 processes on the CLI's own launcher (`--accelerate-config`: accelerate launch on GPUs, gloo processes on CPU).
accelerate's notebook_launcher is not used: it refuses to fork once bitsandbytes is imported, and transformers
imports bitsandbytes (when installed) as soon as TrainingArguments is, so it fails in any session that imported
hftrain.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hftrain.errors import HftrainError


def show_errors_plainly() -> None:
    """In IPython, print an HftrainError as the CLI does (one message, no traceback)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return

    def plain(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: int | None = None) -> None:
        print(f"hftrain: error: {value}")

    shell.set_custom_exc((HftrainError,), plain)


def launch(recipe: Any, num_processes: int = 2, accelerate_config: str = "ddp") -> Path:
    """Train `recipe` in `num_processes` processes from a notebook; returns the final model directory."""
    from hftrain.checkpoint.layout import RunLayout
    from hftrain.launch.processes import relaunch
    from hftrain.parallel import rehearsal
    from hftrain.planning.part import PlanPart
    from hftrain.recipe.load import recipe_to_dict
    from hftrain.recipe.yaml_io import dump_yaml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.touch(mode=0o600)  # the child processes need the recipe as it is, secrets included
        path.write_text(dump_yaml(recipe_to_dict(recipe, redact=False)), encoding="utf-8")
        code = relaunch(
            [str(path)], accelerate_config, num_processes, cpu=rehearsal.on_cpu(), checks=PlanPart.of(recipe)
        )
    final = RunLayout(Path(recipe.training.output_dir)).final
    if code != 0:
        raise HftrainError(
            f"notebook launch: the {num_processes} training processes failed (exit {code}); see their output above."
        )
    if not (final / "config.json").is_file():
        raise HftrainError(f"notebook launch: the processes ended without writing {final}; see their output above.")
    return final
