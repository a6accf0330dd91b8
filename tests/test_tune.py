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
    rows = [ln for ln in out.splitlines() if ln.startswith(("* stage 3", "  stage 3"))]
    assert len(rows) == 2, out
    speeds = [float(ln.split()[-1].replace(",", "")) for ln in rows]
    best = rows[speeds.index(max(speeds))]
    assert best.startswith("* "), out
    assert "recommendation: " + best[2:].split("  ")[0].strip() + ":" in out


def test_nothing_fits_is_not_measured(capsys):
    assert main(["tune", *TINY, "--stages", "2,3", "--memory", "1KB",
                 "--runtime-reserve", "0"]) == 1
    out = capsys.readouterr().out
    assert out.count("not measured: stage") == 2 and "recommendation: none" in out


@pytest.mark.parametrize("extra, needle", [
    (["--stages", "4"], "argument --stages: '4' is not a ZeRO stage"),
    (["--stages", "x"], "argument --stages: 'x' is not a ZeRO stage"),
    (["--stages", "0", "1,9"], "'9' is not a ZeRO stage"),
    (["--warmup", "-1"], "'-1' is negative"),
    # --memory is the card (x 0.75 - the 1 GB runtime reserve), as in plan and train
    (["--memory", "1GB"], "--memory 1.00 GB: JAX gets 0.75 GB of it, less than the 1.00 GB "
                          "runtime reserve"),
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


def test_candidates_are_measured_once_each():
    """--stages 3,3 --accum 1,1: one stage-3 configuration, not the same one twice."""
    args = _args(["--stages", "3,3,2", "--accum", "1,1", "--remat-policies", "dots,dots"])
    assert [c.label for c in tune_mod.candidates(args)] == ["stage 3, remat dots",
                                                            "stage 2, remat dots"]


def test_a_winner_within_the_noise_is_said_to_be_one():
    """The spread of each row's timed steps is printed; a recommendation whose mean step
    time is within the 2-standard-error intervals of another row's says so, naming it;
    one clearly faster does not."""
    def row(label, times):
        return tune_mod.TuneRow(label, {}, 2**20, 0.05, 2**20, times, 256)

    args = _args(["--steps", "4"])

    def text(a, b):
        rows = [row("stage 0", a), row("stage 2", b)]
        best = max(rows, key=lambda r: r.tokens_per_s)
        return tune_mod.format_result(tune_mod.TuneResult(rows, [], 2**30, "x", best,
                                                          "predicted: test"), args)

    noisy = text([0.10, 0.12, 0.08, 0.10], [0.11, 0.09, 0.13, 0.11])
    assert "recommendation: stage 0:" in noisy
    assert "within the noise of it" in noisy and "stage 2 (" in noisy, noisy
    clear = text([0.100, 0.101, 0.099, 0.100], [0.200, 0.201, 0.199, 0.200])
    assert "recommendation: stage 0:" in clear and "within the noise" not in clear, clear
    assert "+/- (ms)" in clear and "measured / predicted step: 2.00-4.00x" in clear, clear
    rows = [row("stage 0", [0.1, 0.1])]  # one ratio: one figure, not "2.00-2.00x"
    one = tune_mod.format_result(tune_mod.TuneResult(rows, [], 2**30, "x", rows[0], "p"), args)
    assert "measured / predicted step: 2.00x." in one, one
