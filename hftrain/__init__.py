"""hftrain: pretrain and fine-tune GPT-NeoX-style language models on the Hugging Face stack.

The Python API is the CLI's code path::

    import hftrain
    recipe = hftrain.load_recipe("recipes/quickstart.yaml", training={"max_steps": 50})
    run = hftrain.train(recipe)
    run.metrics["eval_loss"], run.final_dir, run.generate("The ")
"""

from .errors import HftrainError
from .recipe import load_recipe
from .plan import plan
from .train import Run, train

__version__ = "0.1.0"
__all__ = ["HftrainError", "Run", "load_recipe", "plan", "train"]
