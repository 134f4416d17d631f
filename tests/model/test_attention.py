"""Plain causal blocks reach SDPA with no mask under torch.compile (hftrain/model/attention.py); anything that may
need a mask (documents kept apart, padding, generation) still gets sdpa's own."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hftrain.data.packed_batch import PackedCollator
from hftrain.model import attention

EOS, VOCAB, T = 1, 96, 32


def pythia_shaped(context: int = 64) -> GPTNeoXForCausalLM:
    """A tiny model (96 ids) with Pythia's options: partial rotary, parallel residual, untied head."""
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=context,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attn_implementation="sdpa",
        use_cache=False,  # as the Trainer trains it (with a cache, masking_utils skips the packed-sequence detection)
    )
    return GPTNeoXForCausalLM(config)


def sdpa_masks_of_a_compiled_step(model, batch) -> list:
    """The attn_mask of every SDPA call in the graph torch.compile captures for a training forward + backward."""
    masks: list = []

    def spy(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                masks.append(node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None))
        return graph_module.forward

    torch._dynamo.reset()
    model.train()
    out = torch.compile(model, backend=spy)(**batch)
    out.loss.backward()
    return masks


def plain_blocks() -> dict:
    ids = torch.randint(2, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))
    return PackedCollator("sdpa")([{"input_ids": row, "labels": row.clone()} for row in ids])


def test_a_compiled_step_on_plain_blocks_calls_sdpa_without_a_mask():
    batch = plain_blocks()
    assert "position_ids" not in batch  # what hftrain's collator gives one-document blocks
    before = sdpa_masks_of_a_compiled_step(pythia_shaped(), batch)
    assert len(before) == 2 and all(mask is not None for mask in before)  # transformers' sdpa: a dense mask per layer
    after = sdpa_masks_of_a_compiled_step(attention.use(pythia_shaped()), batch)
    assert len(after) == 2 and all(mask is None for mask in after)


def test_the_maskless_kernel_computes_what_sdpa_computes():
    batch = plain_blocks()
    reference = pythia_shaped()
    maskless = attention.use(pythia_shaped())
    assert maskless.config._attn_implementation == attention.CAUSAL_SDPA
    assert torch.allclose(reference(**batch).logits, maskless(**batch).logits, atol=1e-6)
    torch.manual_seed(3)
    prompt = batch["input_ids"][:1, :6]
    reference.eval(), maskless.eval()
    assert torch.equal(
        reference.generate(prompt, max_new_tokens=8, do_sample=False),
        maskless.generate(prompt, max_new_tokens=8, do_sample=False),
    )
    padded = torch.ones(2, T, dtype=torch.long)
    padded[1, 20:] = 0
    ids = batch["input_ids"][:2]
    assert torch.allclose(
        reference(ids, attention_mask=padded).logits, maskless(ids, attention_mask=padded).logits, atol=1e-6
    )
    assert maskless.config._attn_implementation == attention.CAUSAL_SDPA  # back after a forward that needed a mask


def test_documents_kept_apart_still_get_their_mask_and_stay_apart():
    """data.document_masking: position ids restart at each EOS; compiled, every document's logits are the ones it has
    alone, also when the model was set to the maskless kernel."""
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(2, VOCAB, (n,), generator=gen) for n in (9, 14, 9)]
    for doc in docs:
        doc[-1] = EOS
    row = torch.cat(docs)
    batch = PackedCollator("sdpa", eos=EOS)([{"input_ids": row, "labels": row.clone()}] * 2)
    model = attention.use(pythia_shaped())
    masks = sdpa_masks_of_a_compiled_step(model, batch)
    assert masks and all(mask is not None for mask in masks)
    model.eval()
    with torch.no_grad():
        packed = torch.compile(model, backend="eager")(**batch).logits[0]
        start = 0
        for doc in docs:
            alone = model(doc[None]).logits[0]
            assert torch.allclose(packed[start : start + len(doc)], alone, atol=1e-5)
            start += len(doc)


@pytest.mark.parametrize(
    ("kernel", "model_type", "positions", "expected"),
    [
        ("sdpa", "gpt_neox", False, True),
        ("sdpa", "gpt_neox", True, False),  # documents kept apart: the block-causal mask stays
        ("eager", "gpt_neox", False, False),
        ("flash_attention_2", "gpt_neox", False, False),  # no mask there already
        ("sdpa", "llama", False, False),  # only the model whose forward this was read from
    ],
)
def test_which_runs_train_on_it(kernel, model_type, positions, expected):
    assert attention.applies(kernel, model_type, positions) is expected


def test_plain_puts_the_model_back_on_sdpa():
    model = attention.plain(attention.use(pythia_shaped()))
    assert model.config._attn_implementation == "sdpa"
    assert sdpa_masks_of_a_compiled_step(model, plain_blocks())[0] is not None


def test_flex_attention_on_a_cpu_is_the_masked_softmax_for_every_shape():
    """Issues 55 and 65: Inductor's compiled CPU flex kernel let packed documents see each other on an AVX2-only EPYC
    (max |diff| 1.9 against the masked softmax, NaN at 56 tokens, compiled per shape or with dynamic shapes; what
    compiled before in the process had decided it). With hftrain's patch a CPU runs torch's unfused flex: each
    shape exact, whatever ran before, and nothing compiled."""
    import transformers.integrations.flex_attention as flex
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask

    from hftrain import _compat

    _compat.flex_uncompiled_on_cpu()
    _compat.flex_uncompiled_on_cpu()  # idempotent: one wrapper
    assert flex.compile_friendly_flex_attention.hftrain_uncompiled_on_cpu
    torch.manual_seed(0)
    for length in (24, 40, 56):
        q, k, v = (torch.randn(1, 2, length, 16) for _ in range(3))
        docs = torch.arange(length) // 10  # documents of 10 tokens, packed
        mask = create_block_mask(lambda b, h, i, j: (i >= j) & (docs[i] == docs[j]), 1, 1, length, length, device="cpu")
        before = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]
        out = flex.compile_friendly_flex_attention(q, k, v, block_mask=mask)
        assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] == before
        i = torch.arange(length)
        allowed = (i[:, None] >= i[None, :]) & (docs[:, None] == docs[None, :])
        scores = (q @ k.transpose(-1, -2) / 16**0.5).masked_fill(~allowed, float("-inf"))
        torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, rtol=0, atol=1e-5, msg=f"{length} tokens")
