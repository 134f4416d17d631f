"""hftrain: pretrain and fine-tune GPT-NeoX-style language models on the Hugging Face stack.

The Python API is the CLI's code path::

    import hftrain
    recipe = hftrain.load_recipe("recipes/quickstart.yaml", training={"max_steps": 50})
    run = hftrain.train(recipe)
    run.metrics["eval_loss"], run.final_dir, run.generate("The ")

Importing hftrain changes nothing global (no patches, no handlers): a run applies what it needs when it starts
(hftrain/_compat.py), and a notebook shows hftrain's errors as one line after
``hftrain.integrations.notebook.show_errors_plainly()``.
"""

from __future__ import annotations

import importlib
from typing import Any

from hftrain.errors import HftrainError

__version__ = "0.1.0"
__all__ = ["HftrainError", "Run", "load_recipe", "plan", "train"]
_LAZY = {
    "load_recipe": "hftrain.recipe.load",
    "plan": "hftrain.planning",
    "Run": "hftrain.training.run_record",
    "train": "hftrain.training.run",
}


def __getattr__(name: str) -> Any:
    """The API's functions load with their libraries on first use: `import hftrain` stays light and changes nothing."""
    if name not in _LAZY:
        raise AttributeError(f"module 'hftrain' has no attribute {name!r}")
    from hftrain import _compat

    _compat.quiet_optional_warnings()  # before transformers imports bitsandbytes
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
