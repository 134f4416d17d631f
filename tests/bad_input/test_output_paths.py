"""A path a user names as output is written only as a new regular file (or, with --force, in place of a regular
file by one rename); whatever else is there is refused, and nothing hftrain did not write changes content or mode.

Before (issue 63, class 5): `hftrain launch-script ... --out PATH` wrote through an existing file and made it mode
755 (with --out /dev/null, run as root, the system's /dev/null became 755 and every other user's writes to it
failed); `report --out` and `eval --json` wrote through whatever was there (a FIFO: a hang)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hftrain.checkpoint.files import write_new_file
from hftrain.errors import HftrainError

from ..support.cli import in_process


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _commands(work: Path) -> dict[str, list[str]]:
    """Each command that writes a file where the user points, with its flag last (the path follows)."""
    run = work / "a-run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n', encoding="utf-8")
    return {
        "launch-script": ["launch-script", str(work / "r.yaml"), "--kind", "torchrun", "--out"],
        "report": ["report", str(run), "--out"],
    }


def _existing(kind: str, path: Path) -> None:
    """Put `kind` at `path`: what a user's --out may name."""
    if kind == "a file":
        path.write_text("mine\n", encoding="utf-8")
        path.chmod(0o600)
    elif kind == "a FIFO":  # writing through it would wait for a reader forever
        os.mkfifo(path, 0o600)
    elif kind == "a link":
        (path.parent / "target.txt").write_text("mine\n", encoding="utf-8")
        (path.parent / "target.txt").chmod(0o600)
        path.symlink_to(path.parent / "target.txt")
    elif kind == "a directory":
        path.mkdir(mode=0o700)


REFUSED = [
    ("a file", "exists; give a new file name, or add --force to replace it."),
    ("a FIFO", "exists and is not a regular file; give the name of a new file."),
    ("a link", "exists and is a link; give the name of a new file."),
    ("a directory", "exists and is a directory; give the name of a new file."),
]


@pytest.mark.parametrize("command", ["launch-script", "report"])
@pytest.mark.parametrize("kind, said", REFUSED, ids=[k for k, _ in REFUSED])
def test_what_exists_where_a_command_writes_is_refused_and_left_as_it_was(capsys, work, command, kind, said):
    out = work / "out"
    _existing(kind, out)
    before = {p: (_mode(p), p.read_bytes() if p.is_file() and not p.is_symlink() else None) for p in work.glob("*t*")}
    code, printed = in_process(capsys, *_commands(work)[command], str(out))
    assert code == 2 and f"--out {out}: {said}" in printed and "Traceback" not in printed, printed[-2000:]
    after = {p: (_mode(p), p.read_bytes() if p.is_file() and not p.is_symlink() else None) for p in work.glob("*t*")}
    assert after == before  # content and mode of what was there (and a link's target)
    assert not list(work.glob(".out.hftrain-*"))  # nothing staged is left behind


@pytest.mark.parametrize("command", ["launch-script", "report"])
def test_a_new_file_is_written_and_force_replaces_a_file_without_touching_its_inode(capsys, work, command):
    out = work / "out"
    code, printed = in_process(capsys, *_commands(work)[command], str(out))
    assert code == 0 and out.is_file(), printed[-2000:]
    umask = os.umask(0)
    os.umask(umask)
    assert _mode(out) == (0o777 if command == "launch-script" else 0o666) & ~umask  # a script is executable
    out.unlink()
    _existing("a file", out)
    os.link(out, work / "other-link")  # the old file under another name: it keeps its content and mode
    code, printed = in_process(capsys, *_commands(work)[command], str(out), "--force")
    assert code == 0 and out.read_text(encoding="utf-8") != "mine\n", printed[-2000:]
    assert (work / "other-link").read_text(encoding="utf-8") == "mine\n" and _mode(work / "other-link") == 0o600


def test_write_new_file_never_writes_through_a_device(tmp_path):
    """/dev/null itself (a character device) is refused, whatever the rights of the process: its mode is never
    changed (as root, chmod 755 of it broke every other user's writes to it; apt-get update failed)."""
    before = _mode(Path("/dev/null"))
    for replace in (False, True):
        with pytest.raises(HftrainError, match="/dev/null: exists and is not a regular file"):
            write_new_file(Path("/dev/null"), "#!/bin/sh\n", "--out", replace=replace, executable=True)
    assert _mode(Path("/dev/null")) == before
    with pytest.raises(HftrainError, match="its folder .* does not exist"):
        write_new_file(tmp_path / "no" / "such" / "x.sh", "", "--out")
