"""The notebooks run top to bottom in a Jupyter kernel, and their own checks hold.

Each notebook ends its cells with ``assert``s on what it shows (the formula against
the paper's figures, measured against predicted), so a notebook that stops matching
the code fails here. Notebooks are committed without outputs."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# what each notebook must print: the one memory model's tables (estimate_memory with tx,
# plan_model's plan, the GPT step's predicted and compiled peaks)
PRINTS = {"memory_model": ("adafactor, fp32", "recommendation: "),
          "zero_stages": ("estimate_memory", "compiled / predicted")}


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"memory_model.ipynb", "zero_stages.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{path.name}: clear outputs before committing (jupyter nbconvert "
                "--clear-output --inplace)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    # The kernel inherits this process's environment: 8 simulated CPU devices
    # (conftest.py). Plots go through the kernel's inline backend, as in Jupyter.
    NotebookClient(nb, timeout=300, kernel_name="python3").execute(cwd=str(ROOT))
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot was drawn"
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    for text in PRINTS.get(path.stem, ()):
        assert text in printed, f"{path.name} no longer prints {text!r}"
