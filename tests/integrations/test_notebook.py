"""The notebook API: the shipped notebook runs top to bottom (nbclient), and multi-process training from a cell."""

from __future__ import annotations

import json
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from hftrain.checkpoint.layout import RunLayout

from ..support.cli import ROOT
from ..support.data import tiny_recipe


@pytest.mark.slow
def test_finetune_lora_notebook_runs_top_to_bottom(tmp_path, docs_model):
    """As a user runs it after the quickstart: the quickstart's model is where the notebook looks for its base (the
    session's short quickstart model; the notebook's own fallback, 150 quickstart steps through the same API, is
    what every quickstart test trains)."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    (tmp_path / "runs" / "quickstart" / "final").symlink_to(docs_model)
    (tmp_path / "notebooks").mkdir()
    source = ROOT / "notebooks" / "finetune_lora.ipynb"
    nb = nbformat.read(source, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code")  # outputs stripped in the repo
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path / "notebooks")}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "run.plot() shows the curves inline"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "before:" in text and "after: " in text and "held-out loss by step:" in text
    evals = json.loads(RunLayout(tmp_path / "runs" / "notebook-lora").results.read_text())
    assert evals["step"] == 60
    assert (tmp_path / "runs" / "notebook-export" / "model.safetensors").is_file()


def test_errors_in_a_notebook_are_one_line():
    from IPython.core.interactiveshell import InteractiveShell

    import hftrain
    from hftrain.integrations.notebook import show_errors_plainly

    shell = InteractiveShell.instance()
    show_errors_plainly()
    result = shell.run_cell("import hftrain; hftrain.load_recipe(None, {'training': {'learnig_rate': 1}})")
    assert isinstance(result.error_in_exec, hftrain.HftrainError)
    InteractiveShell.clear_instance()


@pytest.mark.slow
def test_notebook_launcher_trains_on_two_processes(tmp_path, corpus):
    raw = tiny_recipe(corpus, tmp_path / "run", max_steps=6, save_steps=6)
    script = (
        "import hftrain, hftrain.integrations.notebook, json\n"
        f"recipe = hftrain.load_recipe(None, {raw!r})\n"
        "print('final:', hftrain.integrations.notebook.launch(recipe, num_processes=2))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(RunLayout(tmp_path / "run").results.read_text())
    assert (info["distributed_type"], info["world_size"]) == ("MULTI_CPU", 2)
