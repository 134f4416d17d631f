"""The recipe resolved once (training/resolve.py): a function of the recipe, the launch and what a continuing run
recorded, which reads and changes nothing; the global batch, the fit, the run length and the resume setting each
come from one place, so the parts the components get agree with each other."""

from __future__ import annotations

import os

import pytest

from hftrain.checkpoint.part import CheckpointPart
from hftrain.parallel.dims import LaunchEnv, Strategy
from hftrain.recipe.load import load_recipe
from hftrain.training.resolve import resolve


def launch(processes: int = 1, elastic_nodes: int | None = None) -> LaunchEnv:
    """A launch as the environment would describe it, without setting the environment."""
    return LaunchEnv(
        processes=processes,
        local_processes=1 if elastic_nodes else processes,
        rank=0,
        local_rank=0,
        launched=Strategy.DDP if processes > 1 else Strategy.SINGLE,
        rehearsal=None,
        elastic_most_nodes=elastic_nodes,
        device="cpu",
    )


def tiny(tmp_path, parallelism: dict | None = None, **training):
    raw = {"output_dir": str(tmp_path / "run"), "max_steps": 5, "per_device_train_batch_size": 4, **training}
    return load_recipe(None, {"model": {"preset": "cpu-tiny"}, "training": raw, "parallelism": parallelism or {}})


def test_resolving_reads_and_changes_nothing_and_the_arguments_follow_the_dims(tmp_path):
    recipe = tiny(tmp_path, resume_from_checkpoint=False, save_total_limit=2)
    environment = dict(os.environ)
    spec = resolve(recipe, launch(2), {"global_batch": 24})  # a run that started with 24 sequences per step
    assert not (tmp_path / "run").exists()  # nothing written before the run owns its output_dir
    assert dict(os.environ) == environment  # no network bound, no process set-up: those are run.py's set-up step
    assert (spec.dims.global_batch, spec.dims.accumulation) == (24, 3)  # 24 = 4 x 3 x 2 processes, kept
    arguments = spec.arguments
    assert arguments["gradient_accumulation_steps"] == 3 and arguments["max_steps"] == spec.length.max_steps == 5
    assert not {"resume_from_checkpoint", "push_to_hub", "save_total_limit"} & set(arguments)  # hftrain's own keys
    assert spec.checkpoints.resume.mode == "never" and spec.checkpoints.save_total_limit == 2
    assert spec.length.tokens_per_step == 24 * recipe.data.seq_len
    with pytest.raises(TypeError):  # made once, read-only: the set-up completes a copy into the TrainingArguments
        arguments["max_steps"] = 6  # type: ignore[index]
    assert spec.as_run.global_batch == 24 and spec.as_run.max_steps == 5 and spec.as_run.strategy == "ddp"


def test_the_fit_answers_with_a_batch_at_the_global_batch_the_dims_use(tmp_path):
    """An elastic launch whose first start has one node of MAX 2: the global batch is 8 sequences on each of the 2
    nodes' processes, for the fit as for the dims (the fit used to count only the processes at hand: 8, and the
    run then trained at 8 while a start with both nodes trained at 16)."""
    recipe = tiny(tmp_path, per_device_train_batch_size=8)
    fitting = tiny(tmp_path, {"fit_memory": True}, per_device_train_batch_size=8)
    spec = resolve(fitting, launch(1, elastic_nodes=2), {})
    assert spec.dims.global_batch == 16 and spec.fit_note and spec.fit_note.startswith("memory fit")
    micro = spec.dims.micro_batch  # the fit's choice: what fits here, at 16 sequences per step
    assert micro * spec.dims.accumulation == 16
    assert (spec.as_run.micro_batch, spec.as_run.global_batch) == (micro, 16)  # what the run became, for the Run record
    assert f"per_device_train_batch_size: {micro}" in spec.checkpoints.recipe_yaml  # what each checkpoint carries
    assert fitting.training.per_device_train_batch_size == 8  # the caller's recipe is left as it was
    plain = resolve(recipe, launch(1, elastic_nodes=2), {})  # no fit: the recipe's micro-batch, accumulated
    assert (plain.dims.micro_batch, plain.dims.accumulation, plain.fit_note) == (8, 2, None)
    assert plain.as_run.recipe_yaml == CheckpointPart.of(recipe).recipe_yaml  # no fit: the recipe as written


def test_a_cuda_launch_reads_with_loader_workers_that_the_dims_and_arguments_agree_on(tmp_path, monkeypatch):
    """The CUDA default of dataloader_num_workers is decided once, here: the readers split over it, the arguments
    carry it (the loader is built from them), and a recipe's own value or a CPU launch keep theirs."""
    from dataclasses import replace

    from hftrain.parallel.batch import BatchPart
    from hftrain.training import resolve as resolving

    # the fit reads the GPU's memory
    monkeypatch.setattr(resolving, "fit_batch", lambda recipe, *a: (BatchPart.of(recipe), None))
    gpu = replace(launch(1), device="cuda", cpus=16)
    spec = resolve(tiny(tmp_path), gpu, {})
    assert spec.dims.readers.workers == spec.arguments["dataloader_num_workers"] == 4 and spec.dims.readers.readers == 8
    assert spec.arguments["accelerator_config"] == {"non_blocking": True}
    own = resolve(tiny(tmp_path, dataloader_num_workers=2), gpu, {})
    assert own.dims.readers.workers == own.arguments["dataloader_num_workers"] == 2
    cpu = resolve(tiny(tmp_path), replace(launch(1), cpus=16), {})
    assert "dataloader_num_workers" not in cpu.arguments and cpu.dims.readers.workers == 1  # in the training process
