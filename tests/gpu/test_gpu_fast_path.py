"""GPU tier, item fast_path (issue 62, part 3): what only a GPU shows of the fast path. An FP8 run (torchao) that
trains, saves and loads in plain transformers; a plain block's attention taking SDPA's flash kernel (no mask);
the loader's batches in pinned memory, on the device by a copy the host does not wait for, from worker processes.
Written on a CPU machine (collected there, skipped); run by scripts/gpu_check.sh."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from . import support

pytestmark = pytest.mark.gpu
ITEM = "fast_path"


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def test_an_fp8_run_trains_saves_and_loads_in_plain_transformers(tmp_path):
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("needs torchao (pip install 'hftrain[fp8]')")
    if _capability() < (8, 9):
        pytest.skip(f"needs a GPU with FP8 (compute capability 8.9+), this one is {_capability()}")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fp8"
    raw = support.shipped_recipe(
        "quickstart.yaml", out, max_steps=60, bf16=True, save_steps=30, eval_steps=30, logging_steps=10
    )
    raw["speed"] = {"fp8": "tensorwise"}
    support.hftrain("train", str(support.write_recipe(raw, tmp_path / "fp8.yaml")))
    losses = support.logged(out)
    steps = sorted(losses)
    assert losses[steps[-1]] < losses[steps[0]] - 0.5, losses  # it learns through the FP8 matmuls
    model = AutoModelForCausalLM.from_pretrained(out / "final")  # plain transformers: no torchao layer, no FP8 weight
    assert all(p.dtype in (torch.float32, torch.bfloat16) for p in model.parameters())
    assert type(model).__name__ == "GPTNeoXForCausalLM"
    support.record(ITEM, "fp8_tensorwise_quickstart", {"first_loss": losses[steps[0]], "last_loss": losses[steps[-1]]})


def test_a_plain_block_takes_sdpas_flash_kernel():
    """The fast path's step (bf16, torch.compile) with hftrain's maskless attention (model/attention.py) runs with
    SDPA held to its flash kernel alone; transformers' own SDPA path, which under torch.compile passes a dense
    causal mask (eager, it drops the mask itself), cannot: flash takes no mask (the check can fail)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hftrain.model import attention

    from ..model.test_attention import plain_blocks, pythia_shaped  # Pythia's options at a tiny shape

    batch = {k: v.to("cuda") for k, v in plain_blocks().items()}

    def step(model) -> None:
        torch._dynamo.reset()
        compiled = torch.compile(model.to("cuda", torch.bfloat16).train())
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            compiled(**batch).loss.backward()

    step(attention.use(pythia_shaped()))
    with pytest.raises(Exception, match="(?i)no available kernel|flash"):  # raised by SDPA, maybe through dynamo
        step(attention.plain(pythia_shaped()))
    support.record(ITEM, "maskless_sdpa_flash", {"flash_only_step": "ran", "with_mask": "refused"})


def test_the_loader_pins_copies_without_waiting_and_uses_its_workers(tmp_path):
    """A short CUDA run's loader: worker processes (the speed default on a GPU), and a batch it hands over is in
    pinned host memory and then on the GPU by a copy the host does not wait for (accelerator_config.non_blocking)."""
    import hftrain
    from hftrain.data import loader as loading

    pinned_inputs: list[bool] = []
    real_pinned = loading.pinned

    def watched(tensor: torch.Tensor) -> torch.Tensor:
        out = real_pinned(tensor)
        pinned_inputs.append(out.is_pinned())
        return out

    out = tmp_path / "loader"
    raw = support.shipped_recipe("quickstart.yaml", out, max_steps=4, bf16=True, save_steps=10_000, eval_strategy="no")
    loading.pinned = watched
    try:
        run = hftrain.train(hftrain.load_recipe(None, raw))
    finally:
        loading.pinned = real_pinned
    loader, args = run.trainer.train_loader, run.trainer.args
    assert args.dataloader_num_workers > 0 and loader.num_workers == args.dataloader_num_workers
    placement = loader.placement
    assert placement.device.type == "cuda" and placement.pin_memory and placement.non_blocking, placement
    assert pinned_inputs and all(pinned_inputs), pinned_inputs  # every batch went through pinned memory
    batch = placement({"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    assert batch["input_ids"].device.type == "cuda"
    support.record(ITEM, "loader_pinned_workers", {"workers": loader.num_workers, "pinned_batches": len(pinned_inputs)})
