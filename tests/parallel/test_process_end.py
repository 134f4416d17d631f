"""A launched process of a multi-process run ends after its exit handlers without tearing down its process group
(parallel/process_end.py: gloo's teardown can deadlock with the GIL held); any other process ends as usual."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from ..support.cli import ROOT

SCRIPT = """
import atexit, sys
import torch.distributed as dist
from hftrain.cli import program

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)

class Witness:
    def __del__(self):
        print("finalized", flush=True)  # interpreter finalization ran: it would destroy the process group too

witness = Witness()
code = program({argv!r})
atexit.register(lambda: print("a later exit handler ran", flush=True))
sys.exit(code)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("launched", [True, False])
def test_a_launched_process_runs_its_exit_handlers_then_ends_without_teardown(launched):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    if launched:
        env["LOCAL_RANK"] = "0"  # as torchrun starts each process
    said = {}
    for argv, code in ((["presets"], 0), (["train", "no/such/recipe.yaml"], 2))[: 2 if launched else 1]:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT.format(port=free_port(), argv=argv)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=env,
        )
        assert done.returncode == code, done.stderr[-2000:]  # the program's own exit code either way
        assert "a later exit handler ran" in done.stdout  # exit handlers (trackers, TensorBoard) still run
        said[code] = "finalized" in done.stdout
    assert said == ({0: False, 2: False} if launched else {0: True})  # launched: no teardown at all
