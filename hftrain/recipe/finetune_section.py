"""The recipe's ``finetune`` section: which weights train (full, LoRA over a full, 4-bit or 8-bit base) and on
which objective (next-token loss, or DPO by TRL), with peft's LoraConfig and TRL's DPOConfig keys checked by
their own names."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import model_validator

from hftrain.recipe.objectives import OBJECTIVES
from hftrain.recipe.sections import Section


class QuantizationSection(Section):
    """BitsAndBytesConfig keys for qlora (4-bit); lora_8bit uses load_in_8bit."""

    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type: NF4 (QLoRA's) or FP4."""
    bnb_4bit_use_double_quant: bool = True
    """Quantize the quantization constants too (saves ~0.4 bits/parameter)."""
    bnb_4bit_compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the 4-bit weights are dequantized to for matmuls."""
    bnb_4bit_quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] | None = None
    """Storage dtype of the packed weights; FSDP needs it equal to the compute dtype."""


OUTPUT_HEADS = ("embed_out", "lm_head")  # GPT-NeoX's output projection, and most other causal LMs'

DPO_KEYS_HFTRAIN_SETS = {  # DPOConfig keys that hftrain decides from other parts of the recipe: why
    "max_length": "the longest prompt + answer is data.seq_len; set that",
    "model_init_kwargs": "the model section builds the policy and the reference",
    "trust_remote_code": "set model.trust_remote_code",
    "precompute_ref_log_probs": "the pairs are streamed, so the reference log-probs are computed with each batch",
    "precompute_ref_batch_size": "the pairs are streamed, so the reference log-probs are computed with each batch",
    "padding_free": "TRL 1.x disabled it; batches are padded to their longest pair",
    "dataset_num_proc": "hftrain tokenizes the pairs in its data stream (data.readers, dataloader_num_workers)",
}


# DPOConfig numbers TRL takes unchecked whose wrong values train without an error, toward nothing or away from the
# preferences (a negative beta rewards the rejected answers): (lowest, highest, whether each end is allowed, why).
DPO_BOUNDS: dict[str, tuple[float | None, float | None, tuple[bool, bool], str]] = {
    "beta": (
        0,
        None,
        (False, False),
        "the strength of the preference against the reference; 0 or less trains nothing or the rejected answers",
    ),
    "label_smoothing": (0, 0.5, (True, True), "the share of pairs assumed mislabelled; above 0.5 the preferences flip"),
    "ld_alpha": (0, 1, (True, True), "the weight of the verbose part of the answer (LD-DPO)"),
    "ref_model_mixup_alpha": (0, 1, (True, True), "the share of the policy mixed into the reference at each sync"),
    "ref_model_sync_steps": (1, None, (True, False), "the steps between reference syncs"),
    "discopop_tau": (0, None, (False, False), "DiscoPOP's temperature"),
    "f_alpha_divergence_coef": (0, None, (False, False), "the alpha of the alpha-divergence"),
    "loss_weights": (0, None, (True, False), "how much each loss_type counts"),  # each weight of the list
}


# TRL 1.16's DPOConfig loss types: used only where a TRL's DPOConfig help no longer lists them (dpo_loss_types).
DPO_LOSS_TYPES_TRL_1_16 = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)


def dpo_loss_types() -> tuple[str, ...]:
    """The loss types TRL's DPOTrainer computes, as its DPOConfig's loss_type help lists them: TRL itself refuses
    an unknown one only in the first step's loss, after the model loaded."""
    import dataclasses
    import re

    from trl import DPOConfig

    field = next((f for f in dataclasses.fields(DPOConfig) if f.name == "loss_type"), None)
    listed = (
        str(field.metadata.get("help", "") if field else "").partition("Possible values are:")[2].partition(". ")[0]
    )
    return tuple(re.findall(r"`'(\w+)'`", listed)) or DPO_LOSS_TYPES_TRL_1_16


def check_loss_types(value: list[str]) -> None:
    """Each finetune.dpo.loss_type is one TRL computes."""
    known = dpo_loss_types()
    for name in value:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(
                f"dpo: loss_type: {name!r} is not a loss type TRL's DPOTrainer "
                f"knows; {hint}give one or a list of: {', '.join(known)}"
            )


def check_dpo_values(dpo: dict[str, Any]) -> None:
    """Each DPOConfig value of the recipe against its type in TRL's DPOConfig and the bounds above."""
    import typing

    from pydantic import TypeAdapter, ValidationError
    from trl import DPOConfig

    hints = typing.get_type_hints(DPOConfig)
    for key, value in dpo.items():
        if key == "loss_type" and isinstance(value, str):
            value = [value]  # one loss type: DPOConfig takes the string (its __post_init__ makes it a list)
        if isinstance(value, bool) and hints.get(key) is not bool and "bool" not in str(hints.get(key)):
            raise ValueError(f"dpo: {key}: {str(value).lower()} is not a {_type_name(hints.get(key))}")
        try:
            value = TypeAdapter(hints.get(key, Any)).validate_python(value)
        except ValidationError:
            raise ValueError(f"dpo: {key}: {value!r} is not a {_type_name(hints.get(key))}") from None
        if key == "loss_type":
            check_loss_types(value)
        low, high, (low_ok, high_ok), why = DPO_BOUNDS.get(key, (None, None, (True, True), ""))
        for v in value if isinstance(value, list) else [value]:
            if v is None or not isinstance(v, (int, float)):
                continue
            if (low is not None and (v < low or (v == low and not low_ok))) or (
                high is not None and (v > high or (v == high and not high_ok))
            ):
                lo = "" if low is None else f"{'>=' if low_ok else '>'} {low}"
                hi = "" if high is None else f"{'<=' if high_ok else '<'} {high}"
                raise ValueError(
                    f"dpo: {key}: {v:g} is out of range; it must be {' and '.join(b for b in (lo, hi) if b)} ({why})"
                )


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return {"float": "number", "int": "whole number"}.get(text, text)


class FinetuneSection(Section):
    """How the weights are trained: all of them, or a LoRA adapter over a (possibly quantized) base."""

    method: Literal["full", "lora", "qlora", "lora_8bit"] = "full"
    """full: every weight. lora: a LoRA adapter. qlora: LoRA over a 4-bit base. lora_8bit: LoRA over an 8-bit base.
    qlora and lora_8bit need model.from_pretrained."""
    lora: dict[str, Any] = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}
    """peft LoraConfig keys (r, lora_alpha, lora_dropout, target_modules, bias, ...). target_modules defaults to
    every attention and MLP projection of the architecture (NeoX: query_key_value, dense, dense_h_to_4h,
    dense_4h_to_h)."""
    quantization: QuantizationSection = QuantizationSection()
    """4-bit quantization of the base for qlora."""
    objective: Literal[tuple(OBJECTIVES)] = "lm"  # recipe/objectives.py: what each objective means to the run
    """lm: next-token loss (pretraining, or supervised fine-tuning on instruction data). dpo: Direct Preference
    Optimization on preference pairs (data format: preference), by TRL's DPOTrainer (pip install 'hftrain[dpo]').
    The reference is the base with the adapter disabled (lora, qlora) or a frozen copy of the starting weights
    (full)."""
    dpo: dict[str, Any] = {}
    """TRL DPOConfig keys by their own names (beta, loss_type, label_smoothing, truncation_mode, ...); the
    TrainingArguments keys stay in the training section, and the sequence limit is data.seq_len."""

    @model_validator(mode="after")
    def _lora_keys(self) -> FinetuneSection:
        if self.method == "full":
            return self  # peft is imported only for LoRA runs
        import dataclasses as dc

        from peft import LoraConfig

        known = {f.name for f in dc.fields(LoraConfig) if f.init} - {"task_type", "peft_type"}
        unknown = sorted(set(self.lora) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            raise ValueError(
                f"lora: {unknown[0]!r} is not a LoraConfig key" + (f"; did you mean {close[0]}?" if close else "")
            )
        return self

    @model_validator(mode="after")
    def _dpo_keys(self) -> FinetuneSection:
        if self.dpo and self.objective != "dpo":
            raise ValueError(
                "dpo: DPOConfig keys are set but finetune.objective is lm; set finetune.objective: dpo or remove them"
            )
        if self.objective != "dpo":
            return self
        try:
            import dataclasses as dc

            from transformers import TrainingArguments
            from trl import DPOConfig  # imported only for DPO runs
        except ImportError:
            raise ValueError("objective dpo needs TRL: pip install 'hftrain[dpo]'") from None
        own = {f.name for f in dc.fields(DPOConfig) if f.init} - {f.name for f in dc.fields(TrainingArguments)}
        for key in self.dpo:
            if key in DPO_KEYS_HFTRAIN_SETS:
                raise ValueError(f"dpo: {key} is not taken: {DPO_KEYS_HFTRAIN_SETS[key]}")
            if key not in own:
                where = (
                    "; TrainingArguments keys go in the training section"
                    if key in {f.name for f in dc.fields(TrainingArguments)}
                    else ""
                )
                close = difflib.get_close_matches(key, own, n=1)
                raise ValueError(
                    f"dpo: {key!r} is not a DPOConfig key{where}"
                    + (f"; did you mean {close[0]}?" if close and not where else "")
                )
        check_dpo_values(self.dpo)
        if self.method != "full" and self.dpo.get("sync_ref_model"):
            raise ValueError(
                f"dpo: sync_ref_model with method {self.method}: the reference is the base with the adapter "
                "disabled, so there is no reference copy to sync (TRL refuses it); use method: full or remove it"
            )
        targets = self.lora.get("target_modules") or []
        if self.method != "full" and any(
            t in OUTPUT_HEADS for t in ([targets] if isinstance(targets, str) else targets)
        ):
            raise ValueError(
                "lora.target_modules: an adapter on the output head is never trained under DPO (TRL scores "
                "log-probabilities from the head's weight directly); remove embed_out / lm_head"
            )
        # DPOConfig's own check (TRL 1.16), made here: building a DPOConfig would set up accelerate's process state
        losses = self.dpo.get("loss_type", ["sigmoid"])
        weights = self.dpo.get("loss_weights")
        if weights is not None and len(weights) != len([losses] if isinstance(losses, str) else losses):
            raise ValueError(
                f"dpo: loss_weights has {len(weights)} weight(s) for "
                f"{len([losses] if isinstance(losses, str) else losses)} loss_type(s); give one weight per loss type"
            )
        return self
