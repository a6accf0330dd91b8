"""Stage-3 prefetch: the next layer's gather may start before the current layer's
compute, with at most about two layers' gathered weights live."""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import (
    zero_vs_reference,
)

import zerojax
from zerojax.analysis import compiled_memory
from zerojax.models import MLP, mse_loss

WIDTH = 384
LAYER_BYTES = WIDTH * WIDTH * 4


def _temp(layers, prefetch):
    model = MLP(features=WIDTH, layers=layers)
    x = jnp.ones((16, WIDTH))
    params = model.init(jax.random.key(0), x)["params"]
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3, prefetch=prefetch)
    state = opt.init_state(params)
    compiled = opt.train_step(mse_loss(model)).lower(state, (x, x[:, :1])).compile()
    return compiled_memory(compiled).temp


@pytest.mark.parametrize("prefetch", [True, False])
def test_gathered_weights_stay_bounded_as_depth_grows(prefetch):
    shallow, deep = _temp(4, prefetch), _temp(12, prefetch)
    assert deep < 3 * LAYER_BYTES, (deep, LAYER_BYTES)  # about two layers, not twelve
    assert deep < 1.25 * shallow, (shallow, deep)


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_does_not_change_the_result(prefetch):
    assert zero_vs_reference(optax.adam(1e-2), stage=3, prefetch=prefetch,
                             reference_key="adam(1e-2)") < 2e-6  # jit DP: 1.7e-7


def test_prefetched_gather_does_not_wait_for_the_previous_layer():
    """With prefetch the second layer's gather depends on the first layer's input only;
    without it, on the first layer's output (read from the traced step)."""
    model = MLP(features=64, layers=2, out=64)
    x = jnp.ones((16, 64))
    params = model.init(jax.random.key(0), x)["params"]
    deps = {}
    for prefetch in (True, False):
        opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=3,
                           prefetch=prefetch, min_shard_size=16)
        state = opt.init_state(params)
        jaxpr = jax.make_jaxpr(opt.train_step(mse_loss(model)).jitted)(
            state, (x, x)).jaxpr
        deps[prefetch] = _second_gather_depends_on_first_tanh(jaxpr)
    assert deps == {True: False, False: True}


def _second_gather_depends_on_first_tanh(jaxpr) -> bool:
    """Among the forward all_gathers of the inner shard_map (kernel 0, bias 0, kernel 1,
    ...), does the third (layer 1's kernel) depend on the first tanh (layer 0's output)?"""
    body = _find(jaxpr, "shard_map")
    order = []  # (name, frozenset of upstream node ids), eqns inlined in program order
    _index(body, [frozenset()] * len(body.invars), order)
    gathers = [deps for name, deps, _ in order if name == "all_gather"]
    first_tanh = next(node for name, _, node in order if name == "tanh")
    return first_tanh in gathers[2]


def _find(jaxpr, name):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return eqn.params["jaxpr"]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found = _find(sub, name)
            if found is not None:
                return found
    return None


def _index(jaxpr, in_deps, order):
    """Interpret ``jaxpr`` symbolically: each value's set of upstream eqn nodes.
    custom_vjp and jit calls are inlined (a fresh environment per call, since traced
    calls can share one inner jaxpr). Returns the outputs' dependency sets."""
    env = dict(zip(jaxpr.invars, in_deps))

    def read(v):
        return frozenset() if isinstance(v, jax.extend.core.Literal) else env.get(v, frozenset())

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
        calls = ("custom_vjp_call", "custom_vjp_call_jaxpr", "jit", "pjit")
        if eqn.primitive.name in calls and subs:
            outs = _index(subs[0], ins, order)
        else:
            node = len(order)
            deps = frozenset().union(*ins) if ins else frozenset()
            order.append((eqn.primitive.name, deps, node))
            outs = [deps | {node}] * len(eqn.outvars)
        for v, d in zip(eqn.outvars, outs):
            env[v] = d
    return [read(v) for v in jaxpr.outvars]
