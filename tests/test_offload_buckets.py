"""Issue 50: the offloaded update's buckets are bounded whatever the largest leaf: a leaf
larger than the bucket is cut into pieces along its free axes (zerojax.tiers.buckets),
bitwise the whole leaf's update."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, regression_batches
from test_offload import update_parts

import zerojax
from zerojax.tiers import buckets as B, offload

STEPS = 2  # FMA contraction shows from step 2 (the moments nonzero)


def _run(mesh, steps=STEPS, **options):
    opt = zerojax.zero(optax.adamw(1e-2), mesh, **options)
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    k = options.get("accum_steps", 1)
    for b in regression_batches(steps):
        state, _ = step(state, tuple(x.reshape(k, -1, *x.shape[1:]) for x in b) if k > 1 else b)
    return jax.tree.map(np.asarray, (opt.full_params(state), state.opt_state))


def _same(a, b) -> list:
    """The leaves of ``a`` that differ from ``b`` (by path)."""
    fa = jax.tree_util.tree_flatten_with_path(a)[0]
    return [jax.tree_util.keystr(p) for (p, x), y in zip(fa, jax.tree.leaves(b))
            if not np.array_equal(x, y)]


@pytest.mark.parametrize("axes, options", [
    # fp32 at stage 1; bf16 params over fp32 master weights with micro-batches at stage
    # 2; fp16 params with fp32 master weights and dynamic loss scaling, the params
    # offloaded too, on a model axis at stage 3
    (dict(data=8), dict(stage=1)),
    (dict(data=8), dict(stage=2, param_dtype=jnp.bfloat16, accum_steps=2)),
    (dict(data=4, model=2), dict(stage=3, param_dtype=jnp.float16, offload_params=True)),
], ids=["stage1_fp32", "stage2_bf16_accum", "stage3_fp16_model"])
def test_a_leaf_ten_times_the_bucket_trains_bitwise(monkeypatch, axes, options):
    """dense2's kernel (64 x 37, with its master and moments 7,104 offloaded elements) in
    buckets of about 710: cut into pieces, bitwise the whole-leaf buckets of before issue
    50 and the step without offload. The bucket is set through the default per device
    (bucket_size would bucket the collectives too, which rounds apart by itself:
    docs/architecture.md)."""
    mesh = zerojax.make_mesh(**axes)
    data = axes["data"]
    monkeypatch.setattr(offload, "DEFAULT_BUCKET_PER_DEVICE", 710 // data)
    packed = []
    pack = B.pack

    def spy(groups, capacity, option="bucket_size"):
        out = pack(groups, capacity, option)
        packed.append(out[0])
        return out

    monkeypatch.setattr(B, "pack", spy)
    cut = _run(mesh, offload_optimizer=True, **options)
    pieces = [b for b in packed[-1] if b.region is not None]
    assert len(pieces) >= 10 and max(b.elements for b in packed[-1]) <= 710 // data * data
    plain = _run(mesh, **options)
    assert not _same(cut[0], plain[0])
    if options["stage"] == 3:  # before issue 50: each group whole, one bucket
        monkeypatch.setattr(B, "free_axes", lambda *a, **k: ())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = _run(mesh, offload_optimizer=True, **options)
        assert not _same(cut, whole)


def test_the_opaque_piece_form_trains_bitwise_the_static_one(monkeypatch):
    """ZEROJAX_PIECE_FORM=opaque (the GPU benchmark's other form: the pieces' starts
    runtime values, so their slices stay dynamic-slice / dynamic-update-slice when
    compiled): the same step, bitwise; the compiled program slices host operands with
    runtime indices where the static form's are folded."""
    mesh = zerojax.make_mesh(data=8)
    monkeypatch.setattr(offload, "DEFAULT_BUCKET_PER_DEVICE", 710 // 8)
    runs, texts = {}, {}
    for form in offload.PIECE_FORMS:
        monkeypatch.setenv("ZEROJAX_PIECE_FORM", form)
        runs[form] = _run(mesh, stage=1, offload_optimizer=True)
        opt = zerojax.zero(optax.adamw(1e-2), mesh, stage=1, offload_optimizer=True)
        state = opt.init_state(awkward_params())
        step = opt.train_step(awkward_loss)
        texts[form] = step.jitted.lower(
            state, step.place_batch(regression_batches(1)[0]), None).as_text()
    assert not _same(runs["static"], runs["opaque"])
    barrier = re.compile(r"optimization_barrier[^\n]*tensor<i32>")
    assert barrier.search(texts["opaque"]) and not barrier.search(texts["static"])
    monkeypatch.setenv("ZEROJAX_PIECE_FORM", "nope")
    with pytest.raises(ValueError, match="ZEROJAX_PIECE_FORM='nope'.*static"):
        _run(mesh, steps=1, stage=1, offload_optimizer=True)


# -- bounds ---------------------------------------------------------------------------
def _adam_update(params, tx=None):
    """``(fn, operands, on_host, out_to_host)``: an Adam update (or ``tx``'s) of
    ``params`` with the params and state offloaded (test_offload.update_parts)."""
    fn, operands, on_host = update_parts(tx or optax.adam(1e-2), params)
    return fn, operands, on_host, [h for h in on_host if h]


ROWS, COLS, CAP = 8, 32, 3 * 8 * 32  # a bucket: one (8, 32) leaf with its moments
MODELS = {"one_leaf_10x": {"big": jnp.ones((10 * ROWS, COLS))},
          "ten_leaves_1x": {f"l{i}": jnp.ones((ROWS, COLS)) for i in range(10)}}


def test_the_buckets_do_not_grow_with_the_largest_leaf():
    """bucket_plan, the planner's mirror and the program lowered for a GPU: a leaf ten
    times the bucket moves the bytes ten leaves of one bucket move, per bucket."""
    moved = {}
    for name, params in MODELS.items():
        fn, operands, on_host, out_host = _adam_update(params)
        plan = offload.bucket_plan(fn, operands, on_host, CAP, 16, detail=True)
        assert [p["elements"] for p in plan] == [CAP] * 10, name
        shapes = [x.shape for x in params.values()]
        assert B.bucket_sizes(shapes, 3, CAP, 16) == [CAP] * 10  # the planner's mirror
        mesh = zerojax.make_mesh(data=8)
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
        placed = [jax.device_put(x, sh.with_memory_kind(offload.HOST if h else "device"))
                  if x.ndim else x for x, h in zip(operands, on_host)]

        def step(*xs, fn=fn, on_host=on_host, out_host=out_host):
            return offload.update_in_buckets(fn, list(xs), on_host, out_host, CAP, 16,
                                             sharded=[(1,) if getattr(x, "ndim", 0) else None
                                                      for x in xs])

        text = jax.jit(step).trace(*placed).lower(lowering_platforms=("cuda",)).as_text()
        to_device = re.findall(r"annotate_device_placement\(%[^)]*\).*?_xla_buffer_placement"
                               r" = \"device\".*?: \((tensor<[^>]*>)\)", text)
        moved[name] = sorted(set(to_device))
        assert len(to_device) == 3 * 10 + 1, name  # per bucket its 3 pieces; the count
    # the same tensors come to the device: an (8, 32) piece (global; 8 x 4 a device)
    assert moved["one_leaf_10x"] == moved["ten_leaves_1x"] == ["tensor<8x32xf32>",
                                                               "tensor<i32>"]


@pytest.mark.parametrize("axes, options", [
    (dict(data=8), dict(stage=1)),
    (dict(data=4, model=2), dict(stage=3, param_dtype=jnp.float16, offload_params=True)),
], ids=["stage1_fp32", "stage3_fp16_model"])
def test_pieces_written_over_the_donated_state_train_bitwise(monkeypatch, axes, options):
    """offload.IN_PLACE (the form a GPU mesh gets): each piece's new master weights and
    moments written into the donated old leaf, one piece behind its reads, instead of
    into a host buffer of their own: bitwise the same training, at stage 1 fp32 and at
    stage 3 with fp16 params over fp32 master weights, the params offloaded too, on a
    model axis; and lowered for CUDA, no host buffer is made for those leaves (two
    scalar broadcasts to a whole cut leaf fewer per leaf: its mu and nu; at stage 3
    the new fp16 params too, written over the old ones)."""
    mesh = zerojax.make_mesh(**axes)
    monkeypatch.setattr(offload, "DEFAULT_BUCKET_PER_DEVICE", 710 // axes["data"])
    runs, buffers = {}, {}
    for form in (False, True):
        monkeypatch.setattr(offload, "IN_PLACE", form)
        runs[form] = _run(mesh, offload_optimizer=True, **options)
        opt = zerojax.zero(optax.adamw(1e-2), mesh, offload_optimizer=True, **options)
        state = opt.init_state(awkward_params())
        step = opt.train_step(awkward_loss)
        text = step.jitted.trace(state, step.place_batch(regression_batches(1)[0]),
                                 None).lower(lowering_platforms=("cuda",)).as_text()
        buffers[form] = len(re.findall(
            r"broadcast_in_dim %\S+, dims = \[\] : \(tensor<f32>\) -> tensor<64x37xf32>"
            if options["stage"] == 1 else
            r"broadcast_in_dim %\S+, dims = \[\] : \(tensor<f16>\)", text))
    assert not _same(runs[False], runs[True])
    # stage 1: dense2's kernel (64 x 37) is cut, its mu and nu get no buffer; stage 3:
    # the new fp16 params of the three cut leaves go into the old ones' host buffers
    assert buffers[True] == buffers[False] - (2 if options["stage"] == 1 else 3), buffers
    monkeypatch.setattr(offload, "IN_PLACE", None)
    assert not offload.in_place(mesh)  # the CPU keeps buffers of their own (see IN_PLACE)


def test_the_step_lowered_for_a_gpu_moves_pieces_never_a_whole_large_leaf(monkeypatch):
    """The stage-3 step (fp32 Adam, mu and nu offloaded, buckets of 704 elements), lowered
    for CUDA from the CPU: what moves between host and device memory is pieces of at
    most one bucket's share (mu's and nu's pieces: 352 elements each) and the small
    leaves; dense2's kernel (64 x 37, 2,368 elements) never moves whole, and its new
    values are written into a host buffer made as a scan's host stack is (no device
    zeros moved to the host)."""
    monkeypatch.setattr(offload, "DEFAULT_BUCKET_PER_DEVICE", 88)  # x 8 devices: 704
    opt = zerojax.zero(optax.adamw(1e-2), zerojax.make_mesh(data=8), stage=3,
                       offload_optimizer=True)
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    text = step.jitted.trace(state, step.place_batch(regression_batches(1)[0]), None).lower(
        lowering_platforms=("cuda",)).as_text()
    moves = re.findall(r"annotate_device_placement\(%[^)]*\).*?_xla_buffer_placement = "
                       r"\"(\w+)\".*?: \(tensor<([^>]*)>\)", text)
    sizes = {int(np.prod([int(d) for d in t.split("x")[:-1]] or [1])) for _, t in moves}
    assert max(sizes) <= 704 // 2, sorted(sizes)
    assert {w for w, _ in moves} == {"device", "pinned_host"}
    assert "dynamic_update_slice" in text


def test_an_axis_named_for_a_one_device_mesh_axis_may_be_cut():
    """sharded_axes names only axes split over more than one device: on one GPU
    (data=1) ZeRO's ``data`` axis is whole, so a stacked leaf is cut along its leading
    axes (contiguous pieces) and not along the minor axis (a strided range, one DMA a
    row), which the H200-compiled GPT step had: f32[32000, 174] pieces of the
    embedding, f32[1, 8192, 682] of the MLP stack."""
    P = jax.sharding.PartitionSpec
    one, eight = zerojax.make_mesh(data=1, devices=jax.devices()[:1]), zerojax.make_mesh(data=8)
    two = zerojax.make_mesh(data=2, model=4)
    got = offload.sharded_axes([
        jax.sharding.NamedSharding(one, P(None, "data")),
        jax.sharding.NamedSharding(eight, P(None, "data")),
        jax.sharding.NamedSharding(two, P(("data", "model"), None)),
        jax.sharding.NamedSharding(two, P(None, "model", "data")), None])
    assert got == [(), (1,), (0,), (1, 2), None]
    params = {"stack": jnp.ones((4, 64, 32))}
    fn, operands, on_host, _ = _adam_update(params)
    sharded = [offload.sharded_axes([jax.sharding.NamedSharding(one, P(None, "data"))])[0]
               if getattr(x, "ndim", 0) == 3 else None for x in operands]
    plan = offload.bucket_plan(fn, operands, on_host, 3 * 16 * 32, 16, sharded=sharded,
                               detail=True)
    regions = [p["region"] for p in plan]
    assert len(regions) == 16 and all(r[2] == (0, 32) for r in regions), regions


# -- what is refused, what is kept whole ----------------------------------------------
def test_a_bucket_smaller_than_a_row_is_refused_naming_the_leaf_and_its_row():
    fn, operands, on_host, _ = _adam_update(MODELS["one_leaf_10x"])
    names = ["params['big']"] + [None] * (len(operands) - 1)
    # cut along both axes (nothing sharded), its finest piece is one element and its moments
    with pytest.raises(B.BucketTooSmall, match=r"bucket_size=2 elements is smaller than one "
                       r"row of params\['big'\] \(shape \(80, 32\), 3 offloaded elements a "
                       r"row.*Raise bucket_size to at least 3"):
        offload.bucket_plan(fn, operands, on_host, 2, 16, names=names)
    # sharded along its columns, a row is a whole row: 3 x 32 elements
    with pytest.raises(B.BucketTooSmall, match=r"96 offloaded elements a row"):
        offload.bucket_plan(fn, operands, on_host, 90, 16, names=names,
                            sharded=[(1,)] + [None] * (len(operands) - 1))


@pytest.mark.parametrize("tx", [optax.lamb(1e-2), optax.adafactor(1e-2, min_dim_size_to_factor=8)],
                         ids=["lamb", "adafactor"])
def test_an_update_reading_across_a_leaf_keeps_it_whole_and_says_so(tx):
    fn, operands, on_host, out_host = _adam_update(MODELS["one_leaf_10x"], tx)
    names = ["params['big']"] + [f"opt_state{i}" for i in range(len(operands) - 1)]
    plan = offload.bucket_plan(fn, operands, on_host, CAP, 16, names=names, detail=True)
    big = [p for p in plan if 0 in p["members"]]
    assert len(big) == 1 and big[0]["region"] is None and big[0]["kept_whole"]
    with pytest.warns(UserWarning, match=r"params\['big'\]'s optimizer state .* larger than "
                      r"bucket_size=768.*brought to the device whole"):
        jax.make_jaxpr(lambda *xs: offload.update_in_buckets(
            fn, list(xs), on_host, out_host, CAP, 16, names=names))(*operands)
