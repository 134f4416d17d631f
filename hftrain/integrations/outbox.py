"""What a run sends out while it trains (Hub pushes, S3 copies, Hub revisions) goes through one background worker,
and what its trackers report is guarded: an outside service that is slow or down never stops or slows a step.

* One worker, in order. Each upload is retried by the call it makes (hub._retry: back-off within
  faults.network_timeout_s); one that still fails is said ("training goes on") and tried again after
  RETRY_AFTER_S (30 s, 2 min, 10 min: an outage of minutes heals itself); one still waiting for its next try
  when training ends is tried then. One that fails its last try is kept, with the command that sends it later.
* Bounded. An upload of a checkpoint that rotation may delete is staged first (hard links beside the run, a copy
  where links are impossible): at most STAGED_LIMIT such uploads wait, and when a newer one comes, the oldest
  waiting one is dropped and reported (a newer checkpoint supersedes it; the staged copies pin disk space rotation
  would free). Revisions read kept checkpoints, which nothing deletes: their number is the recipe's schedule.
* `finish` (after the last step) lets the queued uploads finish and returns every failure: the run's summary and
  results.json list them, and `hftrain train` exits NotShared.exit_code (76) with one line per failed service, the
  model saved on disk.
* The trackers' reports have their own queues (trackers.py); what they could not send joins these failures.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

STAGED_LIMIT = 2  # staged uploads (copies of rotating checkpoints) waiting at once
RETRY_AFTER_S = (30.0, 120.0, 600.0)  # a failed upload is tried again after these pauses while training goes on
OUTBOX_DIR = ".hftrain-outbox"  # in the run directory: staged copies, removed once sent (or dropped)


@dataclass(frozen=True)
class Failure:
    """One thing that was not sent: where to, what, why, and how to send it later."""

    service: str  # "the Hub", "S3", "mlflow": one line per service at the end
    what: str  # "pushing checkpoint-5 to me/model"
    error: str
    later: str = ""  # what to do about it later ("send it later: `hftrain push ...`")

    def line(self) -> str:
        return f"{self.what} failed ({self.error})" + (f"; {self.later}" if self.later else "")

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def reason(err: BaseException) -> str:
    """An error in one line: hftrain's own message, else the exception's type and first line (clients never print
    the token)."""
    from hftrain.errors import HftrainError

    text = str(err).strip()
    return text if isinstance(err, HftrainError) else f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def send_later(command: str) -> str:
    return f"send it later: `{command}`"


def not_shared_message(failures: list[Failure], final_dir: Path) -> str:
    """The run's last words when a service failed: one line per service (its last failure, the final model's where
    it failed too), each with the command that sends it later."""
    by_service: dict[str, list[Failure]] = {}
    for failure in failures:
        by_service.setdefault(failure.service, []).append(failure)
    lines = [
        f"training finished and the model is saved in {final_dir}, but {len(by_service)} outside "
        f"service{'s' if len(by_service) > 1 else ''} failed (every failure is in results.json, not_shared):"
    ]
    for service, seen in by_service.items():
        more = f" (and {len(seen) - 1} earlier)" if len(seen) > 1 else ""
        lines.append(f"  {service}: {seen[-1].line()}{more}")
    return "\n".join(lines)


@dataclass
class _Upload:
    service: str
    what: str
    send: Callable[[], Any]
    later: str
    staged: Path | None
    done: Callable[[Any], None] | None
    due: float = 0.0  # time.monotonic() when it may be tried (again)
    tries: int = 0  # tries again so far, after its first


class Outbox:
    """The run's uploads while it trains (rank 0 only: the process that saves)."""

    def __init__(self, run_dir: Path, owner: bool = True):
        self.folder = Path(run_dir) / OUTBOX_DIR
        if owner:  # the process that saves: a killed launch's leftovers (hftrain's own staging only)
            shutil.rmtree(self.folder, ignore_errors=True)
        self.failures: list[Failure] = []
        self._waiting: collections.deque[_Upload] = collections.deque()
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._staged = 0  # staged copies so far: each its own folder

    def stage(self, folder: Path) -> Path:
        """A copy of `folder` that its rotation cannot remove: hard links (the files of a published checkpoint are
        never rewritten), a copy where the file system cannot link."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._staged += 1
        target = self.folder / f"{folder.name}-{self._staged}"
        shutil.copytree(folder, target, copy_function=link_or_copy)
        return target

    def submit(
        self,
        service: str,
        what: str,
        send: Callable[[], Any],
        later: str = "",
        staged: Path | None = None,
        done: Callable[[Any], None] | None = None,
    ) -> None:
        """Queue `send()`; never blocks and never raises. `staged`: the folder it sends, removed once sent or dropped;
        `done(result)`: called after it succeeded."""
        upload = _Upload(service, what, send, later, staged, done)
        dropped = None
        with self._cond:
            if staged is not None and sum(u.staged is not None for u in self._waiting) >= STAGED_LIMIT:
                dropped = next(u for u in self._waiting if u.staged is not None)
                self._waiting.remove(dropped)
            self._waiting.append(upload)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="hftrain-outbox", daemon=True)
                self._worker.start()
            self._cond.notify()
        if dropped is not None:
            _remove(dropped.staged)
            self.fail(
                Failure(
                    dropped.service,
                    dropped.what,
                    f"not sent: {dropped.service} is slow or down and a newer upload replaced it in the queue",
                    dropped.later,
                )
            )

    def fail(self, failure: Failure, training: bool = True) -> None:
        """Keep a failure and say it once."""
        with self._cond:
            self.failures.append(failure)
        tail = "; training goes on" if training else ""
        print(f"hftrain: warning: {failure.line()}{tail}.", file=sys.stderr, flush=True)

    def finish(self) -> list[Failure]:
        """Let the queued uploads finish (each is bounded by its retries); every failure so far."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            worker = self._worker
        if worker is not None:
            worker.join()
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()
        return list(self.failures)

    def _next(self) -> _Upload | None:
        """The first upload that is due (all of them once the outbox is closed); None when nothing is left."""
        with self._cond:
            while True:
                now = time.monotonic()
                due = next((u for u in self._waiting if self._closed or u.due <= now), None)
                if due is not None:
                    self._waiting.remove(due)
                    return due
                if not self._waiting and self._closed:
                    return None
                self._cond.wait(min((u.due for u in self._waiting), default=now + 3600) - now)

    def _run(self) -> None:
        while (upload := self._next()) is not None:
            try:
                result = upload.send()
            except Exception as err:  # never into a step: said, tried again later, or kept
                with self._cond:
                    again = not self._closed and upload.tries < len(RETRY_AFTER_S)
                    if again:
                        upload.due = time.monotonic() + RETRY_AFTER_S[upload.tries]
                        upload.tries += 1
                        self._waiting.append(upload)
                if again:
                    print(
                        f"hftrain: warning: {upload.what} failed ({reason(err)}); trying again in {RETRY_AFTER_S[upload.tries - 1]:.0f} s; "
                        "training goes on.",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                self.fail(Failure(upload.service, upload.what, reason(err), upload.later))
            else:
                if upload.done is not None:
                    upload.done(result)
            _remove(upload.staged)


def link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)
    return dst


def _remove(staged: Path | None) -> None:
    if staged is not None:
        shutil.rmtree(staged, ignore_errors=True)
