"""A real SLURM on this machine for tests: munge, slurmctld and slurmd (Debian's slurm-wlm, installed by
scripts/install_test_deps.sh) with a configuration written into a temporary directory; see
../shared/notes/slurm-local.md. Runs as root (SlurmUser=root), with no cgroups and no accounting (so job states
are read with `scontrol show job`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CONF = """ClusterName=hftraintest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/ctld.log
SlurmdLogFile={root}/log/d-%n.log
SlurmctldPort={ctld_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AuthType=auth/munge
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
JobRequeue=1
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]

    def run(self, *cmd: str) -> str:
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{' '.join(cmd)}: {result.stderr}"
        return result.stdout

    def sbatch(self, script: Path, cwd: Path) -> str:
        result = subprocess.run(
            ["sbatch", "--parsable", str(script)], cwd=cwd, env=self.env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Reason, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", job_id)
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    def stop(self) -> None:
        for pid in [*self.root.glob("slurmd-*.pid"), self.root / "slurmctld.pid"]:
            if pid.is_file():
                try:
                    os.kill(int(pid.read_text().strip()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
        spool = self.root / "spool"
        if spool.is_file():
            shutil.rmtree(spool.read_text(), ignore_errors=True)


def start_slurm(root: Path, agents: int = 0) -> Slurm:
    """munged (if not running), slurmctld and slurmd on this machine; waits until every node is idle. agents=0: one
    node named as this host with its cores; agents=N: N node agents (slurmd -N agentK, each its own port, 1 CPU),
    the way a cluster's nodes are N machines."""
    assert os.geteuid() == 0, "the SLURM test runs its daemons as root (SlurmUser=root)"
    for tool in ("munged", "slurmctld", "slurmd", "sbatch"):
        assert subprocess.run(["which", tool], capture_output=True).returncode == 0, (
            f"{tool} is missing: run scripts/install_test_deps.sh"
        )
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode != 0:
        for d in ("/etc/munge", "/run/munge", "/var/log/munge", "/var/lib/munge"):
            os.makedirs(d, exist_ok=True)
        key = Path("/etc/munge/munge.key")
        if not key.is_file():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(
            ["chown", "-R", "munge:munge", "/etc/munge", "/run/munge", "/var/log/munge", "/var/lib/munge"], check=True
        )
        subprocess.run(["munged", "--force"], check=True, capture_output=True)
    host = socket.gethostname().split(".")[0]
    names = [f"agent{k}" for k in range(1, agents + 1)] or [host]
    # slurmd's job sockets live in the spool dir, and a Unix socket path holds at most 108 bytes: a test's own
    # tmp_path under an xdist worker (popen-gw1/test_.../) was too long, and every batch job failed to launch
    spool = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "spool").write_text(str(spool))
    for sub in ("state", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for name in names:
        (spool / name).mkdir()
    if agents:
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 "
            f"Port={_free_port()} CPUs=1 RealMemory=4000 State=UNKNOWN"
            for n in names
        )
    else:
        nodes = f"NodeName={host} CPUs={os.cpu_count() or 2} RealMemory=4000 Port={_free_port()} State=UNKNOWN"
    conf = root / "slurm.conf"
    conf.write_text(
        CONF.format(host=host, root=root, spool=spool, ctld_port=_free_port(), nodes=nodes, names=",".join(names))
    )
    slurm = Slurm(root, {**os.environ, "SLURM_CONF": str(conf)})
    subprocess.run(["slurmctld", "-f", str(conf)], env=slurm.env, check=True)
    for name in names:
        subprocess.run(["slurmd", "-f", str(conf), *(["-N", name] if agents else [])], env=slurm.env, check=True)
    deadline = time.monotonic() + 60

    def idle() -> bool:
        states = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], env=slurm.env, capture_output=True, text=True
        ).stdout.split()
        return len(states) == len(names) and all(s == "idle" for s in states)

    while not idle():
        if time.monotonic() > deadline:
            slurm.stop()
            raise AssertionError(f"the SLURM node never became idle; see {root / 'log'}")
        time.sleep(0.5)
    return slurm
