"""GPU tier: packed documents stay apart on the flash kernels, in bf16 at micro-batch 4 (the case where
flash_attention_2 given (batch, seq_len) rows ignores restarted position ids), for instruction examples and
document-masked pretraining; and the same kernel given today's rows is caught by the check."""

from __future__ import annotations

import pytest

from . import support

pytestmark = pytest.mark.gpu
# The report (scripts/gpu_report.py) counts a skip that starts with "needs " as not run, never as passed
NO_FLASH = "needs flash_attention_2 or flash_attention_3 (pip install flash-attn); this machine has {kernels}"


def _recipes(tmp_path):
    from hftrain.data.part import DataPart
    from hftrain.recipe.load import load_recipe

    data = support.ROOT / "recipes" / "finetune" / "data" / "train.jsonl"
    base = {
        "model": {"preset": "pythia-14m"},
        "training": {"per_device_train_batch_size": 4, "output_dir": str(tmp_path / "r")},
    }
    return {
        "examples": DataPart.of(
            load_recipe(
                None, {**base, "data": {"train": {"path": str(data), "format": "prompt_completion"}, "seq_len": 256}}
            )
        ),
        "documents": DataPart.of(load_recipe(None, {**base, "data": {"seq_len": 512, "document_masking": True}})),
    }


@pytest.mark.parametrize("kind", ["examples", "documents"])
def test_flash_kernels_keep_packed_documents_apart(tmp_path, kind):
    import torch

    from hftrain.data.packing_check import available_kernels, check_packing

    kernels = available_kernels(torch.device("cuda"))
    if not any(k.startswith("flash") for k in kernels):
        pytest.skip(NO_FLASH.format(kernels=kernels))
    lines, ok = check_packing(_recipes(tmp_path)[kind])
    print("\n".join(lines))
    assert ok, lines
    assert " bfloat16 on cuda" in lines[0]


def test_flash_attention_on_rows_is_caught(tmp_path):
    import torch

    from hftrain.data.packed_batch import ROWS
    from hftrain.data.packing_check import available_kernels, check_packing

    kernels = available_kernels(torch.device("cuda"))
    flash = [k for k in kernels if k.startswith("flash")]
    if not flash:
        pytest.skip(NO_FLASH.format(kernels=kernels))
    lines, ok = check_packing(_recipes(tmp_path)["examples"], kernels={flash[0]: ROWS})
    assert not ok, lines
