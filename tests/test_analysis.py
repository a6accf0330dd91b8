"""Tests of zerojax.analysis: HLO communication volume and per-device memory."""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.analysis import (
    collective_counts,
    comm_volume,
    compiled_memory,
    device_bytes,
    estimate_memory,
    saved_checkpoints,
)

if jax.device_count() < 8:
    raise RuntimeError(
        f"tests/test_analysis.py needs 8 devices, jax sees {jax.device_count()}: set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported."
    )

PSI = 8 * 1024  # elements of the test tensors


def _mesh(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(data, model), ("data", "model"))


def _compile(fn, mesh, in_specs, out_specs, *args):
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(mapped).lower(*args).compile()


# --- comm_volume on compiled shard_map programs -------------------------------------------


def test_all_gather_counts_gathered_elements():
    # Global (8, 1024) split over 8 devices: each holds (1, 1024), gathers back Psi elements.
    compiled = _compile(
        lambda x: jax.lax.all_gather(x, "data", axis=0, tiled=True),
        _mesh(8, 1),
        P("data"),
        P(),
        jnp.ones((8, 1024)),
    )
    volume = comm_volume(compiled)
    assert volume.all_gather == PSI
    assert volume.total == PSI
    (op,) = volume.ops
    assert (op.kind, op.elements, op.trips, op.dtype, op.group_size) == (
        "all_gather",
        PSI,
        1,
        "f32",
        8,
    )


def test_reduce_scatter_counts_input_elements():
    # Each device holds (8, 1024) = Psi elements and keeps a (1, 1024) shard of the sum.
    compiled = _compile(
        lambda x: jax.lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True),
        _mesh(8, 1),
        P("data"),
        P("data"),
        jnp.ones((64, 1024)),
    )
    volume = comm_volume(compiled)
    assert volume.reduce_scatter == PSI
    assert volume.total == PSI


def test_all_reduce_counts_twice():
    compiled = _compile(
        lambda x: jax.lax.psum(x, "data"), _mesh(8, 1), P("data"), P("data"), jnp.ones((64, 1024))
    )
    volume = comm_volume(compiled)
    assert volume.all_reduce == 2 * PSI
    assert volume.total == 2 * PSI


def test_scalar_reductions_are_skipped_below_min_elements():
    compiled = _compile(
        lambda x: jax.lax.psum(jnp.sum(x), "data"),
        _mesh(8, 1),
        P("data"),
        P(),
        jnp.ones((64, 1024)),
    )
    assert comm_volume(compiled).total == 0
    assert comm_volume(compiled, min_elements=1).all_reduce == 2
    assert collective_counts(compiled)["all_reduce"] == 1


def test_gather_in_forward_gives_reduce_scatter_in_backward():
    # The ZeRO pattern: gather a parameter shard, differentiate, get a reduce-scattered grad.
    def loss(w, x):
        full = jax.lax.all_gather(w, "data", axis=0, tiled=True)
        return jax.lax.psum(jnp.sum(jnp.tanh(x @ full.T)), "data")

    compiled = _compile(
        jax.grad(loss),
        _mesh(8, 1),
        (P("data"), P("data")),
        P("data"),
        jnp.ones((64, 128)),
        jnp.ones((16, 128)),
    )
    units = comm_volume(compiled).in_units_of(64 * 128)
    assert units == {
        "all_gather": 1.0,
        "reduce_scatter": 1.0,
        "all_reduce": 0.0,
        "all_to_all": 0.0,
        "collective_permute": 0.0,
        "total": 2.0,
    }


def _scan_step(carry, _):
    gathered = jax.lax.all_gather(carry, "data", axis=0, tiled=True)  # (8, 1024)
    summed = jax.lax.psum(gathered, "data")
    shard = jax.lax.psum_scatter(summed * 0.5, "data", scatter_dimension=0, tiled=True)
    return shard, None


def _assert_gather_scatter_reduce(volume, trips):
    """One all-gather, reduce-scatter and all-reduce of PSI elements per trip."""
    assert volume.all_gather == trips * PSI
    assert volume.reduce_scatter == trips * PSI
    assert volume.all_reduce == trips * 2 * PSI


def test_collectives_in_scan_are_multiplied_by_trip_count():
    compiled = _compile(
        lambda x: jax.lax.scan(_scan_step, x, None, length=8)[0],
        _mesh(8, 1),
        P("data"),
        P("data"),
        jnp.ones((8, 1024)),
    )
    volume = comm_volume(compiled)
    _assert_gather_scatter_reduce(volume, trips=8)
    assert {op.trips for op in volume.ops} == {8}
    assert volume.counts() == {
        "all_gather": 8,
        "reduce_scatter": 8,
        "all_reduce": 8,
        "all_to_all": 0,
        "collective_permute": 0,
    }


def test_nested_scans_multiply():
    def outer(carry, _):
        return jax.lax.scan(_scan_step, carry, None, length=3)[0], None

    compiled = _compile(
        lambda x: jax.lax.scan(outer, x, None, length=4)[0],
        _mesh(8, 1),
        P("data"),
        P("data"),
        jnp.ones((8, 1024)),
    )
    _assert_gather_scatter_reduce(comm_volume(compiled), trips=12)


def test_two_axis_mesh_splits_by_group_size():
    # Mesh (data=4, model=2); each device holds a (4, 512) block of a (16, 1024) array.
    def fn(x):
        gathered = jax.lax.all_gather(x, "data", axis=0, tiled=True)  # (16, 512)
        return gathered, jax.lax.psum(x, "model")

    compiled = _compile(
        fn,
        _mesh(4, 2),
        P("data", "model"),
        (P(None, "model"), P("data", "model")),
        jnp.ones((16, 1024)),
    )
    groups = comm_volume(compiled).by_group_size()
    assert sorted(groups) == [2, 4]
    assert (groups[4].all_gather, groups[4].all_reduce) == (16 * 512, 0)
    assert (groups[2].all_gather, groups[2].all_reduce) == (0, 2 * 4 * 512)


def test_trivial_groups_move_nothing():
    # Reducing over the size-1 "model" axis leaves single-member replica groups.
    compiled = _compile(
        lambda x: jax.lax.psum(x, "model"),
        _mesh(8, 1),
        P("data"),
        P("data"),
        jnp.ones((64, 1024)),
    )
    assert "all-reduce" in compiled.as_text()
    assert comm_volume(compiled).total == 0


def test_lowered_text_is_rejected():
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(4))
    with pytest.raises(ValueError, match="compile"):
        comm_volume(lowered)


# --- comm_volume on hand-written HLO: async pairs, combined ops, control flow --------------

HAND_WRITTEN = textwrap.dedent(
    """\
    HloModule handwritten, is_scheduled=true, num_partitions=8

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %sum = f32[] add(%a, %b)
    }

    %rs_wrapped (p: f32[64,16]) -> f32[16,16] {
      %p = f32[64,16]{1,0} parameter(0)
      ROOT %rs = f32[16,16]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[2,4]<=[8],
        dimensions={0}, to_apply=%add
    }

    %inner_body (t: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
      %t = (s32[], f32[8,16]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%t), index=0
      %x = f32[8,16]{1,0} get-tuple-element(%t), index=1
      %ag-start = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(f32[8,16]{1,0} %x),
        channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0},
        metadata={op_name="jit(f)/all_gather(x)" source_file="calls=%nope"}
      %ag-done = f32[64,16]{1,0} all-gather-done(%ag-start)
      %rs-start = ((f32[64,16]{1,0}), f32[16,16]{1,0}) async-start(%ag-done), calls=%rs_wrapped
      %rs-done = f32[16,16]{1,0} async-done(%rs-start), calls=%rs_wrapped
      %y = f32[8,16]{1,0} slice(%rs-done), slice={[0:8], [0:16]}
      ROOT %out = (s32[], f32[8,16]{1,0}) tuple(%i, %y)
    }

    %cond (t: (s32[], f32[8,16])) -> pred[] {
      %t = (s32[], f32[8,16]{1,0}) parameter(0)
      ROOT %p = pred[] constant(true)
    }

    combine (x: f32[8,16], y: f32[4]) -> f32[8,16] {
      x = f32[8,16]{1,0} parameter(0)
      y = f32[4]{0} parameter(1)
      ars = (f32[8,16]{1,0}, f32[4]{0}) all-reduce-start(x, y), channel_id=4,
        replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
      ard = (f32[8,16]{1,0}, f32[4]{0}) all-reduce-done(ars)
      ROOT r = f32[8,16]{1,0} get-tuple-element(ard), index=0
    }

    %outer_body (t: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
      %t = (s32[], f32[8,16]{1,0}) parameter(0)
      %inner = (s32[], f32[8,16]{1,0}) while(%t), condition=%cond, body=%inner_body,
        backend_config={"known_trip_count":{"n":"3"}}
      %x = f32[8,16]{1,0} get-tuple-element(%inner), index=1
      %y = f32[4]{0} constant({1, 2, 3, 4})
      %c = f32[8,16]{1,0} call(%x, %y), to_apply=%combine
      %i = s32[] get-tuple-element(%t), index=0
      ROOT %out = (s32[], f32[8,16]{1,0}) tuple(%i, %c)
    }

    %light (x: f32[8,16]) -> f32[8,16] {
      %x = f32[8,16]{1,0} parameter(0)
      %cp-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%x),
        channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
      ROOT %cp-done = f32[8,16]{1,0} collective-permute-done(%cp-start)
    }

    %heavy (x: f32[8,16]) -> f32[8,16] {
      %x = f32[8,16]{1,0} parameter(0)
      %a2a = f32[8,16]{1,0} all-to-all(%x), channel_id=6,
        replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
      ROOT %a2a.1 = f32[8,16]{1,0} all-to-all(%a2a), channel_id=7,
        replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
    }

    ENTRY %main (x: f32[8,16], k: s32[]) -> f32[8,16] {
      %x = f32[8,16]{1,0} parameter(0)
      %k = s32[] parameter(1)
      %zero = s32[] constant(0)
      %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %x)
      %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%outer_body,
        backend_config={"known_trip_count":{"n":"4"}}
      %h = f32[8,16]{1,0} get-tuple-element(%loop), index=1
      %b = f32[8,16]{1,0} conditional(%k, %h, %h), branch_computations={%light, %heavy}
      %s = f32[] constant(1)
      %loss = f32[] all-reduce(%s), channel_id=8, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
      ROOT %local = f32[8,16]{1,0} all-reduce(%b), channel_id=9,
        replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
    }
    """
)


def test_hand_written_module():
    volume = comm_volume(HAND_WRITTEN)
    # Inner loop runs 4 * 3 = 12 times: all-gather-start producing 64*16 elements, and an
    # async-wrapped reduce-scatter of 64*16 elements (async-done not counted again).
    assert volume.all_gather == 12 * 1024
    assert volume.reduce_scatter == 12 * 1024
    # Outer loop (4 trips) calls a combined all-reduce-start of 8*16 + 4 elements.
    assert volume.all_reduce == 4 * 2 * 132
    # The heavier conditional branch (two all-to-alls) is counted, the permute branch not.
    assert volume.all_to_all == 2 * 128
    assert volume.collective_permute == 0
    # The scalar loss all-reduce and the single-member-group all-reduce are left out.
    assert volume.total == 12 * 1024 * 2 + 4 * 2 * 132 + 2 * 128
    assert volume.counts() == {
        "all_gather": 12,
        "reduce_scatter": 12,
        "all_reduce": 4,
        "all_to_all": 2,
        "collective_permute": 0,
    }
    groups = volume.by_group_size()
    assert sorted(groups) == [2, 4, 8]
    assert groups[8].total == groups[8].all_gather == 12 * 1024
    assert groups[4].total == groups[4].reduce_scatter == 12 * 1024  # iota [2,4]<=[8]
    assert groups[2].all_reduce == 4 * 2 * 132  # iota [4,2]<=[2,4]T(1,0)
    assert groups[2].all_to_all == 2 * 128
    (combined,) = (op for op in volume.ops if op.kind == "all_reduce")
    assert combined.replica_groups == "[4,2]<=[2,4]T(1,0)"
    assert (combined.elements, combined.trips, combined.group_size) == (132, 4, 2)


def test_hand_written_permute_branch_and_scalars():
    light_only = HAND_WRITTEN.replace("{%light, %heavy}", "{%light, %light}")
    volume = comm_volume(light_only, min_elements=1)
    assert volume.collective_permute == 128
    assert volume.all_to_all == 0
    (permute,) = (op for op in volume.ops if op.kind == "collective_permute")
    assert permute.group_size == 4  # ring over devices 0..3
    assert volume.all_reduce == 4 * 2 * 132 + 2  # now with the scalar loss all-reduce


def test_unknown_trip_count_warns_and_counts_once():
    text = HAND_WRITTEN.replace(
        'backend_config={"known_trip_count":{"n":"4"}}', "backend_config={}"
    )
    with pytest.warns(UserWarning, match="known_trip_count"):
        volume = comm_volume(text)
    assert volume.all_gather == 3 * 1024


# --- estimate_memory ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "expected_bytes", "paper_gb"),
    [
        (0, 120_000_000_000, 120),
        (1, 31_406_250_000, 31.4),
        (2, 16_640_625_000, 16.6),
        (3, 1_875_000_000, 1.88),
    ],
)
def test_estimate_memory_matches_paper_table(stage, expected_bytes, paper_gb):
    # ZeRO paper, Figure 1 / Table 1: Psi = 7.5B, N = 64, K = 12, mixed precision.
    estimate = estimate_memory(7.5e9, 64, stage)
    assert estimate.total == int(estimate) == expected_bytes
    assert round(estimate.total / 1e9, 2 if paper_gb < 2 else 1) == paper_gb


def test_estimate_memory_breakdown_mp_and_padding():
    stage2 = estimate_memory(6400, 64, 2)
    assert (stage2.params, stage2.grads, stage2.optimizer_state) == (12800, 200, 1200)
    fp32 = estimate_memory(6400, 64, 0, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert fp32.total == 16 * 6400
    assert estimate_memory(6400, 64, 0, mp=2).total == 16 * 3200
    assert estimate_memory(10, 4, 3).total == 16 * 3  # ceil(10 / 4) elements per device
    assert estimate_memory(np.int64(6400), np.int64(64), 3).total == 16 * 100


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stage": 4}, ValueError, "stage must be 0, 1, 2 or 3, got 4"),
        ({"dp": 0}, ValueError, "dp must be >= 1"),
        ({"mp": 0}, ValueError, "mp must be >= 1"),
        ({"num_params": -1}, ValueError, "num_params must be >= 0"),
        ({"num_params": 1.5}, ValueError, "whole number"),
        ({"param_bytes": -2}, ValueError, "param_bytes must be >= 0"),
        ({"optimizer_bytes": "12"}, TypeError, "optimizer_bytes must be an integer"),
        ({"dp": True}, TypeError, "dp must be an integer"),
    ],
)
def test_estimate_memory_rejects_bad_arguments(kwargs, error, match):
    arguments = {"num_params": 1000, "dp": 8, "stage": 1} | kwargs
    with pytest.raises(error, match=match):
        estimate_memory(**arguments)


# --- device_bytes and compiled_memory ------------------------------------------------------


def test_device_bytes_sharded_and_replicated():
    mesh = _mesh(4, 2)
    full = np.ones((64, 128), np.float32)  # 32768 bytes
    sharded = jax.device_put(full, NamedSharding(mesh, P("data", "model")))
    data_only = jax.device_put(full, NamedSharding(mesh, P("data")))
    replicated = jax.device_put(full, NamedSharding(mesh, P()))
    assert device_bytes(sharded) == 32768 // 8
    assert device_bytes(data_only) == 32768 // 4
    assert device_bytes(replicated, jax.devices()[5]) == 32768
    tree = {"a": sharded, "b": [replicated], "host": full, "step": 3}
    assert device_bytes(tree, jax.devices()[7]) == 32768 // 8 + 32768
    single = jax.device_put(full, jax.devices()[0])
    assert device_bytes(single, jax.devices()[1]) == 0
    assert device_bytes({"host": full}) == 0


def test_compiled_memory_fields():
    x = jnp.ones((256, 256), jnp.float32)  # 262144 bytes
    matmul = compiled_memory(jax.jit(lambda a, b: a @ b + 1).lower(x, x).compile())
    assert (matmul.argument, matmul.output, matmul.alias) == (2 * 262144, 262144, 0)
    assert matmul.peak == matmul.argument + matmul.output + matmul.temp
    assert matmul.host_peak == 0
    donated = compiled_memory(jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile())
    assert donated.alias == donated.output == 262144
    assert donated.peak == 262144 + donated.temp


def _scanned_loss(ws, x, offload=False):
    """Three tanh layers in a scan; each iteration's input saved (to host if offload)."""

    @jax.custom_vjp
    def layer(w, h):
        return jnp.tanh(h @ w)

    def fwd(w, h):
        return layer(w, h), (w, jax.device_put(h, jax.memory.Space.Host) if offload else h)

    def bwd(res, ct):
        w, h = res
        h = jax.device_put(h, jax.memory.Space.Device) if offload else h
        return jax.vjp(lambda w, h: jnp.tanh(h @ w), w, h)[1](ct)

    layer.defvjp(fwd, bwd)
    return jnp.sum(jax.lax.scan(lambda h, w: (layer(w, h), None), x, ws)[0])


@pytest.mark.parametrize("offload", [False, True])
def test_saved_checkpoints_lists_what_the_forward_loop_stacks(offload):
    ws, x = jnp.ones((3, 8, 8)) * 0.1, jnp.ones((4, 8))
    grad = jax.grad(lambda ws, x: _scanned_loss(ws, x, offload))
    ckpts = saved_checkpoints(grad, ws, x)
    space = "host" if offload else "device"
    # the layer inputs, stacked over the 3 iterations (the weights are the loop's own
    # input and are not stacked again)
    assert [(c.shape, c.memory_space) for c in ckpts] == [((3, 4, 8), space)]
    assert ckpts[0].nbytes == 3 * 4 * 8 * 4
    # a traced jaxpr gives the same answer; the forward pass alone stacks nothing
    assert saved_checkpoints(jax.make_jaxpr(grad)(ws, x)) == ckpts
    assert saved_checkpoints(lambda ws, x: _scanned_loss(ws, x, offload), ws, x) == []


def test_saved_checkpoints_of_a_jaxpr_takes_no_arguments():
    closed = jax.make_jaxpr(lambda x: x * 2)(1.0)
    with pytest.raises(TypeError, match="no further arguments"):
        saved_checkpoints(closed, 1.0)


def test_saved_checkpoints_sees_jax_own_offload_policy():
    """JAX's own offloading remat policy in a scan: its stacked checkpoints are
    host-resident, as Pa+cpu's are (both lower to the same annotate + stack)."""
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
        offload_src="device", offload_dst="pinned_host")

    def body(h, w):
        return jnp.tanh(checkpoint_name(h, "h") @ w), None

    def loss(ws, x):
        return jnp.sum(jax.lax.scan(jax.checkpoint(body, policy=policy), x, ws)[0])

    ckpts = saved_checkpoints(jax.grad(loss), jnp.ones((3, 8, 8)), jnp.ones((4, 8)))
    assert [(c.shape, c.memory_space) for c in ckpts] == [((3, 4, 8), "host")]


def test_entry_layout_parts_and_exports():
    """EntryLayout's byte properties (made by one class-body helper) sum the right
    buffers: arguments / outputs by memory space, aliases only the donated outputs; each
    keeps a docstring. zerojax.analysis re-exports every name of analysis.memory."""
    import zerojax.analysis as analysis
    from zerojax.analysis import memory
    from zerojax.analysis.memory import HOST_MEMORY_SPACE, EntryLayout

    host = HOST_MEMORY_SPACE
    layout = EntryLayout(arguments=((100, 0), (50, host), (7, host)),
                         outputs=((10, host), (20, 0), (30, host), (40, 0)),
                         aliased_outputs=frozenset({0, 1}))
    assert (layout.host_argument, layout.device_argument) == (57, 100)
    assert (layout.host_output, layout.device_output) == (40, 60)
    assert (layout.host_alias, layout.device_alias) == (10, 20)
    for name in ("host_argument", "device_argument", "host_output", "device_output",
                 "host_alias", "device_alias"):
        assert getattr(EntryLayout, name).__doc__.startswith("Bytes of ")
    assert not hasattr(EntryLayout, "_part")
    assert set(memory.__all__) <= set(analysis.__all__)
    for name in analysis.__all__:
        assert getattr(analysis, name) is not None
