"""hftrain.eval.text_metrics and `hftrain eval`: sliding-window perplexity, bits per byte, last-word accuracy, data
loading, the CLI, lm-eval."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from typing import Any

import pytest
import torch

from hftrain.cli import eval as eval_command
from hftrain.errors import HftrainError
from hftrain.eval import text_metrics as ev

from ..support.data import make_documents, write_jsonl


@pytest.fixture(scope="module")
def trained(pretrained_run: Any) -> tuple[Any, Any]:
    return ev.load_model(pretrained_run.final_dir)


@pytest.fixture(scope="module")
def untrained(pretrained_run: Any) -> tuple[Any, Any]:
    """The same architecture and tokenizer with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrained_run.final_dir)).eval()
    return model, AutoTokenizer.from_pretrained(pretrained_run.final_dir)


HELD_OUT = make_documents(20, seed=99)


def predictable_passages(n: int) -> list[str]:
    """'the ADJ NOUN VERB the': in the training template a verb is always followed by 'the'."""
    return [" ".join(doc.split(" ")[:5]) for doc in make_documents(n, seed=99)]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hftrain")
    eval_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["eval", *argv])


# ------------------------------------------------------------------------------------------ windows
def test_windows_score_every_token_after_the_first_exactly_once():
    for n in range(2, 40):
        for context in range(1, 12):
            for stride in range(1, context + 1):
                scored: list[int] = []
                for begin, end, prev_end in ev.windows(n, context, stride):
                    assert 0 <= begin < end <= n and end - begin <= context and prev_end >= begin
                    scored += range(max(prev_end, begin + 1), end)  # position 0 of a window has no prediction
                assert len(scored) == len(set(scored)), (n, context, stride)
                if stride < context:
                    assert sorted(scored) == list(range(1, n)), (n, context, stride)


def independent_mean_loss(model: Any, ids: torch.Tensor, context: int) -> tuple[float, int]:
    """Non-overlapping chunks of `context` tokens, each scored from its own log-softmax."""
    total, count = 0.0, 0
    for start in range(0, ids.size(0), context):
        chunk = ids[start : start + context]
        if chunk.size(0) < 2:
            continue
        with torch.no_grad():
            logp = torch.log_softmax(model(chunk[None]).logits[0, :-1].double(), -1)
        total -= logp.gather(1, chunk[1:, None]).sum().item()
        count += chunk.size(0) - 1
    return total / count, count


def independent_strided_loss(model: Any, ids: torch.Tensor, context: int, stride: int) -> float:
    """Windows of `context` tokens starting every `stride`; each token is scored once, in the first window that
    ends after it (token 0 never)."""
    total, count, scored_to = 0.0, 0, 1
    for begin in range(0, ids.size(0), stride):
        end = min(begin + context, ids.size(0))
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[begin:end][None]).logits[0, :-1].double(), -1)
        for t in range(max(scored_to, begin + 1), end):
            total -= logp[t - begin - 1, ids[t]].item()
            count += 1
        scored_to = max(scored_to, end)
        if end == ids.size(0):
            break
    return total / count


@pytest.mark.slow
def test_sliding_window_perplexity_matches_an_independent_computation(trained):
    model, tok = trained
    texts = HELD_OUT[:8]
    ids = tok("\n\n".join(texts), return_tensors="pt").input_ids[0]
    n = ids.size(0)
    flat = ev.perplexity(model, tok, texts, context=32, stride=32)
    loss, count = independent_mean_loss(model, ids, 32)
    assert flat["tokens"] == count == n - math.ceil(n / 32)  # first token of each window is unscored
    assert flat["loss"] == pytest.approx(loss, rel=1e-5)
    assert flat["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)

    overlapped = ev.perplexity(model, tok, texts, context=32, stride=8)
    assert overlapped["tokens"] == n - 1
    # each token scored once, in the first window that ends after it: after the first window, with >= 24 tokens before
    # it
    assert overlapped["loss"] == pytest.approx(independent_strided_loss(model, ids, 32, 8), rel=1e-5)
    assert overlapped["loss"] != pytest.approx(flat["loss"], rel=1e-4)

    default = ev.perplexity(model, tok, texts)  # context = max_position_embeddings (512) > n: one window
    assert default["tokens"] == n - 1
    assert default["loss"] == pytest.approx(independent_mean_loss(model, ids, n)[0], rel=1e-5)


@pytest.mark.parametrize(
    "context,stride,message",
    [(32, 33, "larger than --context"), (0, 1, "positive"), (16, 0, "positive"), (513, 8, "max_position_embeddings")],
)
def test_bad_windows_are_refused(trained, context, stride, message):
    with pytest.raises(HftrainError, match=message):
        ev.perplexity(*trained, HELD_OUT[:2], context=context, stride=stride)


# ------------------------------------------------------------------------------------------ trained vs untrained
def test_trained_model_beats_untrained_on_held_out_text(trained, untrained):
    scores = {}
    for name, (model, tok) in {"trained": trained, "untrained": untrained}.items():
        scores[name] = {**ev.perplexity(model, tok, HELD_OUT, 64, 32), **ev.bits_per_byte(model, tok, HELD_OUT, 64, 32)}
    print("\nheld-out scores:", json.dumps(scores))
    assert scores["trained"]["perplexity"] < scores["untrained"]["perplexity"] / 5
    assert scores["trained"]["bits_per_byte"] < scores["untrained"]["bits_per_byte"]
    vocab = untrained[0].config.vocab_size
    assert scores["untrained"]["perplexity"] > vocab / 2  # random weights: about uniform over the vocabulary


def test_bits_per_byte_is_the_perplexity_loss_per_byte(trained):
    model, tok = trained
    texts = HELD_OUT[:10] + ["café naïve — ünïcode bytes"]  # multi-byte characters: bytes != characters
    ppl = ev.perplexity(model, tok, texts, 48, 16)
    bpb = ev.bits_per_byte(model, tok, texts, 48, 16)
    n_bytes = len("\n\n".join(texts).encode("utf-8"))
    assert bpb["bytes"] == n_bytes > len("\n\n".join(texts))
    assert bpb["tokens"] == ppl["tokens"]
    assert bpb["bits_per_byte"] == pytest.approx(ppl["loss"] * ppl["tokens"] / (math.log(2) * n_bytes), rel=1e-9)


# ------------------------------------------------------------------------------------------ last-word accuracy
def test_last_word_accuracy_trained_vs_untrained(trained, untrained):
    passages = predictable_passages(30)
    good = ev.last_word_accuracy(*trained, passages)
    bad = ev.last_word_accuracy(*untrained, passages)
    print("\nlast-word accuracy:", good, bad)
    assert good["total"] == bad["total"] == 30
    assert good["accuracy"] >= 0.8 > bad["accuracy"]


def test_last_word_accuracy_exact_counts(trained):
    passages = [
        "the red cat sees the",
        "the big dog chases the",
        "the red cat sees the zebra",
        "the old owl likes the giraffe",
    ]
    assert ev.last_word_accuracy(*trained, passages) == {"accuracy": 0.5, "correct": 2, "total": 4}
    with pytest.raises(HftrainError, match="no context before its last word"):
        ev.last_word_accuracy(*trained, ["alone"])


def test_last_word_accuracy_equals_greedy_decoding(trained):
    """Teacher-forced argmax over the target == generating len(target) tokens greedily and comparing them."""
    model, tok = trained
    passages = [doc.rstrip(".") for doc in make_documents(20, seed=99)] + predictable_passages(5)
    expected = 0
    for passage in passages:
        context, target = ev.split_last_word(passage)
        ctx = tok(context, add_special_tokens=False).input_ids
        want = tok(context + target, add_special_tokens=False).input_ids[len(ctx) :]
        out = model.generate(
            torch.tensor([ctx]),
            max_new_tokens=len(want),
            min_new_tokens=len(want),
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )
        expected += out[0, len(ctx) :].tolist() == want
    result = ev.last_word_accuracy(model, tok, passages)
    assert 0 < expected < len(passages)  # a mix of right and wrong, so the comparison means something
    assert result["correct"] == expected and result["total"] == len(passages)


# ------------------------------------------------------------------------------------------ data loading
def test_load_texts_local_formats(tmp_path):
    docs = make_documents(12, seed=3)
    path = write_jsonl(tmp_path / "a.jsonl", docs)
    assert ev.load_texts(str(path)) == docs
    assert ev.load_texts(str(path), limit=5) == docs[:5]
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(path.read_bytes()))
    assert ev.load_texts(str(tmp_path / "b.jsonl.gz")) == docs
    write_jsonl(tmp_path / "c.jsonl", docs, field="body")
    assert ev.load_texts(str(tmp_path / "c.jsonl"), text_field="body") == docs
    (tmp_path / "d.txt").write_text("one plain text document\n", encoding="utf-8")
    assert ev.load_texts(str(tmp_path / "d.txt")) == ["one plain text document\n"]


def test_load_texts_errors_name_the_file(tmp_path):
    with pytest.raises(HftrainError, match="no file matches .*missing.jsonl"):
        ev.load_texts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(HftrainError, match="empty.jsonl: no documents"):
        ev.load_texts(str(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n', encoding="utf-8")
    with pytest.raises(HftrainError, match=r"bad.jsonl:2: not valid JSON"):
        ev.load_texts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(HftrainError, match="no string field 'body'"):
        ev.load_texts(str(tmp_path / "bad.jsonl"), text_field="body")
    with pytest.raises(HftrainError, match="expected hf:NAME"):
        ev.load_texts("hf:a:b:c:d")


def test_load_texts_from_s3(s3):
    bucket, docs = s3.make_bucket(), make_documents(15, seed=4)
    body = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    url = s3.put(f"{bucket}/eval/held.jsonl", body)
    s3.put(f"{bucket}/eval/held2.jsonl.gz", gzip.compress(body))
    assert ev.load_texts(url) == docs
    assert ev.load_texts(f"s3://{bucket}/eval/*") == docs + docs  # a glob, shards in order
    with pytest.raises(HftrainError, match="no file matches"):
        ev.load_texts(f"s3://{bucket}/nothing.jsonl")


# ------------------------------------------------------------------------------------------ CLI
def test_cli_prints_a_table_and_writes_json(pretrained_run, trained, tmp_path, capsys):
    data = write_jsonl(tmp_path / "held.jsonl", HELD_OUT)
    out = tmp_path / "out" / "results.json"
    args = parse(
        str(pretrained_run.final_dir),
        "--data",
        str(data),
        "--metric",
        "perplexity",
        "--metric",
        "bits_per_byte",
        "--context",
        "64",
        "--stride",
        "32",
        "--json",
        str(out),
    )
    assert eval_command.run(args, []) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].split() == ["name", "measure", "value"]
    assert {tuple(line.split()[:2]) for line in lines[1:-1]} == {
        ("perplexity", "perplexity"),
        ("perplexity", "loss"),
        ("perplexity", "tokens"),
        ("bits_per_byte", "bits_per_byte"),
        ("bits_per_byte", "bytes"),
        ("bits_per_byte", "tokens"),
    }
    assert len({len(line) for line in lines[:-1]}) == 1  # aligned: values right-justified to one width
    assert lines[-1] == f"wrote {out}"
    saved = json.loads(out.read_text())
    assert saved["data"] == str(data) and saved["model_dir"] == str(pretrained_run.final_dir)
    assert saved["results"]["perplexity"] == ev.perplexity(*trained, HELD_OUT, 64, 32)
    assert f"{saved['results']['perplexity']['perplexity']:.4f}" in printed


def test_cli_last_word_accuracy_with_limit(pretrained_run, tmp_path, capsys):
    data = write_jsonl(tmp_path / "passages.jsonl", predictable_passages(10))
    assert (
        eval_command.run(
            parse(str(pretrained_run.final_dir), "--data", str(data), "--metric", "last_word_accuracy", "--limit", "4"),
            [],
        )
        == 0
    )
    rows = {tuple(line.split()[:2]): line.split()[2] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[("last_word_accuracy", "total")] == "4"


def test_cli_errors_name_the_argument(pretrained_run, tmp_path):
    data = str(write_jsonl(tmp_path / "held.jsonl", HELD_OUT[:3]))
    with pytest.raises(HftrainError, match=f"{tmp_path}: not a model directory \\(no config.json\\)"):
        eval_command.run(parse(str(tmp_path), "--data", data), [])
    with pytest.raises(HftrainError, match="either --data"):
        eval_command.run(parse(str(pretrained_run.final_dir)), [])
    with pytest.raises(HftrainError, match="either --data"):
        eval_command.run(parse(str(pretrained_run.final_dir), "--data", data, "--lm-eval", "local_lambada"), [])
    with pytest.raises(HftrainError, match="--stride 9 is larger than --context 8"):
        eval_command.run(parse(str(pretrained_run.final_dir), "--data", data, "--context", "8", "--stride", "9"), [])
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(HftrainError, match="empty.jsonl: no documents"):
        eval_command.run(parse(str(pretrained_run.final_dir), "--data", str(tmp_path / "empty.jsonl")), [])
    with pytest.raises(SystemExit):
        parse(str(pretrained_run.final_dir), "--data", data, "--metric", "accuracy")


# ------------------------------------------------------------------------------------------ lm-eval
def test_missing_lm_eval_is_a_clear_error(pretrained_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    with pytest.raises(HftrainError, match=r"pip install 'hftrain\[eval\]'"):
        ev.run_lm_eval(pretrained_run.final_dir, ["local_lambada"])


def test_task_yaml_data_files_resolve_against_the_yaml(tmp_path):
    src = tmp_path / "tasks" / "sub"
    src.mkdir(parents=True)
    (src / "t.yaml").write_text(
        "task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        "    test: d.jsonl\n    train: [a.jsonl, s3://b/k.jsonl]\n",
        encoding="utf-8",
    )
    (src / "f.yaml").write_text("task: f\nprocess_docs: !function utils.process\n", encoding="utf-8")
    copy = ev.resolve_task_dir(tmp_path / "tasks", tmp_path / "copy")
    import yaml

    files = yaml.safe_load((copy / "sub" / "t.yaml").read_text())["dataset_kwargs"]["data_files"]
    assert files == {"test": str(src / "d.jsonl"), "train": [str(src / "a.jsonl"), "s3://b/k.jsonl"]}
    assert (copy / "sub" / "f.yaml").read_text() == (src / "f.yaml").read_text()


@pytest.fixture(scope="module")
def lm_eval_installed() -> None:
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (optional: pip install 'hftrain[eval]')")


@pytest.mark.slow
def test_lm_eval_shipped_task_and_include_path_agree_with_our_scoring(
    lm_eval_installed, pretrained_run, trained, tmp_path, capsys
):
    # The shipped local_lambada task (natural English: the tiny model gets ~nothing right), through the CLI.
    out = tmp_path / "lm_eval.json"
    assert (
        eval_command.run(
            parse(str(pretrained_run.final_dir), "--lm-eval", "local_lambada", "--limit", "3", "--json", str(out)), []
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "local_lambada" in printed and "acc,none" in printed
    saved = json.loads(out.read_text())["lm_eval"]
    assert saved["n-samples"]["local_lambada"]["effective"] == 3
    assert 0.0 <= saved["results"]["local_lambada"]["acc,none"] <= 1.0

    # A user task dir with a relative data_files: lm-eval's accuracy equals last_word_accuracy on the same passages.
    passages = predictable_passages(4) + ["the red cat sees the zebra", "the old owl likes the giraffe"]
    tasks = tmp_path / "my_tasks"
    write_jsonl(tasks / "data" / "mine.jsonl", passages)
    shipped = (ev.TASKS_DIR / "local_lambada.yaml").read_text(encoding="utf-8")
    (tasks / "mine.yaml").write_text(
        shipped.replace("task: local_lambada", "task: my_lambada").replace(
            "test: local_lambada.jsonl", "test: data/mine.jsonl"
        ),
        encoding="utf-8",
    )
    results = ev.run_lm_eval(pretrained_run.final_dir, ["my_lambada"], include_path=str(tasks))["results"]["my_lambada"]
    ours = ev.last_word_accuracy(*trained, passages)
    assert ours == {"accuracy": 4 / 6, "correct": 4, "total": 6}
    assert results["acc,none"] == pytest.approx(ours["accuracy"])

    with pytest.raises(HftrainError, match="unknown task"):
        ev.run_lm_eval(pretrained_run.final_dir, ["no_such_task_xyz"])
