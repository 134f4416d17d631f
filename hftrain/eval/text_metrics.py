"""Measure a model on fixed text the way published numbers are measured (`hftrain eval`, and monitor.eval_tasks
during training).

Why: a run's validation loss is the mean over packed blocks of held-out training data; it depends on the
tokenizer and on where blocks are cut, so it cannot compare models, tokenizers or papers. Here: strided
sliding-window perplexity as in the Hugging Face guide "Perplexity of fixed-length models" (documents joined
with "\n\n" into one stream), bits per UTF-8 byte of the same scoring (tokenizer-independent), last-word
accuracy scored as lm-eval's lambada_openai, and lm-eval-harness itself (optional) for benchmarks and local
task YAMLs. Models load with plain transformers; text comes through hftrain's readers (local or fsspec URLs
such as s3://) or, for `hf:NAME[:CONFIG[:SPLIT]]`, `datasets`.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hftrain.data.sources import BadRecords, list_shards, read_shard, shard_problem
from hftrain.errors import HftrainError
from hftrain.eval import METRICS
from hftrain.recipe.data_section import Source

DEFAULT_MAX_CONTEXT = 1024
TASKS_DIR = Path(__file__).parent / "tasks"
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
DATA_PATTERNS = ("*.jsonl", "*.json", "*.ndjson", "*.parquet", "*.csv", "*.txt", "*.gz", "*.zst", "*.arrow")


# ------------------------------------------------------------------------------------------ model and data
def load_model(model_dir: str | Path) -> tuple[Any, Any]:
    """A standard Hugging Face model directory -> (model in eval mode, tokenizer)."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise HftrainError(f"{model_dir}: not a model directory (no config.json); give a run's final/ or checkpoint-N")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise HftrainError(f"{model_dir}: cannot load the model or tokenizer ({str(err).splitlines()[0]})") from None
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), tokenizer


class _FailOnBadRecord(BadRecords):
    """BadRecords("fail") naming file and line; the recipe's data.on_bad_record does not apply to eval data."""

    def __call__(self, where: str, problem: str, fix: str) -> None:
        raise HftrainError(f"{where}: {problem}. {fix}.")


def load_texts(path_or_url: str, text_field: str = "text", limit: int | None = None) -> list[str]:
    """Documents of a .jsonl / .jsonl.gz / .txt file, directory or glob (local or fsspec URL), or of
    `hf:NAME[:CONFIG[:SPLIT]]` (a Hugging Face dataset, split "test" by default). At most `limit` documents."""
    load = _load_dataset if path_or_url.startswith("hf:") else _load_files
    texts = load(path_or_url, text_field, limit)
    if not texts:
        raise HftrainError(f"--data {path_or_url}: no documents to evaluate on")
    return texts


def _load_files(path: str, text_field: str, limit: int | None) -> list[str]:
    source, texts = Source(path=path, text_field=text_field), []
    for shard in list_shards(source, "--data"):
        try:
            parts: list[str] = []  # evaluation keeps whole documents: join the pieces of long ones
            for record in read_shard(source, shard, (0, 0), _FailOnBadRecord("fail")):
                parts.append(record.text)
                if not record.end:
                    continue
                texts.append("".join(parts))
                parts = []
                if limit is not None and len(texts) >= limit:
                    return texts
        except Exception as err:
            if shard_problem(err) is None:  # ours (HftrainError) or a bug: as it is
                raise
            raise HftrainError(f"--data {shard}: cannot read it ({type(err).__name__}: {err})") from None
    return texts


def _load_dataset(spec: str, text_field: str, limit: int | None) -> list[str]:
    parts = spec.removeprefix("hf:").split(":")
    if not parts[0] or len(parts) > 3:
        raise HftrainError(
            f"--data {spec}: expected hf:NAME[:CONFIG[:SPLIT]], e.g. hf:wikitext:wikitext-103-raw-v1:test"
        )
    name, config, split = (parts + ["", ""])[:3]
    import datasets

    try:
        data = datasets.load_dataset(name, config or None, split=split or "test")
    except Exception as err:  # datasets raises many types for "not found / no network"
        raise HftrainError(
            f"--data {spec}: cannot load the dataset ({(str(err).splitlines() or [repr(err)])[0]})"
        ) from None
    if text_field not in data.column_names:
        raise HftrainError(
            f"--data {spec}: no column {text_field!r} (has: {', '.join(data.column_names)}); set --text-field"
        )
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    return list(data[text_field])


# ------------------------------------------------------------------------------------------ the metrics
def _max_positions(model: Any) -> int:
    return getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_CONTEXT


def _check_window(model: Any, context: int | None, stride: int | None) -> tuple[int, int]:
    limit = _max_positions(model)
    context = min(limit, DEFAULT_MAX_CONTEXT) if context is None else context
    stride = max(context // 2, 1) if stride is None else stride
    if context <= 0 or stride <= 0:
        raise HftrainError(f"--context and --stride must be positive (got context={context}, stride={stride})")
    if stride > context:
        raise HftrainError(
            f"--stride {stride} is larger than --context {context}: tokens between windows would not be scored"
        )
    if context > limit:
        raise HftrainError(f"--context {context} is longer than the model's max_position_embeddings ({limit})")
    return context, stride


def windows(n: int, context: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, prev_end) of each window over n tokens, as in the HF guide: tokens [prev_end, end) are scored."""
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        yield begin, end, prev_end
        prev_end = end
        if end == n:
            break


def _score(
    model: Any, tokenizer: Any, texts: list[str], context: int | None, stride: int | None
) -> tuple[float, int, str]:
    """(total negative log-likelihood in nats, tokens scored, joined text). With stride < context every token after
    the first is scored once; with stride == context the first token of each window is not scored. (The guide
    counts `valid labels - 1` tokens in every window, one too few after the first; here the count is exact.)"""
    import torch

    context, stride = _check_window(model, context, stride)
    text = "\n\n".join(texts)
    ids = tokenizer(text, return_tensors="pt").input_ids.to(model.device)
    if ids.size(1) < 2:
        raise HftrainError(f"the evaluation text is {ids.size(1)} token(s) long; at least 2 are needed")
    nll, scored = 0.0, 0
    for begin, end, prev_end in windows(ids.size(1), context, stride):
        input_ids = ids[:, begin:end]
        labels = input_ids.clone()
        labels[:, : prev_end - begin] = -100  # already scored by the previous window
        count = int((labels[:, 1:] != -100).sum())  # the model shifts labels left by one
        if count == 0:
            continue
        with torch.no_grad():
            loss = model(input_ids, labels=labels).loss
        nll += float(loss) * count
        scored += count
    return nll, scored, text


def perplexity(
    model: Any, tokenizer: Any, texts: list[str], context: int | None = None, stride: int | None = None
) -> dict[str, Any]:
    """{"perplexity", "loss" (mean nats/token), "tokens" (scored)}; context defaults to max_position_embeddings
    (at most 1024), stride to context // 2."""
    nll, tokens, _ = _score(model, tokenizer, texts, context, stride)
    return {"perplexity": math.exp(nll / tokens), "loss": nll / tokens, "tokens": tokens}


def bits_per_byte(
    model: Any, tokenizer: Any, texts: list[str], context: int | None = None, stride: int | None = None
) -> dict[str, Any]:
    """The same scoring per UTF-8 byte of the joined text, in bits: {"bits_per_byte", "bytes", "tokens"}."""
    nll, tokens, text = _score(model, tokenizer, texts, context, stride)
    n_bytes = len(text.encode("utf-8"))
    return {"bits_per_byte": nll / (math.log(2) * n_bytes), "bytes": n_bytes, "tokens": tokens}


def split_last_word(passage: str) -> tuple[str, str]:
    """lambada_openai's split: context = all but the last ' '-separated word, target = ' ' + last word."""
    words = passage.rstrip().split(" ")
    if len(words) < 2 or not words[-1]:
        raise HftrainError(f"passage {passage[:60]!r} has no context before its last word")
    return " ".join(words[:-1]), " " + words[-1]


def _encode_pair(tokenizer: Any, context: str, target: str) -> tuple[list[int], list[int]]:
    """As lm-eval's HFLM: trailing spaces move to the target, target tokens = tok(context+target) - tok(context)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, target = context[:-spaces], context[-spaces:] + target
    whole = tokenizer(context + target, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def last_word_accuracy(model: Any, tokenizer: Any, passages: list[str]) -> dict[str, Any]:
    """LAMBADA-style accuracy: a passage is correct when the greedy token at every target position is the target
    token (lm-eval's `is_greedy`, the same as greedy-decoding len(target) tokens). {"accuracy", "correct", "total"}."""
    import torch

    if not passages:
        raise HftrainError("last_word_accuracy: no passages")
    limit, correct = _max_positions(model), 0
    for passage in passages:
        ctx, target = _encode_pair(tokenizer, *split_last_word(passage))
        ids = (ctx + target)[-(limit + 1) :][:-1]  # lm-eval truncates the context on the left
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -len(target) :]
        correct += int(logits.argmax(-1).tolist() == target)
    return {"accuracy": correct / len(passages), "correct": correct, "total": len(passages)}


def evaluate_texts(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    metrics: list[str],
    context: int | None = None,
    stride: int | None = None,
) -> dict[str, dict[str, Any]]:
    """{metric name: its result} for each of `metrics` on `texts`."""
    if set(metrics) - set(METRICS):
        raise HftrainError(
            f"unknown metric(s) {', '.join(sorted(set(metrics) - set(METRICS)))}; metrics are {', '.join(METRICS)}"
        )
    windowed = {"perplexity": perplexity, "bits_per_byte": bits_per_byte}
    return {
        m: last_word_accuracy(model, tokenizer, texts)
        if m == "last_word_accuracy"
        else windowed[m](model, tokenizer, texts, context, stride)
        for m in dict.fromkeys(metrics)
    }


# ------------------------------------------------------------------------------------------ lm-eval
def _absolute(files: Any, base: Path) -> Any:
    if isinstance(files, dict):
        return {split: _absolute(value, base) for split, value in files.items()}
    if isinstance(files, list):
        return [_absolute(value, base) for value in files]
    if isinstance(files, str) and "://" not in files and not Path(files).is_absolute():
        return str((base / files).resolve())
    return files


def resolve_task_dir(src: Path, dst: Path) -> Path:
    """Copy a directory of lm-eval task YAMLs, making relative dataset_kwargs.data_files absolute against the
    YAML's own directory (`datasets` would resolve them against the current directory)."""
    import yaml

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*DATA_PATTERNS))  # data stays where it is
    for copy in dst.rglob("*.yaml"):
        try:
            config = yaml.safe_load(copy.read_text(encoding="utf-8"))
        except yaml.YAMLError:  # e.g. !function tags: left as written
            continue
        files = (config.get("dataset_kwargs") or {}).get("data_files") if isinstance(config, dict) else None
        if files is not None:
            original_dir = (src / copy.relative_to(dst)).parent
            config["dataset_kwargs"]["data_files"] = _absolute(files, original_dir)
            copy.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return dst


@contextmanager
def _offline() -> Iterator[None]:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set for the lm-eval call, then restored as they were."""
    saved = {name: os.environ.get(name) for name in OFFLINE_VARS}
    os.environ.update(dict.fromkeys(OFFLINE_VARS, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_lm_eval(
    model_dir: str | Path, tasks: list[str], include_path: str | None = None, limit: int | None = None
) -> dict[str, Any]:
    """lm-eval-harness tasks on a model directory, offline. hftrain's shipped tasks (hftrain/eval/tasks, e.g.
    local_lambada) are always available; include_path adds a directory of task YAMLs. Returns lm-eval's output."""
    if not (Path(model_dir) / "config.json").is_file():
        raise HftrainError(f"{model_dir}: not a model directory (no config.json); give a run's final/ or checkpoint-N")
    if include_path is not None and not Path(include_path).is_dir():
        raise HftrainError(f"--include-path {include_path}: not a directory of lm-eval task YAMLs")
    with _offline(), tempfile.TemporaryDirectory(prefix="hftrain-lm-eval-") as tmp:
        try:
            import lm_eval
            from lm_eval.tasks import TaskManager
        except ImportError:
            raise HftrainError("--lm-eval needs the optional lm-eval package: pip install 'hftrain[eval]'") from None
        import torch

        dirs = [TASKS_DIR] + ([Path(include_path)] if include_path else [])
        local = [str(resolve_task_dir(d, Path(tmp) / str(i))) for i, d in enumerate(dirs)]
        manager = TaskManager(include_path=local, include_defaults=False)
        if not set(tasks) <= set(manager.all_tasks):  # lm-eval's own ~15k tasks take seconds to index: only if needed
            manager = TaskManager(include_path=local)
        unknown = [task for task in tasks if task not in manager.all_tasks]
        if unknown:
            raise HftrainError(
                f"--lm-eval: unknown task(s) {', '.join(unknown)}; add their YAMLs with --include-path DIR"
            )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(Path(model_dir).resolve())},
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            device=device,
            batch_size=1,
            log_samples=False,
        )
    return dict(results or {})
