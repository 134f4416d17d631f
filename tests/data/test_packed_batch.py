"""Packed batches in each kernel's form: documents found at EOS, first tokens never targets, a flattened row with
the lengths the varlen kernels read, the packing fill; best-fit packing resumes exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hftrain.data.instructions import ExampleStream, best_fit
from hftrain.data.loader import plan_data
from hftrain.data.packed_batch import IGNORE, PackedCollator, document_positions, mask_note, real_tokens
from hftrain.data.stream import DocumentStream
from hftrain.errors import HftrainError
from hftrain.model.tokenizer import gpt2_tokenizer
from hftrain.recipe.load import load_recipe
from tests.support.data import instructions, write_examples

EOS = 0
WORDS = ["red", "green", "the", "cat", "sits", "quietly", "on", "a", "warm", "mat"]


def test_documents_restart_after_each_eos():
    ids = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 3], [EOS, 1, 2, 3, 4, 5, 6, 7]])
    assert document_positions(ids, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_rows_form_masks_first_tokens_and_turns_the_cache_off():
    ids = torch.tensor([5, 6, EOS, 7, 8, EOS, 9, 4])
    batch = PackedCollator("sdpa", eos=EOS)([{"input_ids": ids, "labels": ids.clone()}] * 2)
    assert batch["input_ids"].shape == (2, 8) and batch["use_cache"] is False
    assert batch["labels"][0].tolist() == [IGNORE, 6, EOS, IGNORE, 8, EOS, IGNORE, 4]
    plain = PackedCollator("sdpa")([{"input_ids": ids, "labels": ids.clone()}] * 2)  # no document masking: as before
    assert set(plain) == {"input_ids", "labels"} and plain["labels"][0].tolist() == ids.tolist()


def test_flattened_form_gives_the_varlen_kernels_every_document_length():
    ids = torch.tensor([5, 6, EOS, 7, 8, EOS, 9, 4])
    batch = PackedCollator("flash_attention_2", eos=EOS)([{"input_ids": ids, "labels": ids.clone()}] * 3)
    assert batch["input_ids"].shape == (1, 24) and batch["position_ids"].shape == (1, 24)
    assert (
        batch["cu_seq_lens_q"].tolist() == [0, 3, 6, 8, 11, 14, 16, 19, 22, 24]
        and batch["cu_seq_lens_q"].dtype == torch.int32
    )
    assert batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"] and batch["max_length_q"] == batch["max_length_k"] == 3
    assert (batch["labels"][0, [0, 8, 16]] == IGNORE).all()  # a row's first token is not predicted from the row before


def test_mask_sizes_are_stated():
    assert mask_note("sdpa", 8, 2048) == "sdpa: a block-causal mask of 8 x 2048 x 2048 bool (32.0 MiB) per forward"
    assert mask_note("eager", 2, 128) == "eager: a block-causal mask of 2 x 128 x 128 float32 (128 KiB) per forward"
    assert "no mask" in mask_note("flash_attention_3", 4, 512) and "4 x 16 x 16 tiles" in mask_note(
        "flex_attention", 4, 2048
    )
    with pytest.raises(
        ValueError, match="no packed-batch form is known for attention implementation 'paged_attention'"
    ):
        PackedCollator("paged_attention")


def test_best_fit_packs_tighter_than_greedy_and_is_deterministic():
    assert best_fit([100, 50, 28, 78], 128) == [[0, 2], [1, 3]]  # greedy in read order needs 3 blocks
    lengths = [50, 90, 30, 70, 10, 60, 40, 20, 80, 45]
    bins = best_fit(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins) and all(b == sorted(b) for b in bins)
    assert best_fit(lengths, 128) == bins


def test_padding_is_measured_and_real_tokens_are_not():
    labels = torch.tensor([IGNORE, IGNORE, 5, EOS, IGNORE, 7, EOS, IGNORE, IGNORE, IGNORE])
    ids = torch.tensor([1, 2, 5, EOS, 3, 7, EOS, EOS, EOS, EOS])
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1, 2])
    assert real_tokens(labels, ids, positions, pad=EOS) == 7
    full = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5])
    assert real_tokens(labels, ids, full, pad=EOS) == 10 and real_tokens(labels, ids, None, pad=EOS) == 10


@pytest.fixture(scope="module")
def example_stream(tmp_path_factory):
    rng = random.Random(0)  # answers of 1 to 30 words: examples of unequal length, as real fine-tuning data
    rows = [
        {"prompt": f"Question {i}:", "completion": " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))}
        for i in range(300)
    ]
    path = write_examples(tmp_path_factory.mktemp("examples") / "x.jsonl", rows)
    section = load_recipe(
        None, {"data": {"train": {"path": str(path), "format": "prompt_completion"}, "seq_len": 48}}
    ).data
    plan = plan_data(section, 0)
    return lambda packing: ExampleStream(
        DocumentStream(plan.train, seed=3), gpt2_tokenizer(), 48, window=16, packing=packing
    )


def test_best_fit_blocks_resume_exactly_inside_a_window(example_stream):
    stream = example_stream(True)
    run = [(b, pos) for _, (b, pos) in zip(range(40), stream.blocks(stream.fresh_state()))]
    for k in (5, 16, 23):  # inside the first window, at its end, inside the second
        resumed = [b for _, (b, _) in zip(range(40 - k - 1), stream.blocks(run[k][1]))]
        assert all(np.array_equal(a, b) for a, (b, _) in zip(resumed, run[k + 1 :]))

    def real(b):
        return real_tokens(torch.from_numpy(b[1]), torch.from_numpy(b[0]), torch.from_numpy(b[2]), stream.pad)

    padded = example_stream(False)  # one example per block: what padding costs
    one_each = [b for _, (b, _) in zip(range(40), padded.blocks(padded.fresh_state()))]
    assert sum(real(b) for b, _ in run) / (40 * 48) > 0.9 > 2 * sum(real(b) for b in one_each) / (40 * 48)


def test_unmasked_packed_examples_are_refused_at_load(tmp_path):
    path = write_examples(tmp_path / "x.jsonl", instructions(3, 0))
    with pytest.raises(
        HftrainError, match=r"data: document_masking: false would let packed instruction examples attend to each other"
    ):
        load_recipe(
            None, {"data": {"train": {"path": str(path), "format": "prompt_completion"}, "document_masking": False}}
        )
    load_recipe(
        None,
        {
            "data": {
                "train": {"path": str(path), "format": "prompt_completion"},
                "document_masking": False,
                "packing": False,
            }
        },
    )


def test_a_kernel_without_a_known_form_is_refused_only_where_documents_share_blocks(tmp_path):
    from hftrain.data.loader import collator_for

    path = write_examples(tmp_path / "x.jsonl", instructions(3, 0))
    packed = load_recipe(None, {"data": {"train": {"path": str(path), "format": "prompt_completion"}}}).data
    with pytest.raises(
        HftrainError,
        match=(
            r"model.attn_implementation: the model computes attention with 'custom_kernel', .* or data.packing: false\."
        ),
    ):
        collator_for(packed, "custom_kernel", EOS)
    text = load_recipe(None, {}).data  # plain pretraining: one document stream per row, nothing to keep apart
    assert collator_for(text, "custom_kernel", EOS).form == "rows"
