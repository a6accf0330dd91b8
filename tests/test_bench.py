"""zerojax bench: the side-by-side table from one small run, its arguments, FSDP specs."""

import re

import pytest
from jax.sharding import PartitionSpec as P

from zerojax.cli import bench

SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "8", "--vocab", "32",
         "--batch", "16", "--steps", "1", "--warmup", "1"]


@pytest.fixture(scope="module")
def table():
    import contextlib
    import io

    from zerojax.cli import main as zerojax_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # through the console script's entry point
        assert zerojax_main(["bench", *SMALL]) == 0
    text = out.getvalue()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("run",):
            rows[cells[0]] = cells[1:]
    return text, rows


def test_one_table_with_every_run(table):
    text, rows = table
    assert list(rows) == ["optax, 1 device", "jit DP", "FSDP (MaxText-style)",
                          "zerojax stage 0", "zerojax stage 1", "zerojax stage 2",
                          "zerojax stage 3"]
    psi = int(re.search(r"Psi = ([\d,]+)", text).group(1).replace(",", ""))
    assert psi > 10_000
    assert rows["jit DP"][1] == "1.00" and rows["jit DP"][3] == "1.00"


def test_communication_is_the_papers(table):
    _, rows = table
    comm = {name: float(cells[5]) for name, cells in rows.items()}
    assert comm["optax, 1 device"] == 0.0
    for stage in (0, 1, 2):
        assert comm[f"zerojax stage {stage}"] == pytest.approx(2.0, abs=0.01)
    assert comm["zerojax stage 3"] == pytest.approx(3.0, abs=0.02)
    assert comm["jit DP"] == pytest.approx(2.0, abs=0.1)  # + the loss's small all-reduces
    assert comm["FSDP (MaxText-style)"] >= 3.0  # gathers twice, reduces once (or more)


def test_memory_falls_with_the_stage(table):
    _, rows = table
    peak = {name: float(cells[2]) for name, cells in rows.items()}
    state = {name: float(cells[4]) for name, cells in rows.items()}
    z = [peak[f"zerojax stage {s}"] for s in range(4)]
    assert z[0] > z[1] > z[3] and z[2] <= z[1]
    assert state["zerojax stage 0"] == state["jit DP"] == state["optax, 1 device"]
    # stage 3 and FSDP hold 1/8 of params and Adam's moments (small leaves padded)
    assert state["zerojax stage 3"] == pytest.approx(state["zerojax stage 0"] / 8, rel=0.05)
    assert state["FSDP (MaxText-style)"] < state["zerojax stage 0"] / 4


def test_every_run_trains_like_one_device(table):
    _, rows = table
    for name, cells in rows.items():
        if name != "optax, 1 device":
            # two Adam steps: rounding-noise sign flips of zero gradients (the key bias)
            assert float(cells[6]) < 1e-2, (name, cells[6])  # measured 1e-3


def test_bad_arguments_exit_2(capsys):
    for argv, message in [(["--batch", "12"], "multiple of --devices"),
                          (["--hidden", "30", "--heads", "4"], "multiple of --heads"),
                          (["--steps", "0"], "argument --steps: '0' must be >= 1"),
                          (["--stages", "4"], "'4' is not a ZeRO stage"),
                          (["--sttep", "2"], "did you mean --steps?"),
                          (["--warmup", "-1"], "'-1' is negative")]:
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_fsdp_spec_is_maxtext_like():
    assert bench.fsdp_spec((4, 256, 768), 8, embed=256) == P(None, "data")
    assert bench.fsdp_spec((4, 1024, 256), 8, embed=256) == P(None, None, "data")
    assert bench.fsdp_spec((100, 24), 8, embed=64) == P(None, "data")  # largest divisible
    assert bench.fsdp_spec((7, 3), 8, embed=7) == P()                   # replicated
