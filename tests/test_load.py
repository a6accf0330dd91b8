"""Sharded load of safetensors checkpoints (issue 30): a single file and a Hugging Face
sharded checkpoint (index JSON + several files) load straight into the shardings asked
for, with rename, transpose, a fused QKV split, a stacked-layer leaf and bf16 -> fp32,
bitwise equal to the eager whole load in numpy; each shard reads only its region;
bad input is refused naming the value and the fix; export writes the Hugging Face
layout back through the inverse ops."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import child_env, xla_flags
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

import zerojax
from zerojax import formats, load as ld
from zerojax.checkpoint import CheckpointManager
from zerojax.export import FileTensor, export_params, rename_of
from zerojax.load import Into, expand_dims, load_params, reshape, take, transpose

BF16 = ml_dtypes.bfloat16
D, F, V, L = 16, 24, 40, 2  # hidden, mlp, vocab, layers


def _mesh():
    return jax.make_mesh((8,), ("data",))


def _hf_tensors(seed=0) -> dict[str, np.ndarray]:
    """A small PyTorch-layout model in bf16: fused QKV (3D, D), up (F, D), embedding."""
    rng = np.random.default_rng(seed)
    out = {"model.embed.weight": rng.normal(size=(V, D)).astype(BF16)}
    for i in range(L):
        out[f"model.layers.{i}.attn.qkv.weight"] = rng.normal(size=(3 * D, D)).astype(BF16)
        out[f"model.layers.{i}.mlp.up.weight"] = rng.normal(size=(F, D)).astype(BF16)
    out["lm_head.weight"] = rng.normal(size=(V, D)).astype(BF16)
    return out


def _write(path, tensors, max_shard_size=None):
    entries = [(k, v.dtype, v.shape) for k, v in tensors.items()]
    if max_shard_size is None:
        return formats.write_file(path, entries, iter(tensors.values()))
    return formats.write_sharded(path, entries, iter(tensors.values()), max_shard_size)


LIKE = {
    "embed": {"embedding": jax.ShapeDtypeStruct((V, D), jnp.float32)},
    "layers": {"q": {"kernel": jax.ShapeDtypeStruct((L, D, 2, 8), jnp.float32)},
               "k": {"kernel": jax.ShapeDtypeStruct((L, D, D), jnp.float32)},
               "v": {"kernel": jax.ShapeDtypeStruct((L, D, D), jnp.float32)},
               "up": {"kernel": jax.ShapeDtypeStruct((L, D, F), jnp.float32)}},
    "head": {"kernel": jax.ShapeDtypeStruct((D, V), jnp.float32)},
}


def _rename(name: str):
    """HF name -> where it goes: q/k/v split out of the fused QKV (q's heads split
    out by a reshape), each layer one row of a stacked leaf."""
    parts = name.split(".")
    if name == "model.embed.weight":
        return "embed.embedding"
    if name == "lm_head.weight":
        return Into("head.kernel", (transpose(),))
    i = int(parts[2])
    row = (transpose(), expand_dims(0))
    if parts[-2] == "up":
        return Into("layers.up.kernel", row, at={0: i})
    return [Into("layers.q.kernel", (take(0, 0, D),) + row + (reshape(1, D, 2, 8),),
                 at={0: i}),
            Into("layers.k.kernel", (take(0, D, 2 * D),) + row, at={0: i}),
            Into("layers.v.kernel", (take(0, 2 * D, 3 * D),) + row, at={0: i})]


def _eager(tensors):
    """The same mapping done whole, in numpy (the reference)."""
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    qkv = [tensors[f"model.layers.{i}.attn.qkv.weight"] for i in range(L)]
    return {"embed": {"embedding": f32(tensors["model.embed.weight"])},
            "layers": {"q": {"kernel": np.stack([f32(w[:D].T).reshape(D, 2, 8) for w in qkv])},
                       "k": {"kernel": np.stack([f32(w[D:2 * D].T) for w in qkv])},
                       "v": {"kernel": np.stack([f32(w[2 * D:].T) for w in qkv])},
                       "up": {"kernel": np.stack([
                           f32(tensors[f"model.layers.{i}.mlp.up.weight"].T)
                           for i in range(L)])}},
            "head": {"kernel": f32(tensors["lm_head.weight"].T)}}


SPECS = {  # a different axis sharded per leaf, one replicated
    "embed": {"embedding": P("data")},
    "layers": {"q": {"kernel": P(None, "data")}, "k": {"kernel": P(None, None, "data")},
               "v": {"kernel": P()}, "up": {"kernel": P(None, None, "data")}},
    "head": {"kernel": P(None, "data")},
}


def _shardings():
    return jax.tree.map(lambda s: NamedSharding(_mesh(), s), SPECS,
                        is_leaf=lambda x: isinstance(x, P))


def _same(got, want, shardings=None):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if shardings is not None:
        for x, s in zip(jax.tree.leaves(got), jax.tree.leaves(shardings)):
            assert x.sharding == s


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    tensors = _hf_tensors()
    _write(d, tensors, max_shard_size=3000)
    return d, tensors


class _Counting:
    """Counts the files ``zerojax.load`` opens and the regions it reads (tensor name,
    bytes of the region)."""

    def __init__(self, monkeypatch):
        self.opened, self.reads = [], []
        real_open, real_read = ld._open_file, ld._Reader.read

        def opener(path, flags):
            self.opened.append(os.path.basename(path))
            return real_open(path, flags)

        def read(reader, info, name, region):
            x = real_read(reader, info, name, region)
            self.reads.append((name, x.nbytes))
            return x

        monkeypatch.setattr(ld, "_open_file", opener)
        monkeypatch.setattr(ld._Reader, "read", read)

    @property
    def nbytes(self):
        return sum(n for _, n in self.reads)


def test_a_strided_region_reads_spans_of_at_most_the_buffer(tmp_path, monkeypatch):
    x = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    path = _write(tmp_path / "x.safetensors", {"x": x})
    info = formats.read_header(path)["x"]
    spans, real = [], os.preadv
    monkeypatch.setattr(formats.os, "preadv", lambda fd, bufs, off: (
        spans.append(sum(b.nbytes for b in bufs)), real(fd, bufs, off))[1])
    fd = os.open(path, os.O_RDONLY)
    try:
        got = formats.read_region(fd, info, ((0, 256), (8, 16)), buffer_bytes=4096)
        np.testing.assert_array_equal(got, x[:, 8:16])  # columns: 16 rows per span
        assert max(spans) <= 4096 and sum(spans) < x.nbytes
        spans.clear()
        got = formats.read_region(fd, info, ((3, 200), (0, 64)), buffer_bytes=4096)
        np.testing.assert_array_equal(got, x[3:200])  # whole rows: one contiguous read
        assert spans == [197 * 64 * 4]
    finally:
        os.close(fd)


def test_hf_sharded_checkpoint_loads_sharded_equal_to_the_eager_whole_load(hf_dir,
                                                                           monkeypatch):
    d, tensors = hf_dir
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(files) >= 3 and (d / formats.INDEX_NAME).exists()
    count = _Counting(monkeypatch)
    got = load_params(d, LIKE, shardings=_shardings(), rename=_rename)
    _same(got, _eager(tensors), _shardings())
    # each distinct shard read once, only its region: the bytes read are each leaf's
    # distinct shards' bytes in the file's bf16 (a replicated leaf read once, not 8x)
    want = 0
    for like, s in zip(jax.tree.leaves(LIKE), jax.tree.leaves(_shardings())):
        regions = {ld._index_region(i, like.shape)
                   for i in s.addressable_devices_indices_map(like.shape).values()}
        want += sum(ld._vol(r) for r in regions) * 2
    assert count.nbytes == want
    assert sorted(set(count.opened)) == files and len(count.opened) == len(files)
    # the same through the index JSON itself
    _same(load_params(d / formats.INDEX_NAME, LIKE, shardings=_shardings(), rename=_rename),
          got)


@pytest.mark.parametrize("options", [dict(stage=3), dict(stage=1),
                                     dict(stage=3, offload_params=True)])
def test_loads_into_a_stages_input_shardings_and_init_state_takes_it(hf_dir, options):
    """``opt.input_shardings(like)``: each leaf read straight into the stage's split;
    init_state takes it as it is, the same state as from the eager params."""
    d, tensors = hf_dir
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), min_shard_size=4,
                       **options)
    sh = opt.input_shardings(LIKE)
    got = load_params(d, LIKE, shardings=sh, rename=_rename)
    _same(got, _eager(tensors), sh)
    state = opt.init_state(got)
    _same(opt.full_params(state), opt.full_params(opt.init_state(_eager(tensors))))


def test_transforms_apply_before_each_targets_own_ops(hf_dir):
    """``transforms`` (per file tensor, a dict or a function) run first; each Into's
    ops after them: the same leaves as ops written in the Into alone."""
    d, tensors = hf_dir

    def rename(name):  # the same targets, the transposes moved to transforms
        if name == "model.embed.weight":
            return "embed.embedding"
        if name == "lm_head.weight":
            return "head.kernel"
        i = int(name.split(".")[2])
        if ".up." in name:
            return Into("layers.up.kernel", (expand_dims(0),), at={0: i})
        return [Into("layers.q.kernel", (take(1, 0, D), expand_dims(0), reshape(1, D, 2, 8)),
                     at={0: i}),
                Into("layers.k.kernel", (take(1, D, 2 * D), expand_dims(0)), at={0: i}),
                Into("layers.v.kernel", (take(1, 2 * D, 3 * D), expand_dims(0)), at={0: i})]

    def transforms(name):
        return None if name == "model.embed.weight" else [transpose()]

    got = load_params(d, LIKE, shardings=_shardings(), rename=rename, transforms=transforms)
    _same(got, _eager(tensors), _shardings())
    as_dict = {n: transforms(n) for n in tensors}
    _same(load_params(d, LIKE, rename=rename, transforms=as_dict), got)


def test_a_small_buffer_splits_the_reads_and_changes_nothing(hf_dir, monkeypatch):
    d, tensors = hf_dir
    count = _Counting(monkeypatch)
    got = load_params(d, LIKE, shardings=_shardings(), rename=_rename, buffer_bytes=64)
    _same(got, _eager(tensors))
    assert max(n for _, n in count.reads) <= 64


def test_single_file_with_boxes_loads_into_each_leafs_own_sharding(tmp_path, monkeypatch):
    from flax import linen as nn

    rng = np.random.default_rng(1)
    tensors = {"dense.kernel": rng.normal(size=(64, 8)).astype(np.float32),
               "dense.bias": rng.normal(size=(8,)).astype(np.float32),
               "norm.scale": rng.normal(size=(8,)).astype(BF16)}
    path = _write(tmp_path / "m.safetensors", tensors)
    mesh = _mesh()
    like = {"dense": {"kernel": nn.Partitioned(jax.ShapeDtypeStruct((64, 8), jnp.float32),
                                               names=("data", None), mesh=mesh),
                      "bias": jnp.zeros(8)},
            "norm": {"scale": jax.ShapeDtypeStruct((8,), jnp.bfloat16)}}
    sh = {"dense": {"kernel": NamedSharding(mesh, P("data")), "bias": NamedSharding(mesh, P())},
          "norm": {"scale": NamedSharding(mesh, P())}}
    count = _Counting(monkeypatch)
    got = load_params(path, like, shardings=sh)
    assert isinstance(got["dense"]["kernel"], nn.Partitioned)  # boxes kept
    assert got["dense"]["kernel"].value.sharding == sh["dense"]["kernel"]
    assert got["norm"]["scale"].dtype == jnp.bfloat16
    for name, x in [("dense.kernel", got["dense"]["kernel"].value),
                    ("dense.bias", got["dense"]["bias"]), ("norm.scale", got["norm"]["scale"])]:
        np.testing.assert_array_equal(np.asarray(x), tensors[name])
    # 8 kernel shards of 8 rows each, the bias and scale once each: nothing read twice
    assert sorted(count.reads) == sorted([("dense.kernel", 8 * 8 * 4)] * 8 +
                                         [("dense.bias", 32), ("norm.scale", 16)])
    # default: each leaf's own sharding, else the first device (as before)
    plain = load_params(path, {"dense": {"kernel": jnp.zeros((64, 8)), "bias": jnp.zeros(8)},
                               "norm": {"scale": jnp.zeros(8, jnp.bfloat16)}})
    assert plain["dense"]["kernel"].sharding == jnp.zeros(1).sharding


@pytest.mark.parametrize("ops,shape", [
    ((reshape(4, 6, 5),), (120,)),
    ((reshape(6, 4, 5), transpose(2, 0, 1)), (4, 6, 5)),
    ((transpose(), reshape(12, 10)), (10, 3, 4)),
    ((take(1, 2, 5), reshape(4, 3, 2)), (4, 7, 2)),
    ((expand_dims(1), reshape(3, 8)), (6, 4)),
])
def test_every_shard_region_maps_back_to_the_file(tmp_path, ops, shape):
    """Each op's region map against numpy over the regions 2, 4 and 8 shards read."""
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    want = x
    for op in ops:
        want = {"reshape": lambda y, o=op: y.reshape(o.target),
                "transpose": lambda y, o=op: y.transpose(o.axes or None),
                "take": lambda y, o=op: np.take(y, range(o.start, o.stop), o.axis),
                "expand_dims": lambda y, o=op: np.expand_dims(y, o.axis)}[type(op).__name__](want)
    path = _write(tmp_path / "x.safetensors", {"x": x})
    for n in (2, 4, 8):
        for ax in range(want.ndim):
            if want.shape[ax] % n:
                continue
            mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
            spec = P(*([None] * ax + ["d"]))
            got = load_params(path, {"y": jax.ShapeDtypeStruct(want.shape, jnp.float32)},
                              shardings={"y": NamedSharding(mesh, spec)},
                              rename={"x": Into("y", ops)}, buffer_bytes=40)
            np.testing.assert_array_equal(np.asarray(got["y"]), want)


# --- bad input ----------------------------------------------------------------------

def test_a_rename_map_that_leaves_a_tensor_unmatched_is_named(hf_dir):
    d, _ = hf_dir
    partial = lambda n: None if n == "lm_head.weight" else _rename(n)  # noqa: E731
    with pytest.raises(ValueError, match=r"leaves of `like` that the file lacks: head.kernel"
                                         r".*Map every file tensor"):
        load_params(d, LIKE, rename=partial)
    as_dict = {n: _rename(n) for n in _hf_tensors() if n != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"1 tensor\(s\) in the file that `like` lacks: "
                                         r"lm_head.weight.*or to None to skip it"):
        load_params(d, LIKE, rename=as_dict)
    # strict=False never hands back a placeholder: a ShapeDtypeStruct leaf the file
    # does not fill is refused, named, before any read; like's array is the explicit init
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) for leaves that `like` gives "
                                         r"only as jax.ShapeDtypeStruct.*: head.kernel"):
        load_params(d, LIKE, rename=partial, strict=False)
    head = np.ones(LIKE["head"]["kernel"].shape, np.float32)
    like = {**LIKE, "head": {"kernel": head}}
    got = load_params(d, like, rename=partial, strict=False)  # deliberate: head kept as given
    assert got["head"]["kernel"] is head


def test_a_transform_that_changes_the_shape_is_named(hf_dir):
    d, _ = hf_dir
    no_transpose = lambda n: "head.kernel" if n == "lm_head.weight" else _rename(n)  # noqa: E731
    with pytest.raises(ValueError, match=r"lm_head.weight \(file \(40, 16\); like head.kernel "
                                         r"\(16, 40\)\).*transforms that re-lay"):
        load_params(d, LIKE, rename=no_transpose)
    bad_reshape = lambda n: (Into("head.kernel", (reshape(3, -1),)) if n == "lm_head.weight"  # noqa: E731
                             else _rename(n))
    with pytest.raises(ValueError, match=r"lm_head.weight \(40, 16\): reshape\(3, -1\) "
                                         r"cannot reshape"):
        load_params(d, LIKE, rename=bad_reshape)


def test_an_index_naming_a_missing_file_is_named(hf_dir, tmp_path):
    d, _ = hf_dir
    index = json.loads((d / formats.INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors"
    (tmp_path / formats.INDEX_NAME).write_text(json.dumps(index))
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            os.symlink(d / f, tmp_path / f)
    with pytest.raises(ValueError, match=r"names 1 file\(s\) that do not exist.*"
                                         r"model-00009-of-00009.safetensors \(holding e.g. "
                                         r"lm_head.weight\). Download or copy"):
        load_params(tmp_path, LIKE, rename=_rename)


def test_a_truncated_file_is_named_before_reading(hf_dir, tmp_path):
    d, _ = hf_dir
    for f in os.listdir(d):
        data = (d / f).read_bytes()
        (tmp_path / f).write_bytes(data[:-100] if f.endswith("00002-of-00003.safetensors")
                                   else data)
    with pytest.raises(ValueError, match=r"model-00002-of-00003.safetensors is truncated: "
                                         r"it holds \d+ bytes, its tensor .* Copy or download"):
        load_params(tmp_path, LIKE, rename=_rename)


def test_a_dtype_that_cannot_be_cast_is_named(tmp_path):
    path = _write(tmp_path / "m.safetensors", {"w": np.ones((4,), np.float32),
                                               "c": np.ones((2,), np.complex64)})
    with pytest.raises(ValueError, match=r"w \(float32 in the file, int32 in like's w\).*"
                                         r"give `like` the file's kind"):
        load_params(path, {"w": jnp.zeros(4, jnp.int32), "c": jnp.zeros(2, jnp.complex64)})
    with pytest.raises(ValueError, match=r"c \(complex64 in the file, float32 in like's c\)"):
        load_params(path, {"w": jnp.zeros(4), "c": jnp.zeros(2)})


def test_shardings_that_do_not_fit_are_named_before_reading(hf_dir):
    d, _ = hf_dir
    sh = jax.tree.map(lambda _: NamedSharding(_mesh(), P("data")), LIKE)
    with pytest.raises(ValueError, match=r"params leaf layers.k.kernel \(2, 16, 16\): its "
                                         r"sharding"):
        load_params(d, LIKE, shardings=sh, rename=_rename)


# --- export back -----------------------------------------------------------------------

def _mapping(params):
    """FileTensors of the HF layout above, for export (the loader's _rename with shapes)."""
    return [FileTensor(n, x.shape, _rename(n)) for n, x in _hf_tensors().items()]


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_export_writes_the_hf_layout_back_through_the_inverse_ops(hf_dir, tmp_path, dtype,
                                                                  monkeypatch):
    """Each file tensor reads only its regions of the checkpoint's leaves (one layer of
    a stacked leaf, not the stack): the whole-leaf restore is never called."""
    from zerojax import export

    d, tensors = hf_dir
    regions = []
    real_region = export._CheckpointSource.region
    monkeypatch.setattr(export._CheckpointSource, "read", None)  # no whole leaf
    monkeypatch.setattr(export._CheckpointSource, "region", lambda self, leaf, region: (
        regions.append((leaf.name, region)), real_region(self, leaf, region))[1])
    params = jax.tree.map(np.asarray, load_params(d, LIKE, rename=_rename))
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=3, min_shard_size=4)
    state = opt.init_state(params)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(0, state)
    index = export_params(tmp_path / "ckpt", tmp_path / "out", format="hf",
                          mapping=_mapping(params), dtype=dtype, max_shard_size=3000)
    assert index == str(tmp_path / "out" / formats.INDEX_NAME)
    assert ("layers.up.kernel", ((1, 2), (0, D), (0, F))) in regions  # layer 1's up
    assert len(regions) == 1 + 4 * L + 1  # embed, q k v up per layer, head
    weight_map = json.loads(open(index).read())["weight_map"]
    assert sorted(weight_map) == sorted(tensors) and len(set(weight_map.values())) >= 3
    written = {}
    for f in set(weight_map.values()):
        written.update(load_file(tmp_path / "out" / f))
    for name, x in tensors.items():  # bf16 -> f32 -> bf16 is exact; f32 holds it exactly
        assert written[name].dtype == (BF16 if dtype is not None else np.float32)
        np.testing.assert_array_equal(written[name].astype(np.float32), x.astype(np.float32))
    back = load_params(tmp_path / "out", LIKE, rename=rename_of(_mapping(params)))
    _same(back, params)
    # the same from the params tree in memory (only the regions come to the host)
    export_params(params, tmp_path / "mem", format="hf", mapping=_mapping(params),
                  dtype=dtype, max_shard_size=3000)
    _same(load_params(tmp_path / "mem", LIKE, rename=_rename), params)
    if dtype is None:  # no mapping: the params' own names, in the sharded layout
        export_params(tmp_path / "ckpt", tmp_path / "own", format="hf", max_shard_size=3000)
        assert len(os.listdir(tmp_path / "own")) >= 3
        _same(load_params(tmp_path / "own", LIKE), params)
    with pytest.raises(TypeError, match="opt.full_params"):
        export_params(state, tmp_path / "x", format="hf")
    if dtype is None:  # straight from the sharded state: no device holds a leaf whole
        split = opt.full_params(state, "split")
        assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(split))
        export_params(split, tmp_path / "split", format="hf", mapping=_mapping(params),
                      max_shard_size=3000)
        _same(load_params(tmp_path / "split", LIKE, rename=_rename), params)


def test_export_refuses_a_mapping_that_leaves_a_leaf_out(hf_dir, tmp_path):
    d, _ = hf_dir
    params = jax.tree.map(np.asarray, load_params(d, LIKE, rename=_rename))
    mapping = [m for m in _mapping(params) if m.name != "lm_head.weight"]
    # in export's words (the mapping, the params tree), not load_params' (like, rename)
    with pytest.raises(ValueError, match=r"leaf/leaves of the params tree that the mapping "
                                         r"lacks: head.kernel\. Pass the mapping of the "
                                         r"model that was saved") as e:
        export_params(params, tmp_path / "out", format="hf", mapping=mapping)
    assert "like" not in str(e.value) and "strict" not in str(e.value)
    assert not (tmp_path / "out").exists()


# --- two processes -----------------------------------------------------------------------

@pytest.mark.slow
def test_load_peak_rss_is_the_shards_plus_two_buffers_in_one_process_and_two(tmp_path):
    """A 300 MB float32 checkpoint whose largest leaf is 128 MiB (the embedding), in 3
    files, a third of it transposed on load (strided column reads), loaded in a fresh
    process x 8 devices and by 2 processes x 4: each process's peak RSS growth
    (sampled every 2 ms, from a baseline after a warm-up on a file of its own) is at
    most the shards it holds plus 2 x buffer_bytes (16 MiB: each shard, 16 MiB at
    most, read into one buffer, put on its device, freed and handed back before the
    next; was the shards + 94 MiB: a leaf's 8 shards on their way at once, freed
    memory kept); every shard equals the one-process load's bitwise (sha256)."""
    import subprocess
    import sys

    import load_worker

    total_mb, largest_mb, buffer = 300, 128, 16 << 20
    size = load_worker.write_checkpoint(tmp_path / "ckpt", total_mb, 128 << 20, largest_mb)
    assert len([f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".safetensors")]) == 3
    env = child_env()
    args = [load_worker.__file__, str(tmp_path / "ckpt"), None, str(total_mb), str(buffer),
            str(largest_mb)]
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"out{nproc}"
        out.mkdir()
        args[2] = str(out)
        if nproc == 1:
            cmd = [sys.executable, *args]
            run_env = dict(env, XLA_FLAGS=xla_flags(8),
                           JAX_PLATFORMS="cpu")
        else:
            cmd = [sys.executable, "-m", "zerojax.cli.launch", "--nproc", "2",
                   "--devices-per-proc", "4", *args]
            run_env = env
        proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[nproc] = [json.loads((out / f"p{p}.json").read_text()) for p in range(nproc)]
    for nproc, rs in results.items():
        for r in rs:
            assert r["held"] == size // nproc  # its share of the state
            assert r["largest_leaf_local"] >= (128 << 20) // nproc
            assert r["growth"] <= r["held"] + 2 * buffer, (nproc, r["growth"] / 2**20,
                                                           r["held"] / 2**20)
    one = results[1][0]["digests"]
    two = results[2][0]["digests"] | results[2][1]["digests"]
    assert len(results[2][0]["digests"]) == len(results[2][1]["digests"]) == len(two) // 2
    assert two == one


def test_zerojax_export_format_hf_writes_a_llama_checkpoint_transformers_layout(tmp_path,
                                                                                capsys):
    """``zerojax export CKPT OUT --format hf --mapping llama --hf-config config.json``:
    the LlamaForCausalLM tensors (as models.llama.hf_from_params makes them whole), in
    several bf16 files, read back by the sharded loader into the params exactly as
    bf16 rounds them."""
    from zerojax.cli.command import main
    from zerojax.models import llama

    cfg = llama.LlamaConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, kv_heads=2,
                            mlp_hidden=48)
    shapes = llama.llama_param_shapes(llama.Llama(cfg))  # traced only: no 8 s init compile
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=3, min_shard_size=4)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, opt.init_state(params))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf("float32")))  # fp32 source
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--format", "hf", "--mapping",
                 "llama", "--hf-config", str(tmp_path / "config.json"), "--dtype", "bfloat16",
                 "--max-shard-size", "16KB"]) == 0
    assert "bfloat16 params of step 3" in capsys.readouterr().out
    written_cfg = json.loads((out / "config.json").read_text())
    assert written_cfg["num_key_value_heads"] == 2
    assert written_cfg["torch_dtype"] == "bfloat16"  # the files' dtype, not the source's
    assert written_cfg == {**cfg.to_hf("float32"), "torch_dtype": "bfloat16"}
    index = json.loads((out / formats.INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) >= 3
    written = {}
    for f in set(index["weight_map"].values()):
        written.update(load_file(out / f))
    want = llama.hf_from_params(params, cfg, dtype=BF16)
    assert sorted(written) == sorted(want)
    for name, x in want.items():
        assert written[name].dtype == BF16
        np.testing.assert_array_equal(written[name], x)
    back = llama.load_hf_llama(out, llama.Llama(cfg))
    _same(back, jax.tree.map(lambda x: np.asarray(x).astype(BF16).astype(np.float32), params))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"),
                 "--mapping", "llama"]) == 2
    assert "--mapping goes with --format hf" in capsys.readouterr().err
