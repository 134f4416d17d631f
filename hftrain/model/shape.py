"""What a recipe's model is made of, as numbers: its parameters by part, its linear layers, its repeated blocks and
its training FLOPs per token. They feed the speed defaults, MFU, speed.fp8's choice of layers and `hftrain plan`.

A GPT-NeoX config gives them by arithmetic (``of_gpt_neox``), so that `hftrain plan` and a run's start import no
modeling code for them (transformers' modeling stack costs more than torch itself to import), and a preset recipe's
fields give them without importing transformers at all (model/config.py's ``config_view``; transformers' config is
made when something asks for ``ModelShape.config``). Any other model (a pretrained checkpoint's own code,
trust_remote_code) is built on the meta device and read (``of_module``). tests/model/test_shape.py holds the
arithmetic to the meta model's numbers, layer by layer, on each supported transformers.

Training FLOPs per token follow the PaLM appendix: 6 N + 12 L d T, where N counts the parameters that do matmuls
(all but the input embedding, so the output head is included), L layers, d hidden size, T context.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hftrain.model.config import check_context, config_view, tokenizer_size_estimate
from hftrain.model.remote_code import allow
from hftrain.recipe.objectives import OBJECTIVES

if TYPE_CHECKING:
    from hftrain.model.part import ModelPart

GPT_NEOX_BLOCKS = "gpt_neox.layers"


@dataclass(frozen=True)
class Linear:
    """One nn.Linear of the model, by its module name."""

    name: str
    in_features: int
    out_features: int
    head: bool = False  # the output head (the LM head: never quantized, never in FP8)

    @property
    def params(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class ModelShape:
    """A recipe's model as numbers, measured once per run (nothing allocated)."""

    dims: Any  # the config's attributes the numbers come from (num_hidden_layers, hidden_size, vocab_size, ...)
    counts: dict[str, int]  # total, embedding, head (0 when tied to the embedding), non_embedding
    linears: tuple[Linear, ...]
    blocks: str  # the dotted name of the repeated blocks (GPT-NeoX: gpt_neox.layers); "" without any
    block_params: tuple[int, ...]  # the parameters of each block, in order
    flops_per_token: float
    make_config: Callable[[], Any] = field(default=lambda: None, compare=False, repr=False)

    @functools.cached_property
    def config(self) -> Any:
        """transformers' config of the model (made at the first use: a preset's needs transformers imported)."""
        return self.make_config() or self.dims

    @property
    def matmul_params(self) -> int:
        return self.counts["total"] - self.counts["embedding"]

    @property
    def largest_block_params(self) -> int:
        """The largest unit FSDP wraps (one block; the whole model without blocks)."""
        return max(self.block_params, default=self.counts["total"])

    @property
    def all_block_params(self) -> int:
        return sum(self.block_params) if self.block_params else self.counts["total"]


def flops_per_token(counts: dict[str, int], config: Any, seq_len: int, objective: str = "lm") -> float:
    """6N + 12·L·d·T per trained token (forward a third, backward two thirds), times the objective's factor (under
    DPO the reference's forward on the same token adds a third: 8N + 16·L·d·T)."""
    matmul_params = counts["total"] - counts["embedding"]
    return (6.0 * matmul_params + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len) * OBJECTIVES[
        objective
    ].flops_factor


def is_plain_gpt_neox(config: Any) -> bool:
    """transformers' own GPT-NeoX (not a checkpoint's code): the model `of_gpt_neox` counts."""
    from transformers import GPTNeoXConfig

    return type(config) is GPTNeoXConfig and "AutoModelForCausalLM" not in (getattr(config, "auto_map", None) or {})


def of_gpt_neox(config: Any, seq_len: int, objective: str = "lm") -> ModelShape:
    """transformers' GPTNeoXForCausalLM of `config`, counted from the config: per block two LayerNorms, the fused
    query/key/value and output projections (biased with attention_bias) and the two biased MLP projections; around
    them the input embedding, the final LayerNorm and the LM head (none of its own when tied to the embedding)."""
    h, i, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    attention_bias = bool(getattr(config, "attention_bias", True))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    linears: list[Linear] = []
    for n in range(layers):
        at = f"{GPT_NEOX_BLOCKS}.{n}"
        linears += [
            Linear(f"{at}.attention.query_key_value", h, 3 * h),
            Linear(f"{at}.attention.dense", h, h),
            Linear(f"{at}.mlp.dense_h_to_4h", h, i),
            Linear(f"{at}.mlp.dense_4h_to_h", i, h),
        ]
    linears.append(Linear("lm_head", h, vocab, head=True))
    block = 2 * 2 * h + 4 * h * h + (4 * h if attention_bias else 0) + 2 * h * i + i + h
    embedding, head = vocab * h, 0 if tied else h * vocab
    total = embedding + layers * block + 2 * h + head
    counts = {"total": total, "embedding": embedding, "head": head, "non_embedding": total - embedding - head}
    return ModelShape(
        config,
        counts,
        tuple(linears),
        GPT_NEOX_BLOCKS,
        (block,) * layers,
        flops_per_token(counts, config, seq_len, objective),
    )


def of_module(model: Any, seq_len: int, objective: str = "lm") -> ModelShape:
    """Any model, read from its modules (on the meta device: nothing allocated). Its blocks: the first ModuleList."""
    import torch

    head_module = model.get_output_embeddings()
    linears = tuple(
        Linear(name, m.in_features, m.out_features, head=m is head_module)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    )
    blocks, block_params = "", ()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module):
            blocks, block_params = name, tuple(sum(p.numel() for p in block.parameters()) for block in module)
            break
    counts = parameter_counts(model)
    return ModelShape(
        model.config, counts, linears, blocks, block_params, flops_per_token(counts, model.config, seq_len, objective)
    )


def parameter_counts(model: Any) -> dict[str, int]:
    """Total, input-embedding, output-head and non-embedding parameters of a module (Pythia's table convention)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head_module = model.get_output_embeddings()
    tied = head_module is not None and head_module.weight is model.get_input_embeddings().weight
    head = 0 if head_module is None or tied else head_module.weight.numel()
    return {"total": total, "embedding": embed, "head": head, "non_embedding": total - embed - head}


def meta_model(part: ModelPart, config: Any) -> Any:
    """The model of `config` with no memory allocated (meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = part.model
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, trust_remote_code=allow(m.trust_remote_code, "model.trust_remote_code", m.from_pretrained)
        )


def measure_model(part: ModelPart) -> ModelShape:
    """The recipe's model as numbers, with the checks `hftrain train` makes before it builds one (the tokenizer, a
    pretrained checkpoint's weights, the context): for the speed defaults, MFU and `hftrain plan`."""
    size, is_new = tokenizer_size_estimate(part)
    view, make_config = config_view(part, size, is_new)
    check_context(part, view)  # `hftrain plan` refuses what `hftrain train` refuses
    objective = part.finetune.objective
    if not part.model.from_pretrained or is_plain_gpt_neox(view):  # a preset is always transformers' GPT-NeoX
        counted = of_gpt_neox(view, part.seq_len, objective)
    else:
        counted = of_module(meta_model(part, view), part.seq_len, objective)
    return replace(counted, make_config=make_config)
