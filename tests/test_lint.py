"""The code base stays ruff-clean (rules in pyproject.toml)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "zerojax", "tests", "examples",
                          "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
