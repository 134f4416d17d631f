"""Pieces of throughput.py: the run_clm-style data both baselines share, a character-level tokenizer, and the
second baseline, a minimal hand-written training loop over the same transformers model (AdamW, the same
cosine schedule and clipping, no Trainer), so that hftrain's own per-step overhead is measured apart from the
model's."""

from __future__ import annotations

import json
import time
from itertools import chain
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks._turns import Turns


def load_tokenizer(tokenizer_dir: str | None) -> Any:
    """The shape's tokenizer: GPT-2 BPE (hftrain's built-in), or the character-level one in `tokenizer_dir`."""
    if tokenizer_dir:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir)
    from hftrain.model.tokenizer import gpt2_tokenizer

    return gpt2_tokenizer()


def write_char_tokenizer(docs: list[str], out: Path) -> Path:
    """A character-level tokenizer: hftrain's byte-level BPE with no merges (256 bytes + EOS)."""
    from hftrain.model.tokenizer import train_bpe

    train_bpe(docs[:2000], vocab_size=257, min_frequency=2, special_tokens=["<|endoftext|>"]).save_pretrained(out)
    return out


def clm_blocks(docs_file: Path, tokenizer: Any, block_size: int) -> Any:
    """run_clm.py's data: Dataset.from_dict + map(tokenize) + map(group_texts) into block_size blocks."""
    import datasets

    raw = datasets.Dataset.from_dict({"text": json.loads(docs_file.read_text())})

    def group_texts(examples: dict[str, list]) -> dict[str, list]:
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    tokenized = raw.map(lambda examples: tokenizer(examples["text"]), batched=True, remove_columns=["text"])
    return tokenized.map(group_texts, batched=True)


def context(shape: dict[str, Any]) -> int:
    """The model's max_position_embeddings on both sides: 1024 (the small presets'), or the shape's seq when longer
    (gpu-160m trains at 2048, as Pythia did; hftrain refuses a seq_len beyond the model's context)."""
    return max(1024, shape["seq"])


def neox_model(shape: dict[str, Any], tokenizer: Any) -> Any:
    """GPTNeoXForCausalLM of the shape, its vocabulary padded to a multiple of 128 as hftrain sizes it."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    vocab = -(-len(tokenizer) // 128) * 128
    config = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        intermediate_size=4 * shape["hidden"],
        max_position_embeddings=context(shape),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPTNeoXForCausalLM(config)


def run_loop(
    shape: dict[str, Any],
    steps: int,
    log_steps: int,
    docs_file: Path,
    run_steps: int,
    seed: int,
    warmup: int,
    tokenizer_dir: str | None,
) -> tuple[Any, Any, SimpleNamespace, list[dict[str, Any]], dict[str, Any]]:
    """The minimal loop: for each batch, forward, backward, clip, AdamW step, scheduler step, zero_grad.
    Returns (model, tokenizer, an args-like record, its log history, its step clock in StepClock's format)."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import default_data_collator, get_cosine_schedule_with_warmup, set_seed

    tokenizer = load_tokenizer(tokenizer_dir)
    blocks = clm_blocks(docs_file, tokenizer, shape["seq"])
    set_seed(seed)
    model = neox_model(shape, tokenizer)
    # as the Trainer does: weight decay on everything but biases and LayerNorm weights
    decay = [
        p
        for m in model.modules()
        if not isinstance(m, torch.nn.LayerNorm)
        for n, p in m.named_parameters(recurse=False)
        if n != "bias"
    ]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    # the Trainer's default (adamw_torch_fused)
    optimizer = torch.optim.AdamW(groups, lr=shape["lr"], betas=(0.9, 0.95), eps=1e-8, fused=True)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, run_steps)
    loader = DataLoader(
        blocks,
        batch_size=shape["batch"],
        shuffle=True,
        collate_fn=default_data_collator,
        generator=torch.Generator().manual_seed(seed),
    )
    clock: dict[str, Any] = {
        "train_begin": time.perf_counter(),
        "wall_at_train_begin": time.time(),
        "step_end": [],
        "cpu": [],
        "waited": [],
    }
    turns = Turns.from_env()  # the turns the sides of a pair take (_turns.py)
    history: list[dict[str, Any]] = []
    model.train()
    for step, batch in enumerate(loader, start=1):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        clock["step_end"].append(time.perf_counter())
        clock["cpu"].append(time.process_time())
        clock["waited"].append(turns.after_step(step, steps) if turns else 0.0)
        if step % log_steps == 0:
            history.append({"step": step, "loss": float(loss)})
        if step >= steps:
            break
    args = SimpleNamespace(
        per_device_train_batch_size=shape["batch"],
        gradient_accumulation_steps=1,
        world_size=1,
        bf16=False,
        torch_compile=False,
        dataloader_num_workers=0,
    )
    return model, tokenizer, args, history, clock
