"""Preference pairs: tokenized exactly as TRL tokenizes them, read from every kind of source, bad records named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hftrain.data.loader import plan_data, train_blocks
from hftrain.data.preference_pairs import encode_pair, use_chatml
from hftrain.data.stream import Worker
from hftrain.data.validation_set import validation_pairs
from hftrain.errors import HftrainError
from hftrain.recipe.load import load_recipe

SHIPPED = Path(__file__).resolve().parents[2] / "recipes" / "finetune" / "data"

CHATS = [
    {
        "chosen": [
            {"role": "user", "content": "What does json.dumps do?"},
            {"role": "assistant", "content": "Serialize obj to a JSON str."},
        ],
        "rejected": [
            {"role": "user", "content": "What does json.dumps do?"},
            {"role": "assistant", "content": "Merge sorted inputs."},
        ],
    },
    {
        "prompt": [{"role": "user", "content": "And os.getcwd?"}],
        "chosen": [{"role": "assistant", "content": "Return the current working directory."}],
        "rejected": [{"role": "assistant", "content": "Close the file."}],
    },
]


def gpt2():
    from hftrain.model.part import ModelPart
    from hftrain.model.tokenizer import load_tokenizer

    recipe = load_recipe(None, {"data": {"train": {"builtin": "python-docs"}}})
    tokenizer, _ = load_tokenizer(ModelPart.of(recipe), Path("/nonexistent"), lambda n: iter(()))
    return tokenizer


def trl_ids(tokenizer, records):
    """What TRL's DPOTrainer makes of the records (its own dataset preparation, on a bare instance)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer._tokenizer = tokenizer
    prepared = trainer._prepare_dataset(
        Dataset.from_list(records),
        tokenizer,
        DPOConfig("unused", max_length=None, use_cpu=True, bf16=False, gradient_checkpointing=None),
        "train",
    )
    return [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in prepared]


def test_pairs_are_tokenized_as_trl_tokenizes_them():
    tokenizer = gpt2()
    shipped = [json.loads(line) for line in (SHIPPED / "preference_train.jsonl").read_text().splitlines()[:200]]
    assert [encode_pair(tokenizer, r) for r in shipped] == trl_ids(tokenizer, shipped)
    use_chatml(tokenizer)  # conversations: an implicit prompt extracted, the chat template applied
    ours = [encode_pair(tokenizer, r) for r in CHATS]
    assert ours == [trl_ids(tokenizer, [r])[0] for r in CHATS]  # one dataset each: a dataset has one set of columns
    assert tokenizer.decode(ours[0]["chosen_ids"]).startswith("Serialize obj")
    # the check can fail: without the EOS TRL appends to a plain answer, the ids differ
    assert [encode_pair(tokenizer, {**r, "chosen": r["chosen"] + tokenizer.eos_token}) for r in shipped[:3]] == trl_ids(
        tokenizer, shipped[:3]
    )
    assert encode_pair(tokenizer, shipped[0])["chosen_ids"][-1] == tokenizer.eos_token_id


def dpo_recipe(tmp_path, train, validation=None, **data):
    return load_recipe(
        None,
        {
            "data": {
                "train": {"path": str(train), "format": "preference"},
                "seq_len": 64,
                "eval_blocks": 8,
                **({"validation": {"path": str(validation), "format": "preference"}} if validation else {}),
                **data,
            },
            "finetune": {"objective": "dpo"},
            "training": {"output_dir": str(tmp_path / "run")},
        },
    )


def test_pairs_stream_resumes_where_they_stopped(tmp_path):
    recipe = dpo_recipe(
        tmp_path, SHIPPED / "preference_train.jsonl", SHIPPED / "preference_validation.jsonl", shuffle_window=16
    )
    plan, tokenizer = plan_data(recipe.data, 0), gpt2()
    stream = train_blocks(plan, tokenizer, Worker(), 16)
    items = []
    for pair, position in stream.blocks(stream.fresh_state()):
        items.append((pair, position))
        if len(items) == 40:
            break
    resumed = [item[0] for item, _ in zip(stream.blocks(items[24][1]), range(15))]
    assert resumed == [pair for pair, _ in items[25:40]]
    # shuffled
    assert [p for p, _ in items[:16]] != [
        encode_pair(tokenizer, r)
        for r in map(json.loads, (SHIPPED / "preference_train.jsonl").read_text().splitlines()[:16])
    ]
    held_out = validation_pairs(plan)
    assert len(held_out) == 8 and held_out[0]["prompt"].startswith(
        "What does the Python function ipaddress.num_addresses"
    )


@pytest.mark.parametrize(
    "line, problem",
    [
        (
            {"chosen": "c", "rejected": "r"},
            "needs a string 'prompt' beside string 'chosen' and 'rejected' (has: chosen, rejected)",
        ),
        ({"prompt": "p", "chosen": "c"}, "needs 'prompt', 'chosen' and 'rejected': three strings, or message lists"),
        (
            {"prompt": "p", "chosen": "c", "rejected": 3},
            "needs 'prompt', 'chosen' and 'rejected': three strings, or message lists",
        ),
        (
            {"chosen": [{"role": "user"}], "rejected": []},
            "needs 'prompt', 'chosen' and 'rejected': three strings, or message lists",
        ),
    ],
)
def test_a_bad_pair_names_its_file_and_line(tmp_path, line, problem):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "p", "chosen": " yes", "rejected": " no"}
    path.write_text("\n".join(json.dumps(x) for x in [good, good, line, good]) + "\n")
    plan = plan_data(dpo_recipe(tmp_path, path).data, 0)
    stream = train_blocks(plan, gpt2(), Worker(), 4)
    with pytest.raises(HftrainError) as err:
        list(zip(stream.blocks(stream.fresh_state()), range(3)))
    assert f"{path}:3" in str(err.value) and problem in str(err.value)


def test_preference_settings_are_checked_when_the_recipe_is_read(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "p", "chosen": " yes", "rejected": " no"}) + "\n")
    cases = [
        (
            {"data": {"train": {"path": str(pairs), "format": "preference"}}},
            "preference pairs (format: preference) train with finetune.objective: dpo",
        ),
        (
            {"finetune": {"objective": "dpo"}},
            "finetune.objective dpo trains on preference pairs: set format: preference on data.train",
        ),
        ({"finetune": {"dpo": {"beta": 0.2}}}, "DPOConfig keys are set but finetune.objective is lm"),
        (
            {
                "finetune": {"objective": "dpo", "dpo": {"betta": 0.2}},
                "data": {"train": {"path": str(pairs), "format": "preference"}},
            },
            "'betta' is not a DPOConfig key; did you mean beta?",
        ),
        (
            {
                "finetune": {"objective": "dpo", "dpo": {"max_length": 512}},
                "data": {"train": {"path": str(pairs), "format": "preference"}},
            },
            "max_length is not taken: the longest prompt + answer is data.seq_len; set that",
        ),
        (
            {
                "finetune": {"objective": "dpo", "dpo": {"learning_rate": 1e-6}},
                "data": {"train": {"path": str(pairs), "format": "preference"}},
            },
            "'learning_rate' is not a DPOConfig key; TrainingArguments keys go in the training section",
        ),
        (
            {
                "data": {"train": [{"path": str(pairs), "format": "preference"}, {"builtin": "python-docs"}]},
                "finetune": {"objective": "dpo"},
            },
            "preference and text data cannot be mixed",
        ),
        # what TRL's DPOTrainer would refuse in every process, refused once here
        (
            {
                "finetune": {"objective": "dpo", "method": "lora", "dpo": {"sync_ref_model": True}},
                "data": {"train": {"path": str(pairs), "format": "preference"}},
            },
            "dpo: sync_ref_model with method lora: the reference is the base with the adapter disabled",
        ),
        (
            {
                "finetune": {
                    "objective": "dpo",
                    "method": "lora",
                    "lora": {"target_modules": ["query_key_value", "embed_out"]},
                },
                "data": {"train": {"path": str(pairs), "format": "preference"}},
            },
            "lora.target_modules: an adapter on the output head is never trained",
        ),
        (
            {
                "finetune": {"objective": "dpo", "dpo": {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}},
                "data": {"train": {"path": str(pairs), "format": "preference"}},
            },
            "dpo: loss_weights has 1 weight(s) for 2 loss_type(s); give one weight per loss type",
        ),
    ]
    for raw, message in cases:
        with pytest.raises(HftrainError) as err:
            load_recipe(None, raw)
        assert message in str(err.value), (raw, str(err.value))


def test_held_out_scoring_bounds_its_logits_by_the_recipe_not_the_number_of_pairs():
    from hftrain.eval.preference_accuracy import LOGIT_BUDGET_BYTES, _batches

    rows = [([1] * 100, [2] * 28)] * 1000  # 1,000 rows of 128 tokens
    small = _batches(rows, vocab=512, batch_size=16)
    assert [len(b) for b in small] == [16] * 62 + [8]  # the batch size when the logits fit
    large = _batches(rows, vocab=50_000, batch_size=16)  # 16 x 128 x 50k x 8 bytes would be 819 MB
    assert max(8 * len(b) * 128 * 50_000 for b in large) <= LOGIT_BUDGET_BYTES and sum(map(len, large)) == 1000
    huge = _batches([([1] * 4000, [2] * 96)] * 3, vocab=50_000, batch_size=16)
    assert [len(b) for b in huge] == [1, 1, 1]  # one row at least, even over the budget


def test_pairs_read_the_same_from_a_local_file_s3_and_a_hugging_face_dataset(tmp_path, s3):
    import gzip

    lines = "".join((SHIPPED / "preference_train.jsonl").read_text().splitlines(keepends=True)[:24])
    (tmp_path / "pairs.jsonl").write_text(lines)
    bucket = s3.make_bucket()
    s3.put(f"{bucket}/pairs.jsonl.gz", gzip.compress(lines.encode()))
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_text(lines)
    tokenizer = gpt2()

    def first_pairs(train):
        recipe = load_recipe(
            None,
            {
                "data": {
                    "train": {**train, "format": "preference"},
                    "seq_len": 64,
                    "eval_blocks": 4,
                    "shuffle_window": 1,
                    "readers": 1,
                },
                "finetune": {"objective": "dpo"},
                "training": {"output_dir": str(tmp_path / "run")},
            },
        )
        stream = train_blocks(plan_data(recipe.data, 0), tokenizer, Worker(), 16)
        return [pair for (pair, _), _ in zip(stream.blocks(stream.fresh_state()), range(12))]

    local = first_pairs({"path": str(tmp_path / "pairs.jsonl")})
    assert len(local) == 12 and all(p["chosen_ids"] != p["rejected_ids"] for p in local)
    assert first_pairs({"path": f"s3://{bucket}/pairs.jsonl.gz"}) == local
    assert first_pairs({"dataset": str(tmp_path / "ds"), "split": "train"}) == local


@pytest.mark.parametrize(
    ("same", "of", "expected"),
    [
        (0, 10, None),  # every pair teaches something: nothing said
        (
            3,
            10,
            "data.train (pairs.jsonl): 3 of the first 10 preference pairs have the same chosen and rejected answer",
        ),
        (6, 10, "most pairs are like that"),  # refused
    ],
)
def test_pairs_whose_answers_are_one_are_counted_and_refused_when_most_are(same, of, expected):
    """DPO learns nothing from a pair whose chosen answer is its rejected one: said, and refused when most are (before:
    such data trained to exit 0, nothing said). Conversations are compared as training tokenizes them."""
    from hftrain.data.preference_pairs import same_answers

    shipped = [json.loads(line) for line in (SHIPPED / "preference_train.jsonl").read_text().splitlines()[:of]]
    records = [{**r, "rejected": r["chosen"]} if i < same else r for i, r in enumerate(shipped)]
    tokenizer = gpt2()
    if expected == "most pairs are like that":
        with pytest.raises(HftrainError, match=expected) as refused:
            same_answers(records, tokenizer, "data.train (pairs.jsonl)")
        assert "\n" not in str(refused.value) and "data.train (pairs.jsonl): 6 of the first 10" in str(refused.value)
    else:
        said = same_answers(records, tokenizer, "data.train (pairs.jsonl)")
        assert said == expected or said.startswith(expected)
    chats = [{**CHATS[0], "rejected": CHATS[0]["chosen"]}, CHATS[1]]
    # the run's tokenizer untouched:
    assert same_answers(chats, tokenizer, "chats").startswith("chats: 1 of the first 2")
    assert tokenizer.chat_template is None


def test_a_dpo_run_on_pairs_with_one_answer_is_refused_before_its_model_loads(tmp_path, capsys, monkeypatch):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from hftrain.model import build
    from tests.support.cli import in_process

    base = tmp_path / "base"  # DPO starts from pretrained weights: a tiny model with the GPT-2 vocabulary
    config = GPTNeoXConfig(
        vocab_size=50304, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    GPTNeoXForCausalLM(config).save_pretrained(base)
    gpt2().save_pretrained(base)

    pairs = [json.loads(line) for line in (SHIPPED / "preference_train.jsonl").read_text().splitlines()[:40]]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({**r, "rejected": r["chosen"]}) + "\n" for r in pairs))
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": {"from_pretrained": str(base)},
                "tokenizer": {"path": str(base)},
                "data": {"train": {"path": str(data), "format": "preference"}, "seq_len": 64, "eval_blocks": 4},
                "finetune": {"objective": "dpo", "method": "full"},
                "training": {
                    "output_dir": str(tmp_path / "run"),
                    "max_steps": 2,
                    "bf16": False,
                    "torch_compile": False,
                },
            }
        )
    )
    monkeypatch.setattr(build, "build_model", lambda *a, **k: pytest.fail("the model was built before the refusal"))
    code, printed = in_process(capsys, "train", str(recipe))
    assert code == 2 and "Traceback" not in printed, printed[-2000:]
    assert (
        f"data.train ({data}): 40 of the first 40 preference pairs have the same chosen and rejected answer" in printed
    ), printed[-2000:]
