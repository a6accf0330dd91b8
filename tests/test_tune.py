"""``zerojax tune`` on 8 CPU devices (issue 32): every row it prints was measured (its
peak is the compiled step's memory_analysis peak for that configuration, its tokens/s
comes from the clock readings around the timed steps), and it recommends the row with
the best measured tokens/s. Bad input exits 2 with one line."""

from __future__ import annotations

import jax
import optax
import pytest

import zerojax
from zerojax.analysis import compiled_memory
from zerojax.cli import tune as tune_mod
from zerojax.cli.command import build_parser, main
from zerojax.models import GPT, GPTConfig, lm_loss

TINY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "16", "--vocab", "64",
        "--batch", "16", "--no-progress"]
STEPS = 2
# seconds each timed step of the i-th measured row lasts on the injected clock: the
# second row (stage 2) is the fastest, so neither the first row nor the last wins
DURATIONS = (0.30, 0.10, 0.20)


def _args(extra):
    args = build_parser().parse_args(["tune", *TINY, *extra])
    tune_mod.check_arguments(args)
    return args


class FakeClock:
    """Two readings per timed step (before and after): row i's steps last
    DURATIONS[i]; records every reading."""

    def __init__(self):
        self.t, self.calls = 100.0, 0

    def __call__(self):
        row = self.calls // (2 * STEPS)
        if self.calls % 2:
            self.t += DURATIONS[row]
        self.calls += 1
        return self.t


@pytest.fixture(scope="module")
def tuned():
    args = _args(["--stages", "0,2,3", "--steps", str(STEPS), "--accum", "1"])
    clock = FakeClock()
    return args, tune_mod.tune(args, clock=clock), clock


def test_every_row_measured_peak_is_the_compiled_steps(tuned):
    args, res, _ = tuned
    assert [r.label for r in res.rows] == ["stage 0", "stage 2", "stage 3"]
    mesh = zerojax.make_mesh(data=8)
    model = GPT(GPTConfig(vocab=64, seq=16, layers=1, hidden=16, heads=2, attention="xla"))
    tokens = jax.numpy.zeros((16, 16), jax.numpy.int32)

    def init_fn(key):
        return model.init(key, tokens[:1])["params"]

    for r in res.rows:
        opt = zerojax.zero(optax.adamw(1e-3), mesh, **r.options)
        state = opt.init_sharded(init_fn, jax.random.key(0))
        compiled = opt.train_step(lm_loss(model)).lower(state, tokens).compile()
        assert r.peak == compiled_memory(compiled).peak, r.label
        assert r.predicted_peak > 0 and r.predicted_step_time > 0
    # the stages' measured peaks differ: each row compiled its own configuration
    assert len({r.peak for r in res.rows}) == 3


def test_tokens_per_s_from_timed_steps_and_recommendation(tuned):
    args, res, clock = tuned
    assert clock.calls == 2 * STEPS * len(res.rows)  # warm-up steps are not timed
    for r, d in zip(res.rows, DURATIONS):
        assert r.step_times == pytest.approx([d] * STEPS)
        assert r.tokens_per_step == 16 * 16
        assert r.tokens_per_s == pytest.approx(16 * 16 / d)
    best = max(res.rows, key=lambda r: r.tokens_per_s)
    assert res.recommendation is best and best.label == "stage 2"
    text = tune_mod.format_result(res, args)
    assert "* stage 2" in text and "recommendation: stage 2:" in text
    assert "predicted step: the planner's time model for cpu x 8 (measured)" in text
    assert f"{16 * 16 / 0.10:,.0f}" in text


def test_cli_real_clock(capsys):
    assert main(["tune", *TINY, "--stages", "3", "--accum", "1,2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if "stage 3" in ln and "MiB" in ln
            and not ln.startswith("recommendation")]
    assert len(rows) == 2, out
    speeds = [float(ln.split()[-1].replace(",", "")) for ln in rows]
    best = rows[speeds.index(max(speeds))]
    assert best.startswith("* "), out
    assert "recommendation: " + best[2:].split("  ")[0].strip() + ":" in out


def test_nothing_fits_is_not_measured(capsys):
    assert main(["tune", *TINY, "--stages", "2,3", "--memory", "1KB"]) == 1
    out = capsys.readouterr().out
    assert out.count("not measured: stage") == 2 and "recommendation: none" in out


@pytest.mark.parametrize("extra, needle", [
    (["--stages", "4"], "stage 4"),
    (["--stages", "x"], "--stages 'x'"),
    (["--steps", "0"], "--steps"),
    (["--steps", "-2"], "--steps"),
    (["--devices", "6", "--mp", "4"], "--devices 6"),
    (["--batch", "12"], "--batch 12"),
    (["--remat-policies", "fast"], "'fast'"),
    (["--bucket-sizes", "1e6"], "--bucket-sizes"),
    (["--accum", "3"], "--batch 16"),
    (["--accelerator", "tpu9"], "'tpu9'"),
])
def test_bad_input_exits_2_with_one_line(extra, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", *TINY, *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err
