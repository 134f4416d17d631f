"""hftrain: pretrain and fine-tune GPT-NeoX-style language models on the Hugging Face stack.

The Python API is the CLI's code path::

    import hftrain
    recipe = hftrain.load_recipe("recipes/quickstart.yaml", training={"max_steps": 50})
    run = hftrain.train(recipe)
    run.metrics["eval_loss"], run.final_dir, run.generate("The ")
"""

from .errors import HftrainError
from .recipe import load_recipe

__version__ = "0.1.0"
__all__ = ["HftrainError", "load_recipe", "plan", "train"]


def train(recipe):  # noqa: ANN001, ANN201 - imported lazily: transformers/torch are slow to import
    """Run a recipe (see hftrain.train.train)."""
    from .train import train as _train

    return _train(recipe)


def plan(recipe):  # noqa: ANN001, ANN201
    """Size, FLOPs and memory of a recipe's model (see hftrain.plan.plan)."""
    from .plan import plan as _plan

    return _plan(recipe)
