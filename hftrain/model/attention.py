"""Plain causal attention with no mask at all, so that SDPA can take its flash and memory-efficient kernels.

transformers' GPT-NeoX hands every forward's position ids to ``create_causal_mask``, which looks for packed
sequences in them. Under torch.compile that check cannot return "none found" (it would be data-dependent
control flow), so the causal shortcut is skipped and a dense (batch, 1, T, T) mask is built for every forward;
SDPA uses ``is_causal`` (and with it the flash kernel) only when it gets no mask. Eagerly, the same check reads a
device value back on the host at every forward (a sync). The plain Trainer pays both (transformers#41856, #48925).
litgpt calls SDPA with ``is_causal=True`` and no mask.

A block that holds one document (pretraining without ``data.document_masking``: the collator gives no position
ids) needs nothing but causality. For such runs the model's kernel is ``CAUSAL_SDPA``: transformers' own SDPA
function under a name that has no mask function registered, so mask creation ends at once and SDPA runs with
``is_causal``. Any input that may need a mask (an attention mask, position ids, a cache passed in: documents kept
apart, padding, generation) runs that forward as plain ``sdpa``, mask and all, exactly as transformers would: the
kernel is a speed choice only, never a change of what attends to what. Saved configs never name it
(transformers does not write ``_attn_implementation``).
"""

from __future__ import annotations

from typing import Any

from hftrain.errors import HftrainError

SDPA = "sdpa"
CAUSAL_SDPA = "hftrain_causal_sdpa"
_HOOKED = "_hftrain_causal_sdpa_hooks"


def check_trains_here(kernel: str | None, device: str) -> None:
    """A kernel that cannot train on the run's device is refused before anything loads: torch has no flex attention
    backward on a CPU (a traceback after the model loaded, before)."""
    if kernel == "flex_attention" and device == "cpu":
        import torch

        raise HftrainError(
            f"model.attn_implementation: flex_attention cannot train on a CPU (torch {torch.__version__} has no flex "
            "attention backward there). Use sdpa or eager, which keep packed documents apart too (a block-causal "
            "mask), or train on a GPU; `hftrain data inspect --check-packing` still compares flex's forward here."
        )


def applies(kernel: str, model_type: str, collator_gives_positions: bool) -> bool:
    """Whether a run trains on the maskless kernel: sdpa asked for, a GPT-NeoX model, and blocks with no
    documents to keep apart (the collator gives no position ids)."""
    return kernel == SDPA and model_type == "gpt_neox" and not collator_gives_positions


def register() -> None:
    """CAUSAL_SDPA as an attention function (transformers' SDPA itself), with no mask function (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)


def use(model: Any) -> Any:
    """Train `model` (a transformers GPT-NeoX causal LM on sdpa) on CAUSAL_SDPA; inputs that may need a mask keep
    sdpa's (module docstring)."""
    register()
    body = model.base_model
    if getattr(body, _HOOKED, None) is None:
        setattr(
            body,
            _HOOKED,
            (
                body.register_forward_pre_hook(_mask_when_needed, with_kwargs=True),
                body.register_forward_hook(_back_to_maskless, with_kwargs=True),
            ),
        )
    model.config._attn_implementation = CAUSAL_SDPA
    return model


def plain(model: Any) -> Any:
    """`model` back on sdpa (the hooks removed), as transformers built it."""
    body = model.base_model
    for hook in getattr(body, _HOOKED, None) or ():
        hook.remove()
    setattr(body, _HOOKED, None)
    if model.config._attn_implementation == CAUSAL_SDPA:
        model.config._attn_implementation = SDPA
    return model


def needs_mask(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a forward of the model body may need a mask: anything beyond the ids (or embeddings) of plain blocks.
    Python checks only: no tensor is read (compiled, this is a guard, not a graph break)."""
    if len(args) > 1:  # attention_mask and the rest given by position
        return True
    mask = kwargs.get("attention_mask")
    return (mask is not None) or any(
        kwargs.get(key) is not None for key in ("position_ids", "cache", "past_key_values")
    )


def _mask_when_needed(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    if module.config._attn_implementation == CAUSAL_SDPA and needs_mask(args, kwargs):
        module.config._attn_implementation = SDPA
        module._hftrain_restore = True


def _back_to_maskless(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    if getattr(module, "_hftrain_restore", False):
        module.config._attn_implementation = CAUSAL_SDPA
        module._hftrain_restore = False
