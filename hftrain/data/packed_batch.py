"""How a micro-batch of packed blocks reaches the attention kernel, so that no document sees another on any kernel.

A block may hold several documents: instruction examples (always kept apart), or pretraining documents split at
EOS when ``data.document_masking`` is on. Each document's position ids restart at 0. What each kernel gets:

* ``eager``, ``sdpa``, ``flex_attention`` ("rows"): the (batch, seq_len) rows with those position ids;
  transformers' masking_utils finds the documents from them (``find_packed_sequence_indices``) and builds a
  block-causal mask per row: batch x seq_len^2 (bool for sdpa, the model's dtype for eager, a BlockMask of
  128 x 128 tiles for flex), never larger than a padded batch's mask.
* ``flash_attention_2``, ``flash_attention_3`` ("flattened"): one row of batch x seq_len tokens with the
  documents' cumulative lengths (``cu_seq_lens_q/k``) and the longest (``max_length_q/k``), as transformers'
  ``DataCollatorWithFlattening`` and ``FlashAttentionKwargs`` define them: the varlen kernel, no mask at all.
  Given (batch, seq_len) rows instead, flash attention ignores restarted position ids whenever batch > 1
  (transformers' ``_is_packed_sequence``) and packed documents would attend to each other.

The model is called with ``use_cache=False``: with a cache (GPT-NeoX configs default to ``use_cache: true``, and
not every transformers Trainer turns it off) masking_utils skips the packed-sequence detection and every
document sees the ones before it in its row.

Labels: a document's first token is never a target (it would be predicted from the previous document), nor is
a flattened row's first token (it would be predicted from the row before), so the loss is the documents' losses
taken alone, the same on every kernel. `hftrain data inspect RECIPE --check-packing` (data/packing_check.py)
compares each document's logits with the document run alone, per kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

IGNORE = -100
ROWS, FLATTENED = "rows", "flattened"
KERNEL_FORMS = {  # attention implementation -> the batch form that keeps documents apart on it (see above)
    "eager": ROWS,
    "sdpa": ROWS,
    "flex_attention": ROWS,
    "flash_attention_2": FLATTENED,
    "flash_attention_3": FLATTENED,
}


def form_of(kernel: str) -> str:
    if kernel not in KERNEL_FORMS:
        raise ValueError(
            f"no packed-batch form is known for attention implementation {kernel!r}; known: {', '.join(KERNEL_FORMS)}"
        )
    return KERNEL_FORMS[kernel]


def document_positions(input_ids: torch.Tensor, eos: int) -> torch.Tensor:
    """Position ids that restart at 0 after every EOS (and at each row's start): (batch, seq_len) -> same."""
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos
    index = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def real_tokens(
    block_labels: torch.Tensor, block_ids: torch.Tensor, position_ids: torch.Tensor | None, pad: int
) -> int:
    """Tokens of one block that are not padding: instruction blocks end in a padding segment (position ids from 0,
    pad tokens, no target); text blocks have none."""
    if position_ids is None:
        return int(block_ids.numel())
    starts = torch.nonzero(position_ids == 0).flatten()
    last = int(starts[-1]) if len(starts) else 0
    tail_ids, tail_labels = block_ids[last:], block_labels[last:]
    if last > 0 and bool((tail_ids == pad).all()) and bool((tail_labels == IGNORE).all()):
        return last
    return int(block_ids.numel())


@dataclass
class PackedCollator:
    """Stacks samples into the batch form of `kernel`. `eos`: split text rows into documents at EOS
    (data.document_masking); instruction samples carry their own position ids."""

    kernel: str = "sdpa"
    eos: int | None = None
    form: str | None = None  # default: the kernel's own (KERNEL_FORMS)

    def __post_init__(self) -> None:
        self.form = self.form or form_of(self.kernel)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = {
            k: torch.stack([s[k] for s in samples])
            for k in ("input_ids", "labels", "shift_labels", "position_ids")
            if k in samples[0]
        }
        if "position_ids" not in batch and self.eos is not None:
            batch["position_ids"] = document_positions(batch["input_ids"], self.eos)
        if "position_ids" not in batch:  # one document per row (plain causal pretraining): nothing to keep apart
            return batch
        starts = batch["position_ids"] == 0
        batch["labels"] = batch["labels"].masked_fill(starts, IGNORE)
        if self.form == FLATTENED:
            batch = flatten(batch)
        return {**batch, "use_cache": False}


def flatten(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """(batch, seq_len) rows -> one row, with the documents' cumulative lengths for the varlen kernels."""
    flat = {k: v.reshape(1, -1) for k, v in batch.items()}
    positions = flat["position_ids"][0]
    starts = torch.nonzero(positions == 0).flatten()
    bounds = torch.cat([starts, torch.tensor([positions.numel()], device=starts.device)]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return {**flat, "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}


def mask_note(kernel: str, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> str:
    """What keeping documents apart costs per forward on `kernel`, for the run's start-up line."""
    if form_of(kernel) == FLATTENED:
        return (
            f"{kernel}: one flattened row of {batch} x {seq_len} tokens with the documents' lengths (varlen, no mask)"
        )
    if kernel == "flex_attention":
        tiles = -(-seq_len // 128)
        return f"flex_attention: a block mask of {batch} x {tiles} x {tiles} tiles of 128 x 128"
    item = 1 if kernel == "sdpa" else torch.empty((), dtype=dtype).element_size()
    kind = "bool" if kernel == "sdpa" else str(dtype).removeprefix("torch.")
    size = batch * seq_len * seq_len * item
    return f"{kernel}: a block-causal mask of {batch} x {seq_len} x {seq_len} {kind} ({_mib(size)}) per forward"


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
