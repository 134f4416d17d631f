"""The causal-LM loss in fewer passes over the logits, for eager training on CPUs.

transformers computes the loss as ``cross_entropy(logits.float(), labels)``: log_softmax writes a tensor of
log-probabilities as large as the logits, and its backward zero-fills another, scatters into it and runs
log_softmax's backward over a third. With GPT-2's 50k vocabulary a micro-batch of 768 tokens has 154 MB of
logits, and on a CPU these memory-bound passes (and the page faults of three fresh 154 MB tensors) took a third
of a 4-layer, 128-wide model's step (torch.profiler, benchmark shape small).

Here the forward walks the logits in chunks of rows small enough to stay in a core's cache and computes, per
chunk, the log-sum-exp, the loss and already the gradient, softmax minus one-hot (Liger-Kernel's approach on
GPUs); the backward only scales that gradient. The value is transformers' ``ForCausalLMLoss`` (labels shifted,
ignore_index -100, a sum over ``num_items_in_batch`` or a mean), equal to fp32 rounding; bf16 logits are upcast
a chunk at a time, and their gradient is bf16 as before. Without autograd (evaluation) transformers' own loss runs.

Compiled (torch.compile traces the model's loss with it), the same value is computed a slice of rows at a time
with plain ops (``CHUNK_BYTES_COMPILED`` of fp32 logits per slice, a handful of slices): the compiler fuses
each slice's upcast into its cross-entropy, and no fp32 copy of all the logits exists at once.

Which runs train with it is ``speed.loss`` (``auto``: eager training on a CPU, where it was measured faster,
``applies``); on GPUs the choice is measured by benchmarks/gpu_fast_path.py, not guessed.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_BYTES = 2 << 20  # fp32 logits per chunk: 2 MiB (10 rows at a 50k vocabulary; measured best among 2-128 rows)
CHUNK_BYTES_COMPILED = 256 << 20  # per slice when compiled: 1,334 rows at 50k (13 slices at 8 x 2,048 tokens)


def applies(device: torch.device, compiled: bool, choice: str = "auto") -> bool:
    """Whether training uses this loss: as ``speed.loss`` says; ``auto``: eager training on a CPU."""
    if choice != "auto":
        return choice == "chunked"
    return device.type == "cpu" and not compiled


def use(model: Any) -> None:
    """Make `model` (a transformers causal LM) compute its training loss here; nothing of it is saved."""
    model.loss_function = causal_lm_loss


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss, with the same arguments and value."""
    if not (torch.is_grad_enabled() and logits.requires_grad):
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    if torch.compiler.is_compiling():
        return _sliced_cross_entropy(logits.reshape(-1, vocab_size), target, num_items_in_batch, ignore_index)
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, vocab_size), target, num_items_in_batch, ignore_index)


def _sliced_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, num_items_in_batch: Any, ignore_index: int
) -> torch.Tensor:
    """The compiled form: transformers' sum (or mean) of fp32 cross-entropies, a slice of rows at a time."""
    rows, vocab = logits.shape
    step = max(1, CHUNK_BYTES_COMPILED // (4 * vocab))
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, rows, step):
        piece = logits[start : start + step].float()
        total = total + torch.nn.functional.cross_entropy(
            piece, target[start : start + step], ignore_index=ignore_index, reduction="sum"
        )
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum()
    return total / torch.as_tensor(num_items_in_batch, device=logits.device)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, num_items_in_batch: Any, ignore_index: int
    ) -> torch.Tensor:
        rows, vocab = logits.shape
        valid = target != ignore_index
        denominator = (
            valid.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=logits.device)
        )
        weight = valid.float() / denominator  # d loss / d (row's cross-entropy)
        index = target.clamp(min=0)[:, None]
        grad = torch.empty_like(logits)
        scratch = None if logits.dtype == torch.float32 else torch.empty((0,), device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        step = max(1, CHUNK_BYTES // (4 * vocab))
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            chunk = logits[start:stop].float()  # fp32 as transformers; a view when already fp32 (read, never written)
            if scratch is None:
                probs = grad[start:stop]
            else:
                probs = scratch = scratch.resize_(stop - start, vocab)
            top = chunk.amax(dim=1, keepdim=True)
            torch.sub(chunk, top, out=probs).exp_()
            sums = probs.sum(dim=1, keepdim=True)
            probs.div_(sums)
            lse = (top + sums.log()).squeeze(1)
            picked = chunk.gather(1, index[start:stop]).squeeze(1)
            total += ((lse - picked) * weight[start:stop]).sum()
            probs.scatter_add_(1, index[start:stop], -torch.ones_like(picked)[:, None])  # softmax - one-hot
            probs.mul_(weight[start:stop, None])
            if scratch is not None:
                grad[start:stop].copy_(probs)
        ctx.save_for_backward(grad)
        return total  # fp32, as transformers' loss (it upcasts the logits)

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = ctx.saved_tensors  # scaled in place: a second backward through this graph is refused by autograd
        return grad.mul_(upstream.to(grad.dtype)), None, None, None
