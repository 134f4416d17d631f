"""What a run sends out while it trains (Hub pushes, S3 copies, Hub revisions) goes through one background worker,
and what its trackers report is guarded: an outside service that is slow or down never stops or slows a step.

* In order. Uploads to one place (a branch of a repo) go in the order they were queued, a retried one included
  (a push of checkpoint-20 never lands on main after checkpoint-40's); one whose destination a newer upload rewrites
  (hub_strategy every_save or checkpoint) is replaced by it while it waits: the newer one carries it, nothing is lost.
* Retried. Each upload is retried by the call it makes (hub._retry: back-off within faults.network_timeout_s);
  one that still fails is said ("training goes on") and tried again after RETRY_AFTER_S (30 s, 2 min, then every
  10 min until training ends: an outage heals itself, whenever it ends); one still waiting when training ends is
  tried then, once (an outage that healed after the last pause still gets its upload). A service that fails
  then after making the run wait (SLOW_FAILURE of the network bound: silent, or answering too late) is not waited
  on again for the uploads behind it: each is kept, with the command that sends it later, so the wait after the
  last step is about one network bound per service, not one per upload.
* Bounded. An upload of a checkpoint that rotation may delete is staged first (hard links beside the run, a copy
  where links are impossible): at most STAGED_LIMIT such uploads wait, and when a newer one comes, the oldest
  waiting one is dropped and reported (the staged copies pin disk space rotation would free).
* Journaled. Every upload the run owes is written to JOURNAL beside its staged copies until it is sent (or
  reported at the run's end): a launch killed with kill -9 (an OOM kill, a lost node) leaves it, and the next
  launch of the run sends it again or reports it (`earlier`; hub.CheckpointPusher.recover).
* `finish` (after the last step) lets the queued uploads finish and returns every failure: the run's summary and
  results.json list them, and `hftrain train` exits NotShared.exit_code (76) with one line per failed service, the
  model saved on disk.
* The trackers' reports have their own queues (trackers.py); what they could not send joins these failures.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hftrain import network
from hftrain.checkpoint.layout import RunLayout

STAGED_LIMIT = 2  # staged uploads (copies of rotating checkpoints) waiting at once
RETRY_AFTER_S = (30.0, 120.0, 600.0)  # a failed upload is tried again after these pauses while training goes on
OUTBOX_DIR = RunLayout.OUTBOX  # in the run directory: staged copies and the journal, removed once sent (or reported)
JOURNAL = "pending.json"  # in OUTBOX_DIR: the uploads the run still owes
SLOW_FAILURE = 0.5  # of the network bound: a service whose failure took this long is not waited on again at the end


@dataclass(frozen=True)
class Failure:
    """One thing that was not sent: where to, what, why, and how to send it later."""

    service: str  # "the Hub", "S3", "mlflow": one line per service at the end
    what: str  # "pushing checkpoint-5 to me/model"
    error: str
    later: str = ""  # what to do about it later ("send it later: `hftrain push ...`")
    source: str = field(default="", compare=False)  # the local folder it sends, where one does: its command needs it

    def line(self) -> str:
        return f"{self.what} failed ({self.error})" + (f"; {self.later}" if self.later else "")

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if k != "source"}


def reason(err: BaseException) -> str:
    """An error in one line: hftrain's own message, else the exception's type and first line (clients never print
    the token)."""
    from hftrain.errors import HftrainError

    text = str(err).strip()
    return (
        text
        if isinstance(err, HftrainError)
        else f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    )


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
    seq: int  # the order it was queued in: uploads to one service go in this order
    service: str
    what: str
    send: Callable[[], Any]
    later: str
    staged: Path | None
    done: Callable[[Any], None] | None
    target: str | None  # where it lands, when a newer upload to the same place replaces it (None: its own place)
    record: dict[str, Any] | None  # what the journal keeps to send it again after a kill (None: not journaled)
    source: Path | None  # the checkpoint it sends
    lane: str  # uploads of one lane (one branch of one repo, say) go in the order they were queued
    due: float = 0.0  # time.monotonic() when it may be tried (again)
    tries: int = 0  # tries again so far, after its first
    pause: float = 0.0  # seconds before its next try (the schedule's, its last pause once past it)


class Outbox:
    """The run's uploads while it trains (rank 0 only: the process that saves)."""

    def __init__(self, run_dir: Path, owner: bool = True):
        self.folder = Path(run_dir) / OUTBOX_DIR
        self.failures: list[Failure] = []
        self.earlier: list[dict[str, Any]] = []  # what an earlier, killed launch owed: hub.CheckpointPusher.recover
        self._owner = owner
        if owner:
            self.earlier = _read_journal(self.folder / JOURNAL)
            _clear(self.folder, keep={e["staged"] for e in self.earlier if e.get("staged")} | {JOURNAL})
        self._waiting: list[_Upload] = []  # by seq
        self._records: dict[int, dict[str, Any]] = {}  # seq -> journal record, until sent or settled
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._down: dict[str, str] = {}  # service -> why, for those that failed once training ended
        self._seq = 0
        self._staged = 0  # staged copies so far: each its own folder

    def stage(self, folder: Path) -> Path:
        """A copy of `folder` that its rotation cannot remove: hard links (the files of a published checkpoint are
        never rewritten), a copy where the file system cannot link."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._staged += 1
        target = self.folder / f"{folder.name}-{time.time_ns()}-{self._staged}"
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
        *,
        target: str | None = None,
        record: dict[str, Any] | None = None,
        source: Path | None = None,
        lane: str | None = None,
    ) -> None:
        """Queue `send()`; never blocks and never raises. `staged`: the folder it sends, removed once sent or dropped;
        `done(result)`: called after it succeeded; `target`: where it lands, when a newer upload there replaces it;
        `record`: the journal's description (an entry of `earlier` when it is that one sent again); `lane`: what
        it keeps its order within (the service, unless given)."""
        replaced: list[_Upload] = []
        dropped = None
        with self._cond:
            self._seq += 1
            upload = _Upload(
                self._seq, service, what, send, later, staged, done, target, record, source, lane or service
            )
            if target is not None:
                replaced = [u for u in self._waiting if u.target == target]
            for old in replaced:
                self._waiting.remove(old)
                self._records.pop(old.seq, None)
            waiting_staged = [u for u in self._waiting if u.staged is not None]
            if staged is not None and len(waiting_staged) >= STAGED_LIMIT:
                dropped = waiting_staged[0]
                self._waiting.remove(dropped)
            self._waiting.append(upload)
            if record is not None:
                self._records[upload.seq] = self._entry(upload)
                self.earlier = [e for e in self.earlier if e is not record]
            self._write_journal()
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="hftrain-outbox", daemon=True)
                self._worker.start()
            self._cond.notify()
        for old in replaced:
            _remove(old.staged)
            print(
                f"hftrain: {what} replaces {old.what} in the queue (it lands in the same place; training goes on).",
                flush=True,
            )
        if dropped is not None:
            _remove(dropped.staged)
            error = f"not sent: {dropped.service} is slow or down and a newer upload replaced it in the queue"
            self.fail(
                Failure(dropped.service, dropped.what, error, dropped.later, str(dropped.source or "")), seq=dropped.seq
            )

    def fail(
        self, failure: Failure, training: bool = True, *, seq: int | None = None, record: dict[str, Any] | None = None
    ) -> None:
        """Keep a failure and say it once. Its journal record (the queued upload's, `seq`, or an `earlier` one,
        `record`) stays until the run settles, so a killed launch's successor tries it again."""
        with self._cond:
            self.failures.append(failure)
            if seq is not None and seq in self._records:  # its staged copy goes: the record names its checkpoint
                self._records[seq] = {**self._records[seq], "staged": None}
            if record is not None:
                self._seq += 1
                self._records[self._seq] = record
                self.earlier = [e for e in self.earlier if e is not record]
            if seq is not None or record is not None:
                self._write_journal()
        tail = "; training goes on" if training else ""
        print(f"hftrain: warning: {failure.line()}{tail}.", file=sys.stderr, flush=True)

    def finish(self) -> list[Failure]:
        """Let the queued uploads finish (each tried once more at most; none waits on a service that just failed);
        every failure so far, each whose checkpoint rotation removed saying so instead of a command."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            worker = self._worker
        if worker is not None:
            worker.join()
        self.failures = [_without_source(f) for f in self.failures]
        return list(self.failures)

    def settle(self) -> None:
        """The run's end is written (results.json lists what was not sent): the journal and the folder go."""
        if not self._owner:
            return
        with self._cond:
            self._records.clear()
            self.earlier = []
            (self.folder / JOURNAL).unlink(missing_ok=True)
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()

    def _entry(self, upload: _Upload) -> dict[str, Any]:
        staged = upload.staged.name if upload.staged is not None and upload.staged.parent == self.folder else None
        return {
            **(upload.record or {}),
            "service": upload.service,
            "what": upload.what,
            "later": upload.later,
            "staged": staged,
        }

    def _write_journal(self) -> None:
        """Under the lock: what the run owes, written whole (a kill leaves the last complete version)."""
        if not self._owner:
            return
        entries = [*self.earlier, *self._records.values()]
        path = self.folder / JOURNAL
        if not entries:
            path.unlink(missing_ok=True)
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        with open(part, "w", encoding="utf-8") as handle:
            json.dump(entries, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(part, path)

    def _next(self) -> _Upload | None:
        """The first upload that is due and has nothing queued before it in its lane (all of them in order once the
        outbox is closed); None when nothing is left."""
        with self._cond:
            while True:
                now, held = time.monotonic(), set()
                for upload in self._waiting:
                    if upload.lane not in held and (self._closed or upload.due <= now):
                        self._waiting.remove(upload)
                        return upload
                    held.add(upload.lane)
                if not self._waiting and self._closed:
                    return None
                self._cond.wait(min((u.due for u in self._waiting), default=now + 3600) - now)

    def _run(self) -> None:
        while (upload := self._next()) is not None:
            down = self._down.get(upload.service)
            if down is not None:  # training has ended and this service just failed: not waited on again
                self._give_up(upload, f"not tried: {upload.service} failed just before ({down})")
                continue
            started = time.monotonic()
            try:
                result = upload.send()
            except Exception as err:  # never into a step: said, tried again later, or kept
                slow = time.monotonic() - started >= SLOW_FAILURE * network.bound()
                with self._cond:
                    newer = upload.target is not None and any(u.target == upload.target for u in self._waiting)
                    again = not self._closed and not newer  # past the schedule: every last pause until the end
                    if newer:  # a newer upload to the same place came while it was tried: it carries it
                        self._records.pop(upload.seq, None)
                        self._write_journal()
                    elif again:
                        upload.pause = RETRY_AFTER_S[min(upload.tries, len(RETRY_AFTER_S) - 1)]
                        upload.due = time.monotonic() + upload.pause
                        upload.tries += 1
                        self._waiting.insert(sum(u.seq < upload.seq for u in self._waiting), upload)
                    elif self._closed and slow:  # it made the run wait, then failed: not waited on again
                        self._down[upload.service] = reason(err)
                if newer:
                    _remove(upload.staged)
                    print(
                        f"hftrain: {upload.what} failed ({reason(err)}); a newer upload to the same place replaces it.",
                        flush=True,
                    )
                    continue
                if again:
                    print(
                        f"hftrain: warning: {upload.what} failed ({reason(err)}); trying again in "
                        f"{upload.pause:.0f} s; training goes on.",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                self._give_up(upload, reason(err))
            else:
                if upload.done is not None:
                    upload.done(result)
                with self._cond:
                    self._records.pop(upload.seq, None)
                    self._write_journal()
                _remove(upload.staged)

    def _give_up(self, upload: _Upload, error: str) -> None:
        failure = Failure(upload.service, upload.what, error, upload.later, str(upload.source or ""))
        self.fail(failure, training=not self._closed, seq=upload.seq)
        _remove(upload.staged)


def _without_source(failure: Failure) -> Failure:
    """A failure whose checkpoint rotation removed cannot be sent later by the command that names it: say so."""
    if not failure.source or Path(failure.source).exists():
        return failure
    name = Path(failure.source).name
    return replace(
        failure, later=f"it cannot be sent later: {name} was removed by checkpoint rotation (training.save_total_limit)"
    )


def _read_journal(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # written whole and replaced: unreadable only if damaged by hand
        print(
            f"hftrain: warning: {path} cannot be read; what an earlier launch queued is not sent again.",
            file=sys.stderr,
            flush=True,
        )
        return []
    return [e for e in entries if isinstance(e, dict) and "what" in e] if isinstance(entries, list) else []


def _clear(folder: Path, keep: set[str]) -> None:
    """A killed launch's leftovers in hftrain's own staging folder, but what its journal still names."""
    if not folder.is_dir():
        return
    for item in folder.iterdir():
        if item.name not in keep:
            shutil.rmtree(item, ignore_errors=True) if item.is_dir() else item.unlink(missing_ok=True)


def link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)
    return dst


def _remove(staged: Path | None) -> None:
    if staged is not None:
        shutil.rmtree(staged, ignore_errors=True)
