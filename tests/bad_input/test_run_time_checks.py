"""What was left to run time or to another library, checked before any work: each refusal is one line naming the
recipe key and what to do (exit 2, no traceback), with nothing written (the work folder byte-identical) and the
run's set-up never reached (no speed probe, no tokenizer trained, no model loaded: the test's set-up stand-in says
so if it is). Through the CLI's own entry point in this process. Before, each row failed late: a traceback and
exit 1 after the tokenizer was trained (a, b), a refusal of a valid value (c), a silent change of the run's
global batch (d), a script written for a recipe that cannot run (e), a refusal after the speed probe (f)."""

from __future__ import annotations

import json
import sys

import pytest

from hftrain.errors import HftrainError

from ..support.checks import tree_digest
from ..support.cli import in_process
from .conftest import fill

SET_UP = "the test's stand-in: the run's set-up was reached"  # every check passed
PAIRS = ["data.train={{path: {tmp}/pairs.jsonl, format: preference}}", "finetune.objective=dpo"]
PRETRAINED = ["model.from_pretrained={tmp}/base", "tokenizer.train=null"]  # the model's own tokenizer
EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of no bytes
SCRIPT = ["launch-script", "{recipe}", "--out", "{tmp}/job.sh"]

# (name, argv with conftest.fill's placeholders, the message (SET_UP: accepted), what the folder holds first)
ROWS = [
    (
        "a: a tracker not installed",
        ["train", "{recipe}", "training.report_to=[tensorboard, wandb]"],
        "training.report_to: wandb cannot report: the library is not installed here; run `pip install wandb`, or "
        "remove it from training.report_to (none: no tracker).",
        "no wandb",
    ),
    (
        "a: a tracker name transformers does not know",
        ["train", "{recipe}", "training.report_to=wandbb"],
        "training.report_to: 'wandbb' is not a tracker transformers "
        "knows; did you mean wandb? give none, all, or some of: ",
        None,
    ),
    (
        "b: a misspelt DPO loss type in a list",
        ["train", "{recipe}", *PAIRS, *PRETRAINED, "finetune.dpo={{loss_type: [sigmoid, bco_pari]}}"],
        "dpo: loss_type: 'bco_pari' is not a loss type TRL's DPOTrainer knows; did you mean bco_pair? give one or a "
        "list of: sigmoid, hinge, ipo,",
        "base model",
    ),
    (
        "c: one DPO loss type as a string",
        ["train", "{recipe}", *PAIRS, *PRETRAINED, "finetune.dpo={{loss_type: ipo}}"],
        SET_UP,
        "base model",
    ),
    (
        "d: a resumed run given another global batch",
        ["train", "{recipe}", "parallelism.global_batch_size=16"],
        "parallelism.global_batch_size: 16 sequences per step, but this run started with 8 (recorded in its "
        "hftrain_run.json): each step would train on another number of tokens (tokens_seen would jump). Remove "
        "parallelism.global_batch_size to keep 8, or set training.output_dir to a new directory to start a new run.",
        "a run at step 2",
    ),
    (
        "e: torchrun script for a misspelt key",
        [*SCRIPT, "--kind", "torchrun", "training.learnig_rate=1"],
        "training.learnig_rate: unknown key; did you mean training.learning_rate?",
        None,
    ),
    (
        "e: slurm script with a missing accelerate config",
        [*SCRIPT, "--kind", "slurm", "--accelerate-config", "{tmp}/fsdp2.yaml"],
        "--accelerate-config: no file '{tmp}/fsdp2.yaml' and no shipped config of that name; shipped: ddp, ",
        None,
    ),
    (  # before: read as an accelerate config, "distributed_type NO is not a multi-process backend"
        "e: slurm script given a DeepSpeed JSON as its accelerate config",
        [*SCRIPT, "--kind", "slurm", "--accelerate-config", "{tmp}/ds.json"],
        "{tmp}/ds.json: a DeepSpeed config (zero_optimization, train_batch_size), not an accelerate config. Give "
        "--accelerate-config zero3",
        "a DeepSpeed JSON",
    ),
    (
        "e: torchrun script whose readers cannot split",
        [*SCRIPT, "--kind", "torchrun", "--nodes", "2", "--gpus-per-node", "8", "data.readers=12"],
        "data.readers: 12 logical readers cannot be split over the 16 processes of 2 node(s) x --gpus-per-node 8; set "
        "data.readers to a multiple of 16, or remove it",
        None,
    ),
    (
        "f: a resumed run with another tokenizer",
        ["train", "{recipe}", "tokenizer.train.vocab_size=288"],
        "training.output_dir: {tmp}/run holds a run whose tokenizer differ from this recipe's. Continuing it would mix "
        "two runs. Set training.output_dir to a new directory, or delete {tmp}/run to start fresh.",
        "a run at step 2",
    ),
]


def _prepare(work, what: str, monkeypatch) -> None:
    """The folder (and the process) as the row finds them."""
    records = [{"prompt": f"Q{i}?", "chosen": " yes", "rejected": " no"} for i in range(8)]
    (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    if what == "a DeepSpeed JSON":
        (work / "ds.json").write_text(
            '{"zero_optimization": {"stage": 3}, "train_batch_size": "auto"}', encoding="utf-8"
        )
    elif what == "no wandb":
        monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed (find_spec answers None)
    elif what == "base model":  # a pretrained model's config and tokenizer: nothing before the set-up reads its weights
        from transformers import GPTNeoXConfig

        from hftrain.model.tokenizer import gpt2_tokenizer

        base = work / "base"
        GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=50304
        ).save_pretrained(base)
        gpt2_tokenizer().save_pretrained(base)
    elif (
        what == "a run at step 2"
    ):  # what a run of r.yaml leaves: its start record (global batch 8), one complete checkpoint
        import hftrain
        from hftrain.checkpoint.layout import COMPLETE_MARKER
        from hftrain.checkpoint.part import CheckpointPart

        identity = CheckpointPart.of(hftrain.load_recipe(work / "r.yaml")).identity
        (work / "run" / "checkpoint-2").mkdir(parents=True)
        (work / "run" / "checkpoint-2" / COMPLETE_MARKER).write_text('{"step": 2}', encoding="utf-8")
        (work / "run" / "hftrain_run.json").write_text(
            json.dumps({"fingerprint": identity, "global_batch": 8}), encoding="utf-8"
        )


@pytest.mark.parametrize("name, argv, expected, prepared", ROWS, ids=[r[0] for r in ROWS])
def test_a_run_time_check_comes_before_any_work(capsys, monkeypatch, work, name, argv, expected, prepared):
    from hftrain.training import run as training_run

    def stand_in(*args):  # the set-up: the TrainingArguments and the speed probe; then the tokenizer and model
        raise HftrainError(SET_UP)

    monkeypatch.setattr(training_run, "set_up", stand_in)
    _prepare(work, prepared or "", monkeypatch)
    before = tree_digest(work)
    places = fill(work)
    code, printed = in_process(capsys, *(word.format(**places) for word in argv))
    assert code == 2 and "Traceback" not in printed, (code, printed[-2000:])
    assert expected.format(**places) in printed, printed[-2000:]
    if expected == SET_UP:  # accepted: TRL's own config takes it as its one loss type
        from hftrain.recipe.load import load_recipe
        from hftrain.training.dpo import dpo_arguments

        recipe = load_recipe(work / "r.yaml", [word.format(**places) for word in argv[2:]])
        config = dpo_arguments(
            {"output_dir": str(work / "dpo"), "use_cpu": True, "report_to": "none"}, recipe.finetune.dpo, 64
        )
        assert config.loss_type == ["ipo"], config.loss_type
        return
    assert SET_UP not in printed, printed[-2000:]
    after = tree_digest(work)
    # `hftrain train` owns the output_dir first; in one that exists it stays, empty
    lock = after.pop("run/.hftrain.lock", None)
    assert after == before and lock in (None, EMPTY)  # no tokenizer, no start record, no script
