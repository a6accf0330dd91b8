"""Memory-centric tiling of the language-model head and loss (zerojax/tiling.py, issue 33):
the tiled loss and its gradients equal the untiled ones to float32 rounding (masked,
z-loss, label smoothing, tied and untied heads, uneven last tile), zerojax stages 0-3
train the tiled GPT as one device trains the untiled one, and the compiled stage-3
step's peak drops by the logits' share."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import cached_gpt_params, max_rel_err, reference_run

import zerojax
from zerojax.analysis import compiled_memory
from zerojax.analysis.report import compile_step
from zerojax.models import (
    GPT,
    GPTConfig,
    Llama,
    LlamaConfig,
    gpt_params,
    llama_params,
    lm_loss,
    markov_tokens,
)
from zerojax.tiling import (
    TiledDense,
    check_tiles,
    lm_head_loss,
    logits_bytes,
    tile_kernel,
    tiled_dense,
    untile_kernel,
)

B, S, H, V = 3, 13, 16, 97


@pytest.fixture(scope="module")
def head_problem():
    k = jax.random.split(jax.random.key(0), 5)
    hidden = jax.random.normal(k[0], (B, S, H))
    emb = 0.3 * jax.random.normal(k[1], (V, H))  # tied layout (vocab, hidden)
    targets = jax.random.randint(k[2], (B, S), 0, V)
    weights = (jax.random.uniform(k[3], (B, S)) > 0.3).astype(jnp.float32)
    weights = weights * jax.random.uniform(k[4], (B, S), minval=0.5, maxval=2.0)
    return hidden, emb, targets, weights


def _mean_and_grads(hidden, head, targets, weights, tiles, **kw):
    def mean(h, w):
        s, n = lm_head_loss(h, w, targets, weights=weights, tiles=tiles, **kw)
        return s / n

    return jax.jit(jax.value_and_grad(mean, argnums=(0, 1)))(hidden, head)


# measured (jax 0.10.2, XLA:CPU): loss within 9.5e-7 absolute (|loss| ~ 5.4, 1.8e-7
# relative), gradients within 1.5e-7 relative (the per-tile sums, dW's accumulation
# over the tiles and the custom backward's softmax - onehot reorder float32 roundings)
@pytest.mark.parametrize("tied,extra", [(True, {}),
                                        (False, {"z_loss": 1e-2, "label_smoothing": 0.1})])
def test_tiled_equals_untiled(head_problem, tied, extra):
    hidden, emb, targets, weights = head_problem
    head = emb if tied else emb.T
    ref_loss, ref_grads = _mean_and_grads(hidden, head, targets, weights, None, tied=tied,
                                          **extra)
    # optax's cross-entropy, the model's formula, on the whole logits
    if not extra:
        logits = jnp.einsum("bsh,vh->bsv", hidden, emb)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        want = float(jnp.sum(ce * weights) / jnp.sum(weights))
        assert abs(float(ref_loss) - want) <= 2e-6 * abs(want)
    for tiles in (1, 4, 13):  # 4 leaves a shorter last tile (4, 4, 4, 1); 13: a token each
        loss, grads = _mean_and_grads(hidden, head, targets, weights, tiles, tied=tied,
                                      **extra)
        assert abs(float(loss) - float(ref_loss)) <= 2e-6, (tiles, float(loss - ref_loss))
        assert max_rel_err(ref_grads, grads) < 1e-6, (tiles, max_rel_err(ref_grads, grads))


def test_masked_tokens_get_no_gradient(head_problem):
    hidden, emb, targets, weights = head_problem
    _, (dh, _) = _mean_and_grads(hidden, emb, targets, weights, 4, tied=True)
    masked = np.asarray(weights) == 0
    assert masked.any() and not np.asarray(dh)[masked].any()
    assert np.asarray(dh)[~masked].any()


def test_bf16_compute_float32_accumulation(head_problem):
    """bf16 matmul inputs, float32 logits: tiled equals untiled to float32 rounding (the
    same bf16 products), and both within bf16's rounding of the float32 loss."""
    hidden, emb, targets, weights = head_problem
    f32, _ = _mean_and_grads(hidden, emb, targets, weights, None, tied=True)
    ref, ref_g = _mean_and_grads(hidden, emb, targets, weights, None, tied=True,
                                 dtype=jnp.bfloat16)
    got, got_g = _mean_and_grads(hidden, emb, targets, weights, 5, tied=True,
                                 dtype=jnp.bfloat16)
    assert got.dtype == jnp.float32
    assert abs(float(got) - float(ref)) <= 2e-6
    assert max_rel_err(ref_g, got_g) < 1e-2  # bf16 gradients (measured 2.7e-3)
    assert abs(float(got) - float(f32)) <= 1e-2 * abs(float(f32))


def _gpt(**kw):
    return GPT(GPTConfig(**{**dict(vocab=64, seq=16, layers=1, hidden=32, heads=4), **kw}))


def _random_like(shapes):
    def draw():  # one program, not one eager normal per leaf shape (CI time)
        keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(shapes))))
        return jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape), shapes)

    return jax.jit(draw)()


def test_llama_lm_loss_tiled():
    """The Llama (untied lm_head; weighted, masked tokens): lm_loss with vocab_tiles=3
    (tiles 6, 6, 4) equals the untiled lm_loss, values and gradients (the tied GPT:
    the stage tests below)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (2, 17)).astype(np.int32)
    weights = (rng.random((2, 16)) > 0.25).astype(np.float32)
    lcfg = dict(vocab=64, seq=16, layers=1, hidden=32, heads=4, kv_heads=2, mlp_hidden=48)

    def llama(**k):
        return Llama(LlamaConfig(**lcfg, **k))

    params = _random_like(jax.eval_shape(lambda: llama_params(llama(), 0)))

    def mean(p, m):
        loss_sum, weight_sum = lm_loss(m, weighted=True)(p, (tokens, weights))
        return loss_sum / weight_sum

    grad = jax.jit(jax.value_and_grad(mean), static_argnums=1)
    ref, got = grad(params, llama()), grad(params, llama(vocab_tiles=3))
    assert abs(float(got[0]) - float(ref[0])) <= 2e-6
    assert max_rel_err(ref[1], got[1]) < 1e-6


# measured: after 3 Adam steps the tiled params (stage 0 and 3) are within 4.4e-7 of
# the untiled single-device run, the untiled zerojax ones within 4.7e-7 (data=4 x
# model=2 at stage 3 with lm_loss(mesh=), the vocabulary split over model: 3.4e-7); the
# QKV bias 1.6e-4 to 2.7e-4 tiled or not
@pytest.mark.parametrize("stage,model", [(0, 1), (1, 1), (2, 1), (3, 1), (3, 2)])
def test_zero_stages_tiled_matches_single_device_untiled(stage, model):
    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, 64, (16, 17)).astype(np.int32),
                (rng.random((16, 16)) > 0.2).astype(np.float32)) for _ in range(3)]
    params = cached_gpt_params(_gpt())
    untiled = lm_loss(_gpt(), weighted=True)

    def ref_loss(p, b):
        s, n = untiled(p, b)
        return s / n

    ref = _reference(stage, params, ref_loss, batches)
    mesh = zerojax.make_mesh(data=8 // model, model=model)
    opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage)
    state = opt.init_state(params)
    # with the model axis: the vocabulary split over it (each shard its slice's logits)
    loss = lm_loss(_gpt(vocab_tiles=3), weighted=True, mesh=mesh if model > 1 else None)
    step = opt.train_step(loss, weighted=True)
    for b in batches:
        state, metrics = step(state, b)
    assert np.isfinite(float(metrics["loss"]))
    got = opt.full_params(state)
    # the key part of the QKV bias has an exactly-zero gradient (softmax is shift
    # invariant): Adam moves it by rounding noise only, in every run (test_gpt.py)
    noisy = ("blocks", "qkv", "bias")
    errs = {k: max_rel_err(a, b) for k, a, b in _leaves(ref, got)}
    assert max(e for k, e in errs.items() if k != noisy) < 4e-6, errs
    assert errs[noisy] < 1e-3, errs


def _leaves(ref, got):
    flat_ref = jax.tree_util.tree_flatten_with_path(ref)[0]
    flat_got = jax.tree.leaves(got)
    return [(tuple(getattr(k, "key", k) for k in path), a, b)
            for (path, a), b in zip(flat_ref, flat_got)]


def test_loss_curve_20_steps_stage3():
    """20 steps at stage 3, tiled (4 tiles of 4 tokens), against one device untiled:
    the same loss curve (measured: within 2.3e-7 relative at every step; 4.17 -> 2.84)."""
    batches = markov_tokens(20, 16, 16, 64, seed=3)
    params = cached_gpt_params(_gpt())
    tx = optax.adam(3e-3)
    untiled = lm_loss(_gpt())

    @jax.jit
    def ref_step(p, s, b):
        loss, g = jax.value_and_grad(untiled)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    # committed to one device from the first call (uncommitted inputs compiled the
    # step a second time for the committed ones it returns)
    p, s, want = jax.device_put((params, tx.init(params)), jax.devices()[0]) + ([],)
    for b in batches:
        p, s, loss = ref_step(p, s, b)
        want.append(float(loss))
    opt = zerojax.zero(tx, zerojax.make_mesh(data=8), stage=3)
    state = opt.init_state(cached_gpt_params(_gpt()))
    step = opt.train_step(lm_loss(_gpt(vocab_tiles=4)))
    got = []
    for b in batches:
        state, metrics = step(state, b)
        got.append(float(metrics["loss"]))
    assert want[-1] < want[0] - 1.0  # it learns
    np.testing.assert_allclose(got, want, rtol=1e-6)


_REF: dict = {}


def _reference(stage, params, loss_fn, batches):
    if "ref" not in _REF:
        _REF["ref"] = reference_run(optax.adam(1e-3), params, loss_fn, batches)
    return _REF["ref"]


def _stage3_peak(tiles, per_device):
    """The compiled (not run) stage-3 step's peak per device for a GPT whose logits
    dominate: vocab 32768, hidden 32, one layer, ``per_device`` sequences of 128
    tokens per device (16 MiB of float32 logits each)."""
    model = _gpt(vocab=32768, seq=128, hidden=32, heads=2, vocab_tiles=tiles)
    shapes = jax.eval_shape(lambda: gpt_params(model, 0))
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3)
    # compiled from shapes: nothing initialised or placed (CI time)
    tokens = jax.ShapeDtypeStruct((8 * per_device, 129), jnp.int32)
    return compiled_memory(compile_step(opt, lm_loss(model), shapes, tokens)).peak


def test_stage3_peak_drops_by_the_logits_share():
    """The logits' part of the peak (what grows with the tokens: the per-token
    activations other than the logits are 32 floats a layer against 32768) shrinks by
    at least the tile count; the peak itself drops by more than half."""
    logits = logits_bytes(128, 32768)  # one sequence's float32 logits
    assert logits == 16 * 2**20
    peaks = {(tiles, n): _stage3_peak(tiles, n) for tiles in (None, 8) for n in (1, 2)}
    # measured (jax 0.10.2, MiB): untiled 38.8 / 71.5, 8 tiles 16.7 / 19.3
    assert peaks[8, 2] <= peaks[None, 2] / 2, peaks
    untiled = peaks[None, 2] - peaks[None, 1]  # one more sequence a device, untiled
    tiled = peaks[8, 2] - peaks[8, 1]
    # untiled: 32.7 MiB a sequence, 2.04 x its logits (the logits and their gradient);
    # 8 tiles: 2.6 MiB, 12.6x less (at most a tile's logits and their gradient)
    assert untiled >= 2 * logits, peaks
    assert tiled <= 2 * logits / 8 * 1.05, peaks


def test_vocab_split_over_model_axis():
    """data=4 x model=2, stage 3, vocab 32768 in 8 tiles: with ``mesh`` each model
    shard's tile loop holds its half of the head (16384 rows) and its half of the
    logits, the log-sum-exp / target logit reduced over ``model``; the peak drops."""
    mesh = zerojax.make_mesh(data=4, model=2)
    model = _gpt(vocab=32768, seq=128, hidden=32, heads=2, vocab_tiles=8)
    shapes = jax.eval_shape(lambda: gpt_params(model, 0))
    opt = zerojax.zero(optax.adam(1e-3), mesh, stage=3)
    tokens = jax.ShapeDtypeStruct((8, 129), jnp.int32)
    peaks, texts = {}, {}
    for split in (False, True):
        loss = lm_loss(model, mesh=mesh if split else None)
        compiled = compile_step(opt, loss, shapes, tokens)  # from shapes (CI time)
        peaks[split], texts[split] = compiled_memory(compiled).peak, compiled.as_text()
    # the scanned tile loop carries the head's model slice, not the whole head
    loops = [line for line in texts[True].splitlines() if "parameter(0)" in line
             and "= (s32[]" in line and "f32[8,2,16,32]" in line]
    assert loops and all("f32[16384,32]" in line and "f32[32768,32]" not in line
                         for line in loops), loops
    # measured (jax 0.10.2, MiB): 21.3 without the split, 15.4 with it
    assert peaks[True] <= 0.8 * peaks[False], peaks
    with pytest.raises(ValueError, match="vocab_axis='tensor' is not an axis"):
        lm_head_loss(jnp.ones((1, 2, 4)), jnp.ones((4, 8)), jnp.zeros((1, 2), jnp.int32),
                     tiles=2, mesh=mesh, vocab_axis="tensor")


def test_bad_input_named(head_problem):
    hidden, emb, targets, _ = head_problem
    for tiles, text in ((0, "tiles=0 must be >= 1"), (-2, "tiles=-2 must be >= 1"),
                        (14, "tiles=14 is larger than the sequence it splits (13)"),
                        (2.0, "tiles must be an int")):
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            lm_head_loss(hidden, emb, targets, tied=True, tiles=tiles)
    with pytest.raises(ValueError, match=r"head has shape \(97, 16\).*width 16.*tied=True"):
        lm_head_loss(hidden, emb, targets, tiles=2)  # an embedding passed as a kernel
    with pytest.raises(ValueError, match=r"head has shape \(97, 15\)"):
        lm_head_loss(hidden, emb[:, :15], targets, tied=True, tiles=2)
    with pytest.raises(ValueError, match=r"weights have shape \(3, 12\)"):
        lm_head_loss(hidden, emb, targets, tied=True, weights=jnp.ones((3, 12)))
    for bad in (0, -1, True, 17):
        with pytest.raises(ValueError, match=f"GPTConfig.vocab_tiles.*{bad!r}"):
            _gpt(vocab_tiles=bad)
    with pytest.raises(ValueError, match="LlamaConfig.vocab_tiles=200 is larger than seq"):
        LlamaConfig(vocab=64, seq=16, vocab_tiles=200)
    assert check_tiles(16, 16, "sequence") == 16


class _Wide(nn.Module):
    """A layer whose gathered weight is the largest buffer: (256, 8192) float32, 8 MiB
    whole, against 16 x 8192 activations."""

    tiles: int | None

    @nn.compact
    def __call__(self, x):
        wide = (nn.Dense(8192, name="wide") if self.tiles is None
                else TiledDense(8192, self.tiles, name="wide"))
        return nn.Dense(4, name="out")(jnp.tanh(wide(x)))


def _wide_loss(net):
    def loss(p, x):
        return jnp.mean(net.apply({"params": p}, x) ** 2)

    return loss


def test_tiled_dense_equals_dense():
    """Same init (the kernel is nn.Dense's, tiled), same output and gradients on one
    device; tiled_dense's function form on an uneven-looking (in, out) weight."""
    x = jax.random.normal(jax.random.key(1), (16, 256))
    ref_p = _Wide(None).init(jax.random.key(0), x)["params"]
    got_p = _Wide(8).init(jax.random.key(0), x)["params"]
    assert got_p["wide"]["kernel"].shape == (8, 256, 1024)
    assert jnp.array_equal(untile_kernel(got_p["wide"]["kernel"]), ref_p["wide"]["kernel"])
    ref_l, ref_g = jax.jit(jax.value_and_grad(_wide_loss(_Wide(None))))(ref_p, x)
    got_l, got_g = jax.jit(jax.value_and_grad(_wide_loss(_Wide(8))))(got_p, x)
    got_g["wide"]["kernel"] = untile_kernel(got_g["wide"]["kernel"])
    # measured (jax 0.10.2, XLA:CPU): loss and gradients bitwise equal
    assert abs(float(got_l) - float(ref_l)) <= 1e-6 * abs(float(ref_l))
    assert max_rel_err(ref_g, got_g) < 1e-6
    w = jax.random.normal(jax.random.key(2), (5, 12))
    xs = jax.random.normal(jax.random.key(3), (2, 3, 5))
    np.testing.assert_allclose(tiled_dense(xs, tile_kernel(w, 3)), xs @ w, rtol=1e-6,
                               atol=1e-6)


def test_tiled_dense_stage3_gathers_a_tile():
    """Stage 3 on 8 devices: the tiled layer gathers (256, 1024) per tile, never the
    whole (256, 8192); the compiled peak drops (measured 17.1 -> 4.1 MiB) and 3 SGD
    steps give the untiled run's parameters."""
    x = jax.random.normal(jax.random.key(1), (16, 256))
    peaks, kernels = {}, {}
    for tiles in (None, 8):
        net = _Wide(tiles)
        opt = zerojax.zero(optax.sgd(1e-3), zerojax.make_mesh(data=8), stage=3)
        state = opt.init_state(net.init(jax.random.key(0), x)["params"])
        step = opt.train_step(_wide_loss(net))
        compiled = step.lower(state, x).compile()
        peaks[tiles] = compiled_memory(compiled).peak
        text = compiled.as_text()
        assert ("f32[256,8192]" in text) == (tiles is None)
        for _ in range(3):
            state, _m = step(state, x)
        k = opt.full_params(state)["wide"]["kernel"]
        kernels[tiles] = k if tiles is None else untile_kernel(k)
    assert peaks[8] <= peaks[None] / 2, peaks
    assert max_rel_err(kernels[None], kernels[8]) < 1e-6  # measured: bitwise equal


def test_tiled_dense_bad_input():
    x = jnp.ones((2, 6))
    with pytest.raises(ValueError, match=r"tiles=6 leaves the last tile of the output "
                       r"dimension 10 empty .* use tiles=5"):
        TiledDense(10, 6).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"features=9 does not fit a kernel of 5 tiles"):
        tiled_dense(x, jnp.ones((5, 6, 3)), features=9)
    with pytest.raises(ValueError, match=r"bias has shape \(15,\), expected \(13,\)"):
        tiled_dense(x, jnp.ones((5, 6, 3)), jnp.ones(15), features=13)
    with pytest.raises(ValueError, match="tiles=0 must be >= 1"):
        TiledDense(12, 0).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="tiles=13 is larger than the output dimension"):
        tile_kernel(jnp.ones((6, 12)), 13)
    with pytest.raises(ValueError, match=r"kernel has shape \(2, 5, 6\).*in=6"):
        tiled_dense(x, jnp.ones((2, 5, 6)))


def test_tiled_dense_uneven_last_tile():
    """13 outputs in 5 tiles of ceil(13 / 5) = 3 columns: the last tile holds 1 real
    column and 2 zero ones. Values are nn.Dense's for the same key, the output and
    gradients equal nn.Dense's, the padding's gradient is exactly zero, and Adam keeps
    it zero."""
    x = jax.random.normal(jax.random.key(1), (4, 6))
    dense, tiled = nn.Dense(13), TiledDense(13, 5)   # ceil(13 / 5) = 3: 15 stored
    ref_p = dense.init(jax.random.key(0), x)["params"]
    got_p = tiled.init(jax.random.key(0), x)["params"]
    assert got_p["kernel"].shape == (5, 6, 3)
    assert jnp.array_equal(untile_kernel(got_p["kernel"], 13), ref_p["kernel"])
    assert not jnp.any(untile_kernel(got_p["kernel"])[:, 13:])

    def loss(net):
        return lambda p: jnp.sum(jnp.tanh(net.apply({"params": p}, x)) ** 2)

    ref_l, ref_g = jax.value_and_grad(loss(dense))(ref_p)
    got_l, got_g = jax.value_and_grad(loss(tiled))(got_p)
    # measured (jax 0.10.2, XLA:CPU): bitwise equal
    assert abs(float(got_l) - float(ref_l)) <= 1e-6 * abs(float(ref_l))
    whole = untile_kernel(got_g["kernel"])
    assert not jnp.any(whole[:, 13:])   # the padding gets no gradient
    assert max_rel_err(ref_g, {"kernel": whole[:, :13], "bias": got_g["bias"]}) < 1e-6
    opt = optax.adam(1e-2)
    p, s = got_p, opt.init(got_p)
    for _ in range(3):
        u, s = opt.update(jax.grad(loss(tiled))(p), s, p)
        p = optax.apply_updates(p, u)
    assert not jnp.any(untile_kernel(p["kernel"])[:, 13:])


def test_vocab_split_that_does_not_divide_warns():
    mesh = zerojax.make_mesh(data=2, model=4)
    hidden = jnp.ones((2, 4, 8))
    targets = jnp.zeros((2, 4), jnp.int32)
    with pytest.warns(UserWarning, match=r"vocabulary \(10\) is not split over 'model': "
                      r"its size 4 does not divide it.*\(e.g. 12\)"):
        got = lm_head_loss(hidden, jnp.ones((8, 10)), targets, tiles=2, mesh=mesh)
    ref = lm_head_loss(hidden, jnp.ones((8, 10)), targets, tiles=2)
    assert float(got[0]) == float(ref[0])
