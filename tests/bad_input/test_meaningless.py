"""Values that load and would train, but cannot mean what the user wants: each refused with its message before any
training step (exit 2, no traceback), through the CLI's own entry point in this process. Before, every row here
trained to exit 0, or (the last) wrote a SageMaker job that fails on the cluster."""

from __future__ import annotations

import json

import pytest

from ..support.cli import in_process
from .conftest import fill

PAIRS = ["data.train={{path: {tmp}/pairs.jsonl, format: preference}}", "finetune.objective=dpo"]
S3_DATA = "data.train={{path: 's3://bucket/corpus/*.jsonl'}}"

# (name, argv with conftest.fill's placeholders, the message)
MEANINGLESS = [
    (
        "DPO beta below 0",
        ["train", "{recipe}", *PAIRS, "finetune.dpo={{beta: -0.1}}"],
        "dpo: beta: -0.1 is out of range; it must be > 0 (the strength of the preference against the reference",
    ),
    (
        "DPO beta 0",
        ["train", "{recipe}", *PAIRS, "finetune.dpo={{beta: 0}}"],
        "dpo: beta: 0 is out of range; it must be > 0",
    ),
    (
        "DPO beta not a number",
        ["train", "{recipe}", *PAIRS, "finetune.dpo={{beta: strong}}"],
        "dpo: beta: 'strong' is not a number",
    ),
    ("DPO beta true", ["train", "{recipe}", *PAIRS, "finetune.dpo={{beta: true}}"], "dpo: beta: true is not a number"),
    (
        "DPO label smoothing that flips",
        ["train", "{recipe}", *PAIRS, "finetune.dpo={{label_smoothing: 0.7}}"],
        "dpo: label_smoothing: 0.7 is out of range; it must be >= 0 and <= 0.5",
    ),
    (
        "DPO negative loss weight",
        ["train", "{recipe}", *PAIRS, "finetune.dpo={{loss_type: [sigmoid], loss_weights: [-1.0]}}"],
        "dpo: loss_weights: -1 is out of range; it must be >= 0",
    ),
    (
        "DPO sync steps 0",
        ["train", "{recipe}", *PAIRS, "finetune.dpo={{sync_ref_model: true, ref_model_sync_steps: 0}}"],
        "dpo: ref_model_sync_steps: 0 is out of range; it must be >= 1",
    ),
    (
        "full DPO on a preset",
        ["train", "{recipe}", *PAIRS],
        "finetune.objective: dpo aligns a trained model's preferences, "
        "but this recipe builds model.preset cpu-tiny from random weights",
    ),
    (
        "LoRA DPO on a preset",
        ["train", "{recipe}", *PAIRS, "finetune.method=lora"],
        "finetune.objective: dpo aligns a trained model's preferences",
    ),
    (
        "a kept step after max_steps",
        ["train", "{recipe}", "checkpoints.steps=[1, 5000]"],
        "checkpoints.steps: 5000 after training.max_steps (4) would never be kept",
    ),
    (
        "a kept step after a token budget",
        ["train", "{recipe}", "training.max_steps=-1", "data.train_tokens=2048", "checkpoints.steps=[1, 50]"],
        "checkpoints.steps: 50 after this run's last step (data.train_tokens=2,048 / ",
    ),
    (
        "SageMaker job with a local tokenizer",
        [
            "launch-script",
            "{recipe}",
            "--kind",
            "sagemaker",
            S3_DATA,
            "tokenizer.train=null",
            "tokenizer.path={notdir}",
        ],
        "tokenizer.path '{notdir}' is a path on this machine, which a SageMaker job cannot read",
    ),
    (
        "SageMaker job resuming a local checkpoint",
        ["launch-script", "{recipe}", "--kind", "sagemaker", S3_DATA, "training.resume_from_checkpoint={notdir}"],
        "training.resume_from_checkpoint '{notdir}' is a path on this machine, which a SageMaker job cannot read; a "
        "job resumes from its own",
    ),
]


@pytest.mark.parametrize("name, argv, expected", MEANINGLESS, ids=[c[0] for c in MEANINGLESS])
def test_a_value_that_cannot_mean_anything_is_refused_before_training(capsys, work, name, argv, expected):
    records = [{"prompt": f"Q{i}?", "chosen": " yes", "rejected": " no"} for i in range(8)]
    (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    places = fill(work)
    code, printed = in_process(capsys, *(word.format(**places) for word in argv))
    assert code == 2, (code, printed[-2000:])
    assert "Traceback" not in printed and "{'loss'" not in printed, printed[-2000:]  # no step was trained
    assert expected.format(**places) in printed, printed[-2000:]
    assert not (work / "run" / "checkpoint-1").exists()


def test_the_dpo_values_a_user_would_give_still_load(recipe_file, work):
    """The bounds refuse only what cannot work: TRL's defaults and the usual settings load."""
    import hftrain

    (work / "pairs.jsonl").write_text(
        json.dumps({"prompt": "Q?", "chosen": " yes", "rejected": " no"}) + "\n", encoding="utf-8"
    )
    base = [f"data.train={{path: {work}/pairs.jsonl, format: preference}}", "finetune.objective=dpo"]
    for dpo in (
        "{beta: 0.1}",
        "{beta: 2, label_smoothing: 0.5}",
        "{loss_type: [sigmoid, sft], loss_weights: [1.0, 0.0]}",
        "{ld_alpha: 0.5, discopop_tau: 0.05}",
        "{sync_ref_model: true, ref_model_sync_steps: 1, ref_model_mixup_alpha: 1.0}",
    ):
        recipe = hftrain.load_recipe(recipe_file, [*base, f"finetune.dpo={dpo}"])
        assert recipe.finetune.dpo
    kept = hftrain.load_recipe(recipe_file, ["checkpoints.steps=[0, 1, 4]"])
    assert kept.checkpoints.steps == [0, 1, 4]
