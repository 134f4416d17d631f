"""`hftrain data inspect RECIPE --check-packing`: do packed documents stay apart on this machine's kernels?

Builds the recipe's model with random weights, packs the recipe's first micro-batch as training does
(data/packed_batch.py), and compares each document's logits with the logits of that document run alone, on
every attention implementation available here (eager, sdpa, flex_attention; on a CUDA GPU also the installed
flash kernels, in bf16). A kernel, transformers version or batch form that lets documents see each other shows
as a difference far above rounding: the check fails and names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hftrain.data.inspect import scratch_tokenizer
from hftrain.data.loader import as_sample, collator_for, plan_data, train_blocks
from hftrain.data.packed_batch import KERNEL_FORMS
from hftrain.data.part import DataPart
from hftrain.data.stream import Worker
from hftrain.model.part import ModelPart

# max |diff| of logits: rounding, not a leak
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
REFERENCE = "sdpa"  # the kernel a document alone runs on: one shape per document, compiled by nothing


@dataclass
class KernelResult:
    kernel: str
    max_diff: float
    tolerance: float
    documents: int

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance

    def line(self) -> str:
        verdict = "ok" if self.ok else f"FAILED (above {self.tolerance:g}: documents see each other)"
        return f"check-packing: {self.kernel} max |diff| {self.max_diff:.1e} {verdict}"


def available_kernels(device: torch.device) -> list[str]:
    """The attention implementations that run here."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_torch_flex_attn_available

    kernels = ["eager", "sdpa"] + (["flex_attention"] if is_torch_flex_attn_available() else [])
    if device.type == "cuda":
        kernels += ["flash_attention_2"] if is_flash_attn_2_available() else []
        kernels += ["flash_attention_3"] if is_flash_attn_3_available() else []
    return kernels


def check_packing(
    part: DataPart,
    kernels: dict[str, str] | None = None,
    device: torch.device | None = None,
    collator: Callable[[str, str], Any] | None = None,
) -> tuple[list[str], bool]:
    """(lines to print, whether every kernel kept the documents apart). `kernels`: kernel -> batch form (default:
    every kernel available here, in the form training gives it); `collator(kernel, form)`: makes the batches
    (default: training's collator for the recipe)."""
    section = part.data
    plan = plan_data(section, part.seed)  # first: a missing or empty source is named, whatever follows
    if not section.masks_documents:
        return [
            "check-packing: data.document_masking is off: pretraining "
            "documents joined with EOS attend to the ones before "
            "them in their block by design (Pythia was trained so). Set data.document_masking: true to keep them apart."
        ], True
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = scratch_tokenizer(part.model, plan)
    samples = first_micro_batch(part.batch_size, plan, tokenizer)
    model = random_model(part.model, len(tokenizer)).to(device=device, dtype=dtype).eval()
    forms = kernels or {k: KERNEL_FORMS[k] for k in available_kernels(device)}
    make = collator or (lambda kernel, form: collator_for(section, kernel, tokenizer.eos_token_id, form))
    if "flex_attention" in forms:
        from hftrain import _compat

        _compat.flex_uncompiled_on_cpu()  # Inductor's CPU flex kernel is wrong on some CPUs (_compat.py)
    results, alone = [], {}  # alone: each document's logits on its own (REFERENCE), shared by every kernel
    for kernel, form in forms.items():
        results.append(compare(model, kernel, samples, make(kernel, form), TOLERANCE[dtype], alone))
    docs = results[0].documents if results else 0
    head = (
        f"check-packing: first micro-batch of {len(samples)} block(s) x {section.seq_len} tokens, {docs} documents; "
        f"the recipe's model shape with random weights, {str(dtype).removeprefix('torch.')} on {device.type}"
    )
    lines = [head] + [r.line() for r in results]
    failed = [r.kernel for r in results if not r.ok]
    if failed:
        lines.append(
            f"check-packing: packed documents are not kept apart on {', '.join(failed)}: do not train this recipe "
            "with model.attn_implementation set to it here (use one marked ok), and report the versions above."
        )
    return lines, not failed


def first_micro_batch(size: int, plan: Any, tokenizer: Any) -> list[dict[str, torch.Tensor]]:
    """The first reader's first `size` (training.per_device_train_batch_size) blocks, packed as training packs them."""
    stream = train_blocks(plan, tokenizer, Worker(0, 1), window=max(4, 2 * size))
    samples = []
    for block, _ in stream.blocks(stream.fresh_state()):
        samples.append(as_sample(block))
        if len(samples) == size:
            break
    return samples


def random_model(part: ModelPart, tokenizer_size: int) -> Any:
    """The recipe's model shape with random weights (seeded): a pretrained checkpoint's weights are not read."""
    from transformers import AutoModelForCausalLM

    from hftrain.model.remote_code import allow
    from hftrain.model.shape import measure_model

    config = measure_model(part).config
    if config.vocab_size < tokenizer_size:
        config.vocab_size = tokenizer_size
    torch.manual_seed(part.seed)
    m = part.model
    return AutoModelForCausalLM.from_config(
        config, trust_remote_code=allow(m.trust_remote_code, "model.trust_remote_code", m.from_pretrained)
    )


def compare(
    model: Any,
    kernel: str,
    samples: list[dict[str, torch.Tensor]],
    collate: Any,
    tolerance: float,
    alone: dict | None = None,
) -> KernelResult:
    """Max |logits packed on `kernel` - logits of the document alone| over every document of the micro-batch. A
    document alone runs on REFERENCE (no packing, so no mask to get wrong), once for every kernel (`alone`)."""
    rows, seq_len = len(samples), samples[0]["input_ids"].numel()
    alone = {} if alone is None else alone
    batch = collate(samples)
    inputs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        model.set_attn_implementation(kernel)
        packed = model(**inputs).logits.reshape(rows, seq_len, -1).float()
        ids = batch["input_ids"].reshape(rows, seq_len)
        positions = batch["position_ids"].reshape(rows, seq_len)
        worst, documents = 0.0, 0
        model.set_attn_implementation(REFERENCE)
        for r in range(rows):
            starts = torch.nonzero(positions[r] == 0).flatten().tolist() + [seq_len]
            for a, b in zip(starts[:-1], starts[1:]):
                if (r, a, b) not in alone:
                    alone[r, a, b] = (
                        model(input_ids=ids[r, a:b][None].to(model.device), use_cache=False).logits[0].float()
                    )
                worst = max(worst, float((packed[r, a:b] - alone[r, a, b]).abs().max()))
                documents += 1
    return KernelResult(kernel, worst, tolerance, documents)
