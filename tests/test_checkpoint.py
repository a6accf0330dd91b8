"""Sharded checkpoints (issue 10): exact resume in a new process, restore onto another
mesh, stage or precision, a killed save never damages the previous step, export to one
safetensors file, clear errors."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    awkward_loss,
    awkward_params,
    cached_gpt_params,
    max_rel_err,
    reference_run,
    regression_batches,
    xla_flags,
)

import zerojax
from zerojax import checkpoint, checkpoint_reader
from zerojax.checkpoint import CheckpointError, CheckpointManager, export_params, load_params

HERE = pathlib.Path(__file__).resolve().parent
BATCHES = regression_batches(10)

_RESUME = r"""
import os, sys
sys.path.insert(0, {here!r})
import jax, numpy as np, optax, zerojax
from helpers import awkward_loss, awkward_params, regression_batches
from zerojax.checkpoint import CheckpointManager
mode, stage, d = sys.argv[1], int(sys.argv[2]), sys.argv[3]
opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=stage, min_shard_size=16)
step = opt.train_step(awkward_loss)
batches = regression_batches(10)
mgr = CheckpointManager(d)
if mode == "first":
    state = opt.init_state(awkward_params())
    for b in batches[:5]:
        state, _ = step(state, b)
    mgr.save(5, state, extra={{"data_position": 5}})
    mgr.wait()
else:
    state = mgr.restore(opt, like=awkward_params())
    assert mgr.extra(5) == {{"data_position": 5}}
    for b in batches[5:]:
        state, _ = step(state, b)
    full = opt.full_params(state)
    np.savez(os.path.join(d, "final.npz"), **{{str(i): np.asarray(x) for i, x in
                                              enumerate(jax.tree.leaves(full))}})
"""


def _py(code: str, *args, timeout=300, env=None):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8),
               JAX_PLATFORMS="cpu", **(env or {}))
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_resume_in_a_new_process_is_bitwise(tmp_path, stage):
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=stage,
                       min_shard_size=16)
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    for b in BATCHES:
        state, _ = step(state, b)
    straight = [np.asarray(x) for x in jax.tree.leaves(opt.full_params(state))]
    code = _RESUME.format(here=str(HERE))
    for mode in ("first", "second"):
        out = _py(code, mode, stage, tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
    resumed = np.load(tmp_path / "final.npz")
    for i, x in enumerate(straight):
        np.testing.assert_array_equal(x, resumed[str(i)])


@functools.cache
def _adam_reference():
    """Plain optax Adam over the 10 batches on one device (shared by the layouts)."""
    return reference_run(optax.adam(1e-2), awkward_params(), awkward_loss, BATCHES)


def _train(opt, state, batches):
    step = opt.train_step(awkward_loss)
    for b in batches:
        state, _ = step(state, b)
    return state


@pytest.mark.parametrize("before,after", [
    ({"data": 8, "stage": 2}, {"data": 4, "stage": 3}),
    ({"data": 4, "stage": 3}, {"data": 8, "stage": 2}),
    ({"data": 8, "stage": 3}, {"data": 8, "stage": 0}),
    ({"data": 8, "stage": 1, "param_dtype": jnp.bfloat16}, {"data": 8, "stage": 3}),
    ({"data": 8, "stage": 3}, {"data": 4, "stage": 1, "param_dtype": jnp.bfloat16}),
])
def test_restore_onto_another_layout_keeps_training_exactly(tmp_path, before, after):
    """Save, restore by the new optimizer's rules (padding differs: (37,) is (40,) at
    N=4 and 8, whole at stage 0-2), train on: the same as an uninterrupted run."""
    def make(cfg):
        cfg = dict(cfg)
        n = cfg.pop("data")
        return zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=n, devices=jax.devices()[:n]),
                            min_shard_size=16, **cfg)

    first, second = make(before), make(after)
    mgr = CheckpointManager(tmp_path)
    saved = _train(first, first.init_state(awkward_params()), BATCHES[:5])
    mgr.save(5, saved)
    mgr.wait()
    state = mgr.restore(second, like=awkward_params())
    assert int(state.step) == 5
    if "param_dtype" in before or "param_dtype" in after:
        # precision changes: the fp32 truth (master weights, else params) carries over
        # exactly and becomes the params, or the master of the new run
        assert max_rel_err(first.full_params(saved), second.full_params(state)) == 0
        assert np.isfinite(float(second.train_step(awkward_loss)(state, BATCHES[5])[1]["loss"]))
        return
    got = second.full_params(_train(second, state, BATCHES[5:]))
    want = _adam_reference()
    assert max_rel_err(want, got) <= 2e-6  # the core parity tolerance for adam


@functools.cache
def _host_boxed_gpt_params():
    """The tiny GPT's params as flax initialises them (``nn.Partitioned`` boxes kept),
    on the host: flax's eager init once for the tests below (their token batches have
    the same shape, so the same params)."""
    from zerojax.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4))
    tok = np.random.default_rng(0).integers(0, 64, (16, 17)).astype(np.int32)
    return jax.tree.map(np.asarray, model.init(jax.random.key(0), tok[:, :-1])["params"])


def _boxed_gpt_params():
    return jax.tree.map(jnp.asarray, _host_boxed_gpt_params())  # fresh arrays each call


def test_restore_with_a_model_axis_on_one_side(tmp_path):
    from zerojax.models import GPT, GPTConfig, lm_loss

    model = GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4))
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 64, (16, 17)).astype(np.int32) for _ in range(4)]
    boxed = _boxed_gpt_params()
    steps = {}  # one train step (one compile) per optimizer: dp trains twice below

    def run(opt, state, bs):
        if id(opt) not in steps:
            steps[id(opt)] = opt.train_step(lm_loss(model))
        step = steps[id(opt)]
        for b in bs:
            state, _ = step(state, b)
        return state

    tp = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=4, model=2), stage=3)
    dp = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=2)
    mgr = CheckpointManager(tmp_path / "a")
    mgr.save(2, run(tp, tp.init_state(boxed), batches[:2]))
    mgr.wait()
    got = dp.full_params(run(dp, mgr.restore(dp, like=boxed), batches[2:]))
    want = reference_run(optax.adam(1e-3), cached_gpt_params(model, 0), lm_loss(model), batches)
    assert max_rel_err(want, got) < 3e-4  # tests/test_gpt.py: the zero-gradient key bias
    back = CheckpointManager(tmp_path / "b")
    back.save(4, run(dp, mgr.restore(dp, like=boxed), batches[2:]))
    back.wait()
    again = tp.full_params(back.restore(tp, like=boxed))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_KILLED = r"""
import os, signal, sys
sys.path.insert(0, {here!r})
import jax, jax.numpy as jnp, numpy as np, optax, zerojax
from zerojax.checkpoint import CheckpointManager
d, saved = sys.argv[1], sys.argv[2]
opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3)
params = {{"w%d" % i: jnp.full((1024, 1024), float(i)) for i in range(12)}}
state = opt.init_state(params)
mgr = CheckpointManager(d)
mgr.save(1, state)
mgr.wait()
np.save(saved, np.asarray(opt.full_params(state)["w3"]))  # beside the checkpoints
state = state.replace(params=jax.tree.map(lambda x: x + 1, state.params))
mgr.save(2, state)          # asynchronous: the bytes are being written
print("killing", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_step_whole(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = _py(_KILLED.format(here=str(HERE)), ckpt, tmp_path / "saved.npy")
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    left = _temporaries(ckpt)
    assert left == [".zerojax-tmp-2"], left
    mgr = CheckpointManager(ckpt)
    assert not _temporaries(ckpt)  # its process is gone: removed when a manager opens
    assert mgr.latest_step() == 1, os.listdir(ckpt)
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3)
    like = {f"w{i}": jax.ShapeDtypeStruct((1024, 1024), jnp.float32) for i in range(12)}
    state = mgr.restore(opt, like=like)
    np.testing.assert_array_equal(np.asarray(opt.full_params(state)["w3"]),
                                  np.load(tmp_path / "saved.npy"))


def test_export_loads_into_the_flax_model_and_reproduces_its_outputs(tmp_path):
    from zerojax.models import GPT, GPTConfig, lm_loss

    model = GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4))
    tok = np.random.default_rng(0).integers(0, 64, (16, 17)).astype(np.int32)
    boxed = _boxed_gpt_params()
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=4, model=2), stage=3)
    state = opt.init_state(boxed)
    step = opt.train_step(lm_loss(model))
    for _ in range(3):
        state, _ = step(state, tok)
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(3, state)
    mgr.wait()
    path = export_params(tmp_path / "ckpt", tmp_path / "model.safetensors")
    loaded = load_params(path, boxed)  # boxes kept: the flax metadata survives
    from flax.core import meta

    plain = meta.unbox(loaded)
    full = opt.full_params(state)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(full)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    on_host = jax.tree.map(np.asarray, full)  # both on one device: the same program
    np.testing.assert_array_equal(np.asarray(model.apply({"params": plain}, tok[:, :-1])),
                                  np.asarray(model.apply({"params": on_host}, tok[:, :-1])))


_EXPORT_MEMORY = r"""
import os, sys, threading
from zerojax.checkpoint import CheckpointManager, export_params
d, out = sys.argv[1], sys.argv[2]
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
CheckpointManager(d).meta()          # imports and first orbax read done
before = peak = rss()
stop = threading.Event()
def poll():                          # resident set size, sampled while the export runs
    global peak
    while not stop.is_set():
        peak = max(peak, rss())
sys.setswitchinterval(1e-5)
t = threading.Thread(target=poll, daemon=True)
t.start()
export_params(d, out)
stop.set()
t.join()
print("PEAK", before, max(peak, rss()))
"""


@pytest.mark.slow
def test_export_streams_leaf_by_leaf(tmp_path):
    """Peak host memory of the export (a fresh process) stays under twice the largest
    leaf plus a fixed overhead, far below the model (12 leaves of 16 MiB)."""
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=3)
    params = {f"w{i}": jnp.full((2048, 2048), float(i)) for i in range(12)}
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(0, opt.init_state(params))
    mgr.wait()
    del params
    # glibc's malloc raises its mmap threshold once a big block is freed, then keeps
    # later freed leaves in per-thread arenas (RSS plateaus near 4.5 leaves here, for
    # any number of leaves); a fixed threshold measures what the export itself holds
    out = _py(_EXPORT_MEMORY, tmp_path / "ckpt", tmp_path / "m.safetensors",
              env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(int, next(x for x in out.stdout.splitlines()
                                  if x.startswith("PEAK")).split()[1:])
    leaf, model = 2048 * 2048 * 4, 12 * 2048 * 2048 * 4
    grown = after - before
    print(f"export peak growth {grown / 2**20:.1f} MiB, largest leaf {leaf / 2**20:.0f} MiB, "
          f"model {model / 2**20:.0f} MiB")
    assert grown < 2 * leaf + 32 * 2**20, grown
    from safetensors.numpy import load_file

    got = load_file(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(f"w{i}" for i in range(12))
    assert float(got["w7"][5, 5]) == 7.0


def test_errors_name_the_leaf_and_the_directory(tmp_path):
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=1, min_shard_size=16)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint.*does not exist"):
        CheckpointManager(tmp_path / "empty").restore(opt, like=awkward_params())
    mgr = CheckpointManager(tmp_path / "run")
    mgr.save(3, opt.init_state(awkward_params()))
    mgr.wait()
    with pytest.raises(FileNotFoundError, match=r"step 7.*complete steps: \[3\]"):
        mgr.restore(opt, like=awkward_params(), step=7)
    wrong = dict(awkward_params())
    wrong["proj"] = jnp.zeros((37, 8))
    with pytest.raises(ValueError, match=r"\['proj'\].*\(37, 8\).*\(37, 7\)"):
        mgr.restore(opt, like=wrong)
    extra = dict(awkward_params(), more=jnp.zeros((4,)))
    with pytest.raises(ValueError, match=r"\['more'\]"):
        mgr.restore(opt, like=extra)
    with pytest.raises(ValueError, match="JSON"):
        mgr.save(4, opt.init_state(awkward_params()), extra={"x": object()})


def test_max_to_keep_prunes_and_latest_step(tmp_path):
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=2, min_shard_size=16)
    state = opt.init_state(awkward_params())
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for s in (1, 2, 3):
        mgr.save(s, state)
    mgr.wait()
    assert mgr.all_steps() == [2, 3] and mgr.latest_step() == 3


def test_cli_export(tmp_path, capsys):
    from zerojax.cli import main

    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3, min_shard_size=16)
    state = opt.init_state(awkward_params())
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, state)
    mgr.save(2, state)
    mgr.wait()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"),
                 "--step", "1"]) == 0
    assert "step 1" in capsys.readouterr().out
    loaded = load_params(tmp_path / "m.safetensors", awkward_params())
    assert loaded["proj"].shape == (37, 7)  # the padding (40, 7) is gone
    np.testing.assert_array_equal(np.asarray(loaded["proj"]), np.asarray(awkward_params()["proj"]))
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "x.safetensors")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "x.safetensors"),
                 "--step", "9"]) == 2   # bad input: a step the checkpoint does not have
    assert "complete steps: [1, 2]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0 and "safetensors" in capsys.readouterr().out


def _device0_live_bytes() -> int:
    """Bytes of every live jax array held on the first device."""
    dev = jax.devices()[0]
    total = 0
    for a in jax.live_arrays():
        try:
            if dev in a.sharding.device_set and not a.is_deleted():
                total += (int(np.prod(a.sharding.shard_shape(a.shape), dtype=np.int64))
                          * a.dtype.itemsize)
        except Exception:  # an array freed while we look at it
            pass
    return total


class _PeakSampler:
    """Samples device 0's live-array bytes in a thread while the block runs (the CPU
    backend keeps no allocator statistics; ``memory_stats()`` is None there)."""

    def __enter__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)

        def poll():
            while not self._stop.is_set():
                self.peak = max(self.peak, _device0_live_bytes())

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        self.peak = max(self.peak, _device0_live_bytes())


@pytest.mark.parametrize("param_dtype", [None, jnp.bfloat16])
def test_restore_peak_device_memory_is_the_restored_state(tmp_path, param_dtype):
    """Stage 3 restore reads each device's own shards: device 0's live bytes never
    exceed 1.1x the restored state's own share (no whole array on one device)."""
    import gc

    params = {f"w{i}": jnp.full((512, 1024), float(i)) for i in range(6)}
    params["odd"] = jnp.ones((4099, 33))          # padded to 4104 rows at N=8
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3,
                       param_dtype=param_dtype)
    mgr = CheckpointManager(tmp_path)
    state = opt.init_state(params)
    mgr.save(1, state)
    mgr.wait()
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    del state, params
    gc.collect()
    base = _device0_live_bytes()
    with _PeakSampler() as sampler:
        restored = mgr.restore(opt, like=like)
        jax.block_until_ready(restored)
    own = _device0_live_bytes() - base
    peak = sampler.peak - base
    # the restored state on device 0: params, adam's two moments (and the fp32 master),
    # 1/8 of each; a whole leaf would add 512 KiB at once
    assert own <= 1.02 * (3 + (param_dtype is not None)) * whole / 8 + 64 * 1024, own
    assert peak <= 1.1 * own, (peak, own)
    del restored


# --- a save is never lost when the script ends (issue 17, first part) -----------------

_SAVE_AND_END = r"""
import sys
sys.path.insert(0, {here!r})
import jax, numpy as np, optax, zerojax
from helpers import awkward_loss, awkward_params, regression_batches
from zerojax.checkpoint import CheckpointManager
how, d = sys.argv[1], sys.argv[2]
opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3, min_shard_size=16)
state = opt.init_state(awkward_params())
state, _ = opt.train_step(awkward_loss)(state, regression_batches(1)[0])
np.savez(d + ".npz", *[np.asarray(x) for x in jax.tree.leaves(opt.full_params(state))])
if how == "with":
    with CheckpointManager(d) as mgr:
        mgr.save(1, state)
else:
    CheckpointManager(d).save(1, state)   # async; no wait(), no close()
if how == "raise":
    raise RuntimeError("the script fails right after saving")
if how == "sigterm":  # what a scheduler sends; nobody asks reached_preemption here
    import os, signal, time
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["return", "raise", "with", "sigterm"])
def test_a_save_survives_the_end_of_the_script(tmp_path, how):
    """A script that saves and ends (returns, raises, or leaves a `with` block) leaves
    the step complete and restorable: pending writes finish at interpreter exit."""
    d = tmp_path / "ckpt"
    out = _py(_SAVE_AND_END.format(here=str(HERE)), how, d)
    want = {"raise": 1, "sigterm": 128 + signal.SIGTERM}.get(how, 0)
    assert out.returncode == want, out.stderr[-3000:]
    assert "cannot schedule new futures" not in out.stderr, out.stderr[-3000:]
    assert not list(d.glob("*tmp*")), list(d.iterdir())
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3, min_shard_size=16)
    mgr = CheckpointManager(d)
    assert mgr.all_steps() == [1]
    restored = opt.full_params(mgr.restore(opt, like=awkward_params()))
    want = np.load(str(d) + ".npz")
    for i, x in enumerate(jax.tree.leaves(restored)):
        np.testing.assert_array_equal(want[f"arr_{i}"], np.asarray(x))


def test_latest_step_right_after_an_async_save_sees_it(tmp_path):
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=1, min_shard_size=16)
    state = opt.init_state(awkward_params())
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(3, state)
        assert mgr.latest_step() == 3          # waits for the pending write
        assert mgr.all_steps() == [3]
        restored = mgr.restore(opt, like=awkward_params())
        assert int(restored.step) == int(state.step)
    mgr.close()  # closing twice is fine


# -- issue 17: no step dropped or overwritten silently, foreign entries, integrity ------


@pytest.fixture(scope="module")
def small():
    """A stage-3 Adam state of the awkward params, and a second one with other values."""
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3, min_shard_size=16)
    a = opt.init_state(awkward_params(0))
    b = opt.init_state(awkward_params(1))
    return opt, a, b


def _full(opt, state):
    return [np.asarray(x) for x in jax.tree.leaves(opt.full_params(state))]


def _same(opt, x, y):
    for u, v in zip(_full(opt, x), _full(opt, y)):
        np.testing.assert_array_equal(u, v)


def test_saving_an_existing_or_lower_step_raises_or_rolls_back(tmp_path, small):
    opt, a, b = small
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    for s in (2, 3, 4):
        mgr.save(s, a)
    with pytest.raises(CheckpointError, match=r"step 4 exists.*nothing was written.*overwrite"):
        mgr.save(4, b)
    with pytest.raises(CheckpointError, match=r"step 1 is below the newest step 4.*\[2, 3, 4\]"):
        mgr.save(1, b)
    assert mgr.all_steps() == [2, 3, 4]
    _same(opt, mgr.restore(opt, like=awkward_params(), step=4), a)
    # a rollback: resumed from step 2, the new run saves step 3 again
    mgr.save(3, b, overwrite=True)
    assert mgr.all_steps() == [2, 3]
    _same(opt, mgr.restore(opt, like=awkward_params()), b)
    mgr.save(3, a, overwrite=True)  # the same step replaced on purpose
    _same(opt, mgr.restore(opt, like=awkward_params(), step=3), a)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".zerojax")]


def test_foreign_entries_are_never_listed_pruned_or_in_the_way(tmp_path, small):
    opt, a, _ = small
    for name in ("1", "2", "7", "12"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine")
    (tmp_path / "5").write_text("a file named like a step")
    with pytest.warns(UserWarning, match=r"did not write: \['1', '12', '2', '5', '7'\]"):
        mgr = CheckpointManager(tmp_path, max_to_keep=1)
        assert mgr.all_steps() == []
        for s in (3, 4):
            mgr.save(s, a)
        assert mgr.all_steps() == [4]
    for name in ("1", "2", "7", "12"):
        assert (tmp_path / name / "notes.txt").read_text() == "mine"
    assert mgr.latest_step() == 4


def _largest_data_file(step_dir):
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "empty_meta"])
def test_a_damaged_step_names_itself_and_the_previous_one_restores(tmp_path, small, damage):
    opt, a, b = small
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(1, a)
    mgr.save(2, b)
    mgr.wait()
    step2 = tmp_path / "2"
    if damage == "flip":
        f = _largest_data_file(step2)
        data = bytearray(f.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 8] = bytes(x ^ 0xFF for x in data[mid:mid + 8])
        f.write_bytes(bytes(data))
        want = rf"step 2 .* damaged: file {f.relative_to(step2)} fails its checksum"
    elif damage == "truncate":
        f = _largest_data_file(step2)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        want = rf"step 2 .* damaged: file {f.relative_to(step2)} has \d+ bytes, \d+ were written"
    elif damage == "delete":
        f = next((step2 / "state").rglob("manifest.ocdbt"))
        f.unlink()
        want = rf"step 2 .* damaged: its file {f.relative_to(step2)} is missing"
    else:
        (step2 / "meta.json").write_text("")
        want = r"step 2 .* damaged: (file )?meta.json (is not valid JSON|has 0 bytes)"
    with pytest.raises(CheckpointError, match=want) as err:
        mgr.restore(opt, like=awkward_params())
    if damage in ("flip", "truncate"):  # the file packs many arrays: the leaf is named too
        assert re.search(r"The changed bytes hold leafs? (params|inner)\.[\w.]+ \(chunks? ",
                         str(err.value)), err.value
    if damage == "flip":  # an export checks too
        with pytest.raises(CheckpointError, match=want):
            export_params(tmp_path, tmp_path / "m.safetensors")
    with pytest.warns(UserWarning, match="skipping step 2"):
        assert mgr.latest_step(verify=True) == 1
    _same(opt, mgr.restore(opt, like=awkward_params(), step=1), a)


def test_chunk_table_reads_every_key_of_a_deep_ocdbt_tree(tmp_path):
    # tiny nodes force a tree of height 3, whose nodes store keys relative to prefixes
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/state/",
                          "config": {"max_decoded_node_bytes": 512,
                                     "max_inline_value_bytes": 4}}).result()
    with ts.Transaction() as t:
        for i in range(200):
            kv.with_transaction(t)[f"leaf{i % 7}/{i:04d}"] = bytes([i]) * 100
    table = checkpoint._ocdbt_chunks(str(tmp_path / "state"))
    found = {}
    for name, chunks in table.items():
        data = (tmp_path / name).read_bytes()
        for off, length, key in chunks:
            found[key] = data[off:off + length]
    assert found == {f"leaf{i % 7}/{i:04d}": bytes([i]) * 100 for i in range(200)}


def test_chunk_crcs_match_the_bytes_across_read_buffers(tmp_path, monkeypatch):
    data = os.urandom(1000)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(checkpoint_reader, "_CHUNK", 7)  # segments straddle many reads
    monkeypatch.setattr(checkpoint_reader, "_buffers", type(checkpoint_reader._buffers)())
    segments = [(500, 499), (0, 13), (13, 1), (14, 300), (990, 20)]  # the last is cut short
    size, crc, crcs = checkpoint_reader._crc(str(tmp_path / "f"), segments)
    assert (size, crc) == (1000, zlib.crc32(data))
    assert crcs == [zlib.crc32(data[o:o + n]) for o, n in segments]


def test_restore_argument_errors_name_the_cause(tmp_path, small):
    opt, a, _ = small
    mgr = CheckpointManager(tmp_path)
    mgr.save(4, a)
    with pytest.raises(TypeError, match=r"step='4' must be a non-negative int"):
        mgr.restore(opt, like=awkward_params(), step="4")
    other = zerojax.zero(optax.adabelief(1e-2), zerojax.make_mesh(data=8), stage=3,
                         min_shard_size=16)
    with pytest.raises(ValueError, match=r"another optimizer: saved \['ScaleByAdamState'.*"
                                         r"ScaleByBeliefState"):
        mgr.restore(other, like=awkward_params())
    with pytest.raises(TypeError, match="step=-1"):
        mgr.save(-1, a)
    clash = {"a.b": jnp.ones((4,)), "a": {"b": jnp.zeros((4,))}}
    sgd = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=1)
    with pytest.raises(ValueError, match=r"\['a.b'\].*\['a'\]\['b'\]|\['a'\]\['b'\].*\['a.b'\]"):
        mgr.save(5, sgd.init_state(clash))
    assert mgr.all_steps() == [4]


def test_a_static_loss_scale_wins_over_the_saved_one(tmp_path):
    def make(loss_scale):
        return zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=2,
                            min_shard_size=16, param_dtype=jnp.float16, loss_scale=loss_scale)

    saved = make("auto")
    state = saved.init_state(awkward_params())
    assert float(state.loss_scale.scale) == 2.0**15
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        static = mgr.restore(make(128.0), like=awkward_params())
        assert float(static.loss_scale.scale) == 128.0
        dynamic = mgr.restore(make("auto"), like=awkward_params())
        assert float(dynamic.loss_scale.scale) == 2.0**15


def test_extra_is_per_process_and_a_failed_save_is_not_silent(tmp_path, small, monkeypatch):
    opt, a, _ = small
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, a, extra={"data_position": 7})
    assert mgr.extra() == {"data_position": 7} == mgr.extra(1, process=0)
    with pytest.raises(FileNotFoundError, match="no extra of process 1.*saved by 1 process"):
        mgr.extra(1, process=1)

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_checksums", broken)
    mgr.save(2, a)
    with pytest.raises(CheckpointError, match="step is NOT saved.*disk full"):
        mgr.wait()
    monkeypatch.undo()
    assert mgr.all_steps() == [1]
    mgr.save(2, a)  # the failed step's leftovers do not stand in the way
    assert mgr.all_steps() == [1, 2]


def test_a_first_format_step_still_lists_and_restores(tmp_path, small):
    """Steps written by zerojax's first format (orbax's own CheckpointManager, items
    `state` and `meta`) are still listed and restored (no checksums to verify)."""
    import orbax.checkpoint as ocp

    from zerojax import partition as part
    from zerojax.checkpoint import _paths

    opt, a, _ = small
    tree = {"step": a.step, "params": a.params, "inner": a.opt_state}
    meta = {"format": 1, "data": 8, "has_master": False, "has_loss_scale": False,
            "params": {k: {"shape": list(s), "stored": list(x.shape), "dtype": str(x.dtype)}
                       for (k, x), s in zip(_paths(a.params).items(),
                                            part.logical_shapes(a.params))},
            "extra": {"old": True}}
    old = ocp.CheckpointManager(str(tmp_path), item_handlers={
        "state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
    old.save(6, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree),
                                        meta=ocp.args.JsonSave(meta)))
    old.wait_until_finished()
    old.close()
    mgr = CheckpointManager(tmp_path)
    assert mgr.all_steps() == [6] and mgr.extra() == {"old": True}
    _same(opt, mgr.restore(opt, like=awkward_params()), a)
    mgr.save(7, a)  # a new step beside it, in the new format
    assert mgr.all_steps() == [6, 7]


# -- issue 31: a rollback or a collision never loses a step; temporaries; markers -----


def _temporaries(d):
    return sorted(n for n in os.listdir(d) if n.startswith(".zerojax"))


def test_a_rollback_over_a_colliding_folder_keeps_the_newer_step(tmp_path, small):
    opt, a, b = small
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(6, a)
    mgr.save(8, b)
    mgr.wait()
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match="did not write"):
        with pytest.raises(CheckpointError, match=rf"step 7: {re.escape(str(tmp_path / '7'))} "
                                                  r"exists and zerojax did not write it.*nothing"):
            mgr.save(7, a, overwrite=True)  # refused at save, before anything moves
    mgr.save(9, a)  # the next successful save
    assert mgr.all_steps() == [6, 8, 9]
    _same(opt, mgr.restore(opt, like=awkward_params(), step=8), b)
    assert (tmp_path / "7" / "notes.txt").read_text() == "mine"
    assert not _temporaries(tmp_path)


def test_a_failed_rollback_names_the_cause_and_keeps_every_step(tmp_path, small,
                                                               monkeypatch):
    """The folder appears after `save` checked (between save and the rename): the
    rename fails, nothing older or newer is removed, the error names the path."""
    opt, a, b = small
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(6, a)
    mgr.save(8, b)
    mgr.wait()
    real = checkpoint._checksums

    def user_makes_7(root, names, segments=None):
        (tmp_path / "7").mkdir(exist_ok=True)
        (tmp_path / "7" / "notes.txt").write_text("mine")
        return real(root, names, segments)

    monkeypatch.setattr(checkpoint, "_checksums", user_makes_7)
    mgr.save(7, a, overwrite=True)
    with pytest.warns(UserWarning, match="did not write"):
        with pytest.raises(CheckpointError, match=rf"step is NOT saved.*"
                           rf"{re.escape(str(tmp_path / '7'))}.*did not write"):
            mgr.wait()
    monkeypatch.undo()
    assert mgr.all_steps() == [6, 8]
    mgr.save(9, a)
    assert mgr.all_steps() == [6, 8, 9]
    _same(opt, mgr.restore(opt, like=awkward_params(), step=8), b)
    assert (tmp_path / "7" / "notes.txt").read_text() == "mine"
    assert not _temporaries(tmp_path)


def test_a_colliding_save_fails_at_save_and_temporaries_are_removed(tmp_path, small,
                                                                    monkeypatch):
    opt, a, _ = small
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match=r"did not write: \['12'\]"):
        mgr = CheckpointManager(tmp_path, max_to_keep=None)
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path / '12'))} exists"
                                                  r" and zerojax did not write it"):
            mgr.save(12, a)
    assert not _temporaries(tmp_path)  # nothing was written
    # a failed save leaves its temporary; the next save removes it
    monkeypatch.setattr(checkpoint, "_checksums", lambda *a: (_ for _ in ()).throw(
        OSError("disk full")))
    mgr.save(13, a)
    with pytest.raises(CheckpointError, match="NOT saved.*disk full"):
        mgr.wait()
    monkeypatch.undo()
    assert _temporaries(tmp_path) == [".zerojax-tmp-13"]
    mgr.save(14, a)
    mgr.wait()
    assert not _temporaries(tmp_path) and mgr.all_steps() == [14]
    # a killed save's temporary (its process is gone) is removed when a manager opens;
    # a live save's, or one zerojax did not write, is left alone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, pid in ((".zerojax-tmp-15", dead.pid), (".zerojax-tmp-16", os.getppid())):
        (tmp_path / name / "state").mkdir(parents=True)
        (tmp_path / name / "meta.json").write_text("{}")
        checkpoint._write_json(str(tmp_path / name / checkpoint._OWNER),
                               {"host": checkpoint._HOST, "pid": pid, "save": "x"})
    (tmp_path / ".zerojax-tmp-17").mkdir()
    (tmp_path / ".zerojax-tmp-17" / "notes.txt").write_text("not zerojax's")
    CheckpointManager(tmp_path)
    assert _temporaries(tmp_path) == [".zerojax-tmp-16", ".zerojax-tmp-17"]


@pytest.mark.parametrize("damage", ["delete", "garbage"])
def test_a_removed_marker_is_reported_as_a_damaged_step(tmp_path, small, damage):
    opt, a, b = small
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(1, a)
    mgr.save(2, b)
    mgr.wait()
    marker = tmp_path / "2" / checkpoint.MARKER
    if damage == "delete":
        marker.unlink()
        why = "is missing"
    else:
        marker.write_text("{not json")
        why = "is not valid JSON"
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    with pytest.warns(UserWarning, match=rf"step 2 in {re.escape(str(tmp_path))} is a damaged "
                                         rf"zerojax step: its marker {checkpoint.MARKER} {why}"
                      ) as rec:
        assert mgr.all_steps() == [1]
    assert not any("did not write" in str(w.message) for w in rec)
    assert list(mgr.damaged_steps()) == [2]
    with pytest.raises(CheckpointError, match=r"the newest step 2 .* is damaged.*marker.*"
                                              r"step=1 or fallback=True"):
        mgr.restore(opt, like=awkward_params())
    with pytest.warns(UserWarning, match=r"step 2 .* damaged.*restoring step 1"):
        _same(opt, mgr.restore(opt, like=awkward_params(), fallback=True), a)
    with pytest.raises(CheckpointError, match=r"step 2 exists \(damaged"):
        mgr.save(2, b)
    mgr.save(2, b, overwrite=True)  # zerojax's own damaged step may be replaced
    assert mgr.all_steps() == [1, 2] and not mgr.damaged_steps()
    _same(opt, mgr.restore(opt, like=awkward_params()), b)


def test_a_save_killed_between_its_renames_is_finished_or_undone_at_open(tmp_path, small):
    """What `_publish` leaves if the process dies between two renames: a replaced step
    moved aside (its replacement never moved in) comes back; a rollback whose new step
    is not in place deletes nothing; one whose new step is in place deletes the newer
    steps its journal names."""
    opt, a, b = small
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    for s in (3, 5, 6):
        mgr.save(s, a)
    mgr.wait()
    os.replace(tmp_path / "6", tmp_path / ".zerojax-replaced-6-123")
    checkpoint._write_json(str(tmp_path / ".zerojax-rollback-5.json"),
                           {"step": 5, "token": "5:99", "doomed": [6]})
    assert CheckpointManager(tmp_path, max_to_keep=None).all_steps() == [3, 5, 6]
    assert not _temporaries(tmp_path)
    token = json.loads((tmp_path / "3" / checkpoint.MARKER).read_text())["token"]
    checkpoint._write_json(str(tmp_path / ".zerojax-rollback-3.json"),
                           {"step": 3, "token": token, "doomed": [5, 6]})
    assert CheckpointManager(tmp_path, max_to_keep=None).all_steps() == [3]
    assert not _temporaries(tmp_path)
