"""The recipe's smaller sections (parallelism, hub, checkpoints, faults, speed, lr_schedule, monitor, profile) and the
base every section shares; schema.py holds the others and the whole Recipe. Each field is documented right under it,
for `hftrain explain`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


# --------------------------------------------------------------------------------------------- checkpoints
PYTHIA_LOG_UNTIL, PYTHIA_EVERY = 512, 1000  # Pythia: steps 1, 2, 4, ..., 512, then every 1,000 (to 143,000)


class CheckpointsSection(Section):
    """Checkpoints kept for study, as Pythia publishes its own, besides training.save_steps' checkpoints (which
    exist for resuming and which training.save_total_limit rotates). A kept checkpoint is a full checkpoint (a run
    resumes from it like any other) that rotation never removes."""

    schedule: Literal["pythia", "log"] | None = None
    """pythia: Pythia's steps 0, 1, 2, 4, ..., 512, then every 1,000; log: 0, 1, 2, 4, ... up to log_until, then
    every `every` steps when that is set. Step 0 is the initialization, kept as output_dir/initial (the weights and
    tokenizer: nothing to resume from)."""
    log_until: int | None = Field(default=None, ge=1)
    """With schedule: log, the last step of the log-spaced part (the largest power of two up to it)."""
    every: int | None = Field(default=None, ge=1)
    """With schedule: log, a kept checkpoint every this many steps after log_until (pythia: 1000)."""
    steps: list[int] = []
    """More steps to keep, e.g. [0, 100, 250, 5000] (alone, or with a schedule)."""
    push_revisions: bool = False
    """Push each kept checkpoint to the Hub while training, in the background, as branch `stepN` of
    training.hub_model_id (needs training.push_to_hub), loadable with from_pretrained(repo, revision="stepN"); the
    final model goes to main and its model card lists the revisions."""

    @field_validator("steps")
    @classmethod
    def _positive_steps(cls, steps: list[int]) -> list[int]:
        if any(s < 0 for s in steps):
            raise ValueError("steps are optimizer steps: 0 (the initialization) or more")
        return sorted(set(steps))

    @model_validator(mode="after")
    def _log_has_an_end(self) -> CheckpointsSection:
        if self.schedule == "log" and self.log_until is None:
            raise ValueError("schedule: log needs log_until (the last log-spaced step), e.g. log_until: 512")
        if self.schedule != "log" and (self.log_until is not None or self.every is not None):
            raise ValueError("log_until and every belong to schedule: log (pythia fixes them at 512 and 1000)")
        return self

    def _log_part(self) -> tuple[int, int | None]:
        if self.schedule == "pythia":
            return PYTHIA_LOG_UNTIL, PYTHIA_EVERY
        return (self.log_until or 0), self.every

    @property
    def keeps_any(self) -> bool:
        """Whether any step's checkpoint is kept apart from save_steps' rotation (a list or a schedule)."""
        return bool(self.steps) or self.schedule is not None

    def keeps(self, step: int) -> bool:
        """Whether the checkpoint after optimizer step `step` is kept (0: the initialization)."""
        if step in self.steps:
            return True
        if self.schedule is None or step < 0:
            return False
        if step == 0:
            return True
        until, every = self._log_part()
        if step <= until:
            return step & (step - 1) == 0  # a power of two
        return every is not None and step % every == 0

    def kept_steps(self, max_steps: int) -> list[int]:
        """Every kept step of a run of max_steps steps, in order."""
        kept = {s for s in self.steps if s <= max_steps}
        if self.schedule is not None:
            kept.add(0)
            until, every = self._log_part()
            kept |= {
                1 << k for k in range(max(min(until, max_steps), 1).bit_length()) if 1 << k <= min(until, max_steps)
            }
            if every is not None:
                kept |= set(range((until // every + 1) * every, max_steps + 1, every))
        return sorted(kept)


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


# ----------------------------------------------------------------------------------------------- speed
class SpeedSection(Section):
    """Speed levers hftrain adds to TrainingArguments' own (bf16, tf32, torch_compile, optim, which stay in
    `training`): how the loss is computed, and FP8 matmuls."""

    loss: Literal["auto", "chunked", "transformers"] = "auto"
    """The causal-LM loss. chunked: cross-entropy over the logits a slice of rows at a time, never a full fp32 copy
    of them (model/fused_loss.py; equal to transformers' loss); transformers: the model's own loss, which upcasts
    all the logits to fp32 at once; auto: chunked where it was measured faster (eager training on a CPU), else
    transformers' (docs/performance.md has the measurements)."""
    fp8: Literal["tensorwise", "rowwise"] | None = None
    """FP8 matmuls in the linear layers through torchao (its `convert_to_float8_training`; pip install
    'hftrain[fp8]'), on GPUs with FP8 (compute capability 8.9+: Ada, Hopper, Blackwell), full training only, not
    under ZeRO-3. The output head, the first and last block and dims not multiples of 16 stay in high precision.
    Needs torch.compile: turned on where training.torch_compile is unset (false is refused). tensorwise: one scale
    per tensor (fastest); rowwise: one per row (closer to bf16). Pays on large matmuls (Llama-3-8B +25%); below
    ~2,048 hidden it may be slower (`hftrain plan` says). Checkpoints stay plain safetensors. Off by default."""


# ----------------------------------------------------------------------------------------- lr_schedule
class LrScheduleSection(Section):
    """A learning-rate schedule transformers does not have, in place of training.lr_scheduler_type's (its peak is
    still training.learning_rate). Unset type: TrainingArguments' schedule, as without this section."""

    type: Literal["gpt_neox_annealing"] | None = None
    """gpt_neox_annealing: Pythia's schedule, gpt-neox v1.0's AnnealingLR with cosine decay (training/schedules.py):
    from 0, linear warmup to the peak over warmup_fraction x decay_steps steps, then peak / 2 x (cos(pi x (step -
    warmup) / decay_steps) + 1), cut off at min_lr_rate x peak. Not transformers' cosine_with_min_lr, whose cosine
    is over decay_steps - warmup and squeezed above the floor: this one's divisor is decay_steps and it meets the
    floor early (Pythia: at step ~115,000 of 143,000). Set, it replaces training.lr_scheduler_type, warmup_steps and
    lr_scheduler_kwargs (giving them too is refused, as is a DeepSpeed config with its own "scheduler" block)."""
    decay_steps: int | None = Field(default=None, ge=1)
    """gpt-neox's lr_decay_iters: the steps the cosine is laid over (Pythia: 143000). Default: the run's last step,
    training.max_steps after data.start_step (a run that continues another at its step N is at step N + k)."""
    warmup_fraction: float = Field(default=0.01, ge=0, lt=0.5)
    """gpt-neox's warmup: the warmup's length as a fraction of decay_steps (Pythia: 0.01, 1,430 steps). Under 0.5: at
    0.5 gpt-neox's formula no longer decays, and above it never reaches the peak."""
    min_lr_rate: float = Field(default=0.1, ge=0, le=1)
    """The floor of the decay as a fraction of training.learning_rate (gpt-neox's min_lr; Pythia: 0.1, 6e-5 under
    6e-4). The warmup starts at 0, below it, as gpt-neox's does."""

    @model_validator(mode="after")
    def _settings_need_a_type(self) -> LrScheduleSection:
        fields = type(self).model_fields  # a saved recipe writes every key: its defaults are not a choice
        given = sorted(k for k in self.model_fields_set - {"type"} if getattr(self, k) != fields[k].default)
        if self.type is None and given:
            raise ValueError(f"{', '.join(given)} would be ignored without a type; set type: gpt_neox_annealing")
        return self


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
    sample_temperature: float = Field(default=0.8, ge=0)
    """Temperature of the end-of-run sample (top-k 40); 0 takes the likeliest token each time (greedy), which
    gives the same text for the same weights, e.g. to compare runs."""
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


# ----------------------------------------------------------------------------------------- parallelism
class ParallelismSection(Section):
    """How the run is spread over devices. Which backend and how many processes is the launcher's business
    (accelerate_configs/); the recipe may name the strategy it expects, and a mismatch is an error."""

    strategy: Literal["auto", "single", "ddp", "fsdp", "zero3", "device_map"] = "auto"
    """auto: whatever the launch set up. single/ddp/fsdp/zero3: must match the launch (checked at start).
    device_map: one process, layers spread over the visible devices (a naive pipeline)."""
    global_batch_size: int | None = Field(default=None, gt=0)
    """Sequences per optimizer step over all processes. Gradient accumulation is derived from it, the
    micro-batch (training.per_device_train_batch_size) and the process count; it must divide evenly."""
    max_memory: dict[str | int, str] | None = None
    """device_map only: memory budget per device, e.g. {0: 20GiB, 1: 20GiB, cpu: 64GiB}."""
    fit_memory: bool = False
    """true: before the model is built, `train` takes the micro-batch and gradient checkpointing that `hftrain plan`
    recommends for the memory at hand (each GPU's, or this machine's RAM shared by its processes) under the launched
    strategy, keeping the global batch (accumulation derived), and prints the choice. Unlike TrainingArguments'
    auto_find_batch_size, which halves the micro-batch after a CUDA out-of-memory error at run time and changes the
    global batch with it, this is decided on paper before step 1 and keeps the global batch (and so the run's
    losses)."""
    memory_check: Literal["refuse", "warn"] = "refuse"
    """What `train` does with a layout that would certainly run out of memory: its predicted peak (`hftrain plan`) over
    each process's whole memory by more than the prediction's measured error (12%, docs/planning.md), whether the
    recipe's own micro-batch or, with fit_memory, the smallest layout. refuse: stop before anything is loaded (or any
    process started), with the numbers and what would fit; warn: say so and train anyway (the memory may be more
    than the machine reports, e.g. swap). A near miss (within the error) is a warning either way."""
