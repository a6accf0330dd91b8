"""ZeRO++ quantized collectives (zerojax.quant): error bounds derived from the block
quantization, bitwise equalities, exact gradients, wire bytes read from the compiled HLO,
non-finite propagation, argument errors, and training against exact collectives."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from zerojax import compat, quant

N = 8
U32 = 2.0 ** -24  # float32 unit roundoff
UNIT = {np.dtype(np.float32): 0.0, np.dtype(jnp.bfloat16): 2.0 ** -8,
        np.dtype(np.float16): 2.0 ** -11}  # rounding of the cast back to a narrower dtype


# jitted: one compilation per shape instead of one per operation
quantize = jax.jit(quant.quantize_blocks, static_argnames=("bits", "block"))
dequantize = jax.jit(quant.dequantize_blocks, static_argnums=(2, 3))


def flat_mesh():
    return Mesh(np.array(jax.devices()[:N]), ("data",))


def two_level_mesh():
    return Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("replica", "data"))


# -- a numpy model of the block quantization -----------------------------------------


def np_quantize(row, bits: int, block: int):
    """``(q, scales, deq, b)`` for one float32 row, as the module documents it."""
    qmax = {8: 127, 4: 7}[bits]
    row = np.asarray(row, np.float32).ravel()
    b = quant._block_len(row.size, block, bits)
    nb = max(-(-row.size // b), 1)
    xb = np.zeros(nb * b, np.float32)
    xb[:row.size] = row
    xb = xb.reshape(nb, b)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.max(np.abs(xb), axis=1)
        scales = (amax * np.float32(1 / qmax)).astype(np.float32)
        ok = np.isfinite(scales) & (scales > 0)
        safe = np.where(ok, scales, np.float32(1)).astype(np.float32)
        q = np.where(ok[:, None], np.clip(np.round(xb / safe[:, None]), -qmax, qmax), 0)
        deq = (q.astype(np.float32) * scales[:, None]).ravel()[:row.size]
    return q.astype(np.int8), scales, deq, b


def np_bound(row, bits: int, block: int):
    """Per-element bound on |x - dequantize(quantize(x))| in float32 arithmetic:
    scale / 2 from rounding to the integer grid, plus (absmax + scale) * 2**-23 for the
    float32 division and product (see zerojax.quant's docstring)."""
    _, scales, _, b = np_quantize(row, bits, block)
    s = np.repeat(scales.astype(np.float64), b)[:np.size(row)]
    amax = s * {8: 127, 4: 7}[bits]
    return s / 2 + (amax + s) * 2 * U32, s


# -- quantize / dequantize -------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_round_trip_within_half_a_scale(bits, dtype):
    block = 64
    x = (3.0 * jax.random.normal(jax.random.key(1), (37, 29))).astype(dtype)  # 1073: padded
    q, scales = quantize(x, bits=bits, block=block)
    nb = -(-x.size // block)
    assert q.shape == ((nb, block) if bits == 8 else (nb, block // 2))
    assert q.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert scales.shape == (nb,) and scales.dtype == jnp.float32
    deq = dequantize(q, scales, x.shape, x.dtype)
    assert deq.shape == x.shape and deq.dtype == x.dtype

    x32 = np.asarray(x, np.float32).ravel()
    q_ref, s_ref, deq_ref, _ = np_quantize(x32, bits, block)
    np.testing.assert_array_equal(np.asarray(scales), s_ref)
    if bits == 8:
        np.testing.assert_array_equal(np.asarray(q), q_ref)
    np.testing.assert_array_equal(np.asarray(deq, np.float32).ravel(),
                                  deq_ref.astype(dtype).astype(np.float32))
    bound, s = np_bound(x32, bits, block)
    u = UNIT[np.dtype(dtype)]
    tiny = float(jnp.finfo(dtype).smallest_subnormal) / 2
    bound = bound + (s * {8: 127, 4: 7}[bits] + s) * u + tiny
    err = np.abs(np.asarray(deq, np.float64).ravel() - x32.astype(np.float64))
    assert np.all(err <= bound)
    if dtype == jnp.float32:
        # the bound is attained: rounding to the grid costs up to half a scale
        assert np.max(err / (s / 2)) > 0.95
    # every block's absmax lands on the end of the grid
    np.testing.assert_array_equal(np.max(np.abs(q_ref), axis=1), {8: 127, 4: 7}[bits])


def test_int4_packing_round_trips_and_halves_the_bytes():
    values = jnp.asarray(np.stack(np.meshgrid(np.arange(-8, 8), np.arange(-8, 8)), -1)
                         .reshape(-1, 2), jnp.int8).reshape(1, -1)  # every pair of nibbles
    packed = quant._pack_int4(values)
    assert packed.dtype == jnp.uint8 and packed.shape == (1, 256)
    assert len(set(np.asarray(packed).ravel().tolist())) == 256  # a byte per pair, no clash
    np.testing.assert_array_equal(np.asarray(quant._unpack_int4(packed)), np.asarray(values))

    x = jax.random.normal(jax.random.key(2), (4096 + 3,))
    q8, s8 = quantize(x, bits=8, block=512)
    q4, s4 = quantize(x, bits=4, block=512)
    assert q8.dtype == jnp.int8 and q4.dtype == jnp.uint8
    assert q4.nbytes * 2 == q8.nbytes == 9 * 512  # 9 blocks, the last one padded
    assert s4.nbytes == s8.nbytes == 9 * 4
    assert quant.wire_bytes(x.size, bits=4, block=512) == q4.nbytes + s4.nbytes
    assert quant.wire_bytes(x.size, bits=8, block=512) == q8.nbytes + s8.nbytes
    # the int4 codes are the int8 grid with 7 levels each side
    _, _, deq_ref, _ = np_quantize(np.asarray(x), 4, 512)
    np.testing.assert_array_equal(np.asarray(dequantize(q4, s4, x.shape, x.dtype)), deq_ref)


def test_small_tensor_is_one_block_and_zeros_stay_zero():
    q, s = quantize(jnp.ones((5,)), bits=4, block=2048)
    assert q.shape == (1, 3) and s.shape == (1,)  # 5 elements -> one block of 6
    x = jnp.zeros((3, 100)).at[2, 99].set(-2.5)
    q, s = quantize(x, bits=8, block=64)
    assert np.asarray(s).tolist()[:4] == [0.0, 0.0, 0.0, 0.0]
    deq = dequantize(q, s, x.shape, x.dtype)
    assert np.all(np.isfinite(np.asarray(deq)))
    np.testing.assert_array_equal(np.asarray(deq), np.asarray(x))  # absmax is exact


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("size,block", [(300, 64), (3 * 2048, 2048)])  # CPU's long-row max
def test_non_finite_input_gives_non_finite_block(bad, dtype, size, block):  # drops NaN
    at = block + 6
    x = jax.random.normal(jax.random.key(3), (size,)).astype(dtype).at[at].set(bad)
    q, s = quantize(x, bits=8, block=block)
    deq = np.asarray(dequantize(q, s, x.shape, x.dtype), np.float32)
    assert not np.isfinite(deq[at])
    assert not np.any(np.isfinite(deq[block:2 * block]))  # the whole block
    assert np.all(np.isfinite(deq[:block])) and np.all(np.isfinite(deq[2 * block:]))


# -- qwZ: quantized all-gather -----------------------------------------------------------


@pytest.mark.parametrize("dtype,axis,tiled,bits,axes", [
    (jnp.float32, 0, True, 8, "data"),
    (jnp.float32, 1, False, 4, "data"),
    (jnp.bfloat16, 1, True, 8, ("replica", "data")),
])
def test_quantized_all_gather_is_the_gather_of_dequantized_shards(dtype, axis, tiled, bits,
                                                                  axes):
    mesh = flat_mesh() if axes == "data" else two_level_mesh()
    block = 128
    x = (jax.random.normal(jax.random.key(4), (N, 24, 40))).astype(dtype)  # shard (24, 40)
    ct = jax.random.normal(jax.random.key(5), (N, *([N * 24, 40] if axis == 0 else
                                                   [24, N * 40]))).astype(dtype)
    if not tiled:
        ct = jax.random.normal(jax.random.key(5), (N, 24, N, 40)).astype(dtype)

    def body(s, c):
        s, c = s[0], c[0]
        got, vjp = jax.vjp(lambda s: quant.quantized_all_gather(
            s, axes, bits=bits, block=block, axis=axis, tiled=tiled), s)
        deq = quant.dequantize_blocks(*quant.quantize_blocks(s, bits=bits, block=block),
                                      s.shape, s.dtype)
        want = jax.lax.all_gather(deq, axes, axis=axis, tiled=tiled)
        (grad,) = vjp(c)
        want_grad = jax.lax.psum_scatter(c, axes, scatter_dimension=axis, tiled=tiled)
        return got[None], want[None], grad[None], want_grad[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(axes)),
                              out_specs=P(axes), check_vma=False))
    got, want, grad, want_grad = f(x, ct)
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for i in range(1, N):  # every device holds the same weights
        np.testing.assert_array_equal(np.asarray(got[i], np.float32),
                                      np.asarray(got[0], np.float32))
    assert grad.dtype == dtype
    np.testing.assert_array_equal(np.asarray(grad, np.float32),
                                  np.asarray(want_grad, np.float32))


def test_quantized_all_gather_under_check_vma_and_grad():
    mesh = flat_mesh()
    w = jax.random.normal(jax.random.key(6), (N * 16, 32))

    def loss(w_shard, x):
        full = quant.quantized_all_gather(w_shard, "data", block=256)
        return jnp.sum(jnp.tanh(x @ full.T))

    def body(w_shard, x):
        return jax.grad(loss)(w_shard, x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=P("data")))
    x = jax.random.normal(jax.random.key(7), (N * 2, 32))
    g = f(w, x)
    # straight-through: the gradient at the dequantized weights, reduce-scattered exactly
    deq = jnp.concatenate([dequantize(*quantize(s, block=256), s.shape, s.dtype)
                           for s in jnp.split(w, N)])
    want = jax.jit(jax.grad(lambda full: jnp.sum(jnp.tanh(x @ full.T))))(deq)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5)


# -- qgZ: quantized reduce-scatter ---------------------------------------------------------


def flat_bound(pieces, bits, block):
    """Bound on |quantized sum - exact sum| for ``pieces`` (n_src, chunk): each contribution
    within its own block bound, plus the float32 sum of n_src terms."""
    n = pieces.shape[0]
    per, mags = [], []
    for row in pieces:
        bound, s = np_bound(row, bits, block)
        per.append(bound)
        mags.append(np.abs(row.astype(np.float64)) + s)
    return np.sum(per, 0) + (n - 1) * U32 * np.sum(mags, 0)


def run_reduce_scatter(mesh, axes, g, bits, block, dim, **kw):
    spec = P(axes)

    def body(g):
        g = g[0]
        got = quant.quantized_reduce_scatter(g, axes, bits=bits, block=block,
                                             scatter_dimension=dim, **kw)
        want = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
        return got[None], want[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                              check_vma=False))
    return [np.asarray(a) for a in f(g)]


def as_pieces(full, dim, n):
    """(n, chunk) view of a full-shape array: row k is device k's shard along ``dim``."""
    moved = np.moveaxis(np.asarray(full), dim, 0)
    return moved.reshape(n, -1)


@pytest.mark.parametrize("bits,dim", [(8, 0), (4, 1)])
def test_quantized_reduce_scatter_within_the_sum_of_block_bounds(bits, dim):
    block = 64
    shape = (N * 5, 37) if dim == 0 else (37, N * 5)  # chunk 185: blocks padded
    g = jax.random.normal(jax.random.key(8), (N, *shape))
    g = g * jnp.exp(jax.random.normal(jax.random.key(9), (N, 1, 1)))  # unequal scales
    got, want = run_reduce_scatter(flat_mesh(), "data", g, bits, block, dim)
    assert got.shape == want.shape == (N, *[s // N if i == dim else s
                                            for i, s in enumerate(shape)])
    exact = np.sum(np.asarray(g, np.float64), axis=0)
    pieces = np.stack([as_pieces(gi, dim, N) for gi in np.asarray(g)])  # (src, dst, chunk)
    for k in range(N):
        bound = flat_bound(pieces[:, k], bits, block)
        got_k = np.moveaxis(got[k], dim, 0).ravel().astype(np.float64)
        err = np.abs(got_k - as_pieces(exact, dim, N)[k])
        assert np.all(err <= bound), (k, np.max(err / bound))
        # the exact psum_scatter puts the same shard here
        assert np.all(np.abs(np.moveaxis(want[k], dim, 0).ravel() - got_k) <= bound + 1e-5)
    assert np.max(np.abs(got - want)) > 0  # it is quantized


def test_quantized_reduce_scatter_of_half_precision():
    """Summed in float32, cast back once: the bound gains one rounding of the result."""
    dtypes = (jnp.bfloat16, jnp.float16)
    gs = [jax.random.normal(jax.random.key(15), (N, N * 4, 40)).astype(d) for d in dtypes]
    f = jax.jit(jax.shard_map(  # check_vma on: the types of a real step
        lambda *gs: [quant.quantized_reduce_scatter(g[0], "data", block=64)[None] for g in gs],
        mesh=flat_mesh(), in_specs=P("data"), out_specs=P("data")))
    for dtype, g, got in zip(dtypes, gs, f(*gs)):
        assert got.dtype == dtype and got.shape == (N, 4, 40)
        g32 = np.asarray(g, np.float32)
        exact = as_pieces(np.sum(g32.astype(np.float64), axis=0), 0, N)
        pieces = np.stack([as_pieces(gi, 0, N) for gi in g32])
        u = UNIT[np.dtype(dtype)]
        for k in range(N):
            bound = flat_bound(pieces[:, k], 8, 64)
            bound = bound + (np.abs(exact[k]) + bound) * u + float(
                jnp.finfo(dtype).smallest_subnormal) / 2
            err = np.abs(np.asarray(got[k], np.float64).ravel() - exact[k])
            assert np.all(err <= bound)


def hierarchical_bound(pieces4, bits, block):
    """Bound for ("replica", "data") = (R, D): pieces4[src_r, src_d, dst_r, dst_d, chunk].

    Level 1 (data): device (r, d) sums the D contributions of its replica to each row r'
    (E1 = flat bound of those D pieces). Level 2 (replica): those partial sums, whose
    absmax is at most the exact one plus E1, are requantized and summed over R."""
    R, D = pieces4.shape[:2]
    bounds = np.zeros(pieces4.shape[2:])
    for dst_r in range(R):
        for dst_d in range(D):
            total = 0.0
            mags = 0.0
            for src_r in range(R):
                contrib = pieces4[src_r, :, dst_r, dst_d]  # (D, chunk): level-1 inputs
                e1 = flat_bound(contrib, bits, block)
                partial = np.sum(contrib.astype(np.float64), 0)
                worst = np.abs(partial) + e1  # |partial as computed| <= this
                b2, s2 = np_bound(worst.astype(np.float32), bits, block)
                s2 = s2 * (1 + 2 * U32)  # worst rounded to float32
                b2 = b2 * (1 + 2 * U32)
                total = total + e1 + b2
                mags = mags + worst + s2
            bounds[dst_r, dst_d] = total + (R - 1) * U32 * mags
    return bounds


@pytest.mark.parametrize("bits", [8, 4])
def test_hierarchical_reduce_scatter_on_replica_x_data(bits):
    block, R, D = 64, 2, 4
    g = jax.random.normal(jax.random.key(10), (N, N * 6, 33))  # chunk 198
    mesh = two_level_mesh()
    axes = ("replica", "data")
    hier, want = run_reduce_scatter(mesh, axes, g, bits, block, 0)
    flat, _ = run_reduce_scatter(mesh, axes, g, bits, block, 0, hierarchical=False)
    exact = as_pieces(np.sum(np.asarray(g, np.float64), axis=0), 0, N)  # (dst, chunk)
    pieces = np.stack([as_pieces(gi, 0, N) for gi in np.asarray(g)])  # (src, dst, chunk)
    b_hier = hierarchical_bound(pieces.reshape(R, D, R, D, -1), bits, block).reshape(N, -1)
    b_flat = np.stack([flat_bound(pieces[:, k], bits, block) for k in range(N)])
    hier, flat, want = (a.reshape(N, -1).astype(np.float64) for a in (hier, flat, want))
    assert np.all(np.abs(hier - exact) <= b_hier)
    assert np.all(np.abs(flat - exact) <= b_flat)
    assert np.all(np.abs(hier - flat) <= b_hier + b_flat)
    assert np.all(np.abs(want - exact) <= 1e-4)  # device k holds shard k, as psum_scatter
    assert np.max(np.abs(hier - flat)) > 0  # two quantizations, not one


def test_quantized_reduce_scatter_grad_is_the_exact_all_gather():
    mesh = flat_mesh()
    g = jax.random.normal(jax.random.key(11), (N, N * 4, 16))
    ct = jax.random.normal(jax.random.key(12), (N, 4, 16))

    def body(g, c):
        _, vjp = jax.vjp(lambda g: quant.quantized_reduce_scatter(g, "data", bits=4), g[0])
        return vjp(c[0])[0][None], jax.lax.all_gather(c[0], "data", tiled=True)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=P("data"), check_vma=False))
    got, want = f(g, ct)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_non_finite_gradients_reach_the_owner():
    mesh = flat_mesh()
    g = jax.random.normal(jax.random.key(13), (N, N * 4, 16))
    g = g.at[3, 21, 5].set(jnp.inf).at[6, 2, 0].set(jnp.nan).at[1, 30, 15].set(-jnp.inf)
    x = jax.random.normal(jax.random.key(14), (N, 4, 16)).at[2, 0, 0].set(jnp.nan)
    x = x.at[7, 3, 15].set(jnp.inf)

    def body(g, x):
        return ([quant.quantized_reduce_scatter(g[0], "data", bits=b, block=32)[None]
                 for b in (8, 4)] + [quant.quantized_all_gather(x[0], "data", block=32)[None]])

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              check_vma=False))
    *reduced, gathered = f(g, x)
    for got in reduced:
        # device k holds rows 4k..4k+3 (64 elements, blocks of 32): row 21 col 5 is device
        # 5's element 21 (block 0), row 2 col 0 device 0's 32, row 30 col 15 device 7's 47
        bad = ~np.isfinite(np.asarray(got)).reshape(N, -1)
        blocks = {(int(k), int(i) // 32) for k, i in zip(*np.nonzero(bad))}
        assert blocks == {(5, 0), (0, 1), (7, 1)}  # exactly the blocks holding them
        assert np.all(bad[5, :32]) and np.all(bad[0, 32:]) and np.all(bad[7, 32:])
    out = ~np.isfinite(np.asarray(gathered)).reshape(N, -1)  # every device sees them
    assert np.all(out[:, 128:160]) and np.all(out[:, 7 * 64 + 32:])
    assert not np.any(out[:, :128]) and not np.any(out[:, 160:7 * 64 + 32])


# -- bytes on the wire, from the compiled HLO ---------------------------------------------

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "s32": 4}
_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|[a-z0-9]+\[[^\]]*\]\{[^}]*\}|[a-z0-9]+\[[^\]]*\])\s+"
                         r"(all-gather|all-to-all|reduce-scatter|all-reduce)(?:-start)?\(")


def wire(compiled):
    """[(opcode, dtypes, bytes, group size)] for each collective of a compiled program:
    the gathered result of an all-gather, the operands (= results) of an all-to-all, the
    input (group size x result) of a reduce-scatter."""
    text = compiled.as_text()
    out = []
    for line in text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        arrays = re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", m.group(1))
        nbytes = sum(_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                     for t, dims in arrays)
        group = compat.replica_group_size(compat.replica_groups_attr(line), N)
        if m.group(2) == "reduce-scatter":
            nbytes *= group
        out.append((m.group(2), {t for t, _ in arrays}, nbytes, group))
    return out


def compile_body(mesh, body, spec_in, spec_out, *args):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec_in, out_specs=spec_out,
                              check_vma=False))
    return f.lower(*args).compile()


def test_hlo_bytes_of_the_quantized_all_gather():
    mesh, block = flat_mesh(), 2048
    w = jnp.ones((N * 256, 512))  # shard: 131072 elements
    exact = wire(compile_body(mesh, lambda s: jax.lax.all_gather(s, "data", tiled=True),
                              P("data"), P(), w))
    quantized = wire(compile_body(mesh, lambda s: quant.quantized_all_gather(
        s, "data", block=block), P("data"), P(), w))
    assert [(op, t) for op, t, _, _ in exact] == [("all-gather", {"f32"})]
    # blocks and their scales (bit-cast to 4 bytes each) in one int8 all-gather
    assert [(op, t) for op, t, _, _ in quantized] == [("all-gather", {"s8"})]
    q_bytes = quantized[0][2]
    assert exact[0][2] == 4 * w.size
    assert q_bytes == N * quant.wire_bytes(256 * 512, bits=8, block=block)
    assert q_bytes / exact[0][2] == pytest.approx(0.25 + 1 / block, abs=1e-12)


@pytest.mark.parametrize("bits", [8, 4])
def test_hlo_bytes_of_the_quantized_reduce_scatter(bits):
    mesh, block = flat_mesh(), 2048
    g = jnp.ones((N * 256, 512))
    chunk = 256 * 512
    exact = wire(compile_body(mesh, lambda g: jax.lax.psum_scatter(g, "data", tiled=True),
                              P(), P("data"), g))
    quantized = wire(compile_body(mesh, lambda g: quant.quantized_reduce_scatter(
        g, "data", bits=bits, block=block), P(), P("data"), g))
    assert [(op, t) for op, t, _, _ in exact] == [("reduce-scatter", {"f32"})]
    assert exact[0][2] == 4 * g.size
    payload = {8: "s8", 4: "u8"}[bits]
    assert [(op, t) for op, t, _, _ in quantized] == [("all-to-all", {payload})]
    q_bytes = quantized[0][2]
    assert q_bytes == N * quant.wire_bytes(chunk, bits=bits, block=block)
    assert q_bytes / exact[0][2] == pytest.approx(bits / 32 + 1 / block, abs=1e-12)


def test_hlo_bytes_of_the_hierarchical_reduce_scatter():
    mesh, block, R, D = two_level_mesh(), 2048, 2, 4
    g = jnp.ones((N * 256, 512))
    chunk = 256 * 512
    ops = wire(compile_body(mesh, lambda g: quant.quantized_reduce_scatter(
        g, ("replica", "data"), bits=4, block=block), P(), P(("replica", "data")), g))
    assert sorted((op, tuple(t), group) for op, t, _, group in ops) == [
        ("all-to-all", ("u8",), R), ("all-to-all", ("u8",), D)]
    inner = sum(b for _, _, b, group in ops if group == D)
    outer = sum(b for _, _, b, group in ops if group == R)
    assert inner == R * D * quant.wire_bytes(chunk, bits=4, block=block)
    assert outer == R * quant.wire_bytes(chunk, bits=4, block=block)  # 1/D crosses replicas
    assert outer * D == inner


# -- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 3}, r"bits must be 8 .* or 4 .*got 3"),
    ({"bits": True}, r"bits must be 8"),
    ({"block": 0}, r"block must be a positive int .*got 0; pass e\.g\. block="),
    ({"block": 2.5}, r"got 2\.5"),
    ({"bits": 4, "block": 33}, r"block must be even for bits=4.*got 33"),
])
def test_bad_arguments_name_the_value_and_the_fix(kwargs, match):
    x = jnp.ones((16,))
    with pytest.raises(ValueError, match=match):
        quant.quantize_blocks(x, **kwargs)
    mesh = flat_mesh()
    for fn in (quant.quantized_all_gather, quant.quantized_reduce_scatter):
        f = jax.shard_map(lambda s, fn=fn: fn(s, "data", **kwargs), mesh=mesh,
                          in_specs=P("data"), out_specs=P("data"), check_vma=False)
        with pytest.raises(ValueError, match=match):
            jax.jit(f).lower(jnp.ones((N * 8,)))


def test_non_float_input_is_refused():
    with pytest.raises(ValueError, match=r"got dtype int32; cast it first"):
        quant.quantize_blocks(jnp.ones((16,), jnp.int32))
    with pytest.raises(ValueError, match=r"got dtype complex64"):
        quant.quantize_blocks(jnp.ones((16,), jnp.complex64))
    mesh = flat_mesh()
    for fn in (quant.quantized_all_gather, quant.quantized_reduce_scatter):
        f = jax.shard_map(lambda s, fn=fn: fn(s, "data"), mesh=mesh, in_specs=P("data"),
                          out_specs=P("data"), check_vma=False)
        with pytest.raises(ValueError, match=r"quantize.*got dtype int32"):
            jax.jit(f).lower(jnp.ones((N * 8,), jnp.int32))


def test_indivisible_scatter_dimension_is_refused():
    f = jax.shard_map(lambda g: quant.quantized_reduce_scatter(g, "data"), mesh=flat_mesh(),
                      in_specs=P(), out_specs=P("data"), check_vma=False)
    with pytest.raises(ValueError, match=r"\(12\) is not divisible by the 8 devices"):
        jax.jit(f).lower(jnp.ones((12, 3)))


# -- training --------------------------------------------------------------------------------


def test_quantized_zero3_trains_like_exact():
    """30 Adam steps of a small GPT (tests/quant_training.py): the quantized steps' losses
    stay within 1% of the exact step's at every step (200 steps: benchmarks/quant_block.py,
    figures in benchmarks/README.md)."""
    import quant_training as qt

    exact = qt.train("exact", 30)
    int4 = qt.train("int4", 30)
    assert exact[-1] < 0.75 * exact[0]  # it learns
    assert np.max(np.abs(int4 / exact - 1)) < 0.01
