"""Fine-tuning: full, LoRA, QLoRA and 8-bit LoRA on a tiny NeoX the session pretrained; instruction data with
loss masks and packing without cross-attention; adapters merged into a model plain transformers loads."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import hftrain
from hftrain.data.instructions import IGNORE, ExampleStream, encode_example
from hftrain.data.loader import plan_data
from hftrain.data.stream import DocumentStream
from hftrain.errors import HftrainError
from hftrain.recipe.load import load_recipe

from ..support.cli import in_process
from ..support.data import finetune_recipe, instructions, write_examples


def held_out_losses(run):
    evals = [e["eval_loss"] for e in run.log_history if "eval_loss" in e]
    return evals[0], run.metrics["eval_loss"]


@pytest.mark.parametrize("method, gain", [("full", 1.0), ("lora", 0.7), ("qlora", 0.5), ("lora_8bit", 0.5)])
def test_each_method_lowers_held_out_loss(pretrained_run, tmp_path, method, gain):
    run = hftrain.train(load_recipe(None, finetune_recipe(pretrained_run.final_dir, tmp_path, method)))
    before, after = held_out_losses(run)
    assert after < before - gain, (method, before, after)  # loss on the answers only, on held-out examples
    final = run.final_dir
    assert (final / "model.safetensors").is_file() and json.loads((final / "config.json").read_text())[
        "model_type"
    ] == "gpt_neox"
    results = json.loads((run.output_dir / "results.json").read_text())
    # 4 examples of 14-15 tokens per 64
    assert results["document_masking"] is True and 0.85 < results["packing_fill"] < 1
    if method != "full":
        model = run.trainer.model
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        assert trainable < total / 4  # r=8 on a 64-wide model; at 20B the ratio is >1,000x
        base = json.loads((final / "adapter" / "hftrain_base.json").read_text())
        assert base["base_model"] == str(pretrained_run.final_dir) and base["fingerprint"]
        assert json.loads((final / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
            pretrained_run.final_dir
        )


@pytest.mark.slow
def test_merged_export_loads_without_peft_and_matches_base_plus_adapter(pretrained_run, tmp_path, capsys):
    run = hftrain.train(
        load_recipe(None, finetune_recipe(pretrained_run.final_dir, tmp_path, "lora", max_steps=6, save_steps=6))
    )
    checkpoint = tmp_path / "lora" / "checkpoint-6"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    assert (checkpoint / "adapter_model.safetensors").stat().st_size < (
        pretrained_run.final_dir / "model.safetensors"
    ).stat().st_size / 3
    out = tmp_path / "merged"
    code, printed = in_process(capsys, "export", str(checkpoint), "--merge", "--out", str(out))
    assert code == 0, printed[-2000:]
    ids = [[5, 9, 33, 120, 7, 64]]
    model = run.trainer.accelerator.unwrap_model(
        run.trainer.model, keep_fp32_wrapper=False
    ).eval()  # without the autocast
    with torch.no_grad():  # wrapper accelerate puts on forward where the speed defaults chose bf16 (an AMX CPU, a GPU)
        expected = model(input_ids=torch.tensor(ids)).logits
    script = (
        "import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()\n"
        "assert 'peft' not in sys.modules and 'hftrain' not in sys.modules\n"
        f"torch.save(m(torch.tensor({ids})).logits, {str(tmp_path / 'l.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    torch.testing.assert_close(torch.load(tmp_path / "l.pt"), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(HftrainError, match="a LoRA adapter checkpoint; add --merge"):
        from hftrain.export.model_dir import export

        export(checkpoint, tmp_path / "nomerge")


def test_prompt_tokens_carry_no_loss(pretrained_run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pretrained_run.final_dir)
    ids, labels = encode_example(tok, {"prompt": "the cat is", "completion": " red."}, tok.eos_token_id)
    prompt_len = len(tok("the cat is")["input_ids"])
    assert labels[:prompt_len] == [IGNORE] * prompt_len
    assert labels[prompt_len:] == ids[prompt_len:] and ids[-1] == tok.eos_token_id
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "the dog is"},
            {"role": "assistant", "content": "green."},
            {"role": "user", "content": "and the cat?"},
            {"role": "assistant", "content": "red."},
        ]
    }
    ids, labels = encode_example(tok, chat, tok.eos_token_id)
    learnt = tok.decode([i for i, label in zip(ids, labels) if label != IGNORE])
    assert learnt.replace("<|endoftext|>", "") == "green.<|im_end|>\nred.<|im_end|>\n"  # assistant turns only


def test_packed_examples_do_not_attend_to_each_other(pretrained_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pretrained_run.final_dir)
    rows = instructions(6, 3)
    section = load_recipe(
        None,
        {
            "data": {
                "train": {"path": str(write_examples(tmp_path / "x.jsonl", rows)), "format": "prompt_completion"},
                "seq_len": 64,
                "shuffle_window": 1,
            }
        },
    ).data
    plan = plan_data(section, 0)
    stream = ExampleStream(
        DocumentStream(plan.train, seed=0, shuffle=False, loop=False), tok, 64, window=4, packing=True
    )
    block = next(b for b, _ in stream.blocks(stream.fresh_state()))
    starts = np.flatnonzero(block[2] == 0)
    assert len(starts) >= 3  # several examples share the block
    model = AutoModelForCausalLM.from_pretrained(pretrained_run.final_dir).eval()
    second = slice(starts[1], starts[2])
    with torch.no_grad():
        packed = model(input_ids=torch.tensor(block[0])[None], position_ids=torch.tensor(block[2])[None]).logits[
            0, second
        ]
        alone = model(input_ids=torch.tensor(block[0][second])[None]).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def test_bad_finetune_settings(pretrained_run, tmp_path):
    raw = finetune_recipe(pretrained_run.final_dir, tmp_path, "lora")
    raw["finetune"]["lora"]["target_modules"] = ["q_proj"]
    with pytest.raises(
        HftrainError, match="q_proj match no linear layer of this model; its linear layers are: dense, dense_4h_to_h"
    ):
        hftrain.train(load_recipe(None, raw))
    with pytest.raises(
        HftrainError, match="finetune.method qlora quantizes pretrained weights: set model.from_pretrained"
    ):
        load_recipe(None, {"finetune": {"method": "qlora"}})
    bad = write_examples(tmp_path / "bad.jsonl", [{"prompt": "x"}])
    raw = finetune_recipe(pretrained_run.final_dir, tmp_path, "lora")
    raw["data"]["train"]["path"] = str(bad)
    with pytest.raises(
        HftrainError, match=r"bad.jsonl:1: needs string fields 'prompt' and 'completion' \(has: prompt\)"
    ):
        hftrain.train(load_recipe(None, raw))


def test_lora_onto_random_weights_is_refused_before_training(tmp_path):
    """A preset has no saved weights for the adapter to be merged into: the run used to train to the end and then
    fail writing final/ (a TypeError from the merge). Now one message before anything is written."""
    from ..support.data import make_documents, tiny_recipe, write_jsonl

    raw = tiny_recipe(write_jsonl(tmp_path / "docs.jsonl", make_documents(20)), tmp_path / "out", max_steps=2)
    raw["finetune"] = {"method": "lora"}
    with pytest.raises(
        HftrainError,
        match=r"finetune.method: lora trains an adapter onto pretrained weights, but this "
        r"recipe builds model.preset cpu-tiny from random weights .*Set model.from_pretrained",
    ):
        hftrain.train(load_recipe(None, raw))
    assert not (tmp_path / "out").exists()
