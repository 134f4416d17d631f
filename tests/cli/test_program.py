"""`hftrain` as a program (cli/__init__.py `program`): the installed console script, and how it exits."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..support.cli import ROOT


def test_console_script_is_installed_and_exits_without_collecting_the_heap(capsys):
    """Every way hftrain runs as a program goes through `program`, which freezes the heap for the collector once
    the command is done (the interpreter's exit then skips a full collection of torch's and transformers' objects:
    2-2.5 s per process on 2 cores); `main`, which notebooks and tests call, leaves the collector alone."""
    import gc

    from hftrain.cli import main, program
    from hftrain.launch.sagemaker import ENTRY

    script = Path(sys.executable).parent / "hftrain"
    assert script.is_file() and os.access(script, os.X_OK)
    assert "from hftrain.cli import program" in script.read_text()  # pyproject's console script
    assert "sys.exit(program())" in (ROOT / "hftrain" / "__main__.py").read_text()  # python -m hftrain, every rank
    assert "sys.exit(program([" in ENTRY  # SageMaker's processes
    gc.unfreeze()
    assert main(["presets"]) == 0 and gc.get_freeze_count() == 0
    try:
        assert program(["presets"]) == 0 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this test process goes on collecting
    assert "pythia-160m" in capsys.readouterr().out
