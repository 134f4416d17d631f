"""GGUF export (export/gguf_file.py), proven with the real client: llama.cpp (llama-cpp-python) loads each file,
tokenizes as the model's tokenizer does, and gives transformers' next-token logits on the same checkpoint.

Bounds (issue 30): f32 with an f32 KV cache: the top-5 tokens agree and max |diff| <= 1% of the largest |logit|
(llama.cpp computes GELU by the tanh form through an f16 table, transformers' NeoX by erf); f16 and q8_0: the top-1
token agrees wherever transformers' top-2 margin exceeds 0.05; greedy generation gives the same first tokens (f32).
Trained models (slow): a run's final model with the BPE hftrain trained, a NeoX variant trained with GPT-2's
tokenizer, `use_parallel_residual: false`, rotary_pct 0.5 and tied embeddings, and a LoRA checkpoint merged on
export. Fast: the same variant with random weights in f32 and f16 (q8_0 of random weights is no test: llama.cpp
also quantizes the activations, and on untrained weights that moves logits by 2-3% against 0.4% on trained ones),
and each refusal: one message that names the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ..support.checks import tree_digest
from ..support.cli import in_process as cli
from ..support.data import finetune_recipe, make_documents, tiny_recipe, write_jsonl

PROMPTS = [
    "def train(model, data):\n    return",
    "The quick brown fox jumps over",
    "Return the  number of\titems, 42 or 7.",
    "the fox is",
]
NEW_TOKENS = 8


def export_gguf(capsys, source: Path, out: Path, quant: str, *extra: str) -> Path:
    code, printed = cli(capsys, "export", str(source), "--format", "gguf", "--quant", quant, "--out", str(out), *extra)
    assert code == 0, printed[-3000:]
    assert f"exported: {out} (GGUF, {quant}," in printed
    return out


def llama(path: Path):
    """llama.cpp on `path`, with the weights in its plain CPU buffers: its extra buffer types (weights repacked for
    AMX or other kernels) stay off. llama-cpp-python 0.3.36 built natively on an AMX Xeon (Sapphire Rapids) ran
    `tileloadd` without a tile configuration there and died of SIGILL, taking the whole pytest process with it."""
    from unittest import mock

    import llama_cpp.llama_cpp as native
    from llama_cpp import Llama

    defaults = native.llama_model_default_params

    def plain_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    with mock.patch.object(native, "llama_model_default_params", plain_buffers):
        # f32 KV cache (GGML_TYPE_F32 = 0): only the weights' type differs between the files compared
        return Llama(
            model_path=str(path),
            n_ctx=128,
            n_batch=128,
            logits_all=True,
            type_k=0,
            type_v=0,
            n_threads=2,
            seed=0,
            verbose=False,
        )


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def compare(model_dir: Path, files: dict[str, Path]) -> dict[str, float]:
    """Every check of the module docstring, for one model exported at each quantization; returns max |diff| / max
    |logit| per quantization (for the note)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    relative = {}
    for quant, path in files.items():
        llm = llama(path)
        assert llm.n_vocab() == model.config.vocab_size
        worst, checked = 0.0, 0
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            assert llm.tokenize(prompt.encode(), add_bos=False, special=False) == ids, (quant, prompt)  # the same ids
            ours, theirs = llama_logits(llm, ids), hf_logits(model, ids)
            worst = max(worst, float(np.abs(ours - theirs).max() / np.abs(theirs).max()))
            top2 = np.sort(theirs, axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 0.05
            assert (ours.argmax(-1) == theirs.argmax(-1))[clear].all(), (quant, prompt)
            checked += int(clear.sum())
            if quant == "f32":
                assert [set(r) for r in np.argsort(-ours)[:, :5]] == [set(r) for r in np.argsort(-theirs)[:, :5]], (
                    prompt
                )
        assert checked >= len(PROMPTS) * 3, quant  # the top-1 check saw most positions
        if quant == "f32":
            assert worst <= 0.01, worst
            for prompt in PROMPTS:  # greedy generation, token by token
                ids = tokenizer(prompt)["input_ids"]
                llm.reset()
                theirs = model.generate(
                    torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id
                )
                ours = [t for _, t in zip(range(NEW_TOKENS), llm.generate(ids, temp=0.0, top_k=1, reset=True))]
                assert ours == theirs[0, len(ids) :].tolist(), prompt
        relative[quant] = worst
    return relative


def all_quants(capsys, source: Path, tmp_path: Path, *extra: str, quants=("f32", "f16", "q8_0")) -> dict[str, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return {q: export_gguf(capsys, source, tmp_path / f"model-{q}.gguf", q, *extra) for q in quants}


VARIANT = {"use_parallel_residual": False, "rotary_pct": 0.5, "tie_word_embeddings": True}  # NeoX variants' switches


@pytest.fixture(scope="module")
def variant(tmp_path_factory) -> Path:
    """A NeoX variant: GPT-2's 50,257-token tokenizer (vocabulary padded to 50,304), no parallel residual, rotary on
    half of each head, tied embeddings; random weights spread wide enough that the top tokens are not near-ties."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from hftrain.model.tokenizer import gpt2_tokenizer

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=50304,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=256,
        initializer_range=0.15,
        eos_token_id=50256,
        bos_token_id=50256,
        **VARIANT,
    )
    path = tmp_path_factory.mktemp("variant") / "neox-variant"
    GPTNeoXForCausalLM(config).save_pretrained(path)
    gpt2_tokenizer().save_pretrained(path)
    return path


def test_a_neox_variant_with_gpt2s_tokenizer_runs_in_llama_cpp_as_in_transformers(capsys, variant, tmp_path):
    import gguf

    files = all_quants(capsys, variant, tmp_path)
    relative = compare(variant, {q: files[q] for q in ("f32", "f16")})
    reader = gguf.GGUFReader(str(files["q8_0"]))
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer.ggml.t")}
    assert meta["gptneox.use_parallel_residual"] is False and meta["gptneox.rope.dimension_count"] == 8  # half of 16
    assert meta["tokenizer.ggml.pre"] == "gpt-2" and meta["tokenizer.ggml.eos_token_id"] == 50256
    assert meta["general.name"] == "neox-variant"
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["output.weight"] == kinds["blk.0.attn_qkv.weight"] == "Q8_0" and kinds["blk.0.attn_qkv.bias"] == "F32"
    print(f"neox variant, max |llama.cpp - transformers| / max |logit|: {relative}")


@pytest.mark.slow
def test_a_trained_run_and_a_merged_lora_adapter_run_in_llama_cpp_as_in_transformers(capsys, pretrained_run, tmp_path):
    """hftrain's trained BPE tokenizer, a run's final model; the NeoX variant trained with GPT-2's tokenizer; then a
    LoRA checkpoint of the first, merged on export, against the same checkpoint exported as a merged model directory."""
    final = pretrained_run.final_dir
    relative = compare(final, all_quants(capsys, final, tmp_path / "final"))
    data = write_jsonl(tmp_path / "docs.jsonl", make_documents(300))
    raw = tiny_recipe(data, tmp_path / "variant", max_steps=80, save_steps=80)  # clear top-1 margins
    raw["model"].update(VARIANT)
    raw["tokenizer"] = {"builtin": "gpt2"}
    raw["monitor"]["sample_max_new_tokens"] = 0
    (tmp_path / "variant.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert cli(capsys, "train", str(tmp_path / "variant.yaml"))[0] == 0
    variant_relative = compare(
        tmp_path / "variant" / "final", all_quants(capsys, tmp_path / "variant" / "final", tmp_path / "variant-gguf")
    )
    raw = finetune_recipe(final, tmp_path, "lora", max_steps=2, save_steps=2, eval_on_start=False)
    raw["monitor"]["sample_max_new_tokens"] = 0
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert cli(capsys, "train", str(recipe))[0] == 0
    adapter = tmp_path / "lora" / "checkpoint-2"
    code, printed = cli(capsys, "export", str(adapter), "--format", "gguf", "--out", str(tmp_path / "no.gguf"))
    assert code == 2 and "a LoRA adapter checkpoint; add --merge" in printed and not (tmp_path / "no.gguf").exists()
    merged = tmp_path / "merged"
    assert cli(capsys, "export", str(adapter), "--merge", "--out", str(merged))[0] == 0
    merged_relative = compare(merged, all_quants(capsys, adapter, tmp_path / "lora-gguf", "--merge"))
    print(
        f"max |llama.cpp - transformers| / max |logit|: trained run {relative}; trained variant {variant_relative}; "
        f"merged LoRA {merged_relative}"
    )


# ------------------------------------------------------------------------------------------------- refusals


def _llama_config(d: Path) -> None:
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}', encoding="utf-8")


def _relu(d: Path) -> None:
    import json

    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}), encoding="utf-8")


def _word_level(d: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.save(str(d / "tokenizer.json"))


REFUSALS = {  # name: (damage to a copy of the variant, extra arguments, the message)
    "not gpt_neox": (
        _llama_config,
        [],
        "config.json: model_type 'llama'; GGUF export converts GPT-NeoX models (gpt_neox) only.",
    ),
    "relu": (
        _relu,
        [],
        "config.json: cannot be converted to GGUF faithfully: hidden_act 'relu' (llama.cpp's GPT-NeoX computes GELU).",
    ),
    "not byte-level BPE": (
        _word_level,
        [],
        'tokenizer.json: a WordLevel tokenizer with pre-tokenizer {"type": "Whitespace"}; GGUF export converts '
        "byte-level BPE tokenizers",
    ),
    "no tokenizer": (
        lambda d: (d / "tokenizer.json").unlink(),
        [],
        "no tokenizer.json; GGUF export needs the model's fast tokenizer",
    ),
    "out exists": (
        lambda d: (d.parent / "out.gguf").write_bytes(b"mine"),
        [],
        "out.gguf: exists; give a new file name",
    ),
    "out folder missing": (lambda d: None, ["--out", "nowhere/out.gguf"], "its folder"),
    "quant without gguf": (lambda d: None, ["--format", "hf", "--out", "dir"], "--quant applies to --format gguf"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_what_cannot_be_converted_is_refused_naming_why(capsys, variant, tmp_path, monkeypatch, name):
    import shutil

    damage, extra, message = REFUSALS[name]
    work = tmp_path / "work"
    model = work / "model"
    shutil.copytree(variant, model)
    damage(model)
    monkeypatch.chdir(work)
    before = tree_digest(work)
    argv = ["export", str(model), "--format", "gguf", "--quant", "q8_0", "--out", str(work / "out.gguf"), *extra]
    code, printed = cli(capsys, *argv)
    assert code == 2 and "Traceback" not in printed, printed[-3000:]
    assert printed.count("hftrain: error:") == 1 and message in printed, printed[-3000:]
    assert tree_digest(work) == before  # nothing written, nothing replaced
    assert not [p for p in os.listdir(work) if p.startswith(".")]  # no partial file left
