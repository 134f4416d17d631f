"""Who is writing into an output directory right now: one run, one `data prepare`, at a time.

Two launches into one ``training.output_dir`` would interleave metrics.jsonl, remove each other's saves in
progress and replace each other's checkpoints; two prepares would mix their shards. So the work owns its output
while it runs:

* On a file system the owner is an ``flock`` on ``DIR/.hftrain.lock``, held by the process that started the work
  for as long as it lives. The kernel drops it when that process ends, however it ends (kill -9 included), so the
  same command run again takes over at once. The file also says who holds it (pid, host, command, start time), for
  the refusal message. It stays when the work ends (emptied); only a directory the lock itself created, with
  nothing else in it, is removed again.
* The processes one launch starts are the same run, not a second one: they share a run token (``run_token``: the
  launcher's ``HFTRAIN_RUN_TOKEN``, which ranks and ``--max-restarts`` restarts inherit; else the SLURM job; else
  torchrun's run id and rendezvous address, the same on every node) and join instead of being refused. A process
  that joins holds a shared flock on ``DIR/.hftrain.writers`` while it lives, so the lock is held by the processes
  that write, not only by the one that launched them: while any of a killed launcher's ranks still writes, a new
  launch is refused. A child forked from an owner (a pool worker, a DataLoader worker) closes its copy of the
  lock: a lock inherited that way outlived its owner (kill -9 of a prepare left it held by a worker).
* On S3 (``data prepare --out s3://``) the lock is an object created with a conditional write (If-None-Match),
  deleted at the end. An object left by a process that died on this host is taken over; one from another host is
  named with the command that removes it. Other stores have no conditional write: the work says so and goes on.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hftrain.errors import HftrainError

LOCK_FILE = ".hftrain.lock"
WRITERS_FILE = ".hftrain.writers"  # a shared flock per process that joined a launch's lock
LOCK_FILES = (LOCK_FILE, WRITERS_FILE)  # what the lock leaves in a directory (not the work's own files)
RUN_TOKEN_ENV = "HFTRAIN_RUN_TOKEN"
RECORD_WAIT_S = 5.0  # how long a holder may take to say who it is after taking the lock

_held: dict[str, list[Any]] = {}  # where -> [lock, how many holders in this process]
EARLIER_WRITERS = (
    " (its launcher has ended, but processes it started still write there: they stop at their next step, or end them)"
)


def _forget_in_child() -> None:
    """A forked child owns nothing: its copies of the locks close (see the module docstring)."""
    for lock, _ in _held.values():
        if isinstance(lock, FileLock):
            lock.forget()
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def run_token() -> str:
    """The identity every process of one launch shares (see the module docstring)."""
    token = os.environ.get(RUN_TOKEN_ENV)
    if token:
        return token
    job, elastic = os.environ.get("SLURM_JOB_ID"), os.environ.get("TORCHELASTIC_RUN_ID")
    if job:
        return f"slurm-{job}"
    if elastic and os.environ.get("MASTER_ADDR"):
        return f"torchrun-{elastic}@{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '')}"
    return _own_token


_own_token = uuid.uuid4().hex  # this process's, when no launcher gave one


@contextmanager
def owning(where: str | Path, key: str, storage_options: dict[str, Any] | None = None) -> Iterator[None]:
    """Own `where` (a directory path or URL; `key` names it in messages, e.g. training.output_dir) for the block:
    refused with the holder's name if another launch owns it; re-entrant within a process. While it is held, the
    processes this one starts inherit its run token (and so join instead of being refused)."""
    name = str(where) if "://" in str(where) else str(Path(where).resolve())
    if name in _held:
        _held[name][1] += 1
    else:
        lock: Any = (
            S3Lock(name, key, storage_options or {})
            if name.startswith("s3://")
            else (
                FileLock(Path(str(where).removeprefix("file://")), key)
                if "://" not in name or name.startswith("file://")
                else None
            )
        )
        if lock is None:
            print(
                f"hftrain: note: {key} {name}: this store offers no lock; make sure no other hftrain writes there now.",
                flush=True,
            )
        else:
            lock.acquire()
        _held[name] = [lock, 1]
    inherited = os.environ.get(RUN_TOKEN_ENV)
    os.environ[RUN_TOKEN_ENV] = run_token()
    try:
        yield
    finally:
        if inherited is None:
            os.environ.pop(RUN_TOKEN_ENV, None)
        _held[name][1] -= 1
        if _held[name][1] == 0:
            lock = _held.pop(name)[0]
            if lock is not None:
                lock.release()


def holder_record() -> dict[str, Any]:
    """What a lock says about its holder: the command without its key=value words (they may carry secrets)."""
    program = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    program = "hftrain" if program.endswith(("hftrain", "__main__.py")) else Path(program).name
    words = [w for w in sys.argv[1:4] if "=" not in w and not w.startswith("-")]
    return {
        "token": run_token(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": " ".join([program, *words]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def _in_use(key: str, where: str, holder: dict[str, Any] | None, remedy: str = "") -> HftrainError:
    who = (
        f"pid {holder.get('pid')} on {holder.get('host')} (`{holder.get('command')}`, started {holder.get('started')})"
        if holder
        else "a process that did not say who it is"
    )
    return HftrainError(
        f"{key}: {where} is in use by another hftrain process: {who}. Two at once would mix their files. Wait for it "
        f"to finish or stop it{remedy}, or give {key} another directory."
    )


def _dead_here(holder: dict[str, Any]) -> bool:
    """The holder ran on this host and has ended (its record is stale)."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, KeyError, ValueError, TypeError):
        return False
    return False


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data.decode("utf-8"))
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("token") else None


def writable_directory(root: Path, key: str = "training.output_dir") -> None:
    """`root` exists (created here) as a directory this process can write, or the message saying why not."""
    if root.exists() and not root.is_dir():
        raise HftrainError(f"{key}: {root} is a file, not a directory. Set {key} to a directory path.")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".hftrain-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise HftrainError(
            f"{key}: cannot write to {root} ({err.strerror or err}). "
            "Give a directory on a writable file system where you have write permission."
        ) from None


class FileLock:
    """An flock on DIR/.hftrain.lock (the directory is created); see the module docstring."""

    def __init__(self, directory: Path, key: str):
        self.directory, self.key, self.fd, self.joined = directory, key, None, False

    def acquire(self) -> None:
        import fcntl

        path = self.directory / LOCK_FILE
        self.created = not self.directory.exists()
        writable_directory(self.directory, self.key)
        try:
            deadline = time.monotonic() + RECORD_WAIT_S
            while True:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    holder = _parse(path.read_bytes()) if path.exists() else None
                    if holder is not None and holder["token"] == run_token():
                        self.fd, self.joined = self._writer(fcntl.LOCK_SH), True  # the same launch holds it: join
                        return
                    if (holder is not None and not _dead_here(holder)) or time.monotonic() > deadline:
                        raise _in_use(self.key, str(self.directory), holder) from None
                    time.sleep(0.05)  # the new holder is still writing its record
                    continue
                except OSError as err:  # a file system without locks (some network mounts)
                    os.close(fd)
                    print(
                        f"hftrain: note: {self.key} {self.directory}: cannot be locked here ({err.strerror}); "
                        "make sure no other hftrain writes there now.",
                        flush=True,
                    )
                    return
                if not path.exists() or os.stat(path).st_ino != os.fstat(fd).st_ino:
                    os.close(fd)  # locked a file its holder had just removed: try the one there now
                    continue
                still = self._writer(fcntl.LOCK_EX)  # an earlier launch's processes, their launcher gone
                if still is None:
                    os.close(fd)
                    raise _in_use(self.key, str(self.directory), _parse(path.read_bytes()), EARLIER_WRITERS)
                os.close(still)
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(holder_record()).encode("utf-8"), 0)
                self.fd = fd
                return
        except OSError as err:
            raise HftrainError(
                f"{self.key}: cannot lock {path} ({err.strerror or err}). Give a directory you can write."
            ) from None

    def _writer(self, how: int) -> int | None:
        """A descriptor of the writers' file flocked `how` (shared: this process writes, the file made where it
        is not; exclusive: nobody else does, the file, if any, only looked at), or None where another process
        holds it the other way."""
        import fcntl

        exclusive = how == fcntl.LOCK_EX
        try:
            fd = os.open(self.directory / WRITERS_FILE, os.O_RDWR | (0 if exclusive else os.O_CREAT), 0o644)
        except FileNotFoundError:  # no process ever joined here: nobody writes
            return os.open(os.devnull, os.O_RDONLY)
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:  # a file system without locks: the main lock said what it could
            return fd
        return fd

    def forget(self) -> None:
        """In a forked child: close this process's copy, leaving the lock to the processes that own it."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def release(self) -> None:
        """Say no one holds it; a directory this lock created and nothing else wrote into goes again (a refused
        or failed start leaves no trace)."""
        if self.fd is None:
            return
        if self.joined:
            os.close(self.fd)  # a joiner's shared writers' lock
            self.fd = None
            return
        os.ftruncate(self.fd, 0)
        alone = self.created and sorted(p.name for p in self.directory.iterdir()) in (
            [LOCK_FILE],
            [LOCK_FILE, WRITERS_FILE],
        )
        if alone:
            (self.directory / WRITERS_FILE).unlink(missing_ok=True)
            (self.directory / LOCK_FILE).unlink()  # while still locked: a newcomer retries on the path (acquire)
        os.close(self.fd)  # drops the flock
        self.fd = None
        if alone:
            try:
                self.directory.rmdir()
            except OSError:
                pass  # someone started writing there meanwhile


class S3Lock:
    """A lock object under an s3:// prefix, created only if absent (If-None-Match: *); see the module docstring."""

    def __init__(self, url: str, key: str, storage_options: dict[str, Any]):
        import fsspec

        self.url, self.key = url.rstrip("/"), key
        self.fs, root = fsspec.core.url_to_fs(self.url, **storage_options)
        self.bucket, _, prefix = root.partition("/")
        self.object = f"{prefix}/{LOCK_FILE}" if prefix else LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        for _ in range(3):
            try:
                self.fs.call_s3(
                    "put_object",
                    Bucket=self.bucket,
                    Key=self.object,
                    IfNoneMatch="*",
                    Body=json.dumps(holder_record()).encode("utf-8"),
                )
                self.held = True
                return
            except FileExistsError:  # s3fs's word for 412 PreconditionFailed: the object is there
                pass
            holder = self._holder()
            if holder is not None and holder["token"] == run_token():
                return
            if holder is None:
                continue  # released meanwhile
            if not _dead_here(holder):
                raise _in_use(self.key, self.url, holder, f" (if it is gone, delete {self.url}/{LOCK_FILE})")
            self.fs.rm_file(f"{self.bucket}/{self.object}")  # its holder died on this host: take over
        raise _in_use(self.key, self.url, self._holder())

    def _holder(self) -> dict[str, Any] | None:
        try:
            return _parse(self.fs.cat_file(f"{self.bucket}/{self.object}"))
        except FileNotFoundError:
            return None

    def release(self) -> None:
        if self.held:
            self.fs.rm_file(f"{self.bucket}/{self.object}")
            self.held = False
