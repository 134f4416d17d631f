"""The GPU fast path, checked on the CPU in one compiled run: the training step reads nothing back on the host
beyond what the plain Trainer reads, SDPA gets no mask, and the compiled model neither breaks its graph nor
recompiles after the first step (issue 51, parts 1-3)."""

from __future__ import annotations

from collections import Counter

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Trainer, TrainerCallback, TrainingArguments

import hftrain
from hftrain.model import attention

from ..support.data import tiny_recipe

STEPS, ACCUMULATION, BATCH, LOG_EVERY = 8, 2, 4, 4


class HostReads(TorchDispatchMode):
    """Counts what makes the host wait for the device: a tensor's value read (``.item()``, ``bool(t)``,
    ``float(t)`` all dispatch ``aten._local_scalar_dense``) and copies from a device to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.endswith("_local_scalar_dense"):
            self.count["value reads"] += 1
        elif name.endswith(("copy_", "_to_copy")) and any(
            isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args
        ):
            out_device = kwargs.get("device") if kwargs else None
            if (out_device is not None and torch.device(out_device).type == "cpu") or (
                name.endswith("copy_") and args[0].device.type == "cpu"
            ):
                self.count["device-to-host copies"] += 1
        return func(*args, **(kwargs or {}))


class Watch(TrainerCallback):
    """Host reads over the whole training loop, and torch.compile's counters at the end of every step."""

    def __init__(self) -> None:
        self.reads = HostReads()
        self.compiled_at: dict[int, tuple[int, int, int]] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.reads.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        graph_breaks = sum(counters["graph_break"].values())
        self.compiled_at[state.global_step] = (
            graph_breaks,
            counters["frames"]["total"],
            counters["stats"]["unique_graphs"],
        )

    def on_train_end(self, args, state, control, **kwargs):
        self.reads.__exit__(None, None, None)

    @property
    def total(self) -> int:
        return sum(self.reads.count.values())


COMMON = dict(
    max_steps=STEPS,
    gradient_accumulation_steps=ACCUMULATION,
    per_device_train_batch_size=BATCH,
    logging_steps=LOG_EVERY,
    max_grad_norm=1.0,
    report_to="none",
)
COMPILED = dict(torch_compile=True, torch_compile_backend="aot_eager")  # traces forward and backward as inductor does


def plain_trainer_reads(config: GPTNeoXConfig, seq_len: int, tmp_path) -> int:
    """The plain Trainer at its fewest reads (logging_nan_inf_filter off) on the same model, batch and steps."""
    torch.manual_seed(0)
    ids = torch.randint(
        0, config.vocab_size, (STEPS * ACCUMULATION * BATCH, seq_len), generator=torch.Generator().manual_seed(0)
    )
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / "plain"), use_cpu=True, save_strategy="no", logging_nan_inf_filter=False, **COMMON
    )
    watch = Watch()
    Trainer(model=GPTNeoXForCausalLM(config), args=args, train_dataset=data, callbacks=[watch]).train()
    return watch.total


def train(corpus, output_dir, **training):
    raw = tiny_recipe(corpus, output_dir, save_steps=100, eval_strategy="no", **COMMON, **training)
    raw["monitor"]["sample_max_new_tokens"] = 0
    watch = Watch()
    run = hftrain.train(hftrain.load_recipe(None, raw), callbacks=[watch])
    return run, watch, raw


def test_a_training_step_reads_back_no_more_than_the_plain_trainer(tmp_path, corpus):
    """Eager (a dispatch mode keeps torch.compile out): before, the non-finite guard read every micro-batch's loss
    and every step's norm, the Trainer's nan filter read each loss twice and the packed-sequence check of
    transformers' mask read once per forward: 78 reads against the plain Trainer's 22 here."""
    run, watch, raw = train(corpus, tmp_path / "run", bf16=False, torch_compile=False)
    model = run.trainer.accelerator.unwrap_model(run.trainer.model)
    config = GPTNeoXConfig(**{**model.config.to_dict(), "attn_implementation": "sdpa", "use_cache": False})
    plain = plain_trainer_reads(config, raw["data"]["seq_len"], tmp_path)
    print(
        f"host reads over {STEPS} steps x {ACCUMULATION} micro-batches: "
        f"hftrain {dict(watch.reads.count)}, plain Trainer {plain}"
    )
    assert watch.total <= plain


def test_a_compiled_run_has_no_mask_no_graph_break_and_compiles_once(tmp_path, corpus):
    torch._dynamo.reset()
    counters.clear()
    watch = Watch()
    # no dispatch mode: it would keep compile out
    watch.on_train_begin = watch.on_train_end = lambda *args, **kwargs: None
    raw = tiny_recipe(corpus, tmp_path / "run", save_steps=100, eval_strategy="no", **COMMON, **COMPILED)
    raw["monitor"]["sample_max_new_tokens"] = 0
    run = hftrain.train(hftrain.load_recipe(None, raw), callbacks=[watch])
    model = run.trainer.accelerator.unwrap_model(run.trainer.model)
    # SDPA with is_causal (tests/model/test_attention.py)
    assert model.config._attn_implementation == attention.CAUSAL_SDPA
    breaks, frames, graphs = watch.compiled_at[STEPS]
    assert graphs >= 1 and frames >= 1, watch.compiled_at  # the counters do count this run's compile
    assert breaks == 0, dict(counters["graph_break"])
    assert watch.compiled_at[1] == watch.compiled_at[STEPS], watch.compiled_at  # nothing compiled after step 1
