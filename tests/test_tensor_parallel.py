"""ZeRO over `data` beside Megatron tensor parallelism over `model` (data=4, model=2).

The reference GPT carries its Megatron layout as flax partitioning metadata; the
model axis is left to the compiler, the data axis is zerojax's explicit schedule.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_rel_err, reference_run, xla_flags
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.analysis import device_bytes
from zerojax.analysis.report import abstract_state, gpt_param_shapes
from zerojax.models import GPT, GPTConfig, gpt_param_specs, lm_loss

TINY = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4)
DATA, MODEL = 4, 2


def _mesh():
    return zerojax.make_mesh(data=DATA, model=MODEL)


def _batches(n, vocab=64, seq=16, batch=16):
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32) for _ in range(n)]


@functools.cache
def _reference():
    model = GPT(GPTConfig(**TINY))
    return reference_run(optax.adam(1e-3), _gpt_params(), lm_loss(model), _batches(4))


@functools.cache
def _host_boxed_params():
    model = GPT(GPTConfig(**TINY))
    return jax.tree.map(np.asarray,
                        model.init(jax.random.key(0), _batches(1)[0][:, :-1])["params"])


def _boxed_params():
    """The GPT's params as flax initialises them, ``nn.Partitioned`` boxes kept (once
    per module; fresh arrays each call)."""
    return jax.tree.map(jnp.asarray, _host_boxed_params())


def _gpt_params():
    """The TINY GPT's params unboxed: ``gpt_params(model, 0)`` (flax's values depend on
    the key and the shapes only), from the one init of the module."""
    import flax.linen as nn

    return nn.meta.unbox(_boxed_params())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_matches_single_device(stage):
    opt = zerojax.zero(optax.adam(1e-3), _mesh(), stage=stage)
    # boxed params: the Megatron layout is read from the flax metadata
    state = opt.init_state(_boxed_params())
    # the same layout as the specs read by gpt_param_specs (placed from shapes), so the
    # same program: the one compiled for the model-axis collectives below trains here
    # (remat or not changes neither the maths nor the params)
    step, compiled, layout = _program(stage, 2, stage in (0, 3))
    assert _layout(state) == layout
    for b in _batches(4):
        state, _ = compiled(state, step.place_batch(b), None)
    # tolerance and its reason: tests/test_gpt.py (the QKV key bias has a zero gradient)
    assert max_rel_err(_reference(), opt.full_params(state)) < 3e-4


def test_model_split_leaves_get_their_data_split_on_another_dim():
    model = GPT(GPTConfig(**TINY))
    opt = zerojax.zero(optax.adam(1e-3), _mesh(), stage=3)
    state = opt.init_state(_gpt_params(), model_specs=gpt_param_specs(model, 0))
    p = state.params
    blocks = p["blocks"]
    assert blocks["qkv"]["kernel"].sharding.spec == P(None, "data", "model")  # column-parallel
    assert blocks["attn_out"]["kernel"].sharding.spec == P(None, "model", "data")  # row-par.
    assert p["embed"]["embedding"].sharding.spec == P("model", "data")      # vocab-parallel
    # a bias split over model whose other dim (2 layers) does not divide by 4 is padded
    # to 4 rows and split: each device holds 1 of them, not both
    bias = blocks["qkv"]["bias"]
    assert bias.sharding.spec == P("data", "model")
    assert bias.shape == (4, 3 * TINY["hidden"])
    assert bias.addressable_shards[0].data.shape == (1, 3 * TINY["hidden"] // MODEL)
    logical = opt.logical_params(state.params)
    assert logical["blocks"]["qkv"]["bias"].shape == (2, 3 * TINY["hidden"])
    # the optimizer state follows its parameter, model split included
    assert state.opt_state[0].mu["blocks"]["qkv"]["kernel"].sharding.spec == P(
        None, "data", "model")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_are_the_formula_over_model_degree(stage):
    cfg = GPTConfig(vocab=256, seq=16, layers=2, hidden=256, heads=4)
    # the bytes held depend on the shapes only: zeros of the model's shapes
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), gpt_param_shapes(cfg))
    specs = gpt_param_specs(GPT(cfg), 0)
    psi = sum(x.size for x in jax.tree.leaves(params))
    opt = zerojax.zero(optax.adam(1e-3), _mesh(), stage=stage)
    state = opt.init_state(params, model_specs=specs)
    held = device_bytes((state.params, state.opt_state))
    formula = zerojax.estimate_memory(psi, DATA, stage, param_bytes=4, grad_bytes=0,
                                      optimizer_bytes=8, mp=MODEL).total
    assert abs(held / formula - 1) <= 0.03, (held, formula)


def _layout(state):
    return jax.tree.map(lambda x: (tuple(x.shape), x.dtype, x.sharding), state)


@functools.cache
def _program(stage, layers, remat):
    """(train step, its compiled program, the state's layout) on the GPT with params
    laid out by gpt_param_specs, from shapes (no flax init, nothing placed): one compile
    per (stage, layers, remat) in the module."""
    cfg = GPTConfig(**{**TINY, "layers": layers, "remat": remat})
    model = GPT(cfg)
    opt = zerojax.zero(optax.adam(1e-3), _mesh(), stage=stage)
    state = abstract_state(opt, gpt_param_shapes(cfg), gpt_param_specs(model, 0))
    step = opt.train_step(lm_loss(model))
    batch = jax.ShapeDtypeStruct((16, TINY["seq"] + 1), jnp.int32,
                                 sharding=step.batch_sharding)
    return step, step.jitted.lower(state, batch, None).compile(), _layout(state)


@functools.cache
def _model_axis_volume(stage, layers, remat):
    compiled = _program(stage, layers, remat)[1]
    return zerojax.comm_volume(compiled).by_group_size()[MODEL]


@pytest.mark.parametrize("stage,remat,per_layer", [
    (0, False, 4), (1, False, 4), (2, False, 4), (3, False, 4), (0, True, 5), (3, True, 5)])
def test_model_axis_collectives_are_megatrons(stage, remat, per_layer):
    """Per layer, on `model`: two all-reduces of the activations forward (attention out,
    MLP out) and two backward (the input gradients of QKV and MLP-in), as in Megatron.
    With remat the backward pass recomputes the attention-out one (the MLP-out one
    feeds nothing the backward needs). Nothing else per layer crosses the model axis.
    Read from the HLO of 2- and 4-layer models: the difference is two layers' worth.
    (Volumes, not instruction counts: XLA may combine two all-reduces into one.)
    No stage gathers anything over `model`: ZeRO's collectives run on each device's
    model block. Stage 3 with layers outside any checkpoint makes each layer's
    gathers wait on one element of the layer's input (``schedule._probe``); where
    that input is split over `model`, the element reaches the other rank as a scalar
    all-reduce (XLA folds it into an activation all-reduce): a few elements per
    layer at most, never a whole activation."""
    activation = 16 // DATA * TINY["seq"] * TINY["hidden"]  # elements of one all-reduce
    two, four = _model_axis_volume(stage, 2, remat), _model_axis_volume(stage, 4, remat)
    extra = four.all_reduce - two.all_reduce - 2 * per_layer * 2 * activation
    probes = 2 * 2 * 4 if stage == 3 and not remat else 0  # 2 layers, 2x counted, <= 4
    assert 0 <= extra <= probes, (extra, two, four)
    for kind in ("all_gather", "reduce_scatter", "all_to_all", "collective_permute"):
        assert getattr(four, kind) == getattr(two, kind), (kind, two, four)
    assert four.all_gather == 0, four


_BF16 = """
import json, sys
import jax.numpy as jnp, numpy as np, optax, zerojax
from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss

model = GPT(GPTConfig(**TINY))
params = gpt_params(model, 0)
tokens = np.random.default_rng(0).integers(0, 64, (16, 17)).astype(np.int32)
losses = {}
for stage in (1, 2, 3):
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=4, model=2), stage=stage,
                       param_dtype=jnp.bfloat16)
    state, step = opt.init_state(params), opt.train_step(lm_loss(model))
    losses[stage] = []
    for _ in range(4):
        state, metrics = step(state, tokens)
        losses[stage].append(float(metrics["loss"]))
print(json.dumps(losses))
"""


def test_bf16_params_with_a_model_axis_train_at_stages_1_to_3():
    """``param_dtype=bf16`` on data=4 x model=2 used to abort the process while compiling
    (XLA:CPU, "Invalid binary instruction opcode copy", exit 134) at stages 1-3; on the
    CPU backend the step now reduces 16-bit gradients in float32 beside a model axis
    (``step.cpu_reduce_dtype``). Run in a subprocess: an abort is an exit code here."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=xla_flags(8),
               JAX_PLATFORMS="cpu")
    code = f"TINY = {TINY!r}\n" + _BF16
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = json.loads(run.stdout.strip().splitlines()[-1])
    for stage, ls in losses.items():
        assert np.all(np.isfinite(ls)) and ls[-1] < ls[0], (stage, ls)
        assert abs(ls[0] / losses["1"][0] - 1) < 1e-2, losses  # the same model, bf16
