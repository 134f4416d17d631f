"""How a model built from scratch draws its weights (model.init_method, model.output_layer_init_method), as
gpt-neox does (megatron/model/init_functions.py), where transformers draws every weight from N(0,
initializer_range).

Pythia was trained with ``init_method: small_init`` and ``output_layer_init_method: wang_init`` (its configs, e.g.
pythia-160m.yml):
- small_init, N(0, sqrt(2 / (5 d))) (Nguyen & Salazar 2019): the input embedding, attention's query/key/value, the
  MLP's first layer and the output head (gpt-neox's ``init_method`` layers);
- wang_init, N(0, 2 / (L sqrt(d))): the two layers that write into the residual stream, attention's output and the
  MLP's second layer (its ``output_layer_init_method`` layers);
with d the hidden size and L the number of layers; biases are zero and the LayerNorms one and zero, as in both.
At pythia-160m (d 768, L 12) that is 0.0228 and 0.0060, against transformers' 0.02 for all: the residual writes
start 3.3 times smaller. The draws come from one generator seeded with training.seed, so every process builds the
same weights whatever it drew before.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# gpt-neox's layer roles in transformers' GPTNeoX block module names; the embedding and the output head are found
# by the model's own accessors (the head is lm_head in transformers 5, embed_out before)
INPUT_LAYERS = ("attention.query_key_value", "mlp.dense_h_to_4h")
OUTPUT_LAYERS = ("attention.dense", "mlp.dense_4h_to_h")


def small_init_std(hidden: int) -> float:
    return math.sqrt(2 / (5 * hidden))


def wang_init_std(layers: int, hidden: int) -> float:
    return 2 / layers / math.sqrt(hidden)


def stds(config: Any, init_method: str, output_layer_init_method: str) -> dict[str, float]:
    """The standard deviation each layer role draws from: {"input": ..., "output": ...}."""
    normal = float(config.initializer_range)
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    return {
        "input": small_init_std(hidden) if init_method == "small_init" else normal,
        "output": wang_init_std(layers, hidden) if output_layer_init_method == "wang_init" else normal,
    }


def apply(model: Any, init_method: str, output_layer_init_method: str, seed: int) -> None:
    """Redraw a freshly built GPTNeoX model's weights by the recipe's methods, in place; "normal" for both leaves
    transformers' own draws untouched."""
    if init_method == "normal" and output_layer_init_method == "normal":
        return
    std = stds(model.config, init_method, output_layer_init_method)
    roles = {id(model.get_input_embeddings()): "input", id(model.get_output_embeddings()): "input"}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            role = roles.get(id(module)) or _role(name)
            if role is None:
                continue
            module.weight.normal_(0.0, std[role], generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


def _role(name: str) -> str | None:
    if name.endswith(OUTPUT_LAYERS):
        return "output"
    if name.endswith(INPUT_LAYERS):
        return "input"
    return None
