"""The NVMe tier under a failing disk and flipped bytes (issue 40): a failed write never
leaves the user without a usable state, and corrupt bytes are never trained on or
checkpointed. Faults are injected at the file layer (``nvme_files._write`` for the
manifest, ``nvme_files._pwrite`` for the leaves), raising what a full or read-only disk
raises."""

import errno
import os

import jax
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, regression_batches

import zerojax
from zerojax import nvme
from zerojax.tiers import nvme_files

STEPS = 4


def _snap(opt, state):
    return [np.asarray(x) for x in jax.tree.leaves((opt.full_params(state),
                                                    nvme.read_state(state)))]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One optimizer (stage 2, default min_shard_size, several buckets) and step, compiled
    once, and its uninterrupted run: the snapshot after each step."""
    d = tmp_path_factory.mktemp("nvme")
    opt = zerojax.zero(optax.adamw(1e-2), zerojax.make_mesh(data=8), stage=2,
                       offload_optimizer="nvme", nvme_path=str(d), nvme_buffer_size=16384)
    step = opt.train_step(awkward_loss)
    batches = regression_batches(STEPS)
    state = opt.init_state(awkward_params())
    ref = []
    for b in batches:
        state, _ = step(state, b)
        ref.append(_snap(opt, state))
    return opt, step, batches, ref, d / "zerojax-nvme-p0"


def _fail(monkeypatch, name, code, when=lambda data: True):
    """``nvme_files.<name>`` (``_write`` or ``_pwrite``) raising OSError(code) where ``when``."""
    real = getattr(nvme_files, name)
    calls = {"n": 0}

    def broken(fd, data, *a):
        calls["n"] += 1
        if when(bytes(data[:200]) if name == "_write" else calls["n"]):
            raise OSError(code, os.strerror(code))
        return real(fd, data, *a)

    monkeypatch.setattr(nvme_files, name, broken)
    return calls


def _files(root):
    return {p.name: p.read_bytes() for p in root.glob("leaf-*.bin")}


def test_a_failed_write_never_loses_the_state(run, monkeypatch, tmp_path):
    opt, step, batches, ref, root = run
    state, _ = step(opt.init_state(awkward_params()), batches[0])
    assert _same(_snap(opt, state), ref[0])
    gen = state.opt_state.generation

    # 1. the disk is full at the update's first write (its 'updating' manifest): no leaf
    # written, the state held stays in force
    before = _files(root)
    with monkeypatch.context() as m:
        _fail(m, "_write", errno.ENOSPC)
        with pytest.raises(nvme.NvmeWriteError, match=(
                rf"nvme_path {root.parent}: writing {root}/MANIFEST.json.tmp \('updating' "
                rf"generation {gen + 1}\) failed \(ENOSPC: No space left on device\); \d+ bytes "
                rf"needed, \d+ bytes free there. No leaf was written: the files still hold "
                rf"generation {gen}, and the TrainState you hold still steps and checkpoints "
                r"once the disk is back \(nothing is lost\). Fix: free at least \d+ bytes")):
            step(state, batches[1])
    assert _files(root) == before and not (root / "MANIFEST.json.tmp").exists()
    with zerojax.CheckpointManager(tmp_path / "ckpt") as mgr:  # the disk back: it saves
        mgr.save(1, state)
    assert state.opt_state.store.last_checkpoint == (str(tmp_path / "ckpt"), 1)
    state, _ = step(state, batches[1])  # and steps, as if nothing happened
    assert _same(_snap(opt, state), ref[1])

    # 2. the filesystem turns read-only at the clean manifest: every leaf is written,
    # the new state is in the error, usable once the manifest's write succeeds
    old = state
    with monkeypatch.context() as m:
        _fail(m, "_write", errno.EROFS, lambda data: b'"status": "clean"' in data)
        with pytest.raises(nvme.NvmeWriteError, match=(
                rf"writing {root}/MANIFEST.json.tmp \('clean' generation {gen + 2}\) failed "
                r"\(EROFS: Read-only file system\); \d+ bytes needed, .* The files hold "
                rf"generation {gen + 2} whole; only its manifest is not written, so that state "
                r"\(a step that failed here carries it: err.state\) becomes usable once this "
                r"write succeeds .* Fix: remount that filesystem read-write")) as err:
            step(old, batches[2])
        new = err.value.state
        assert int(new.step) == 3 and float(err.value.metrics["loss"]) > 0
        with pytest.raises(nvme.NvmeWriteError, match="EROFS"):  # still read-only: refused
            step(new, batches[3])
    with pytest.raises(nvme.NvmeError, match="now hold generation .* err.state"):
        step(old, batches[2])  # the retry wrote the manifest: the old state is spent
    assert _same(_snap(opt, new), ref[2])
    state, _ = step(new, batches[3])
    assert _same(_snap(opt, state), ref[3])

    # 3. a leaf write fails mid-update: the files mix two steps; the error names the
    # last checkpoint, which restores and trains on bitwise
    state, _ = step(opt.init_state(awkward_params()), batches[0])
    with monkeypatch.context() as m:
        _fail(m, "_pwrite", errno.EIO, lambda n: n == 2)
        fix = (rf"restore the last checkpoint, step 1 in {tmp_path}/ckpt "
               rf"\(CheckpointManager\('{tmp_path}/ckpt'\).restore\(opt, step=1, like=params\)\)")
        with pytest.raises(nvme.NvmeWriteError, match=(
                rf"after \d+ of its leaf writes began .*EIO.* now mix generations .* not a "
                rf"state. Fix the disk, then {fix}")):
            step(state, batches[1])
    with pytest.raises(nvme.NvmeError, match=f"not a state. Fix the disk, then {fix}"):
        step(state, batches[1])
    with zerojax.CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(nvme.NvmeError, match="mix generations"):
            mgr.save(2, state)  # refused, nothing written
        assert mgr.all_steps() == [1]
        state = mgr.restore(opt, step=1, like=awkward_params())
    for k in (1, 2):
        state, _ = step(state, batches[k])
        assert _same(_snap(opt, state), ref[k])


def test_flipped_bytes_are_never_trained_on_or_checkpointed(run, tmp_path):
    opt, step, batches, ref, root = run
    state, _ = step(opt.init_state(awkward_params()), batches[0])
    e = state.opt_state.store.leaves[0]
    path = root / e["file"]
    data = bytearray(path.read_bytes())
    for k in range(64):  # XOR 0x40 into 64 bytes, the size kept
        data[100 + k] ^= 0x40
    path.write_bytes(bytes(data))
    where = rf"{path} \(opt_state{e['path']}".replace("[", r"\[").replace("]", r"\]")
    match = (rf"{where}, shard .*\) does not hold what was written there by the update of "
             r"step 1 \(generation \d+\): crc32 [0-9a-f]{8}, [0-9a-f]{8} written.*not used, "
             "trained on or checkpointed")
    with zerojax.CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(nvme.NvmeError, match=match):
            mgr.save(1, state)
        assert mgr.all_steps() == [] and not any((tmp_path / "ckpt").glob("*1"))
    with pytest.raises(nvme.NvmeError, match=match):
        step(state, batches[1])
