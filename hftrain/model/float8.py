"""FP8's surgery on the model (``speed.fp8``; speed/fp8.py decides whether a run uses it): which nn.Linear layers
convert (``layer_choice``, pure: module names and shapes, so it runs on the meta device and needs no torchao), and
their swap for torchao's Float8Linear (``apply``). Beside attention.py and fused_loss.py: a change to the model as
the run trains it."""

from __future__ import annotations

from typing import Any

from hftrain import _compat
from hftrain.model.shape import ModelShape, of_module

ALIGN = 16  # FP8 GEMMs (torch._scaled_mm) need both matrix dimensions divisible by 16


def layer_choice(shape: ModelShape) -> dict[str, str | None]:
    """Every nn.Linear of the model by name: why it stays in high precision, or None where it converts to FP8."""
    prefix, count = shape.blocks, len(shape.block_params)
    ends = {f"{prefix}.0.", f"{prefix}.{count - 1}."} if count else set()
    choice: dict[str, str | None] = {}
    for linear in shape.linears:
        name = linear.name
        if linear.head:
            choice[name] = "the output head"
        elif not count or not name.startswith(f"{prefix}.") or any(name.startswith(end) for end in ends):
            choice[name] = "outside the blocks, or in the first or last block"
        elif linear.in_features % ALIGN or linear.out_features % ALIGN:
            choice[name] = f"in or out features not a multiple of {ALIGN}"
        else:
            choice[name] = None
    return choice


def converted(shape: ModelShape) -> list[str]:
    """The names of the nn.Linear modules FP8 converts (`layer_choice`)."""
    return [name for name, why in layer_choice(shape).items() if why is None]


def apply(model: Any, fp8: str) -> Any:
    """Swap the chosen linear layers (`converted`) for torchao's Float8Linear, in place, with the recipe's scaling."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set(converted(of_module(model, seq_len=0)))  # the module's own names
    if fp8 == "rowwise":
        _compat.exact_compiled_casts()  # torchtitan's workaround for NaNs with compiled rowwise casts (_compat.py)
    config = Float8LinearConfig.from_recipe_name(fp8)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
