"""Sharing a model: push to the Hugging Face Hub (or any server speaking its API) or to S3, with a model card.

TrainingArguments' own hub fields drive it (push_to_hub, hub_model_id, hub_strategy, hub_private_repo,
hub_revision); the token comes from HF_TOKEN or `hf auth login`, the endpoint from HF_ENDPOINT. The Trainer's
built-in push uploads from output_dir's root; hftrain's checkpoints are staged and renamed and its final model
lives in output_dir/final, so hftrain uploads with the same huggingface_hub call (`upload_folder`) from the
published directories. A push only reads the local files. While training, every upload goes through the run's
outbox (outbox.py): in the background, bounded, and a failure never stops training.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.checkpoint.files import read_json
from hftrain.checkpoint.layout import COMPLETE_MARKER, RunLayout, checkpoint_step
from hftrain.errors import HftrainError
from hftrain.integrations.model_card import model_card
from hftrain.integrations.outbox import Failure, Outbox, link_or_copy, reason, send_later

if TYPE_CHECKING:
    from hftrain.integrations.publish import PublishPart

CARD = "README.md"
PUSH_RETRIES = 3
SHAREABLE = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.yaml", "*.png", "*.md", "*.jsonl"]


def _retry(action: Callable[[], Any], what: str) -> Any:
    """`action()`, tried again after a failure that another try can fix, within the network bound."""
    from hftrain import network
    from hftrain.errors import as_user_error, retryable

    deadline = time.monotonic() + network.bound()
    for attempt in range(1, PUSH_RETRIES + 1):
        try:
            return action()
        except Exception as err:  # network, HTTP, S3: report without the token (the clients never print it)
            late = time.monotonic() + 2.0 * attempt + network.attempt_timeout() > deadline
            if attempt == PUSH_RETRIES or late or not retryable(err):
                known = as_user_error(err, network.bound())
                detail = str(known) if known is not None else f"{type(err).__name__}: {str(err).splitlines()[0]}"
                raise HftrainError(
                    f"{what} failed after {attempt} attempt{'s' if attempt > 1 else ''}: {detail}"
                ) from None
            print(
                f"hftrain: {what} failed ({type(err).__name__}); retry {attempt} of {PUSH_RETRIES - 1}",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(2.0 * attempt)


def bundle(
    run_dir: Path,
    model_dir: Path,
    part: PublishPart,
    repo_id: str,
    revisions: Sequence[str] = (),
    into: Path | None = None,
) -> Path:
    """A temporary folder (in `into`, else the system's) with the model, card, plot, metrics and recipe: what a push
    sends. The model's files are hard links where `into` is on their file system (they are never rewritten); the
    run's files are copies (metrics.jsonl grows while the run trains)."""
    if into is not None:
        into.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="hftrain-push-", dir=into))
    for item in model_dir.iterdir():
        if item.is_file() and item.name not in ("training_args.bin", COMPLETE_MARKER):
            link_or_copy(str(item), str(out / item.name))
    layout = RunLayout(run_dir)
    for path in (layout.plot, layout.metrics, layout.results):
        if path.is_file():
            shutil.copy2(path, out / path.name)
    results = read_json(layout.results, "the run's results") if layout.results.is_file() else {}
    (out / CARD).write_text(
        model_card(part, results, repo_id, (out / RunLayout.PLOT_FILE).is_file(), revisions), encoding="utf-8"
    )
    return out


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    private: bool | None,
    revision: str | None,
    message: str,
    path_in_repo: str | None = None,
) -> str:
    """Upload a folder to the hub (creating the repo and branch if needed), each call retried."""
    from huggingface_hub import HfApi

    api = HfApi()
    _retry(lambda: api.create_repo(repo_id, private=private, exist_ok=True), f"creating hub repo {repo_id}")
    if revision:
        _retry(
            lambda: api.create_branch(repo_id, branch=revision, exist_ok=True),
            f"creating branch {revision} of {repo_id}",
        )
    upload = dict(
        repo_id=repo_id,
        folder_path=str(folder),
        revision=revision,
        commit_message=message,
        path_in_repo=path_in_repo,
        allow_patterns=SHAREABLE,
    )
    return _retry(lambda: str(api.upload_folder(**upload)), f"pushing {folder} to {repo_id}")


def copy_to_fsspec(
    folder: Path, url: str, storage_options: dict[str, Any] | None = None, name: Path | None = None
) -> str:
    """Copy a folder (a model, a checkpoint with its sharded state's subfolders) to s3:// (or any fsspec URL);
    returns the URL. `name`: the folder a message names (the checkpoint a staged copy was made from)."""
    import fsspec

    from hftrain import network

    network.require_backend(url, "the copy's URL")
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))

    def put() -> None:
        # the first contact bounded as a whole (a silent endpoint held s3fs's makedirs about 4 network bounds)
        network.within_bound(lambda: fs.makedirs(root, exist_ok=True), f"reaching {url}")
        for item in sorted(folder.rglob("*")):
            target = root.rstrip("/") + "/" + item.relative_to(folder).as_posix()
            if item.is_dir():
                fs.makedirs(target, exist_ok=True)  # local and mounted targets need it; object stores ignore it
            elif item.is_file():
                fs.put_file(str(item), target)

    _retry(put, f"copying {name or folder} to {url}")
    return url


def repo_id_of(args: Any) -> str:
    """The Hub repo a run pushes to: training.hub_model_id, else the output directory's name (as the Trainer does)."""
    return args.hub_model_id or Path(args.output_dir).name


class CheckpointPusher:
    """What a run shares, where the recipe says: during training (hub_strategy, hub.s3_uri, and kept checkpoints as
    revisions stepN, revisions.py) through the run's outbox, in the background; at the end, the final model, after
    the outbox has sent what it holds. Nothing here raises into training: failures are collected."""

    def __init__(self, part: PublishPart, args: Any, push_to_hub: bool, outbox: Outbox, revisions: Any = None):
        self.part, self.args, self.push_to_hub, self.outbox = part, args, push_to_hub, outbox
        self.revisions = revisions  # a revisions.RevisionPublisher, or None

    @property
    def enabled(self) -> bool:
        return bool(self.push_to_hub or self.part.hub.s3_uri)

    def repo_id(self) -> str:
        return repo_id_of(self.args)

    def on_initial(self, initial: Path) -> None:
        """The weights before step 1 (recipe.checkpoints keeps step 0): revision step0, when revisions are pushed."""
        if self.revisions is not None:
            self.revisions.submit(Path(self.args.output_dir), initial, 0)

    def on_checkpoint(self, checkpoint: Path) -> None:
        if self.revisions is not None and self.revisions.wants(checkpoint):
            self.revisions.submit(Path(self.args.output_dir), checkpoint, checkpoint_step(checkpoint) or 0)
        strategy = str(getattr(self.args.hub_strategy, "value", self.args.hub_strategy))
        if not self.enabled or strategy == "end":
            return
        if self.part.hub.s3_uri:
            self._copy_checkpoint(checkpoint, f"{self.part.hub.s3_uri.rstrip('/')}/{checkpoint.name}")
        if self.push_to_hub:
            self._push_checkpoint(
                checkpoint,
                {"every_save": None, "checkpoint": "last-checkpoint", "all_checkpoints": checkpoint.name}[strategy],
            )

    def _copy_checkpoint(
        self, checkpoint: Path, url: str, staged: Path | None = None, record: dict[str, Any] | None = None
    ) -> None:
        staged = staged or self.outbox.stage(checkpoint)  # rotation may delete the checkpoint before its turn
        options = self.part.hub.storage_options  # never journaled: it may hold keys
        self.outbox.submit(
            "S3",
            f"copying {checkpoint.name} to {url}",
            lambda: copy_to_fsspec(staged, url, options, name=checkpoint),
            later=send_later(f"hftrain push {checkpoint} --to {url}"),
            staged=staged,
            record=record or {"kind": "s3", "checkpoint": checkpoint.name, "url": url},
            lane=url,
            source=checkpoint,
        )

    def _push_checkpoint(
        self,
        checkpoint: Path,
        path_in_repo: str | None,
        staged: Path | None = None,
        record: dict[str, Any] | None = None,
    ) -> None:
        repo = (record or {}).get("repo") or self.repo_id()
        revision = (record or {}).get("revision", self.args.hub_revision)
        staged = staged or bundle(Path(self.args.output_dir), checkpoint, self.part, repo, into=self.outbox.folder)

        def send() -> str:
            return push_folder(
                staged,
                repo,
                private=self.args.hub_private_repo,
                revision=revision,
                message=f"hftrain: {checkpoint.name}",
                path_in_repo=path_in_repo,
            )

        later = send_later(
            f"hftrain push {checkpoint} --repo-id {repo}" + (f" --revision {revision}" if revision else "")
        )
        self.outbox.submit(
            "the Hub",
            f"pushing {checkpoint.name} to {repo}",
            send,
            later=later,
            staged=staged,
            # every_save and checkpoint rewrite one place: a newer push there replaces a waiting one
            target=None if path_in_repo == checkpoint.name else f"{repo}@{revision or 'main'}:{path_in_repo or '/'}",
            lane=f"{repo}@{revision or 'main'}",
            record=record
            or {
                "kind": "hub",
                "checkpoint": checkpoint.name,
                "repo": repo,
                "revision": revision,
                "path_in_repo": path_in_repo,
            },
            source=checkpoint,
        )

    def recover(self) -> None:
        """What an earlier launch of this run queued and did not send (it was killed before): queued again, from
        its staged copy or its checkpoint; kept as a failure, with its command, where the folder is gone or this
        launch's recipe no longer shares with that service."""
        earlier = list(self.outbox.earlier)
        if not earlier:
            return
        print(
            f"hftrain: an earlier launch of this run queued {len(earlier)} upload(s) it did not send: sending them now",
            flush=True,
        )
        run_dir = Path(self.args.output_dir)
        for entry in earlier:
            kind, checkpoint = entry.get("kind"), run_dir / str(entry.get("checkpoint", ""))
            staged = self.outbox.folder / entry["staged"] if entry.get("staged") else None
            staged = staged if staged is not None and staged.is_dir() else None
            shares = {"hub": self.push_to_hub, "revision": self.revisions is not None, "s3": bool(self.part.hub.s3_uri)}
            why = "queued by an earlier launch of this run, stopped before it was sent"
            if not shares.get(str(kind)):
                self.outbox.fail(
                    Failure(
                        entry["service"],
                        entry["what"],
                        f"{why}; this launch's recipe does not send it",
                        entry["later"],
                        str(checkpoint),
                    ),
                    training=True,
                    record=entry,
                )
            elif staged is None and not checkpoint.is_dir():
                self.outbox.fail(
                    Failure(entry["service"], entry["what"], f"{why}; {checkpoint.name} is gone", "", str(checkpoint)),
                    record=entry,
                )
            elif kind == "s3":
                self._copy_checkpoint(checkpoint, entry["url"], staged, entry)
            elif kind == "hub":
                self._push_checkpoint(checkpoint, entry.get("path_in_repo"), staged, entry)
            else:
                self.revisions.submit(run_dir, checkpoint, int(entry["step"]), record=entry)

    def on_end(self, run_dir: Path, final_dir: Path) -> tuple[list[str], list[Failure]]:
        """Send the final model after what the outbox still holds; (where it went, every failure of the run)."""
        self.outbox.finish()
        done = []
        if self.part.hub.s3_uri:
            url = f"{self.part.hub.s3_uri.rstrip('/')}/final"
            try:
                done.append(copy_to_fsspec(final_dir, url, self.part.hub.storage_options))
            except Exception as err:
                self.outbox.fail(
                    Failure(
                        "S3",
                        f"copying the final model to {url}",
                        reason(err),
                        send_later(f"hftrain push {run_dir} --to {url}"),
                    ),
                    training=False,
                )
        revisions = self.revisions.branches() if self.revisions is not None else []
        if self.push_to_hub:
            repo = self.repo_id()
            folder = bundle(run_dir, final_dir, self.part, repo, revisions, into=self.outbox.folder)
            try:
                push_folder(
                    folder,
                    repo,
                    private=self.args.hub_private_repo,
                    revision=self.args.hub_revision,
                    message="hftrain: final model",
                )
                done.append(f"hub:{repo}")
            except Exception as err:
                later = send_later(
                    f"hftrain push {run_dir} --repo-id {repo}"
                    + (f" --revision {self.args.hub_revision}" if self.args.hub_revision else "")
                )
                self.outbox.fail(
                    Failure("the Hub", f"pushing the final model to {repo}", reason(err), later), training=False
                )
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        return done, self.outbox.finish()
