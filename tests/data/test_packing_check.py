"""`hftrain data inspect --check-packing`: packed documents equal documents run alone on every CPU kernel, for
instruction data and document-masked pretraining; the check fails on a kernel that ignores restarted position ids
(as flash attention does at micro-batch > 1), and passes on that kernel once it gets the flattened form."""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import AttentionInterface

from hftrain.data.packed_batch import FLATTENED, ROWS, PackedCollator
from hftrain.data.packing_check import check_packing, first_micro_batch, random_model
from hftrain.data.part import DataPart
from hftrain.recipe.load import load_recipe
from tests.support.data import instructions, make_documents, write_examples, write_jsonl


def causal_only(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Plain causal attention over each row, whatever the position ids say (flash_attention_2 at batch > 1)."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def varlen_causal(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None, **kwargs):
    """The varlen kernels' contract on a CPU: causal within each cu_seq_lens_q span, else causal over each row."""
    if cu_seq_lens_q is None:
        return causal_only(module, query, key, value, attention_mask, scaling=scaling)
    bounds = cu_seq_lens_q.tolist()
    spans = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling
        )
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(spans, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register("causal_only", causal_only)
AttentionInterface.register("varlen_causal", varlen_causal)


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    base = {
        "model": {"preset": "cpu-tiny"},
        "training": {"per_device_train_batch_size": 4, "output_dir": str(root / "run")},
    }
    examples = {
        **base,
        "data": {
            "train": {
                "path": str(write_examples(root / "x.jsonl", instructions(60, 4))),
                "format": "prompt_completion",
            },
            "seq_len": 64,
        },
    }
    text = {
        **base,
        "data": {
            "train": {"path": str(write_jsonl(root / "docs.jsonl", make_documents(60)))},
            "seq_len": 96,
            "document_masking": True,
        },
    }
    (root / "examples.yaml").write_text(yaml.safe_dump(examples), encoding="utf-8")
    return {
        "examples": root / "examples.yaml",
        "examples_part": DataPart.of(load_recipe(None, examples)),
        "text": DataPart.of(load_recipe(None, text)),
        "plain_text": DataPart.of(load_recipe(None, {**text, "data": {**text["data"], "document_masking": None}})),
    }


def test_every_cpu_kernel_keeps_instruction_examples_apart(recipes, capsys):
    from hftrain.cli import main

    assert main(["data", "inspect", str(recipes["examples"]), "--check-packing"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("check-packing: first micro-batch of 4 block(s) x 64 tokens,")
    for kernel in ("eager", "sdpa", "flex_attention"):
        assert any(
            line.startswith(f"check-packing: {kernel} max |diff| ") and line.endswith(" ok") for line in lines
        ), lines
    assert main(["data", "inspect", str(recipes["examples"]), "--blocks", "1"]) == 0
    assert "--- block 0 (64 tokens) ---" in capsys.readouterr().out  # instruction blocks as trained


def test_document_masked_pretraining_keeps_documents_apart(recipes):
    lines, ok = check_packing(recipes["text"])
    assert ok, lines
    assert [line.split()[1] for line in lines[1:]] == ["eager", "sdpa", "flex_attention"]
    assert int(lines[0].split(" tokens, ")[1].split()[0]) > 4  # several documents per row
    lines, ok = check_packing(recipes["plain_text"])
    assert ok and "documents joined with EOS attend to the ones before them in their block by design" in lines[0]


def test_the_check_fails_where_documents_see_each_other(recipes):
    part = recipes["examples_part"]
    lines, ok = check_packing(part, kernels={"causal_only": ROWS, "varlen_causal": ROWS})  # today's layout, batch 4
    assert not ok and lines[-1].startswith(
        "check-packing: packed documents are not kept apart on causal_only, varlen_causal:"
    )
    assert "FAILED (above 0.0001: documents see each other)" in lines[1]
    lines, ok = check_packing(part, kernels={"varlen_causal": FLATTENED})  # what hftrain gives flash attention
    assert ok, lines

    # without use_cache=False, a GPT-NeoX config's use_cache: true skips transformers' packed-sequence mask
    def leaky(kernel, form):
        return lambda samples: {k: v for k, v in PackedCollator(kernel)(samples).items() if k != "use_cache"}

    lines, ok = check_packing(part, kernels={"sdpa": ROWS}, collator=leaky)
    assert not ok, lines


@pytest.mark.parametrize("kernel", ["eager", "sdpa", "varlen_causal"])
def test_packed_loss_is_the_documents_loss_taken_alone(recipes, kernel):
    from hftrain.data.loader import plan_data
    from hftrain.model.tokenizer import gpt2_tokenizer

    part, tokenizer = recipes["text"], gpt2_tokenizer()
    samples = first_micro_batch(part.batch_size, plan_data(part.data, 0), tokenizer)
    model = random_model(part.model, len(tokenizer)).eval()
    model.set_attn_implementation(kernel)
    collate = PackedCollator(kernel, tokenizer.eos_token_id, FLATTENED if kernel == "varlen_causal" else None)
    with torch.no_grad():
        packed = model(**collate(samples)).loss
        total, count = 0.0, 0
        for sample in samples:
            ids = sample["input_ids"]
            ends = (
                [0]
                + [i + 1 for i in range(len(ids)) if ids[i] == tokenizer.eos_token_id and i + 1 < len(ids)]
                + [len(ids)]
            )
            for a, b in zip(ends[:-1], ends[1:]):
                if b - a > 1:
                    total += float(model(input_ids=ids[a:b][None], labels=ids[a:b][None]).loss) * (b - a - 1)
                    count += b - a - 1
    assert abs(float(packed) - total / count) < 1e-4
