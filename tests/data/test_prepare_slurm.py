"""Issue 63, class 1 on SLURM: `data prepare --executor slurm` submits and returns (the jobs are SLURM's, made to
outlive the command), so what a second launch must not do is write the folder beside an earlier launch's jobs. Each
answer of SLURM's queue, given by stand-in clients on PATH, gets its outcome; tests/launch/test_slurm.py runs the
same against a real SLURM, a launch killed half-way included."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hftrain.data.prepare_slurm import check_no_jobs, jobs_name
from hftrain.errors import HftrainError

CASES = {  # squeue's lines (%A %i %T %r), its exit code -> the refusal's text or None (goes on), what was cancelled
    "an empty queue": ("", 0, None, ""),
    "the array running": (
        "42 42 PENDING Dependency\n41 41_[2-3] PENDING Resources\n41 41_0 RUNNING None\n",
        0,
        "job(s) 41_[2-3] (pending), 41_0 (running), 42 (pending) of an earlier",
        "",
    ),
    "the finisher about to start": ("43 43 PENDING Dependency\n", 0, "job(s) 43 (pending) of an earlier", ""),
    "jobs that can never start": (
        "44 44 PENDING DependencyNeverSatisfied\n43 43 PENDING DependencyNeverSatisfied\n",
        0,
        None,
        "43 44\n",
    ),
    "the controller down": ("", 1, "squeue failed (slurm_load_jobs error: Unable to contact slurm controller)", ""),
}


def _clients(folder: Path, out: str, rc: int) -> None:
    folder.mkdir()
    squeue = folder / "squeue"
    squeue.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {folder}/squeue.args\n'
        f"printf '%s' '{out}'\n"
        + ("echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2\n" if rc else "")
        + f"exit {rc}\n"
    )
    scancel = folder / "scancel"
    scancel.write_text(f'#!/bin/sh\necho "$@" >> {folder}/cancelled\n')
    for client in (squeue, scancel):
        client.chmod(client.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("case", list(CASES))
def test_a_prepare_beside_an_earlier_launchs_jobs_is_refused_before_anything_is_written(
    case, tmp_path, monkeypatch, capsys
):
    lines, rc, refused, cancelled = CASES[case]
    _clients(tmp_path / "bin", lines, rc)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "folder"
    name = jobs_name(str(out))
    if refused is None:
        check_no_jobs(str(out))
    else:
        with pytest.raises(HftrainError) as error:
            check_no_jobs(str(out))
        message = str(error.value)
        assert refused in message and "\n" not in message, message
        if rc == 0:
            assert f"(`scancel {' '.join(sorted(set(lines.split()[::4])))}`)" in message, message
    assert f"--name={name},{name}-finish" in (tmp_path / "bin" / "squeue.args").read_text()
    said = (tmp_path / "bin" / "cancelled").read_text() if (tmp_path / "bin" / "cancelled").exists() else ""
    assert said == cancelled
    assert ("hftrain: cancelled job(s) 43, 44 (" in capsys.readouterr().out) is bool(cancelled)
    assert not out.exists()


def test_a_folder_has_one_job_name_however_it_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert jobs_name("folder") == jobs_name(str(tmp_path / "folder")) == jobs_name(f"file://{tmp_path}/folder")
    assert jobs_name("folder") != jobs_name("other") and jobs_name("s3://b/folder") != jobs_name("folder")
    assert jobs_name("folder").startswith("hftrain-prepare-")


def test_no_squeue_is_the_login_node_message(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        HftrainError, match=r"^--executor slurm: squeue is not on PATH here; run the prepare on a SLURM"
    ):
        check_no_jobs(str(tmp_path / "folder"))
