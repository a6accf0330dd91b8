"""ALST's sequence-tiled MLP (``GPTConfig(mlp_tiles=T)`` / ``LlamaConfig(mlp_tiles=T)``,
:func:`zerojax.models.gpt.tiled_tokens`) and the layer checkpoints in host memory
(``remat_policy="partitioned_host"``) under sequence parallelism.

Against ``jax.jit`` of the untiled model on one device (the references of
tests/test_seq_parallel.py's data, padding weights included): the tiled model on one
device, under ``shard_map`` over ``seq`` = 2 / 4, and in the ZeRO step on data x seq (GPT
2 x 4 at stage 3 with the checkpoints on host; Llama 4 x 2 at stage 3 with bf16 params);
the refusals of tiles that do not divide the tokens a device holds. The compiled
memory of the tiled MLP: tests/test_plan_seq.py.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from test_seq_parallel import (
    GPT_CFG,
    LLAMA_CFG,
    B,
    S,
    _check,
    padded_batch,
    seq_loss_and_grads,
)

import zerojax
from zerojax.analysis import saved_checkpoints
from zerojax.models.gpt import GPT, GPTConfig, gpt_params, lm_loss, shift_tokens
from zerojax.models.llama import Llama, LlamaConfig, llama_params

# float32 rounding, measured (jax 0.10.2 and 0.12, CPU, every case below): loss within
# 9.6e-7, gradients within 6e-8 (absolute; gradient elements reach ~0.3): the
# tolerances of tests/test_seq_parallel.py hold
LOSS_TOL, GRAD_TOL = 2e-6, 2e-7


def _model(family, tiles=None, seq_axis=None):
    cfg = dataclasses.replace(GPT_CFG if family == "gpt" else LLAMA_CFG, mlp_tiles=tiles,
                              seq_axis=seq_axis)
    return GPT(cfg) if family == "gpt" else Llama(cfg)


@pytest.fixture(scope="module")
def data():
    tokens, weights = padded_batch()
    # initialised under jit: 2.4x faster than eagerly here
    params = {"gpt": jax.jit(lambda: gpt_params(_model("gpt"), 0))(),
              "llama": jax.jit(lambda: llama_params(_model("llama"), 0))()}
    return tokens, weights, params


def _value_and_grad(model, params, tokens, weights):
    loss = lm_loss(model, weighted=True)

    def f(p):
        ls, ws = loss(p, (tokens, weights))
        return ls / ws

    return jax.jit(jax.value_and_grad(f))(params)


@pytest.fixture(scope="module")
def reference(data):
    """The untiled model on one device, whole sequences, with the padding weights."""
    tokens, weights, params = data
    return {f: _value_and_grad(_model(f), params[f], tokens, weights) for f in ("gpt", "llama")}


def test_same_params_as_the_untiled_model():
    """A tiled model's own init makes the untiled model's params: the same tree and
    values (Llama with MLP biases: DenseParams' bias too)."""
    cfg = dataclasses.replace(LLAMA_CFG, mlp_bias=True, layers=1)
    tokens = jnp.zeros((1, 8), jnp.int32)
    plain, tiled = (jax.jit(Llama(c).init)(jax.random.key(0), tokens)
                    for c in (cfg, dataclasses.replace(cfg, mlp_tiles=4)))
    assert jax.tree.structure(plain) == jax.tree.structure(tiled)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(plain),
                                                    jax.tree.leaves(tiled)))


@pytest.mark.parametrize("family,tiles", [("gpt", 4)])
def test_one_device(data, reference, family, tiles):
    tokens, weights, params = data
    loss, grads = _value_and_grad(_model(family, tiles), params[family], tokens, weights)
    print(family, tiles, "loss, gradient off by", _check(loss, grads, reference[family],
                                                         LOSS_TOL, GRAD_TOL))


@pytest.mark.parametrize("family,p,tiles", [("gpt", 2, 2), ("llama", 4, 4)])
def test_sequence_parallel(data, reference, family, p, tiles):
    """Under shard_map over seq = P: each device tiles its S / P tokens (GPT: 2 tiles of
    8 tokens; Llama, GQA kv heads repeated: 4 tiles of 2)."""
    tokens, weights, params = data
    got = seq_loss_and_grads(_model(family, tiles, "seq"), p, params[family], tokens,
                             weights)
    print(family, p, tiles, "loss, gradient off by", _check(*got, reference[family],
                                                            LOSS_TOL, GRAD_TOL))


def test_zero_step_seq_with_checkpoints_on_host(data, reference):
    """GPT on data x seq = 2 x 4, stage 3, the tiled MLP (2 tiles of 4 tokens a device)
    and remat_policy="partitioned_host": the loss and the SGD(lr=1) update equal the
    one-device reference; the layer checkpoints the forward loop stacks for the backward
    are each device's (B / 2, S / 4, hidden) slices, in host memory; lowered for a GPU,
    each moves to pinned_host and back once (XLA:CPU ignores memory spaces, so the
    placement is read from the traced and the cross-lowered step)."""
    tokens, weights, params = data
    opt = zerojax.zero(optax.sgd(1.0), mesh=zerojax.make_mesh(data=2, seq=4), stage=3,
                       remat_policy="partitioned_host")
    state = opt.init_state(params["gpt"])
    step = opt.train_step(lm_loss(_model("gpt", 2, "seq"), weighted=True), weighted=True)
    batch = shift_tokens(tokens, weights)
    ckpts = saved_checkpoints(step, state, batch)
    layers, hidden = GPT_CFG.layers, GPT_CFG.hidden
    assert [(c.shape, c.memory_space) for c in ckpts] == [
        ((layers, B // 2, S // 4, hidden), "host")], ckpts
    text = step.jitted.trace(state, step.place_batch(batch)).lower(
        lowering_platforms=("cuda",)).as_text()
    moves = re.findall(r"annotate_device_placement\(%[^)]*\).*?_xla_buffer_placement = "
                       r"\"(\w+)\".*?: \((tensor<[^>]*>)\)", text)
    part = f"tensor<{B // 2}x{S // 4}x{hidden}xf32>"
    assert sorted(moves) == [("device", part), ("pinned_host", part)], moves
    new, metrics = step(state, batch)
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params["gpt"],
                         opt.full_params(new))
    print("step loss, update off by", _check(metrics["loss"], grads, reference["gpt"],
                                             LOSS_TOL, GRAD_TOL))


def test_stage3_bf16_params(data, reference):
    """Llama (GQA) tiled, data x seq = 4 x 2, stage 3, bf16 params, against the float32
    reference: to bf16 rounding, as tests/test_seq_parallel.py's untiled case (measured
    there 2.9e-6 / 4.4e-4)."""
    tokens, weights, params = data
    opt = zerojax.zero(optax.sgd(1.0), mesh=zerojax.make_mesh(data=4, seq=2), stage=3,
                       param_dtype=jnp.bfloat16)
    state = opt.init_state(params["llama"])
    step = opt.train_step(lm_loss(_model("llama", 4, "seq"), weighted=True), weighted=True)
    new, metrics = step(state, shift_tokens(tokens, weights))
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params["llama"],
                         opt.full_params(new))
    print("bf16 loss, gradient off by", _check(metrics["loss"], grads, reference["llama"],
                                               loss_tol=5e-5, grad_tol=2e-3))


def test_tiles_that_do_not_divide_are_refused(data):
    tokens, weights, params = data
    # one device: 32 tokens in 3 tiles
    with pytest.raises(ValueError, match=r"GPTConfig.mlp_tiles=3 does not divide the 32 "
                                         r"tokens.*one of \[1, 2, 4, 8, 16, 32\]"):
        lm_loss(_model("gpt", 3))(params["gpt"], tokens)
    # seq = 4: each device holds 8 of the 32 tokens; 16 tiles fit the sequence, not them
    mesh = zerojax.make_mesh(data=2, seq=4)
    loss = lm_loss(_model("llama", 16, "seq"))
    fn = jax.shard_map(lambda p, b: loss(p, b), mesh=mesh, in_specs=(P(), P(None, "seq")),
                       out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=r"LlamaConfig.mlp_tiles=16 does not divide the 8 "
                                         r"tokens .*the sequence / P"):
        jax.eval_shape(fn, params["llama"], shift_tokens(tokens))


@pytest.mark.parametrize("cls,value,match", [
    (GPTConfig, 0, r"GPTConfig.mlp_tiles must be None or an int >= 1 .*got 0"),
    (GPTConfig, True, r"GPTConfig.mlp_tiles must be None or an int >= 1 .*got True"),
    (LlamaConfig, 2.0, r"LlamaConfig.mlp_tiles must be None or an int >= 1 .*got 2.0"),
    (LlamaConfig, 64, r"LlamaConfig.mlp_tiles=64 is larger than seq=32: .*at most 32"),
])
def test_config_refuses_bad_tiles(cls, value, match):
    with pytest.raises(ValueError, match=match):
        cls(vocab=64, seq=32, layers=1, hidden=32, heads=4, mlp_tiles=value)
