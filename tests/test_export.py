"""export_params / load_params (issue 17): every params tree init_state takes goes out to
one safetensors file and comes back (nnx State, int keys, lists and tuples, keys with
dots), or is refused naming both leaves; load_params refuses a `like` that does not
match the file; export on process 0 of a 2-process job neither hangs nor races."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import child_env, one_layout, transformers_weights, weight_files
from safetensors.numpy import load_file

import zerojax
from zerojax.checkpoint import CheckpointManager
from zerojax.export import export_params, load_params, tensor_names

HERE = pathlib.Path(__file__).resolve().parent


def _save(directory, params, stage=3, tx=None, **kw):
    opt = zerojax.zero(tx or optax.sgd(0.1), zerojax.make_mesh(data=8), stage=stage,
                       min_shard_size=4, **kw)
    state = opt.init_state(params)
    with CheckpointManager(directory) as mgr:
        mgr.save(0, state)
    return opt, state


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_nnx_state_exports_with_plain_names_and_merges_back(tmp_path):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(6, 16, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
            self.head = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            x = jax.nn.relu(self.linear(x))
            for b in self.blocks:
                x = jax.nn.relu(b(x))
            return self.head(x)

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

    def loss(p, batch):
        x, y = batch
        return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(16, 6)).astype(np.float32),
             rng.normal(size=(16, 3)).astype(np.float32))
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3,
                       param_dtype=jnp.bfloat16)  # the fp32 master is what is exported
    state = opt.init_state(params)
    step = opt.train_step(loss)
    for _ in range(2):
        state, _ = step(state, batch)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(2, state)
    out = export_params(tmp_path / "ckpt", tmp_path / "m.safetensors")
    names = sorted(load_file(out))
    assert names == sorted(["linear.kernel", "linear.bias", "blocks.0.kernel", "blocks.0.bias",
                            "blocks.1.kernel", "blocks.1.bias", "head.kernel", "head.bias"])
    assert sorted(tensor_names(params)) == names

    loaded = load_params(out, like=params)
    assert isinstance(loaded, nnx.State)
    full = opt.full_params(state)
    _same(loaded, jax.tree.map(np.asarray, full))
    x = batch[0]
    want = np.asarray(nnx.merge(graphdef, jax.tree.map(np.asarray, full))(x))
    np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, loaded)(x)), want)
    model = nnx.merge(graphdef, params)  # the untrained model, updated in place
    nnx.update(model, loaded)
    np.testing.assert_array_equal(np.asarray(model(x)), want)


TREES = {
    "int keys": lambda: {0: {"w": jnp.arange(15.).reshape(5, 3)}, 1: {"w": jnp.ones((2,))}},
    "lists and tuples": lambda: [jnp.arange(15.).reshape(5, 3),
                                 (jnp.arange(9.), jnp.ones(2)),
                                 [{"a": jnp.full((3,), 2.)}, {"b": jnp.full((11,), 3.)}]],
    "keys with dots and quotes": lambda: {"a.b": jnp.arange(9.), "c": {"b": jnp.ones((5,))},
                                          "it's]": jnp.full((2,), 4.), 'q"': jnp.ones(3)},
    "12 int keys (orders differ as str)": lambda: {i: jnp.full((3,), float(i))
                                                   for i in range(12)},
    "one array": lambda: jnp.arange(10.),
    "complex and float32": lambda: {"c": jnp.arange(6.) * (1 + 2j), "r": jnp.ones(9)},
}


@pytest.mark.parametrize("kind", list(TREES))
def test_every_tree_goes_out_and_comes_back(tmp_path, kind):
    params = TREES[kind]()
    stage = 1 if kind.startswith("complex") else 3
    opt, state = _save(tmp_path / "ckpt", params, stage=stage)
    out = export_params(tmp_path / "ckpt", tmp_path / "m.safetensors")
    from_lib = load_file(out)  # the safetensors library reads it
    assert sorted(from_lib) == sorted(tensor_names(params))
    for name, x in zip(tensor_names(params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(from_lib[name], np.asarray(x))  # padding gone
    loaded = load_params(out, like=params)
    _same(loaded, params)
    _same(loaded, opt.full_params(state))


def test_names():
    assert tensor_names({"blocks": [{"qkv": {"kernel": 0.}}]}) == ["blocks.0.qkv.kernel"]
    assert tensor_names(jnp.zeros(3)) == ["params"]
    with pytest.raises(ValueError, match=r"\['a'\]\['b'\] and \['a.b'\].*'a.b'.*Rename"):
        tensor_names({"a.b": 0., "a": {"b": 0.}})
    with pytest.raises(ValueError, match="reserves"):
        tensor_names({"__metadata__": 0.})


def test_a_dotted_key_beside_its_nesting_is_refused_naming_both(tmp_path):
    """orbax stores each leaf under its keys joined with dots: a key "a.b" beside
    a: {b} would be one array on disk. save refuses such params, naming both leaves,
    before anything is written (export refuses a step that holds such a clash)."""
    params = {"a.b": jnp.ones((8,)), "a": {"b": jnp.zeros((8,))}}
    with pytest.raises(ValueError, match=r"\['a'\]\['b'\] and \['a.b'\].*only one.*Rename"):
        _save(tmp_path / "ckpt", params)
    assert not (tmp_path / "ckpt").exists() or not os.listdir(tmp_path / "ckpt")


def test_load_params_refuses_a_like_that_does_not_match(tmp_path):
    params = {f"layer{i}": {"w": jnp.full((4, 3), float(i)), "b": jnp.zeros(3)}
              for i in range(3)}
    _save(tmp_path / "ckpt", params)
    out = export_params(tmp_path / "ckpt", tmp_path / "m.safetensors")
    fewer = {k: v for k, v in params.items() if k != "layer2"}
    with pytest.raises(ValueError, match=r"2 tensor\(s\) in the file that `like` lacks: "
                                         r"layer2.b, layer2.w.*strict=False"):
        load_params(out, like=fewer)
    more = dict(params, extra={"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"`like` that the file lacks: extra.w"):
        load_params(out, like=more)
    wrong = dict(params, layer1={"w": jnp.zeros((3, 4)), "b": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"layer1.w \(file \(4, 3\), like \(3, 4\)\)"):
        load_params(out, like=wrong)
    with pytest.raises(ValueError, match="differ"):  # a partial load keeps shapes checked
        load_params(out, like=wrong, strict=False)
    with pytest.raises(ValueError, match="no tensor in common"):
        load_params(out, like={"other": jnp.zeros(3)}, strict=False)
    part = load_params(out, like=fewer, strict=False)  # deliberate: the tensors both have
    _same(part, fewer)
    got = load_params(out, like=more, strict=False)
    _same(got["layer2"], params["layer2"])
    assert got["extra"]["w"] is more["extra"]["w"]  # kept as given


def test_concurrent_exports_to_one_file_do_not_race(tmp_path):
    params = {f"w{i}": jnp.full((64, 64), float(i)) for i in range(6)}
    _save(tmp_path / "ckpt", params)
    out = tmp_path / "m.safetensors"
    errors = []

    def run():
        try:
            export_params(tmp_path / "ckpt", out)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _same(load_params(out, like=params), params)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "m.safetensors"]


_WORKER = r"""
import os, sys
import zerojax.distributed as zd
zd.initialize()
import jax
from jax.experimental import multihost_utils
from zerojax.export import export_params
ckpt, out = sys.argv[1], sys.argv[2]
me = jax.process_index()
if me == 0:      # process 0 only, as the docs say; process 1 waits at the barrier below
    export_params(ckpt, os.path.join(out, "zero.safetensors"))
    print("exported on 0", flush=True)
multihost_utils.sync_global_devices("after the process-0 export")
export_params(ckpt, os.path.join(out, "all.safetensors"))  # every process, one file
multihost_utils.sync_global_devices("after the every-process export")
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
split = jax.make_array_from_callback(   # half on each process: neither can read it whole
    (4, 2), NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data")),
    lambda index: np.arange(8.).reshape(4, 2)[index])
try:
    export_params({"w": split}, os.path.join(out, f"split{me}.safetensors"))
except ValueError as e:
    print(f"refused on {me}: {e}", flush=True)
print(f"done {me}", flush=True)
"""


@pytest.mark.slow
def test_export_on_process_0_of_two_does_not_hang(tmp_path):
    params = {"a": jnp.arange(24.).reshape(8, 3), "b": [jnp.ones(5), jnp.zeros(7)]}
    _save(tmp_path / "ckpt", params)
    (tmp_path / "worker.py").write_text(_WORKER)
    env = child_env()
    cmd = [sys.executable, "-m", "zerojax.cli.launch", "--nproc", "2", "--devices-per-proc",
           "1", "--progress-timeout", "60", str(tmp_path / "worker.py"),
           str(tmp_path / "ckpt"), str(tmp_path)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the 2-process export hung: {e.stdout!r} {e.stderr!r}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "exported on 0" in proc.stdout and "done 1" in proc.stdout
    for me in (0, 1):   # a params tree split over the processes: refused, naming the fix
        assert (f"refused on {me}: export_params: leaf 'w' (shape (4, 2)) spans devices of "
                "other processes") in proc.stdout, proc.stdout[-3000:]
    assert "save a checkpoint" in proc.stdout
    for name in ("zero", "all"):
        _same(load_params(tmp_path / f"{name}.safetensors", like=params), params)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


# --- issue 51: an export folder holds one layout, never half an export -----------------

def test_hf_export_replaces_another_layout_and_is_never_half_written(tmp_path):
    """export_params(format="hf") into a folder holding a model.safetensors (which
    transformers loads before an index: the new export would be shadowed) and a
    previous export's index and 2 shards: afterwards only the new layout is there and
    both transformers' rule and zerojax.load_params read the new weights; other files
    stay. A foreign weight file is refused, naming it, unless overwrite=True. A
    failed export leaves the folder as it was; a one-file model.safetensors export
    replaces an index and its shards."""
    from safetensors.numpy import save_file

    from zerojax.io import outdir

    new = {"w": jnp.arange(64.0).reshape(8, 8), "b": jnp.ones(8)}
    old = jax.tree.map(lambda x: -x - 1, new)
    out = tmp_path / "hf"
    export_params(old, out, format="hf", max_shard_size=100)  # a previous export
    assert len(weight_files(out)) == 3  # 2 shards and the index
    save_file({k: np.asarray(v) for k, v in old.items()}, str(out / "model.safetensors"))
    (out / "README.md").write_text("mine")
    assert transformers_weights(out) == ["model.safetensors"]  # what shadowed exports

    export_params(new, out, format="hf", max_shard_size=300)
    loaded = one_layout(out)
    assert loaded == ["model-00001-of-00001.safetensors"]
    _same(load_file(out / loaded[0]), {k: np.asarray(v) for k, v in new.items()})
    _same(load_params(out, like=new), new)
    assert (out / "README.md").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".zerojax")]

    (out / "pytorch_model.bin").write_bytes(b"x")
    before = sorted(os.listdir(out))
    with pytest.raises(outdir.OutDirError, match=r"pytorch_model\.bin.*overwrite=True"):
        export_params(old, out, format="hf")
    assert sorted(os.listdir(out)) == before
    with pytest.raises(RuntimeError, match="disk full"):  # killed half way
        with outdir.staged(out, overwrite=True) as tmp:
            (pathlib.Path(tmp) / "model-00001-of-00002.safetensors").write_bytes(b"half")
            raise RuntimeError("disk full")
    assert sorted(os.listdir(out)) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".zerojax")]
    export_params(old, out, format="hf", overwrite=True)
    assert one_layout(out) == ["model-00001-of-00001.safetensors"]
    _same(load_params(out, like=old), old)

    export_params(new, out / "model.safetensors")  # one file: the index goes
    assert one_layout(out) == ["model.safetensors"]
    _same(load_params(out, like=new), new)
    assert sorted(os.listdir(out)) == ["README.md", "model.safetensors"]


def test_hf_export_into_its_checkpoint_is_refused(tmp_path):
    params = {"w": jnp.ones((8, 8))}
    _save(tmp_path / "ckpt", params)
    from zerojax.io.outdir import OutDirError

    for out, words in ((tmp_path / "ckpt", "is the checkpoint directory"),
                       (tmp_path / "ckpt" / "hf", "is inside the checkpoint directory")):
        with pytest.raises(OutDirError, match=words):
            export_params(tmp_path / "ckpt", out, format="hf")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["0"]


def test_a_nonfinite_state_is_never_saved(tmp_path):
    """CheckpointManager.save of params holding NaN (a diverged run) raises, naming the
    leaf, and writes nothing: the latest step stays the last finite one."""
    from zerojax.checkpoint import NonFiniteStateError

    params = {"w": jnp.ones((8, 8)), "b": jnp.zeros(8)}
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=3, min_shard_size=4)
    state = opt.init_state(params)
    bad = state.replace(params={**state.params, "b": state.params["b"] * np.float32("nan")})
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, state)
        with pytest.raises(NonFiniteStateError, match=r"step=2.*\['b'\] holds NaN or inf.*"
                                                      r"stays 1.*check_finite=False"):
            mgr.save(2, bad)
        assert mgr.all_steps() == [1]
        mgr.save(2, bad, check_finite=False)  # asked for
        assert mgr.all_steps() == [1, 2]
