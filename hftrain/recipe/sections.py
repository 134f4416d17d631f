"""The recipe's smaller sections (hub, faults, monitor, profile) and the base every section shares; schema.py
holds the others and the whole Recipe. Each field is documented right under it, for `hftrain explain`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hftrain.recipe.training_section import bool_is_not_a_number


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, docstrings are field docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)
    _no_bool_for_number = field_validator("*", mode="before")(bool_is_not_a_number)


# ----------------------------------------------------------------------------------------------------- hub
class HubSection(Section):
    """Sharing the model, beyond TrainingArguments' own hub fields (push_to_hub, hub_model_id, hub_strategy,
    hub_private_repo, hub_revision). The hub token comes from HF_TOKEN or `hf auth login`, never from here."""

    s3_uri: str | None = None
    """Also copy the final model (and, with a hub_strategy other than end, every checkpoint) to this s3:// URL."""
    storage_options: dict[str, Any] = {}
    """fsspec options for s3_uri (default: the standard AWS environment and config)."""
    license: str = "apache-2.0"
    """License written into the model card's metadata."""
    tags: list[str] = []
    """Extra model card tags."""


# -------------------------------------------------------------------------------------------------- faults
class FaultsSection(Section):
    """What a run does when something goes wrong in the middle of it."""

    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/Inf loss or gradient norm: stop at once (the last good checkpoint is kept) or skip that optimizer step."""
    max_skipped_steps: int = Field(default=10, ge=0)
    """With skip: stop anyway once this many steps have been skipped in one run (something is wrong for good)."""
    network_timeout_s: float = Field(default=60.0, gt=0)
    """An endpoint (S3, GCS, the Hub) that accepts the connection but does not answer is an error naming it within
    this many seconds, retries included: every network client gets connect and read timeouts from it."""


# --------------------------------------------------------------------------------------------- monitor
class EvalTask(Section):
    """An extra metric computed at every evaluation during training (as `hftrain eval` computes it)."""

    data: str
    """A .jsonl / .txt file, directory, glob or fsspec URL (s3://, hf://), or hf:NAME[:CONFIG[:SPLIT]]."""
    metric: Literal["perplexity", "bits_per_byte", "last_word_accuracy"] = "perplexity"
    """perplexity and bits_per_byte: strided sliding window; last_word_accuracy: LAMBADA-style passages."""
    name: str | None = None
    """Name in the logs (eval_NAME_METRIC). Default: the file name without extensions."""
    text_field: str = "text"
    """JSON field holding the text."""
    limit: int | None = Field(default=200, gt=0)
    """Use at most this many documents (evaluation runs often: keep it quick)."""
    context: int | None = Field(default=None, gt=1)
    """Window length in tokens for perplexity / bits_per_byte. Default: the model's context, at most 1024."""
    stride: int | None = Field(default=None, gt=0)
    """Window step. Default: context // 2."""


class MonitorSection(Section):
    """What hftrain reports beyond the loss."""

    peak_tflops: float | None = Field(default=None, gt=0)
    """Peak TFLOP/s of one device for MFU. Default: measured with a short matmul at start."""
    price_per_hour: float | None = Field(default=None, gt=0)
    """Price of the whole job in USD per hour; adds tokens_per_usd to the logs."""
    sample_prompt: str = "The "
    """Prompt of the text sample generated at the end of training."""
    sample_max_new_tokens: int = Field(default=48, ge=0)
    """Length of the end-of-run sample (0 disables it)."""
    plot: bool = True
    """Write a PNG of loss and grad-norm against step into the output directory."""
    eval_tasks: list[EvalTask] = []
    """Extra metrics at every evaluation (training.eval_steps and the end of training), e.g.
    [{data: lambada.jsonl, metric: last_word_accuracy}]. Perplexity and bits per byte of the validation
    set are always added."""
    input_bound_threshold: float = Field(default=0.2, gt=0, le=1)
    """Warn (live, and in the end-of-run summary) when more than this share of the step time is spent waiting
    for data: the accelerator is starved and more compute will not make the run faster."""


# -------------------------------------------------------------------------------------------- profile
class ProfileSection(Section):
    """torch.profiler over a few training steps: a trace for Perfetto / TensorBoard and a text summary."""

    start_step: int | None = Field(default=None, ge=1)
    """First optimizer step to profile (1-based, as in the logs). Unset: no profiling."""
    steps: int = Field(default=3, ge=1)
    """How many consecutive steps to profile (a few: traces grow fast)."""
    record_shapes: bool = False
    """Record input shapes of each operation (bigger trace; groups the summary by shape)."""
    profile_memory: bool = False
    """Record tensor allocations and frees."""
    with_stack: bool = False
    """Record the Python stack of each operation (much bigger trace)."""
