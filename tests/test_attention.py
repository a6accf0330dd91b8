"""The reference GPT's fused attention (GPTConfig(attention=...)): the same loss and
gradients as the explicit attention on the CPU, under zerojax stages 0-3 with and
without the model axis; "auto" and "cudnn" resolved by backend."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import cached_gpt_params

import zerojax
from zerojax.models import GPT, GPTConfig, gpt_param_specs, gpt_params, lm_loss
from zerojax.models.gpt import resolve_attention

TINY = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4)
BATCH = 16


def _gpt_params(model, seed=0):
    """:func:`helpers.cached_gpt_params`; the params do not depend on the attention, so
    the explicit attention's model initialises them."""
    return cached_gpt_params(GPT(dataclasses.replace(model.config, attention="xla")), seed)

# Measured (jax 0.10.2, CPU): the fused attention multiplies the scores by 1/sqrt(d)
# where the explicit one divides by sqrt(d), so the two differ by float32 rounding:
# the loss agrees bit for bit here; each gradient leaf agrees to at most 1.8e-7 of
# its largest entry on one device (3.3e-7 at t = 5 < seq) and at most 1.4e-7 under
# zerojax (stages 0-3, data=8 and data=4 x model=2). The bound is ~5x the largest.
GRAD_RTOL = 1.5e-6
LOSS_ATOL = 2e-6


def _tokens(t=TINY["seq"]):
    rng = np.random.default_rng(0)
    return rng.integers(0, TINY["vocab"], (BATCH, t + 1)).astype(np.int32)


def _model(attention, **kw):
    return GPT(GPTConfig(**{**TINY, **kw}, attention=attention))


def _rel_err(a, b):
    """Per leaf: the largest difference over the leaf's largest entry (0 for a zero
    leaf compared with a zero leaf)."""
    def one(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = np.max(np.abs(x))
        return 0.0 if scale == 0 and np.all(y == 0) else float(np.max(np.abs(x - y)) / scale)
    return jax.tree.map(one, a, b)


@pytest.mark.parametrize("t", [16, 5])
def test_fused_matches_explicit_on_one_device(t):
    """t = 5 < seq: a shorter sequence (the position embedding cut, the causal mask of
    the length given)."""
    tokens = _tokens(t)
    out = {}
    for attention in ("xla", "dot_product"):
        model = _model(attention)
        out[attention] = jax.jit(jax.value_and_grad(lm_loss(model)))(_gpt_params(model, 0),
                                                                       tokens)
    (l_x, g_x), (l_f, g_f) = out["xla"], out["dot_product"]
    assert abs(float(l_x) - float(l_f)) <= LOSS_ATOL
    errs = _rel_err(g_x, g_f)
    assert max(jax.tree.leaves(errs)) < GRAD_RTOL, errs
    # and the fused path is another program (not today's attention under a new name)
    text = jax.jit(lm_loss(_model("dot_product"))).lower(_gpt_params(_model("xla"), 0),
                                                         tokens).as_text()
    assert text != jax.jit(lm_loss(_model("xla"))).lower(_gpt_params(_model("xla"), 0),
                                                         tokens).as_text()


def _capture_grads():
    """An optax transformation that leaves the params as they are and keeps the
    gradients it is handed in its state: the gradient zerojax computed, read back."""
    def init(params):
        return {"g": jax.tree.map(jnp.zeros_like, params)}

    def update(grads, state, params=None):
        return jax.tree.map(jnp.zeros_like, grads), {"g": grads}

    return optax.GradientTransformation(init, update)


def _logical(x, like):
    """``x`` gathered, the layout's padding (appended zeros) cut to ``like``'s shape."""
    return np.asarray(x)[tuple(slice(0, s) for s in like.shape)]


@functools.cache
def _both(stage, model_axis):
    """One zerojax step whose params are two copies of the GPT's: the explicit
    attention's loss on one, the fused attention's on the other, summed (the losses
    as aux). Each copy's gradient is its own model's: one compile gives both."""
    explicit, fused = _model("xla"), _model("dot_product")
    params = _gpt_params(explicit, 0)
    both = {"explicit": params, "fused": params}

    def loss(p, batch):
        a, b = lm_loss(explicit)(p["explicit"], batch), lm_loss(fused)(p["fused"], batch)
        return a + b, (a, b)

    mesh = (zerojax.make_mesh(data=4, model=2) if model_axis
            else zerojax.make_mesh(data=8))
    opt = zerojax.zero(_capture_grads(), mesh, stage=stage)
    specs = gpt_param_specs(explicit, 0) if model_axis else None
    state = opt.init_state(both, model_specs=specs and {"explicit": specs, "fused": specs})
    state, metrics = opt.train_step(loss, has_aux=True)(state, _tokens())
    grads = jax.tree.map(_logical, state.opt_state["g"], both)
    # aux: each data rank's loss on its slice of the batch; their mean is the loss
    return [float(np.mean(np.asarray(v))) for v in metrics["aux"]], grads


@pytest.mark.parametrize("model_axis", [False, True], ids=["data8", "data4xmodel2"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fused_matches_explicit_under_zero(stage, model_axis):
    (l_x, l_f), grads = _both(stage, model_axis)
    assert np.isfinite(l_x) and abs(l_x - np.log(TINY["vocab"])) < 0.2
    assert abs(l_x - l_f) <= LOSS_ATOL
    errs = _rel_err(grads["explicit"], grads["fused"])
    assert max(jax.tree.leaves(errs)) < GRAD_RTOL, errs
    # and the gradients are the model's: the explicit copy against one device (the
    # data ranks' partial sums add in another order: measured <= 6.3e-7)
    assert max(jax.tree.leaves(_rel_err(_one_device_grads(), grads["explicit"]))) < 5e-6


@functools.cache
def _one_device_grads():
    model = _model("xla")
    return jax.jit(jax.grad(lm_loss(model)))(_gpt_params(model, 0), _tokens())


def test_auto_and_cudnn_resolve_by_backend():
    bf16 = dict(dtype=jnp.bfloat16)
    assert resolve_attention(GPTConfig(**TINY, attention="auto")) == "xla"  # CPU here
    assert resolve_attention(GPTConfig(**TINY, attention="auto"), "cpu") == "xla"
    assert resolve_attention(GPTConfig(**TINY, attention="auto"), "tpu") == "xla"
    assert resolve_attention(GPTConfig(**TINY, **bf16, attention="auto"), "cuda") == "cudnn"
    # float32 compute, or a head_dim cuDNN does not take: XLA's fused attention
    assert resolve_attention(GPTConfig(**TINY, attention="auto"), "cuda") == "dot_product"
    odd = dict(TINY, hidden=36, heads=3)  # head_dim 12
    assert resolve_attention(GPTConfig(**odd, **bf16, attention="auto"), "cuda") == \
        "dot_product"
    for name in ("xla", "dot_product"):
        assert resolve_attention(GPTConfig(**TINY, attention=name), "cuda") == name
    cfg = GPTConfig(**TINY, **bf16, attention="cudnn")
    assert resolve_attention(cfg, "cuda") == "cudnn"
    with pytest.raises(ValueError, match=r"attention='cudnn'.*CUDA GPUs only.*'cpu'"):
        resolve_attention(cfg)
    model = GPT(cfg)  # refused when traced on the CPU, with the same message
    with pytest.raises(ValueError, match=r"CUDA GPUs only"):
        jax.eval_shape(lm_loss(model), jax.eval_shape(lambda: gpt_params(_model("xla"))),
                       _tokens())


@pytest.mark.parametrize("kw,match", [
    (dict(attention="flash"), r"attention must be one of \('xla', 'dot_product'"),
    (dict(attention="cudnn"), "needs dtype bfloat16 or float16"),
    (dict(attention="cudnn", dtype=jnp.bfloat16, hidden=36, heads=3),
     "multiple of 8 and at most 128"),
])
def test_bad_attention_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **kw})


def test_train_attention_flag():
    from zerojax.cli.demo import build_parser

    assert build_parser().parse_args([]).attention == "auto"
    assert build_parser().parse_args(["--attention", "dot_product"]).attention == \
        "dot_product"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--attention", "flash"])
