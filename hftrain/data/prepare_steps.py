"""The datatrove pipeline steps of `hftrain data prepare`: the recipe's sources in, datatrove's tokenized layout out.

Task r of a prepare is input shard r (one file of one source, in source order): `RecipeDocuments` reads it as
training reads it (hftrain's readers: local files and globs, JSONL/Parquet/text, compression, s3:// and gs://,
datasets; held-out documents left out), and `RecipeTokenizer` (datatrove's DocumentTokenizer) writes its tokens.
The task count comes from the data, not from the workers or machines, and each task's shuffle is seeded by
(seed, task): the folder is the same byte for byte for any number of workers, machines or SLURM array jobs.
`FinishFolder` runs once every task has finished (in the same command on a local executor, as a dependent job on
SLURM): the validation documents and prepared.json, which says the folder is complete.

A long document comes from hftrain's reader in pieces cut where its tokens do not change (chunking.py), so no
step holds a whole document's text. datatrove's shuffle then copies one document's tokens at a time.
"""

from __future__ import annotations

import json
import os
import signal
from copy import deepcopy
from typing import Any

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer, TokenizedFile
from numpy.random import default_rng

from hftrain.data.chunking import SafeCut, text_batches
from hftrain.data.loader import DataPlan, train_documents
from hftrain.data.token_folder import LOGS, PREPARED, token_dtype, token_size_for, tokenizer_fingerprint
from hftrain.data.validation_set import held_out_documents
from hftrain.parallel.process_end import end_with_parent

Unit = tuple[int, int]  # (source, shard)
VALIDATION_FILE = "00000_validation.ds"


def tokenizer_label(tokenizer: Any) -> str:
    """What the metadata's tokenizer field says for hftrain's folders: hftrain's fingerprint of the vocabulary, which
    a reader compares with its own tokenizer (a temporary path would say nothing)."""
    return f"hftrain:{tokenizer_fingerprint(tokenizer)}"


def task_units(plan: DataPlan, task_bytes: float) -> list[list[Unit]]:
    """The tasks: input files in source order, consecutive files of one source grouped until a task holds
    `task_bytes` (by the listing's sizes; a file is never split, and one of unknown size, a dataset, is a task of its
    own). From the listing alone, so every launch and executor numbers the tasks alike."""
    tasks: list[list[Unit]] = []
    for s, source in enumerate(plan.train):
        known = source.source.dataset is None and len(source.sizes) == len(source.shards)
        held = task_bytes  # a new source starts a new task
        for k in range(len(source.shards)):
            if held >= task_bytes or not known:
                tasks.append([])
                held = 0
            tasks[-1].append((s, k))
            held += source.sizes[k] if known else task_bytes
    return tasks


SKIPPED = "bad records skipped"  # the readers' count (data.on_bad_record=skip), a datatrove stat of each task


class RecipeDocuments(PipelineStep):
    """Task r's documents: its input files (`tasks[r]`), read by hftrain's readers, as (text piece, ends a document)."""

    name = "hftrain sources"
    type = "📖 - READER"

    def __init__(self, plan: DataPlan, tasks: list[list[Unit]]):
        super().__init__()
        self.plan, self.tasks = plan, tasks
        self.parent: int | None = None  # the prepare that started this task's process, when it runs on this machine

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if self.parent not in (None, os.getpid()):  # a spawned pool worker ends with the prepare (process_end.py)
            end_with_parent(signal.SIGKILL, str(self.parent))
        docs = train_documents(self.plan, loop=False, shuffle=False)
        i = 0
        for unit in self.tasks[rank]:
            docs.only = unit
            for text, end in docs.pieces(docs.fresh_state()):
                self.stat_update("pieces")
                yield Document(text=text, id=f"{rank}/{i}", metadata={"end": end})
                i += 1
            if docs.bad.skipped:  # data.on_bad_record=skip; each unit's fresh state counts from 0
                self.stat_update(SKIPPED, value=docs.bad.skipped)


def skipped_records(fs: Any, root: str) -> int:
    """Records and files data.on_bad_record=skip left out, over every task: read from the stats datatrove saves
    per task (logs/stats/NNNNN.json, each step's counters)."""
    total = 0
    for path in fs.glob(f"{root}/{LOGS}/stats/*.json"):
        for step in json.loads(fs.cat_file(path)):  # name: "TYPE: name"; a counter: a number, or {"total": ...}
            if str(step.get("name", "")).endswith(RecipeDocuments.name):
                count = step.get("stats", {}).get(SKIPPED, 0)
                total += int(count.get("total", 0) if isinstance(count, dict) else count)
    return total


class RecipeTokenizer(DocumentTokenizer):
    """datatrove's DocumentTokenizer with the recipe's tokenizer (the object hftrain loaded: nothing downloaded),
    tokenizing the pieces of a document as training does (EOS after each document), seeded per task."""

    name = "✍️ hftrain tokenizer"

    def __init__(
        self,
        output_folder: Any,
        tokenizer: Any,
        seed: int,
        shuffle: bool,
        local_working_dir: str | None = None,
        upload_block_size: int | None = None,
    ):
        super().__init__(
            output_folder,
            tokenizer_name_or_path=tokenizer_label(tokenizer),
            local_working_dir=local_working_dir,
            seed=seed,
            shuffle_documents=shuffle,
            upload_block_size=upload_block_size,
        )
        self.hf_tokenizer, self.seed = tokenizer, seed
        # an instance value over datatrove's cached property, which would load a tokenizer by the name above
        self.token_size = token_size_for(len(tokenizer))

    def __deepcopy__(self, memo: dict[int, Any]) -> RecipeTokenizer:
        """datatrove copies the pipeline for each task a process runs; the tokenizer (read-only) is shared, not
        copied: a copy of GPT-2's vocabulary took 0.5 s per task, a third of a task's time on a 20 MB corpus."""
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({k: v if k == "hf_tokenizer" else deepcopy(v, memo) for k, v in self.__dict__.items()})
        return copied

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        # datatrove seeds one generator for every task a process runs; per task, a task's order does not depend on
        # which tasks its process ran before it (a worker pool, a SLURM array job of several tasks)
        self.rand = default_rng([self.seed, rank])
        return super().run(data, rank, world_size)

    def write_unshuffled(self, data: DocumentsPipeline, filename: str) -> TokenizedFile:
        tok, dtype = self.hf_tokenizer, token_dtype(self.token_size)
        unshuffled = TokenizedFile(
            self.output_folder if not self.shuffle_documents or not self.local_working_dir else self.local_working_dir,
            filename,
            save_index=True,
            upload_block_size=self.upload_block_size,
            tokenizer_name_or_path=self.tokenizer_name_or_path,
            save_final_metadata=self.save_final_metadata,
            token_size=self.token_size,
        )
        pieces = ((doc.text, bool(doc.metadata["end"])) for doc in data)
        for written in write_pieces(unshuffled, pieces, tok, dtype):
            self.stat_update("tokens", value=written)
        unshuffled.close()
        return unshuffled


def write_pieces(file: TokenizedFile, pieces: Any, tok: Any, dtype: Any, stop_at: int | None = None) -> Any:
    """Tokenize (text piece, ends a document) pairs in batches, as training does (EOS after each document), into a
    datatrove TokenizedFile; yields the tokens of each piece written. `stop_at`: stop at the first document end at
    or after that many tokens."""
    eos = int(tok.eos_token_id)
    for texts, ends in text_batches(pieces, SafeCut(tok)):
        ids = tok(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        for seq, end in zip(ids, ends):
            tokens = np.asarray(seq + [eos] if end else seq, dtype=dtype)
            file.write_bytes(tokens.tobytes(), doc_ends=None if end else [])  # []: the document goes on
            yield len(tokens)
            if stop_at is not None and end and file.write_idx >= stop_at:
                return


class FinishFolder(PipelineStep):
    """After every task: the validation documents (validation/, the same layout) and prepared.json."""

    name = "hftrain finish"
    type = "✅ - FINISH"

    def __init__(self, out: str, options: dict[str, Any], plan: DataPlan, tokenizer: Any, request: dict[str, Any]):
        super().__init__()
        self.out, self.options, self.plan, self.tokenizer, self.request = (
            out.rstrip("/"),
            options,
            plan,
            tokenizer,
            request,
        )

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        self.finish()
        return
        yield  # a generator, as datatrove expects of a step

    def finish(self) -> dict[str, Any]:
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.out, **self.options)
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
        files = []
        token_size = token_size_for(len(self.tokenizer))
        for name in names:
            if name.endswith(".ds"):
                files.append({"name": name, "tokens": fs.size(f"{root}/{name}") // token_size})
        validation_tokens = self._write_validation(token_size)
        prepared = {
            "layout": "datatrove tokenized (*.ds, *.ds.index, *.ds.metadata)",
            "written_by": "hftrain data prepare",
            "tasks": self.request["tasks"],
            "files": files,
            "tokens": sum(f["tokens"] for f in files),
            "token_size": token_size,
            "tokenizer": self.request["tokenizer"],
            "seed": self.request["seed"],
            "shuffled": self.request["shuffle"],
            "validation_tokens": validation_tokens,
            "skipped_records": skipped_records(fs, root),  # bad records or files left out (data.on_bad_record=skip)
            "data": self.request["data"],
        }
        with fs.open(f"{root}/{PREPARED}", "w") as f:
            f.write(json.dumps(prepared, indent=2))
        return prepared

    def _write_validation(self, token_size: int) -> int:
        """The held-out documents (or data.validation), enough for data.eval_blocks blocks of data.seq_len."""
        from datatrove.io import get_datafolder

        tok, section = self.tokenizer, self.plan.section
        need = section.eval_blocks * section.seq_len
        target = get_datafolder((f"{self.out}/validation", self.options) if self.options else f"{self.out}/validation")
        file = TokenizedFile(
            target,
            VALIDATION_FILE,
            tokenizer_name_or_path=tokenizer_label(tok),
            save_final_metadata=True,
            token_size=token_size,
        )
        docs = held_out_documents(self.plan)
        for _ in write_pieces(file, docs.pieces(docs.fresh_state()), tok, token_dtype(token_size), stop_at=need):
            pass
        file.close()
        return file.write_idx


def request_of(plan: DataPlan, tokenizer: Any, tasks: int, shuffle: bool, task_mb: float) -> dict[str, Any]:
    """What decides a prepared folder's bytes (saved in logs/ at the start; a prepare run again must match it)."""
    from hftrain.recipe.redaction import redacted

    return {
        "tasks": tasks,
        "task_mb": task_mb,
        "seed": plan.seed,
        "shuffle": shuffle,
        "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer)},
        "data": redacted(plan.section.model_dump(mode="json")),
    }


REQUEST = f"{LOGS}/hftrain-request.json"
