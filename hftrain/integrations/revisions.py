"""Kept checkpoints as Hub revisions, the way Pythia is published: branch `stepN` of one repo per kept checkpoint
(recipe.checkpoints), loadable with `from_pretrained(repo, revision="stepN")`, and the final model on main.

Each kept checkpoint is exported to a standard model directory (checkpoint/export.py: DDP, FSDP, ZeRO-3, a LoRA
adapter merged) and uploaded to its branch by one background worker, in order, while training goes on: a push never
blocks a step, and never reads a checkpoint that rotation could remove (kept ones are never rotated). A push is
retried (hub._retry); one that still fails is reported with the commands that push it later, and training goes on.
At the end, `finish` lets the queued pushes finish, and the final model card lists every `stepN` branch the repo has
(those of earlier launches of a resumed run included).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hftrain.checkpoint.layout import checkpoint_step
from hftrain.integrations.hub import bundle, push_folder, repo_id_of

BRANCH = re.compile(r"step(\d+)")


def branch_of(step: int) -> str:
    return f"step{step}"


def publisher(recipe: Any, args: Any, push_to_hub: bool) -> RevisionPublisher | None:
    """The run's publisher of revisions, when the recipe asks for them (checkpoints.push_revisions)."""
    if not (push_to_hub and recipe.checkpoints.push_revisions):
        return None
    return RevisionPublisher(recipe, repo_id_of(args), args.hub_private_repo)


class RevisionPublisher:
    """One background worker that pushes kept checkpoints to their branches, in the order they were written."""

    def __init__(self, recipe: Any, repo_id: str, private: bool | None):
        self.recipe, self.repo_id, self.private = recipe, repo_id, private
        self.pool: ThreadPoolExecutor | None = None

    def wants(self, checkpoint: Path) -> bool:
        step = checkpoint_step(checkpoint)
        return step is not None and self.recipe.checkpoints.keeps(step)

    def submit(self, run_dir: Path, checkpoint: Path, step: int) -> None:
        """Queue the push of `checkpoint` (a checkpoint, or initial/ for step 0) as branch stepN."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hftrain-revisions")
        branch = branch_of(step)
        future = self.pool.submit(self._push, run_dir, checkpoint, branch)
        future.add_done_callback(lambda done: self._report(done, checkpoint, branch))

    def _push(self, run_dir: Path, checkpoint: Path, branch: str) -> str:
        from hftrain.checkpoint.export import export

        with tempfile.TemporaryDirectory(prefix="hftrain-revision-") as tmp:
            model = export(checkpoint, Path(tmp) / "model", merge=True)  # a standard model, whatever the backend
            folder = bundle(run_dir, model, self.recipe, self.repo_id)
            try:
                push_folder(folder, self.repo_id, private=self.private, revision=branch, message=f"hftrain: {checkpoint.name} as {branch}")
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        return branch

    def _report(self, done: Future, checkpoint: Path, branch: str) -> None:
        err = done.exception()
        if err is None:
            print(f"hftrain: pushed {checkpoint.name} to {self.repo_id} as revision {branch}", flush=True)
            return
        print(f"hftrain: warning: pushing {checkpoint.name} as revision {branch} of {self.repo_id} failed ({err}); training goes "
              f"on. Push it later: `hftrain export {checkpoint} --merge --out DIR` then "
              f"`hftrain push DIR --repo-id {self.repo_id} --revision {branch}`.", file=sys.stderr, flush=True)  # fmt: skip

    def finish(self) -> list[str]:
        """Let the queued pushes finish (each failure was reported as it happened); every stepN branch of the repo."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        return self.branches()

    def branches(self) -> list[str]:
        """Every stepN branch of the repo, by step (for the model card); [] when the repo cannot be listed."""
        from huggingface_hub import HfApi

        try:
            refs = HfApi().list_repo_refs(self.repo_id)
        except Exception:  # the card then lists none; the push of main reports its own failure
            return []
        steps = sorted(int(m.group(1)) for b in refs.branches if (m := BRANCH.fullmatch(b.name)))
        return [branch_of(s) for s in steps]
