"""Tokenizers: the built-in GPT-2 BPE is complete, trained ones work and are saved."""

from __future__ import annotations

from hftrain.model.tokenizer import gpt2_tokenizer, train_bpe

from ..support.data import make_documents


def test_builtin_gpt2_is_the_real_gpt2_bpe():
    tok = gpt2_tokenizer()
    assert len(tok) == 50257 and tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 50256
    assert tok("Hello world")["input_ids"] == [15496, 995]  # GPT-2's published ids
    text = "Pythia was trained on the Pile.\n  def f(x): return x ** 2"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_trained_bpe_round_trips_and_saves(tmp_path):
    from transformers import AutoTokenizer

    tok = train_bpe(make_documents(300), vocab_size=500, min_frequency=2, special_tokens=["<|endoftext|>", "<pad>"])
    assert tok.eos_token_id == 0 and len(tok) <= 500
    text = "the quick brown fox ünïcödé 😀"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: nothing is unknown
    sentence = "the big dog sees the small cat."
    assert len(tok(sentence)["input_ids"]) <= len(sentence) // 3  # merges were learnt: whole words
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == tok(text)["input_ids"]
