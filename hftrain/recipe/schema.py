"""The recipe schema: one pydantic model per section, each field documented right under it.

Those docstrings are what `hftrain explain` and `hftrain train --help` print. The ``training`` section is
not written out here: it is generated from transformers' ``TrainingArguments``, so its keys, types and help
texts are exactly Hugging Face's.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hftrain.recipe.data_section import DataSection
from hftrain.recipe.finetune_section import FinetuneSection
from hftrain.recipe.objectives import OBJECTIVES
from hftrain.recipe.presets import PRESETS
from hftrain.recipe.sections import (
    CheckpointsSection,
    FaultsSection,
    HubSection,
    LrScheduleSection,
    MonitorSection,
    ParallelismSection,
    ProfileSection,
    Section,
    SpeedSection,
)
from hftrain.recipe.training_section import TRAINING_DEFAULTS, TrainingSection

# ----------------------------------------------------------------------------------------------- model
DROPOUT_FIELDS = ("hidden_dropout", "attention_dropout")
INIT_FIELDS = ("init_method", "output_layer_init_method")  # how new weights are drawn (model/init_methods.py)


class ModelSection(Section):
    """What network to train: a named GPT-NeoX shape built from scratch, or pretrained weights."""

    preset: str | None = "pythia-14m"
    """Named GPT-NeoX shape (see `hftrain presets`): the Pythia suite, neox-20b, and small cpu-* shapes.
    Ignored when from_pretrained is set."""
    from_pretrained: str | None = None
    """A local model directory or hub id to start from (continued pretraining or fine-tuning). This is a new
    run starting from those weights; resuming an interrupted run is automatic (training.resume_from_checkpoint)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for from_pretrained."""
    trust_remote_code: bool = False
    """Allow from_pretrained to run Python code shipped with the checkpoint. Off unless you trust the source."""
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"] = "sdpa"
    """Attention kernel, as in transformers. flash_attention_2/3 need a CUDA GPU and the flash-attn package (v2 or
    v3). Packed documents are kept apart on every one of them (data/packed_batch.py); on a GPU, flash attention
    needs no mask at all, while sdpa builds a batch x seq_len^2 mask for packed data."""
    vocab_size: int | None = Field(default=None, gt=0)
    """Embedding rows. Default: the preset's published size when the tokenizer fits in it, else the tokenizer
    size padded up to pad_vocab_multiple."""
    pad_vocab_multiple: int = Field(default=128, gt=0)
    """Round a new tokenizer's vocabulary up to a multiple of this (tensor-core friendly)."""
    hidden_size: int | None = Field(default=None, gt=0)
    """Overrides the preset's hidden size."""
    num_hidden_layers: int | None = Field(default=None, gt=0)
    """Overrides the preset's number of transformer layers."""
    num_attention_heads: int | None = Field(default=None, gt=0)
    """Overrides the preset's number of attention heads (must divide hidden_size)."""
    intermediate_size: int | None = Field(default=None, gt=0)
    """Overrides the MLP width (Pythia: 4 x hidden_size)."""
    max_position_embeddings: int | None = Field(default=None, gt=0)
    """Longest context the model supports (Pythia: 2048). data.seq_len may not exceed it."""
    rotary_pct: float | None = Field(default=None, gt=0, le=1)
    """Fraction of each head's dimensions that get rotary embeddings (Pythia: 0.25)."""
    rotary_emb_base: float | None = Field(default=None, gt=0)
    """Rotary base frequency theta (Pythia: 10000)."""
    use_parallel_residual: bool | None = None
    """Attention and MLP read the same input and are summed (GPT-J/NeoX style). Pythia: true."""
    tie_word_embeddings: bool | None = None
    """Share the input embedding with the output head. Pythia: false."""
    hidden_dropout: float | None = Field(default=None, ge=0, lt=1)
    """Dropout after attention/MLP. Pythia: 0."""
    attention_dropout: float | None = Field(default=None, ge=0, lt=1)
    """Dropout on attention probabilities. Pythia: 0."""
    layer_norm_eps: float | None = Field(default=None, gt=0)
    """LayerNorm epsilon (Pythia: 1e-5)."""
    initializer_range: float | None = Field(default=None, gt=0)
    """Std of the normal initialisation of new weights (init_method normal)."""
    init_method: Literal["normal", "small_init"] = "normal"
    """How a model built from scratch draws the embedding, attention's query/key/value, the MLP's first layer and
    the output head: normal, N(0, initializer_range), as transformers draws them; small_init, N(0, sqrt(2 / (5 x
    hidden_size))), as gpt-neox trained Pythia (model/init_methods.py)."""
    output_layer_init_method: Literal["normal", "wang_init"] = "normal"
    """How a model built from scratch draws the layers that write into the residual stream (attention's output,
    the MLP's second layer): normal, N(0, initializer_range); wang_init, N(0, 2 / (num_hidden_layers x
    sqrt(hidden_size))), as gpt-neox trained Pythia."""

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str | None) -> str | None:
        if name is not None and name not in PRESETS:
            close = difflib.get_close_matches(name, PRESETS, n=1)
            raise ValueError(
                f"unknown preset {name!r}; " + (f"did you mean {close[0]}?" if close else "see `hftrain presets`")
            )
        return name

    @model_validator(mode="after")
    def _a_shape_to_build(self) -> ModelSection:
        if self.preset is None and self.from_pretrained is None:
            raise ValueError(
                "preset is null and from_pretrained is not set; give model.preset (see `hftrain presets`) or "
                "model.from_pretrained"
            )
        return self

    @model_validator(mode="after")
    def _drawn_only_when_built(self) -> ModelSection:
        if self.from_pretrained is not None:
            drawn = [key for key in INIT_FIELDS if getattr(self, key) != "normal"]
            if drawn:
                verb = "draws" if len(drawn) == 1 else "draw"
                raise ValueError(
                    f"{' and '.join(drawn)} {verb} the weights of a model built from scratch, but from_pretrained "
                    "loads its weights; remove them, or build from model.preset"
                )
        return self

    def architecture_overrides(self) -> dict[str, Any]:
        """The GPTNeoXConfig shape fields this recipe sets explicitly (dropout is training behaviour, not shape)."""
        skip = {
            "preset",
            "from_pretrained",
            "revision",
            "trust_remote_code",
            "attn_implementation",
            "pad_vocab_multiple",
            *DROPOUT_FIELDS,
            *INIT_FIELDS,
        }
        return {k: v for k, v in self.model_dump().items() if k not in skip and v is not None}


# ------------------------------------------------------------------------------------------- tokenizer
class TrainTokenizer(Section):
    """Learn a byte-level BPE on the recipe's own training data (saved with the run, reused on resume)."""

    vocab_size: int = Field(default=8192, ge=260)
    """Target vocabulary size, special tokens included."""
    min_frequency: int = Field(default=2, ge=1)
    """A merge must occur this often in the sample to be learnt."""
    max_documents: int = Field(default=20_000, gt=0)
    """Documents read from the start of the training data to learn from."""
    special_tokens: list[str] = ["<|endoftext|>"]
    """Special tokens to reserve; the first is the end-of-document token."""


class TokenizerSection(Section):
    """Which tokenizer turns text into ids. Give exactly one of builtin, path or train."""

    builtin: Literal["gpt2"] | None = "gpt2"
    """A tokenizer that ships with hftrain: gpt2 is the 50,257-token GPT-2 BPE the NeoX runs used."""
    path: str | None = None
    """A local tokenizer directory or hub id, loaded with AutoTokenizer."""
    train: TrainTokenizer | None = None
    """Learn a new BPE tokenizer on the training data."""
    trust_remote_code: bool = False
    """Allow a tokenizer from path to run shipped Python code."""
    chat_template: str | None = None
    """Jinja chat template for chat data; default: the tokenizer's own, else a ChatML-style one."""
    replace_model_tokenizer: bool = False
    """With model.from_pretrained, a tokenizer other than the model's own (a different builtin or path, or one
    trained here) is refused: its ids would mean other text to the model. True says the replacement is intended.
    Without builtin, path or train, a from_pretrained model brings its own tokenizer."""

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> TokenizerSection:
        chosen = [k for k in ("path", "train") if getattr(self, k) is not None]
        if "builtin" in self.model_fields_set and self.builtin is not None:
            chosen.insert(0, "builtin")
        if len(chosen) > 1:
            raise ValueError(f"give only one of builtin, path or train (got {', '.join(chosen)})")
        if chosen and chosen[0] != "builtin":
            self.builtin = None
        if not chosen and self.builtin is None:
            raise ValueError("give one of builtin, path or train")
        return self


class Recipe(Section):
    """One whole run: model, tokenizer, data, training hyper-parameters and reporting."""

    model: ModelSection = ModelSection()
    """The network."""
    tokenizer: TokenizerSection = TokenizerSection()
    """Text to ids."""
    data: DataSection = DataSection()
    """Training and validation text."""
    training: TrainingSection = Field(default_factory=TrainingSection)  # type: ignore[valid-type]
    """transformers.TrainingArguments, names as they are (see `hftrain explain training`)."""
    lr_schedule: LrScheduleSection = LrScheduleSection()
    """A learning-rate schedule transformers lacks (Pythia's gpt-neox annealing) instead of training's own."""
    finetune: FinetuneSection = FinetuneSection()
    """Full training or LoRA / QLoRA / 8-bit LoRA."""
    parallelism: ParallelismSection = ParallelismSection()
    """Data-parallel / sharded / pipelined training (the backend itself comes from the launcher)."""
    hub: HubSection = HubSection()
    """Model card details and an S3 target."""
    checkpoints: CheckpointsSection = CheckpointsSection()
    """Checkpoints kept for study (Pythia's schedule, log-spaced, a list), and their Hub revisions."""
    faults: FaultsSection = FaultsSection()
    """Non-finite losses and gradients."""
    monitor: MonitorSection = MonitorSection()
    """Throughput, MFU, cost and end-of-run reporting."""
    profile: ProfileSection = ProfileSection()
    """torch.profiler over chosen training steps."""
    speed: SpeedSection = SpeedSection()
    """Speed levers beyond TrainingArguments' own: the loss's kernel, FP8."""

    @model_validator(mode="after")
    def _the_model_brings_its_tokenizer(self) -> Recipe:
        tok, source = self.tokenizer, self.model.from_pretrained
        if source and not any(
            getattr(tok, kind) is not None for kind in ("builtin", "path", "train") if kind in tok.model_fields_set
        ):
            tok.path, tok.builtin = source, None  # the model's own tokenizer travels with it
        elif source and tok.train is not None and not tok.replace_model_tokenizer:
            raise ValueError(
                f"tokenizer.train: a new tokenizer for {source}, whose embeddings were trained with its own; remove "
                "the tokenizer section to use the model's, or set "
                "tokenizer.replace_model_tokenizer: true if that is intended"
            )
        return self

    @model_validator(mode="after")
    def _quantized_needs_weights(self) -> Recipe:
        if self.finetune.method in ("qlora", "lora_8bit") and not self.model.from_pretrained:
            raise ValueError(
                f"finetune.method {self.finetune.method} quantizes pretrained weights: set model.from_pretrained"
            )
        return self

    @model_validator(mode="after")
    def _dpo_needs_pairs(self) -> Recipe:
        wants_pairs, pairs = OBJECTIVES[self.finetune.objective].data_format == "preference", self.data.preference_data
        if wants_pairs and not pairs:
            raise ValueError(
                f"finetune.objective {self.finetune.objective} trains on preference pairs: set format: preference on "
                "data.train (records with prompt, chosen and rejected)"
            )
        if pairs and not wants_pairs:
            raise ValueError(
                "data.train: preference pairs (format: preference) train with finetune.objective: dpo; set it, "
                "or give prompt_completion / chat data for supervised fine-tuning"
            )
        return self

    @model_validator(mode="after")
    def _revisions_need_a_hub_repo(self) -> Recipe:
        if self.checkpoints.push_revisions and not self.training_kwargs().get("push_to_hub"):
            raise ValueError(
                "checkpoints.push_revisions pushes kept checkpoints as Hub branches: set training.push_to_hub: true "
                "and training.hub_model_id"
            )
        if self.checkpoints.push_revisions and not (self.checkpoints.schedule or self.checkpoints.steps):
            raise ValueError(
                "checkpoints.push_revisions: no checkpoint is kept; set checkpoints.schedule or checkpoints.steps"
            )
        return self

    @model_validator(mode="after")
    def _one_schedule(self) -> Recipe:
        """lr_schedule.type replaces TrainingArguments' schedule: its keys, given too, would be ignored without a word
        (hftrain's own defaults for them are not the user's choice, and stay)."""
        if self.lr_schedule.type is None:
            return self
        training, given = self.training, []
        for key in ("lr_scheduler_type", "warmup_steps", "lr_scheduler_kwargs"):
            value = getattr(training, key)
            if key in training.model_fields_set and value != TRAINING_DEFAULTS.get(key) and value not in (None, {}):
                given.append(f"training.{key}")
        if given:
            raise ValueError(
                f"lr_schedule.type {self.lr_schedule.type} replaces training's schedule, so {' and '.join(given)} "
                "would be ignored; remove them (its warmup is lr_schedule.warmup_fraction), or remove lr_schedule.type"
            )
        return self

    @model_validator(mode="after")
    def _kept_steps_are_reached(self) -> Recipe:
        last = self.training_kwargs().get("max_steps") or -1
        beyond = [s for s in self.checkpoints.steps if last > 0 and s > last]
        if beyond:
            raise ValueError(
                f"checkpoints.steps: {', '.join(map(str, beyond))} after training.max_steps ({last}) would never be "
                "kept; remove them, or raise training.max_steps (a longer run continues this one)"
            )
        return self

    @model_validator(mode="after")
    def _stored_order_starts_at_the_models_step(self) -> Recipe:
        """A stored-order run from Pythia's `stepN` revision continues at corpus step N unless data.start_step says
        otherwise; the value is written into the recipe, so the saved recipe says where the run began."""
        if self.data.order == "stored" and self.data.start_step is None:
            step = re.fullmatch(r"step(\d+)", self.model.revision or "")
            self.data.start_step = int(step[1]) if step and self.model.from_pretrained else 0
        return self

    def training_kwargs(self) -> dict[str, Any]:
        """The TrainingArguments keys this recipe sets (hftrain defaults included), for TrainingArguments(**...)."""
        return self.training.model_dump(exclude_unset=True)
