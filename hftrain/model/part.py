"""The model's part of the recipe and the model it builds: `ModelPart.of(recipe)` is the one place that says what
the model, its tokenizer (model/tokenizer.py) and its fine-tuning method (model/finetune.py) read of a recipe, and
`ModelPart.build(...)` makes the model as the run trains it from that part and the run's objects: its weights
(model/build.py), its FP8 layers, its attention kernel, its loss, its method, its placement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hftrain import _compat
from hftrain.model import attention, float8, fused_loss
from hftrain.parallel.dims import ParallelDims, Strategy, spread_over_devices
from hftrain.recipe.objectives import OBJECTIVES, Objective

if TYPE_CHECKING:
    from hftrain.recipe.finetune_section import FinetuneSection
    from hftrain.recipe.schema import ModelSection, Recipe, TokenizerSection


@dataclass(frozen=True)
class ModelPart:
    """The model, tokenizer and finetune sections, data.seq_len (checked against the model's context, and in its
    FLOPs), training.seed (a preset's init, an adapter's), parallelism.max_memory (device_map's placement) and
    whether the data's blocks are plain causal ones (no document mask, no padding: the maskless SDPA path)."""

    model: ModelSection
    tokenizer: TokenizerSection
    finetune: FinetuneSection
    seq_len: int
    seed: int
    max_memory: dict[Any, Any] | None = None
    plain_blocks: bool = True  # not data.masks_documents and not preference data

    @classmethod
    def of(cls, recipe: Recipe) -> ModelPart:
        m, tok, ft, data = recipe.model, recipe.tokenizer, recipe.finetune, recipe.data
        return cls(
            m,
            tok,
            ft,
            seq_len=data.seq_len,
            seed=recipe.training.seed,
            max_memory=recipe.parallelism.max_memory,
            plain_blocks=not (data.masks_documents or data.preference_data),
        )

    @property
    def from_pretrained(self) -> str | None:
        return self.model.from_pretrained

    @property
    def preset(self) -> str | None:
        return self.model.preset

    @property
    def objective(self) -> Objective:
        """What finetune.objective means for the model, its data and its Trainer (recipe/objectives.py)."""
        return OBJECTIVES[self.finetune.objective]

    def build(
        self,
        tokenizer: Any,
        tokenizer_is_new: bool,
        dims: ParallelDims,
        *,
        fp8: str | None = None,
        chunked_loss: bool = False,
        gradient_checkpointing: bool = False,
    ) -> Any:
        """The model as this run trains it; `fp8` and `chunked_loss` are the speed plan's choices (speed/defaults.py),
        `gradient_checkpointing` the TrainingArguments' (an adapter's preparation reads it)."""
        from hftrain.model.build import build_model  # transformers' modeling: `hftrain plan` reads the part only
        from hftrain.model.finetune import apply_method

        model = build_model(self, tokenizer, tokenizer_is_new, dims)
        if fp8:
            float8.apply(model, fp8)  # torchao's Float8Linear in the chosen layers (model/float8.py)
        kernel = model.config._attn_implementation
        if kernel == "flex_attention":
            _compat.flex_uncompiled_on_cpu()  # CPU: torch's exact unfused flex (_compat.py)
        if attention.applies(kernel, model.config.model_type, not self.plain_blocks):
            attention.use(model)  # SDPA with is_causal and no mask (model/attention.py)
        if chunked_loss:
            fused_loss.use(model)  # fewer passes over the logits (fused_loss.py)
        if not self.objective.wraps_adapter:  # DPO: TRL wraps the adapter itself (training/dpo.py)
            model = apply_method(model, self, gradient_checkpointing)
        if dims.strategy is Strategy.DEVICE_MAP:
            model = spread_over_devices(model, self.max_memory)
        return model
