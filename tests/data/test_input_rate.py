"""Input that keeps up with a GPU (issue 51 part 5), on the CPU with the device faked: loader workers by device,
decided where the dims are, pinned batches copied without a wait, and the warning before step 1 when the input
cannot keep up, decided from numbers given to it (never from how fast this machine is)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hftrain.data import loader as data_loader
from hftrain.data.input_rate import input_warning, tokens_per_s, wait_share
from hftrain.data.loader import PackedDataset, Placement, ResumableLoader, plan_data
from hftrain.model.tokenizer import gpt2_tokenizer
from hftrain.parallel.dims import LaunchEnv, Strategy
from hftrain.parallel.readers import ReaderLayout
from hftrain.recipe.load import load_recipe
from hftrain.training.arguments import argument_values
from hftrain.training.input_check import InputCheckCallback, consumed_tokens_per_s
from hftrain.training.resolve import loader_workers
from hftrain.training.step_metrics import MetricsOptions


def launch(device: str, cpus: int, processes: int = 1) -> LaunchEnv:
    return LaunchEnv(
        processes, processes, 0, 0, Strategy.SINGLE if processes == 1 else Strategy.DDP, None, None, device, cpus=cpus
    )


def section(**data):
    return load_recipe(None, {"data": {"train": {"builtin": "python-docs"}, **data}}).data


WORKER_CASES = [  # launch, the recipe's training keys, data keys, recorded readers, reader limit -> workers
    (launch("cpu", 16), {}, {}, None, 8, 0),  # a worker would take a core from the matmuls
    (launch("cuda", 16), {}, {}, None, 8, 4),  # the lent H100/H200 machine: 16 cores, 8 readers
    (launch("cuda", 2), {}, {}, None, 8, 1),  # one core beside the training process
    (launch("cuda", 16, processes=8), {}, {}, None, 8, 1),  # 2 cores each; 8 readers over 8 processes: 1 each
    (launch("cuda", 96, processes=8), {}, {}, None, 8, 1),  # cores to spare, but a second worker would need 16 readers
    (launch("cuda", 16, processes=3), {}, {}, None, 8, 4),  # 24 readers, 8 per process
    (launch("cuda", 16), {}, {}, None, 1, 1),  # one shard: one reader, one worker (more would add readers)
    (launch("cuda", 16), {}, {"readers": 6}, None, 8, 3),
    (launch("cuda", 16), {}, {}, 2, 8, 2),  # a resumed run keeps its 2 readers
    (launch("cuda", 16), {"dataloader_num_workers": 0}, {}, None, 8, 0),  # the recipe's own
    (launch("cpu", 16), {"dataloader_num_workers": 3}, {}, None, 8, 3),
    (launch("cuda", 16), {"use_cpu": True}, {}, None, 8, 0),
]


@pytest.mark.parametrize("env, training, data, readers, limit, workers", WORKER_CASES)
def test_loader_workers_by_device(env, training, data, readers, limit, workers):
    recorded = {"readers": readers} if readers else {}
    assert loader_workers(training, env, section(**data), recorded, limit) == workers


def arguments_on(device: str, **training):
    return argument_values(
        {"max_steps": 5, **training},
        SimpleNamespace(accumulation=1, rehearsal=None),
        SimpleNamespace(max_steps=5),
        device,
    )


def test_batches_are_copied_without_a_wait_on_cuda_unless_the_recipe_says_otherwise():
    assert arguments_on("cuda")["accelerator_config"] == {"non_blocking": True}
    assert arguments_on("cuda", accelerator_config={"split_batches": False})["accelerator_config"] == {
        "split_batches": False,
        "non_blocking": True,
    }
    assert arguments_on("cuda", accelerator_config={"non_blocking": False})["accelerator_config"] == {
        "non_blocking": False
    }
    # no pinned memory: a copy waits anyway
    assert "accelerator_config" not in arguments_on("cuda", dataloader_pin_memory=False)
    assert "accelerator_config" not in arguments_on("cuda", use_cpu=True)
    assert "accelerator_config" not in arguments_on("cpu")


PLACEMENT_CASES = [  # device, pin_memory, non_blocking -> pinned, sent to the device
    ("cuda", True, True, True, True),
    ("cuda", True, False, True, False),  # pinned; the Trainer copies it
    ("cuda", False, True, False, True),
    ("cpu", True, True, False, False),
    (None, True, True, False, False),
]


@pytest.mark.parametrize("device, pin, non_blocking, pinned, sent", PLACEMENT_CASES)
def test_the_loader_pins_and_copies_its_batches_on_cuda(monkeypatch, device, pin, non_blocking, pinned, sent):
    import accelerate.utils

    calls = []
    monkeypatch.setattr(data_loader, "pinned", lambda t: calls.append("pin") or t)
    monkeypatch.setattr(
        accelerate.utils, "send_to_device", lambda b, d, non_blocking: calls.append(("send", d.type, non_blocking)) or b
    )
    placement = Placement(torch.device(device) if device else None, pin, non_blocking)
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}
    assert placement(batch) == batch
    assert calls.count("pin") == (2 if pinned else 0) and (("send", "cuda", True) in calls) is sent


def test_the_placement_follows_the_training_arguments():
    args = SimpleNamespace(
        device=torch.device("cuda", 1),
        dataloader_pin_memory=True,
        accelerator_config=SimpleNamespace(non_blocking=True),
    )
    assert Placement.of(args) == Placement(torch.device("cuda", 1), True, True)
    args.accelerator_config = {"non_blocking": False}
    assert Placement.of(args) == Placement(torch.device("cuda", 1), True, False)


# tokens/s: pythia-160m on an H200 consumed 266,764 (notes/gpu-peers.md); one process tokenized the built-in corpus
# at about 617,000 (2048-token blocks) and read prepared shards at about 11,000,000 through a worker
# (benchmarks/data_throughput.py)
H200_160M, RAW, SHARDS = 266_764, 617_000, 11_000_000
KEEPS_UP_CASES = [  # consumed, per worker, workers, pretokenized -> share of each step waiting, warned
    (H200_160M, RAW, 0, False, 0.30, True),  # tokenized between steps: the 5-6% (one window 31%) seen there
    (H200_160M, RAW, 1, False, 0.0, False),  # one worker makes 2.3x what it consumes
    (4 * H200_160M, RAW, 1, False, 0.42, True),  # a smaller model: one worker is not enough, 2 are
    (4 * H200_160M, RAW, 2, False, 0.0, False),
    (4 * H200_160M, SHARDS, 0, True, 0.088, False),
    (40 * H200_160M, SHARDS, 0, True, 0.49, True),
]


@pytest.mark.parametrize("consumed, per_worker, workers, pretokenized, share, warned", KEEPS_UP_CASES)
def test_the_input_keeps_up_or_train_says_so(consumed, per_worker, workers, pretokenized, share, warned):
    assert wait_share(consumed, per_worker, workers) == pytest.approx(share, abs=0.01)
    line = input_warning(consumed, per_worker, workers, 0.2, pretokenized, "as planned")
    assert (line is not None) is warned
    if warned:
        assert (
            line.startswith("warning: the input may not keep up")
            and f"training.dataloader_num_workers (now {workers};" in line
        )
        assert ("`hftrain data prepare`" in line) is not pretokenized  # prepared shards need no second preparation


def test_the_gpu_consumes_what_the_plan_times():
    per_token = 968_629_248  # pythia-160m at 2,048 tokens (6N + 12LdT)
    assert consumed_tokens_per_s(per_token, 989.4e12, 0.35, False) == pytest.approx(357_500, rel=1e-3)
    assert consumed_tokens_per_s(per_token, 989.4e12, 0.35, True) == pytest.approx(0.75 * 357_500, rel=1e-3)


def tiny_loader(tmp_path, workers: int = 0) -> ResumableLoader:
    text = tmp_path / "train.txt"
    text.write_text("the red fox follows the quiet owl. " * 400, encoding="utf-8")
    data = load_recipe(None, {"data": {"train": {"path": str(text)}, "seq_len": 32}}).data
    layout = ReaderLayout(readers=1, processes=1, workers=1, window=1)
    return ResumableLoader(PackedDataset(plan_data(data, 0), gpt2_tokenizer(), 0, layout), 2, workers)


def test_before_step_1_a_gpu_run_measures_its_input_and_warns_once(tmp_path, capsys):
    loader = tiny_loader(tmp_path)
    assert tokens_per_s(loader.dataset.plan, loader.dataset.tokenizer, 1, seconds=0.05) > 0
    args = SimpleNamespace(device=torch.device("cuda"), gradient_checkpointing=False, dataloader_num_workers=0)
    for peak, warned in ((1e21, True), (1.0, False)):  # a device far faster than any input, and a very slow one
        options = MetricsOptions(64, 1, 1e6, peak, None, 0.2, 0)
        check = InputCheckCallback(options, seconds=0.05)
        check.on_train_begin(args, SimpleNamespace(is_world_process_zero=True), None, train_dataloader=loader)
        assert (check.line is not None) is warned
        assert ("hftrain: warning: the input may not keep up" in capsys.readouterr().out) is warned
    cpu = InputCheckCallback(MetricsOptions(64, 1, 1e6, 1e21, None, 0.2, 0))
    cpu.on_train_begin(SimpleNamespace(device=torch.device("cpu")), None, None, train_dataloader=loader)
    assert cpu.line is None  # nothing measured on a CPU
