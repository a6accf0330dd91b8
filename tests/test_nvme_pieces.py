"""The pieces NvmeTrainStep and NvmeStore coordinate (issue 43), each on its own: the
bucket plan (pure bookkeeping: no device, no files), the I/O pipeline (over fake
reads, updates and writes), the file layer (a leaf's shards to a file and back) and
the programs cut from a traced update. The step over them: tests/test_nvme*.py."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as Ps

import zerojax
from zerojax.engine import nvme_pipeline, nvme_plan
from zerojax.runtime.nvme_lock import NvmeError
from zerojax.tiers import nvme_files, nvme_programs, offload


# -- the bucket plan ----------------------------------------------------------------------
def test_state_positions_put_the_master_weights_first_or_skip_the_owned_params():
    assert nvme_plan.state_positions(True, 2, 3) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}
    assert nvme_plan.state_positions(False, 2, 3) == {2: 0, 3: 1, 4: 2}


def test_disk_operands_are_the_state_leaves_not_kept_in_memory():
    index = nvme_plan.state_positions(False, 2, 3)  # operands 2, 3, 4: state leaves 0, 1, 2
    assert nvme_plan.disk_operands(7, index, small={1: None}) == [
        False, False, True, False, True, False, False]


def test_buffer_elements_count_the_widest_operand_at_least_four_bytes():
    assert nvme_plan.buffer_elements(4096, [2, 2]) == 1024  # bf16: counted as 4 bytes
    assert nvme_plan.buffer_elements(4096, [4, 8]) == 512
    assert nvme_plan.buffer_elements(3, [4]) == 1


def test_assign_groups_outputs_by_bucket_and_keeps_the_rest_apart():
    index = {0: 0, 1: 1, 2: 2}  # operands/outputs 0-2 are state leaves 0-2
    buckets, rest = nvme_plan.assign([[2, 0], [1]], [0, 1, 0, -1, 1], index, small={},
                                     name=str)
    assert buckets == [([0, 2], [0, 2]), ([1], [1, 4])]
    assert rest == [3]
    # a small leaf (kept in memory) may be computed outside every bucket
    assert nvme_plan.assign([[0]], [0, -1], {0: 0, 1: 1}, small={1: None}, name=str)[1] == [1]


def test_assign_refuses_a_disk_leaf_updated_without_its_old_value():
    names = {0: "['w']", 1: "['b']"}.get
    with pytest.raises(NotImplementedError, match=r"opt_state leaf \['b'\]'s new value is "
                       "computed without its old one in the same bucket"):
        nvme_plan.assign([[0], [1]], [0, 0], {0: 0, 1: 1}, small={}, name=names)
    with pytest.raises(NotImplementedError, match=r"opt_state leaf \['w'\]'s new value does "
                       "not read its old one"):
        nvme_plan.assign([[1]], [-1, 0], {0: 0, 1: 1}, small={}, name=names)


def test_split_rest_and_param_outputs():
    assert nvme_plan.split_rest([3, 5, 7], lambda k: k == 5) == ([3, 7], [5])
    out, sh = nvme_plan.param_outputs(4, [{"leaf": 0}, {"leaf": 2}], ["s0", "s1", "s2"])
    assert out == {4: 0, 6: 2} and sh == {4: "s0", 6: "s2"}


def test_to_disk_outputs_returns_disk_leaves_and_params_and_keeps_the_rest():
    keep: dict = {}
    got = nvme_plan.to_disk_outputs({0: "a", 1: "b", 2: "c", 5: "p"}, {0: 0, 1: 1},
                                    small={1: None}, param_out={5: 0}, keep=keep)
    assert got == {0: "a", 5: "p"} and keep == {1: "b", 2: "c"}


# -- the I/O pipeline ---------------------------------------------------------------------
class _FakeIO:
    """Reads, writes and their order; ``fail_at``: the bucket whose write fails."""

    def __init__(self, fail_at=None):
        self.events, self.stopped, self.fail_at = [], [], fail_at
        self.lock = threading.Lock()
        self.in_flight = self.most = 0

    def read(self, b):
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.events.append(("read", b))
        time.sleep(0.002)
        return {"bucket": b}

    def write(self, b, res):
        if self.stopped:
            return
        time.sleep(0.004)
        with self.lock:
            self.events.append(("write", b, res))
            self.in_flight -= 1
        if b == self.fail_at:
            self.stopped.append(b)
            raise OSError(28, "No space left on device")


def _update(b, got):
    assert got == {"bucket": b}
    return {"new": b}


@pytest.mark.parametrize("overlap", [False, True])
def test_pipeline_reads_updates_and_writes_every_bucket_once_in_order(overlap):
    io = _FakeIO()
    nvme_pipeline.run(6, io, _update, overlap, slots=3)
    assert [e for e in io.events if e[0] == "read"] == [("read", b) for b in range(6)]
    assert [e for e in io.events if e[0] == "write"] == [("write", b, {"new": b})
                                                         for b in range(6)]
    assert io.most <= (3 if overlap else 1)
    if overlap:  # the next bucket read before this one is written
        assert io.events.index(("read", 1)) < io.events.index(("write", 0, {"new": 0}))


def test_pipeline_stops_writing_after_a_failed_write_and_raises_it():
    io = _FakeIO(fail_at=1)
    with pytest.raises(OSError, match="No space left"):
        nvme_pipeline.run(8, io, _update, True, slots=2)
    written = [e[1] for e in io.events if e[0] == "write"]
    assert written == [0, 1]  # nothing begun after bucket 1's failure
    assert nvme_pipeline.run(0, _FakeIO(), _update, True, slots=2) is None  # no bucket


# -- the file layer -----------------------------------------------------------------------
def test_a_leaf_round_trips_through_its_file_and_a_changed_byte_is_refused(tmp_path):
    mesh = zerojax.make_mesh(data=8)
    sharding = NamedSharding(mesh, Ps("data"))
    x = jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(16, 4), sharding)
    e = nvme_files.leaf_entry(3, "['w']", x, sharding)
    assert e["file"] == "leaf-00003.bin" and e["nbytes"] == 256 and len(e["shards"]) == 8
    assert [s["offset"] for s in e["shards"]] == list(range(0, 256, 32))
    nvme_files.allocate(str(tmp_path), [e])
    nvme_files.write_leaf(str(tmp_path), e, x)
    host = nvme_files.read_shards(str(tmp_path), e, corrupt=lambda *a: "corrupt")
    back = nvme_files.place(e, host, sharding)
    assert np.array_equal(np.asarray(back), np.asarray(x))
    with open(tmp_path / e["file"], "r+b") as f:  # one flipped byte in shard 2
        f.seek(70)
        f.write(b"\xff")
    with pytest.raises(NvmeError, match="corrupt"):
        nvme_files.read_shards(str(tmp_path), e, corrupt=lambda *a: "corrupt")
    with open(tmp_path / e["file"], "r+b") as f:
        f.truncate(100)
    with pytest.raises(NvmeError, match=r"opt_state\['w'\]\) holds 100 bytes, 256 expected"):
        nvme_files.check_size(str(tmp_path), e)


# -- the programs -------------------------------------------------------------------------
def test_programs_compute_the_outputs_asked_for_and_share_equal_compilations():
    def fn(a, b, s):
        c = jnp.sqrt(s) + 1.0
        return [a * 2.0 / c, b * 2.0 / c]

    xs = [jnp.arange(4.0), jnp.arange(4.0) + 10, jnp.float32(4.0)]
    closed = jax.make_jaxpr(fn)(*xs)
    ops: list = []
    out_refs = offload._inline(closed.jaxpr, closed.consts, [0, 1, 2], ops, [3])
    operands = dict(enumerate(xs))
    cache: dict = {}
    p0 = nvme_programs.program(ops, [out_refs[0]], [0], cache=cache)
    p1 = nvme_programs.program(ops, [out_refs[1]], [1], cache=cache)
    assert p0.jitted is p1.jitted  # the same equations of different inputs: one program
    got = nvme_programs.chain([p0, p1])(operands, {})
    want = jax.jit(fn)(*xs)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert nvme_programs.shape_of(out_refs[0], ops) == (4,)


def test_a_piece_round_trips_through_its_file_with_its_own_checksum(tmp_path):
    """Issue 50: a piece of a leaf (a range along an axis its shards hold whole) read and
    written a run at a time: one run per shard cut along the shard's leading axis, one
    per row along its 2nd; the whole shard's crc32 checked once before a piece of a leaf
    written whole is used; each piece written gets its own, checked when read back,
    whole or as the piece."""
    assert nvme_files.piece_runs((4, 6), ((1, 2), (0, 6))) == [(6, 12)]
    assert nvme_files.piece_runs((4, 6), ((0, 4), (2, 3))) == [(2, 3), (8, 3), (14, 3), (20, 3)]
    mesh = zerojax.make_mesh(data=8)
    sharding = NamedSharding(mesh, Ps("data"))
    x = jax.device_put(jnp.arange(16 * 6, dtype=jnp.float32).reshape(16, 6), sharding)
    e = nvme_files.leaf_entry(0, "['w']", x, sharding)
    nvme_files.allocate(str(tmp_path), [e])
    nvme_files.write_leaf(str(tmp_path), e, x)
    region = ((0, 16), (2, 3))  # columns 2-4: a strided piece of each (2, 6) shard
    checked: set = set()
    got = nvme_files.read_box(str(tmp_path), e, region, lambda *a: "corrupt", checked)
    assert len(checked) == 8  # each shard's whole crc32, once
    piece = nvme_files.place_piece(e, got, sharding, region)
    assert np.array_equal(np.asarray(piece), np.asarray(x)[:, 2:5])
    nvme_files.write_box(str(tmp_path), e, piece * 10, region)
    assert all("crc32" not in s and list(s["pieces"]) == ["0:2,2:3"] for s in e["shards"])
    host = nvme_files.read_shards(str(tmp_path), e, corrupt=lambda *a: "corrupt")
    want = np.asarray(x).copy()
    want[:, 2:5] *= 10
    assert np.array_equal(np.asarray(nvme_files.place(e, host, sharding)), want)
    with open(tmp_path / e["file"], "r+b") as f:  # a flipped byte in shard 1's piece
        f.seek(48 + 4 * 3)
        f.write(b"\xff")
    for read in (lambda: nvme_files.read_box(str(tmp_path), e, region, lambda *a: "corrupt",
                                             set()),
                 lambda: nvme_files.read_shards(str(tmp_path), e, lambda *a: "corrupt")):
        with pytest.raises(NvmeError, match="corrupt"):
            read()
