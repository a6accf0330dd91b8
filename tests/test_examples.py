"""The notebook and the demo run as shipped."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_notebook_runs_and_stages_agree(capsys):
    nb = json.loads((ROOT / "notebooks" / "zero_stages.ipynb").read_text())
    scope: dict = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "zero_stages.ipynb", "exec"), scope)
    rows = scope["rows"]
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    losses = [r[1] for r in rows]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    for _, _, held, formula, _, _ in rows:
        assert abs(held / formula - 1) < 0.02
    assert "Psi" in capsys.readouterr().out


def test_demo_runs_one_stage():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--stage", "3", "--steps", "5",
         "--width", "64", "--layers", "2", "--batch", "32"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stage 3" in out.stdout
