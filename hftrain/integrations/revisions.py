"""Kept checkpoints as Hub revisions, the way Pythia is published: branch `stepN` of one repo per kept checkpoint
(recipe.checkpoints), loadable with `from_pretrained(repo, revision="stepN")`, and the final model on main.

Each kept checkpoint is exported to a standard model directory (export/model_dir.py: DDP, FSDP, ZeRO-3, a LoRA
adapter merged) and uploaded to its branch by the run's outbox (outbox.py), in order, while training goes on: a
push never blocks a step, and never reads a checkpoint that rotation could remove (kept ones are never rotated). A
push is retried (hub._retry); one that still fails is reported with the commands that push it later, and training
goes on. The final model card lists every `stepN` branch the repo has (those of earlier launches of a resumed run
included).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.checkpoint.layout import checkpoint_step
from hftrain.integrations.hub import bundle, push_folder, repo_id_of
from hftrain.integrations.outbox import Outbox

if TYPE_CHECKING:
    from hftrain.integrations.publish import PublishPart

BRANCH = re.compile(r"step(\d+)")


def branch_of(step: int) -> str:
    return f"step{step}"


def publisher(part: PublishPart, args: Any, push_to_hub: bool, outbox: Outbox) -> RevisionPublisher | None:
    """The run's publisher of revisions, when the recipe asks for them (checkpoints.push_revisions)."""
    if not (push_to_hub and part.checkpoints.push_revisions):
        return None
    return RevisionPublisher(part, repo_id_of(args), args.hub_private_repo, outbox)


class RevisionPublisher:
    """Queues the push of each kept checkpoint to its branch in the run's outbox, in the order they were written."""

    def __init__(self, part: PublishPart, repo_id: str, private: bool | None, outbox: Outbox):
        self.part, self.repo_id, self.private, self.outbox = part, repo_id, private, outbox

    def wants(self, checkpoint: Path) -> bool:
        step = checkpoint_step(checkpoint)
        return step is not None and self.part.checkpoints.keeps(step)

    def submit(self, run_dir: Path, checkpoint: Path, step: int, record: dict[str, Any] | None = None) -> None:
        """Queue the push of `checkpoint` (a checkpoint, or initial/ for step 0) as branch stepN (`record`: an
        earlier launch's journal entry, sent again to the repo it names)."""
        branch, repo = branch_of(step), (record or {}).get("repo") or self.repo_id
        later = (
            f"send it later: `hftrain export {checkpoint} --merge --out DIR` then `hftrain push DIR --repo-id {repo} "
            f"--revision {branch}`"
        )
        self.outbox.submit(
            "the Hub",
            f"pushing {checkpoint.name} as revision {branch} of {repo}",
            lambda: self._push(run_dir, checkpoint, branch, repo),
            later=later,
            done=lambda _: print(f"hftrain: pushed {checkpoint.name} to {repo} as revision {branch}", flush=True),
            record=record or {"kind": "revision", "checkpoint": checkpoint.name, "step": step, "repo": repo},
            lane=f"{repo}@{branch}",
            source=checkpoint,
        )

    def _push(self, run_dir: Path, checkpoint: Path, branch: str, repo: str) -> str:
        from hftrain.export.model_dir import export

        self.outbox.folder.mkdir(parents=True, exist_ok=True)
        # In the run's own folder, not the system's temp: the export is the size of the model (a small or RAM-backed
        # /tmp would fill), its bundle hard-links it, and a killed launch's leftover is cleared by the next (outbox.py).
        with tempfile.TemporaryDirectory(prefix="revision-", dir=self.outbox.folder) as tmp:
            model = export(checkpoint, Path(tmp) / "model", merge=True)  # a standard model, whatever the backend
            folder = bundle(run_dir, model, self.part, repo, into=Path(tmp))  # links to the export
            try:
                push_folder(
                    folder,
                    repo,
                    private=self.private,
                    revision=branch,
                    message=f"hftrain: {checkpoint.name} as {branch}",
                )
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        return branch

    def branches(self) -> list[str]:
        """Every stepN branch of the repo, by step (for the model card); [] when the repo cannot be listed."""
        from huggingface_hub import HfApi

        try:
            refs = HfApi().list_repo_refs(self.repo_id)
        except Exception:  # the card then lists none; the push of main reports its own failure
            return []
        steps = sorted(int(m.group(1)) for b in refs.branches if (m := BRANCH.fullmatch(b.name)))
        return [branch_of(s) for s in steps]
