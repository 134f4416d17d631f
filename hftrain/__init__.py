"""hftrain: pretrain and fine-tune GPT-NeoX-style language models on the Hugging Face stack.

The Python API is the CLI's code path::

    import hftrain
    recipe = hftrain.load_recipe("recipes/quickstart.yaml", training={"max_steps": 50})
    run = hftrain.train(recipe)
    run.metrics["eval_loss"], run.final_dir, run.generate("The ")
"""

import logging as _logging

# bitsandbytes' CPU backend warns on import that an optional kernel package is absent; it is not needed.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)

from .errors import HftrainError  # noqa: E402
from .recipe import load_recipe  # noqa: E402
from .estimates import plan  # noqa: E402
from .run_record import Run  # noqa: E402
from .train import train  # noqa: E402
from .notebook import show_errors_plainly  # noqa: E402

__version__ = "0.1.0"
show_errors_plainly()
__all__ = ["HftrainError", "Run", "load_recipe", "plan", "train"]
