"""ZeRO-Infinity's per-layer param fetch (``offload_params=True, param_fetch="layer"``):
a scanned stack's shards stay in host memory and each layer's shard moves to the device
inside the loop body. XLA:CPU ignores memory spaces, so where the moves sit is read from
the step lowered for CUDA from this CPU machine (:func:`zerojax.analysis.memory_moves`);
the training is compared bitwise with the same run without offload and with the
whole-shard fetch."""

import collections
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, cached_gpt_params, regression_batches

import zerojax
from zerojax import offload
from zerojax.analysis import memory_moves
from zerojax.models import GPT, GPTConfig, gpt_param_specs, lm_loss

TINY = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4, scan=True)
BATCH = 16


def _batches(n, accum=1):
    rng = np.random.default_rng(0)
    out = [rng.integers(0, 64, (BATCH, 17)).astype(np.int32) for _ in range(n)]
    return [b.reshape(accum, BATCH // accum, 17) for b in out] if accum > 1 else out


@functools.cache
def _model():
    return GPT(GPTConfig(**TINY))


def _run(mesh_shape, steps=2, accum=1, specs=False, stage=3, **options):
    """``(opt, state, step, metrics)`` after ``steps`` steps of the tiny scanned GPT."""
    model = _model()
    mesh = zerojax.make_mesh(**mesh_shape)
    opt = zerojax.zero(optax.adamw(1e-2), mesh, stage=stage, accum_steps=accum, **options)
    state = opt.init_state(cached_gpt_params(model, 0),
                           model_specs=gpt_param_specs(model, 0) if specs else None)
    step = opt.train_step(lm_loss(model))
    for b in _batches(steps, accum):
        state, metrics = step(state, b)
    assert bool(jnp.isfinite(metrics["loss"]))
    return opt, state, step, metrics


def _same_bits(a, b) -> bool:
    a, b = jax.device_get(a), jax.device_get(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# one compiled step per configuration, shared by the tests of this module
@functools.cache
def _fp32(fetch, grads=False):
    off = {} if fetch is None else dict(offload_optimizer=True, offload_params=True,
                                        param_fetch=fetch, offload_gradients=grads)
    return _run(dict(data=8), **off)


ALL = dict(param_dtype=jnp.bfloat16, max_grad_norm=0.05, loss_scale="dynamic")


@functools.cache
def _all_options(fetch, grads=False):
    # a model axis, bf16 params over fp32 master weights, micro-batches, clipping and
    # dynamic loss scaling at once
    return _run(dict(data=4, model=2), accum=2, specs=True, offload_optimizer=True,
                offload_params=True, param_fetch=fetch, offload_gradients=grads, **ALL)


def test_layer_fetch_trains_bitwise_as_without_offload():
    # per-layer fetch and streamed gradients at once (one compiled step for both)
    _, plain, _, m0 = _fp32(None)
    _, got, _, m1 = _fp32("layer", True)
    assert _same_bits(plain.params, got.params)
    assert _same_bits(plain.opt_state, got.opt_state)
    assert _same_bits(m0, m1)
    # the params and the optimizer state stayed in host memory
    assert offload.memory_kinds((got.params, got.opt_state)) == {offload.HOST}


def test_layer_fetch_equals_the_whole_shard_fetch_with_every_option():
    # today's offload (whole-shard fetch, gradients on the device) against per-layer
    # fetch with streamed gradients
    _, whole, _, m0 = _all_options("whole")
    _, layer, _, m1 = _all_options("layer", True)
    assert int(layer.step) == 2 and not bool(m1["skipped"])
    assert _same_bits(whole.params, layer.params)
    assert _same_bits(whole.opt_state, layer.opt_state)
    assert _same_bits(m0, m1)


def _moves(opt, state, step):
    text = step.jitted.trace(state, step.place_batch(_batches(1)[0])).lower(
        lowering_platforms=("cuda",)).as_text()
    return memory_moves(text)


def test_each_layer_shard_moves_inside_the_forward_and_backward_loops():
    """Lowered for a GPU: every scanned, partitioned leaf's per-device layer shard moves
    to the device inside two loops (the forward one and the rematerialised backward
    one), and no param stack moves; with param_fetch="whole" nothing moves inside a
    loop."""
    opt, state, step, _ = _fp32("layer", True)
    logical = opt.logical_params(state.params)
    lays = jax.tree_util.tree_flatten_with_path(opt.layouts(logical))[0]
    n = opt.data_size
    stacked = [(jax.tree_util.keystr(p), lay.shard_shape(n)) for p, lay in lays
               if lay.sharded and "blocks" in jax.tree_util.keystr(p)]
    assert len(stacked) >= 4, stacked
    tensor = lambda shape: "tensor<" + "x".join(map(str, shape)) + "xf32>"  # noqa: E731
    want = collections.Counter(tensor(s[1:]) for _, s in stacked)
    moves = _moves(opt, state, step)
    in_loops = [m for m in moves if m.loops and m.to == "device"]
    # each layer shard in a forward and a backward loop: two loops in all
    loops = {m.loops[-1] for m in in_loops}
    assert len(loops) == 2, loops
    got = collections.Counter(m.type for m in in_loops)
    assert got == collections.Counter({t: 2 * c for t, c in want.items()}), (got, want)
    for loop in loops:
        assert collections.Counter(m.type for m in in_loops if m.loops[-1] == loop) == want
    # no param stack (a whole layer stack of one device's shards) moves to the device:
    # the stacked moves to the device are offload_gradients' norm pass, one per leaf
    # (its gradient, read back whole for its sum of squares), outside the loops
    assert collections.Counter(m.type for m in moves if m.to == "device" and m.type in {
        tensor(s) for _, s in stacked}) == collections.Counter(tensor(s) for _, s in stacked)
    assert not [m for m in moves if m.loops and m.type in {tensor(s) for _, s in stacked}]

    whole = zerojax.zero(optax.adamw(1e-2), zerojax.make_mesh(data=8), stage=3,
                         offload_optimizer=True, offload_params=True, param_fetch="whole")
    state_w = whole.init_state(cached_gpt_params(_model(), 0))
    assert not [m for m in _moves(whole, state_w, whole.train_step(lm_loss(_model())))
                if m.loops]


def test_stage2_streams_gradients_bitwise_with_micro_batches_and_clipping():
    options = dict(stage=2, accum=2, offload_optimizer=True, param_dtype=jnp.bfloat16,
                   max_grad_norm=0.05)
    _, want, _, m0 = _run(dict(data=8), **options)
    _, got, _, m1 = _run(dict(data=8), offload_gradients=True, **options)
    assert _same_bits(want.params, got.params) and _same_bits(want.opt_state, got.opt_state)
    assert _same_bits(m0, m1)


def test_each_layer_gradient_goes_to_host_memory_inside_the_backward_loop():
    """Lowered for a GPU, with offload_gradients: each scanned, partitioned leaf's reduced
    layer shard moves to host memory inside one loop, the backward one (where its layer
    shard is also fetched), and no stacked gradient moves to host memory outside it."""
    opt, state, step, _ = _fp32("layer", True)
    logical = opt.logical_params(state.params)
    lays = jax.tree_util.tree_flatten_with_path(opt.layouts(logical))[0]
    stacked = [lay.shard_shape(opt.data_size) for p, lay in lays
               if lay.sharded and "blocks" in jax.tree_util.keystr(p)]
    tensor = lambda shape: "tensor<" + "x".join(map(str, shape)) + "xf32>"  # noqa: E731
    moves = _moves(opt, state, step)
    to_host = [m for m in moves if m.loops and m.to == "pinned_host"]
    assert collections.Counter(m.type for m in to_host) == collections.Counter(
        tensor(s[1:]) for s in stacked)
    (backward,) = {m.loops[-1] for m in to_host}
    fetch_loops = {m.loops[-1] for m in moves if m.loops and m.to == "device"}
    assert backward in fetch_loops and len(fetch_loops) == 2
    # no stacked gradient moves to host memory outside the loop (the host zero shards
    # the gradients are taken against are allocated there: compat.zeros_in_memory)
    assert not {tensor(s) for s in stacked} & {m.type for m in moves if not m.loops
                                               and m.to == "pinned_host"}


# -- what is refused or said -----------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    (dict(stage=3, offload_params=True, param_fetch="layers"),
     "param_fetch='layers' must be one of \\('layer', 'whole'\\)"),
    (dict(stage=3, param_fetch="whole"), "add offload_params=True"),
    (dict(stage=2, offload_params=True), "needs stage=3"),
    (dict(stage=1, offload_optimizer=True, offload_gradients=True),
     "needs offload_optimizer=True at stage 2 or 3 .*stage=1"),
    (dict(stage=3, offload_gradients=True), "got offload_optimizer=False"),
    (dict(stage=3, offload_optimizer=True, offload_gradients=1), "must be True or False"),
])
def test_bad_fetch_options_are_refused_naming_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), **options)


def test_streamed_gradients_refuse_a_weighted_loss_over_micro_batches():
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3, accum_steps=2,
                       offload_optimizer=True, offload_gradients=True)
    with pytest.raises(ValueError, match="offload_gradients=True with accum_steps=2.*"
                                         "weighted=True"):
        opt.train_step(lambda p, b: (jnp.sum(b), jnp.float32(1.0)), weighted=True)


def test_an_unscanned_model_is_fetched_whole_with_a_warning():
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3,
                       min_shard_size=16, offload_params=True)
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    with pytest.warns(UserWarning, match="no scanned layer stack.*param_fetch='whole'"):
        step.jitted.trace(state, step.place_batch(regression_batches(1)[0]))
    whole = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3,
                         min_shard_size=16, offload_params=True, param_fetch="whole")
    step = whole.train_step(awkward_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step.jitted.trace(state, step.place_batch(regression_batches(1)[0]))


def test_host_memory_too_small_is_refused_before_anything_is_placed(monkeypatch):
    from zerojax.runtime import hostmem

    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3,
                       min_shard_size=16, offload_optimizer=True, offload_params=True)
    params = awkward_params()
    monkeypatch.setattr(hostmem, "available", lambda: 1000)
    placed = []
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: placed.append(a))
    with pytest.raises(ValueError, match=r"keeps [\d,]+ bytes .* only 1,000 bytes "
                                         r"\(0.00 GiB\) are available.*offload_optimizer='nvme'"):
        opt.init_state(params)
    assert not placed


def test_the_fetch_benchmark_runs_on_the_cpu(capsys, monkeypatch):
    """``benchmarks/offload.py --fetch --dry-run``: the rows the lead runs on a GPU
    (per-layer fetch against ``jax.device_put`` of the same bytes), on a tiny stack."""
    import importlib.util
    import os

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "benchmarks")
    monkeypatch.syspath_prepend(bench)
    spec = importlib.util.spec_from_file_location("offload_bench",
                                                  os.path.join(bench, "offload.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--fetch", "--dry-run", "--steps", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["device_put", "fetch slice_then_move", "resident"], out


def _plain_scan_loss(params, batch):
    """A layer stack under a bare ``lax.scan``, no checkpoint, the weights cast inside
    the body (bf16 params over fp32 master weights)."""
    x, y = batch
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.astype(h.dtype)), None), x,
                        params["stack"])
    return jnp.mean((h @ params["head"].astype(h.dtype) - y) ** 2)


def test_a_stack_scanned_without_a_checkpoint_is_fetched_a_layer_at_a_time():
    """A scanned stack with no ``jax.checkpoint`` around its body: each layer's use is a
    stage-3 unit (gather + the equation, a custom_vjp whose backward fetches the layer
    again). Its backward once handed back a layer-shaped cotangent for the whole host
    stack it was given ("Custom VJP bwd rule must produce an output with the same
    type": every such model failed to trace with the default param_fetch="layer").
    Now: two steps bitwise the run with the params on the device, and lowered for a
    GPU, only layer shards move to the device inside the loops, never the stack."""
    k1, k2 = jax.random.split(jax.random.key(1))
    params = {"stack": jax.random.normal(k1, (4, 16, 16)) / 4,
              "head": jax.random.normal(k2, (16, 16)) / 4}
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(16, 16)).astype(np.float32),
                rng.normal(size=(16, 16)).astype(np.float32)) for _ in range(2)]
    mesh = zerojax.make_mesh(data=8)
    got = {}
    for fetch in (None, "layer"):
        extra = {} if fetch is None else dict(offload_params=True, param_fetch=fetch)
        opt = zerojax.zero(optax.adam(1e-2), mesh, stage=3, param_dtype=jnp.bfloat16,
                           offload_optimizer=True, min_shard_size=16, **extra)
        state = opt.init_state(params)
        step = opt.train_step(_plain_scan_loss)
        if fetch:
            text = step.jitted.trace(state, step.place_batch(batches[0])).lower(
                lowering_platforms=("cuda",)).as_text()
            moves = [m for m in memory_moves(text) if m.to == "device"]
            # the stack's per-device layer shard (16 x 16 split over 8: 2 x 16) in the
            # forward loop and in the backward one; the (4, 2, 16) stack never
            assert collections.Counter(m.type for m in moves if m.loops) == {
                "tensor<2x16xbf16>": 2}, moves
            assert not [m for m in moves if m.type == "tensor<4x2x16xbf16>"], moves
        for b in batches:
            state, metrics = step(state, b)
        got[fetch] = jax.tree.map(np.asarray, (opt.full_params(state), metrics["loss"]))
    assert _same_bits(got[None], got["layer"])
