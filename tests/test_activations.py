"""Activation checkpointing policies and ZeRO-R Pa (partitioned activation checkpoints)
on the reference GPT, data=4 x model=2."""

import functools
import re

import jax
import numpy as np
import optax
import pytest
from helpers import cached_gpt_params, max_rel_err, reference_run

import zerojax
from zerojax.analysis import compiled_memory, saved_checkpoints
from zerojax.analysis.report import abstract_state, gpt_param_shapes
from zerojax.models import GPT, GPTConfig, gpt_param_specs, lm_loss

TINY = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4)
DATA, MODEL, BATCH = 4, 2, 16


_gpt_params = cached_gpt_params


def _batches(n, seq=16):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 64, (BATCH, seq + 1)).astype(np.int32) for _ in range(n)]


@functools.cache
def _reference():
    model = GPT(GPTConfig(**TINY))
    return reference_run(optax.adam(1e-3), _gpt_params(model, 0), lm_loss(model), _batches(3))


# CI time: one optimizer and train step per (stage, policy, layers), shared by the tests
# below, so each program compiles once in the module (jax caches the compile on the
# step: calling it, or lowering it after a call, reuses it). TINY (2 layers) is what
# test_policies_train_like_single_device trains; the Pa all-gather count compares it
# with 4 layers, which the checkpoint and remat memory tests read.
@functools.cache
def _step(stage, policy, layers):
    cfg = GPTConfig(**{**TINY, "layers": layers})
    model = GPT(cfg)
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=DATA, model=MODEL),
                       stage=stage, remat_policy=policy)
    # the state as shapes (no flax init, nothing placed; the optimizer learns the
    # Megatron specs from it, before the step is built), to lower and trace the step
    # with: the same program as an init_state state's
    state = abstract_state(opt, gpt_param_shapes(cfg), model_specs=gpt_param_specs(model, 0))
    return model, opt, opt.train_step(lm_loss(model)), state


def _state(stage, policy, layers):
    """A real state for ``_step(stage, policy, layers)``, to step (and donate)."""
    model, opt, _, _ = _step(stage, policy, layers)
    return opt.init_state(_gpt_params(model, 0), model_specs=gpt_param_specs(model, 0))


@pytest.mark.parametrize("stage,policy", [
    (0, "partitioned"), (1, "partitioned"), (2, "partitioned"), (3, "partitioned"),
    (2, "none"), (3, "full"), (1, "layer_inputs"), (0, "partitioned_host"),
    (3, "partitioned_host")])
def test_policies_train_like_single_device(stage, policy):
    _, opt, step, _ = _step(stage, policy, 2)
    state = _state(stage, policy, 2)
    for b in _batches(3):
        state, _ = step(state, b)
    assert max_rel_err(_reference(), opt.full_params(state)) < 3e-4


@functools.cache
def _compiled(stage, policy, layers):
    _, _, step, state = _step(stage, policy, layers)
    return step.jitted.lower(state, step.place_batch(_batches(1)[0]), None).compile()


@pytest.mark.parametrize("stage", [0, 3])
def test_partitioned_checkpoints_are_one_over_model_degree(stage):
    """The layer inputs a scanned, rematerialised stack keeps for its backward pass are
    the forward loop's stacked output: (layers, batch/data, seq, hidden) per device
    without Pa, (layers, batch/data/model, seq, hidden) with it (read from the HLO)."""
    local = BATCH // DATA
    whole = f"f32[4,{local},16,32]"
    split = f"f32[4,{local // MODEL},16,32]"
    plain = _compiled(stage, "full", 4).as_text()
    pa = _compiled(stage, "partitioned", 4).as_text()
    assert whole in plain and split not in plain
    assert split in pa and whole not in pa
    # and the compiled step's temporaries fall by at least a third of the whole copy
    # (measured, jax 0.10.2: by half of it, 8 KiB, at stages 0 and 3)
    saved = 4 * local * 16 * 32 * 4
    drop = compiled_memory(_compiled(stage, "full", 4)).temp - compiled_memory(
        _compiled(stage, "partitioned", 4)).temp
    assert drop >= saved / MODEL / 3, (drop, saved)


@pytest.mark.parametrize("stage", [0, 3])
def test_pa_host_keeps_the_split_checkpoints_in_host_memory(stage):
    """Pa+cpu: the checkpoints the layer loop hands to the backward loop are in host
    memory (device-side bytes: 0), and the compiled program still holds them split
    1/M per device. XLA:CPU ignores memory spaces, so placement is read from the
    traced program and from the step lowered for a GPU (cross-lowered here)."""
    local = BATCH // DATA
    whole = (4, local, 16, 32)  # (layers, batch/data, seq, hidden) as traced
    by_space = {}
    for policy in ("full", "partitioned", "partitioned_host"):
        _, _, step, state = _step(stage, policy, 4)
        ckpts = saved_checkpoints(step, state, _batches(1)[0])
        assert [c.shape for c in ckpts] == [whole], (policy, ckpts)
        by_space[policy] = {s: sum(c.nbytes for c in ckpts if c.memory_space == s)
                            for s in ("device", "host")}
    saved = 4 * local * 16 * 32 * 4
    assert by_space["full"] == by_space["partitioned"] == {"device": saved, "host": 0}
    assert by_space["partitioned_host"] == {"device": 0, "host": saved}

    # lowered for a GPU: each layer's kept slice (batch/data/model, seq, hidden), one
    # per device, goes to pinned_host in the forward loop and comes back to the device
    # before Pa's all-gather in the backward loop; nothing else moves
    text = step.jitted.trace(state, step.place_batch(_batches(1)[0])).lower(
        lowering_platforms=("cuda",)).as_text()
    moves = re.findall(r"annotate_device_placement\(%[^)]*\).*?_xla_buffer_placement = "
                       r"\"(\w+)\".*?: \((tensor<[^>]*>)\)", text)
    part = f"tensor<{local // MODEL}x16x32xf32>"
    assert sorted(moves) == [("device", part), ("pinned_host", part)], moves


def test_host_offload_without_a_model_axis_moves_the_whole_checkpoint():
    """On a data-only mesh there is nothing to split: Pa+cpu offloads the layer
    inputs whole, and training matches single-device training."""
    model = GPT(GPTConfig(**TINY))
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=2,
                       remat_policy="partitioned_host")
    state = opt.init_state(_gpt_params(model, 0))
    step = opt.train_step(lm_loss(model))
    ckpts = saved_checkpoints(step, state, _batches(1)[0])
    assert [(c.shape, c.memory_space) for c in ckpts] == [((2, 2, 16, 32), "host")]
    for b in _batches(3):
        state, _ = step(state, b)
    assert max_rel_err(_reference(), opt.full_params(state)) < 3e-4


def _model_axis(stage, policy, layers):
    return zerojax.comm_volume(_compiled(stage, policy, layers)).by_group_size()[MODEL]


@pytest.mark.parametrize("stage,policy", [(0, "partitioned"), (3, "partitioned"),
                                          (3, "partitioned_host")])
def test_pa_adds_one_activation_all_gather_per_layer(stage, policy):
    """Per layer on `model`: Megatron's all-reduces (2 forward, 2 backward, 1 recomputed)
    and Pa's one all-gather of the layer input before the recomputation (Pa+cpu: the
    same, after the slice is back from the host)."""
    activation = BATCH // DATA * 16 * 32
    two, four = _model_axis(stage, policy, 2), _model_axis(stage, policy, 4)
    assert four.all_gather - two.all_gather == 2 * activation
    assert four.all_reduce - two.all_reduce == 2 * 5 * 2 * activation


def test_no_remat_keeps_more_than_full_remat():
    assert compiled_memory(_compiled(0, "none", 4)).temp > 2 * compiled_memory(
        _compiled(0, "full", 4)).temp


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match=r"remat_policy='offload'.*'partitioned'"):
        zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), remat_policy="offload")


@pytest.mark.parametrize("policy", ["partitioned", "partitioned_host"])
def test_pa_on_a_model_without_named_layer_inputs_is_an_error(policy):
    from zerojax.models import MLP, mse_loss

    model = MLP(features=16, layers=2)
    x = np.ones((16, 8), np.float32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=4, model=2),
                       remat_policy=policy)
    step = opt.train_step(mse_loss(model))
    with pytest.raises(ValueError, match=r"found no rematerialised layer.*'layer_input'"):
        step(opt.init_state(params), (x, np.ones((16, 1), np.float32)))


def test_layer_input_name_is_what_pa_looks_for():
    model = GPT(GPTConfig(**TINY))
    jaxpr = jax.make_jaxpr(lm_loss(model))(_gpt_params(model, 0), _batches(1)[0])
    assert re.search(r"name\[name=layer_input\]", str(jaxpr))
