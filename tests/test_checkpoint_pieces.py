"""The pieces CheckpointManager coordinates (issue 43), each on its own: the step
publisher (open, seal, put in place, roll back, prune, clean up: files only), the
sharded state's handler (what meta.json records, the restore targets and their
refusals) and the NVMe restore's slots. The manager over them: tests/test_checkpoint.py."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import zerojax
from zerojax import checkpoint_nvme, checkpoint_publish, checkpoint_state
from zerojax.checkpoint_publish import StepPublisher
from zerojax.checkpoint_reader import FORMAT, MARKER, CheckpointError, CheckpointReader, _checksums


def _no_chunks(state_dir):
    return {}


def _publish(pub: StepPublisher, step: int, overwrite=False, max_to_keep=None, extra=None):
    token = f"{step}:{os.urandom(4).hex()}"
    tmp = pub.begin(step, token, {"format": FORMAT, "step": step}, json.dumps(extra))
    os.makedirs(os.path.join(tmp, "state"))
    with open(os.path.join(tmp, "state", "data"), "wb") as f:
        f.write(bytes(range(step, step + 64)))
    pub.publish(step, tmp, os.path.join(pub.directory, str(step)), token, overwrite,
                max_to_keep, checksums=_checksums, chunks=_no_chunks)
    checkpoint_publish._live_saves.discard(tmp)
    return token


def test_publisher_puts_a_sealed_step_in_place_that_the_reader_lists(tmp_path):
    reader = CheckpointReader(tmp_path)
    pub = StepPublisher(reader)
    token = _publish(pub, 3, extra={"data_position": 7})
    assert reader.all_steps() == [3]
    reader.verify(3)  # every file's checksum as sealed
    assert reader.extra(3) == {"data_position": 7} and reader.meta(3)["step"] == 3
    marker = json.loads((tmp_path / "3" / MARKER).read_text())
    assert marker["token"] == token and "state/data" in marker["files"]
    assert sorted(os.listdir(tmp_path)) == ["3"]  # no temporary, no owner record left
    assert checkpoint_publish._OWNER not in os.listdir(tmp_path / "3")
    (tmp_path / "3" / "state" / "data").write_bytes(b"changed")
    with pytest.raises(CheckpointError, match="step 3.*state/data"):
        reader.verify(3)


def test_publisher_refuses_an_existing_newer_or_foreign_step(tmp_path):
    pub = StepPublisher(CheckpointReader(tmp_path))
    _publish(pub, 3)
    with pytest.raises(CheckpointError, match="step 3 exists .*overwrite=True"):
        pub.check_new(3, overwrite=False)
    with pytest.raises(CheckpointError, match="step 2 is below the newest step 3"):
        pub.check_new(2, overwrite=False)
    pub.check_new(2, overwrite=True)
    pub.check_new(4, overwrite=False)
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match="did not write"):
        with pytest.raises(CheckpointError, match=r"cannot save step 7: .*zerojax did not "
                           r"write it"):
            pub.check_new(7, overwrite=False)


def test_publisher_rolls_back_prunes_and_cleans_up(tmp_path):
    reader = CheckpointReader(tmp_path)
    pub = StepPublisher(reader)
    for s in (1, 2, 3):
        _publish(pub, s)
    token = _publish(pub, 2, overwrite=True)  # a rollback: step 3 goes once 2 is in place
    assert reader.all_steps() == [1, 2]
    assert json.loads((tmp_path / "2" / MARKER).read_text())["token"] == token
    _publish(pub, 4, max_to_keep=2)
    assert reader.all_steps() == [2, 4]
    stale = tmp_path / ".zerojax-tmp-9"  # a killed save's: only files a save writes
    stale.mkdir()
    (stale / "meta.json").write_text("{}")
    foreign = tmp_path / ".zerojax-tmp-10"  # not recognisable: left alone
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    pub.cleanup(at_save=True)
    assert not stale.exists() and foreign.exists()
    assert reader.all_steps() == [2, 4]


@pytest.fixture(scope="module")
def small():
    params = {"w": jnp.arange(37, dtype=jnp.float32), "b": jnp.ones((4, 3), jnp.float32)}
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3,
                       min_shard_size=16)
    return opt, params, opt.init_state(params)


def test_state_handler_records_shapes_and_kinds_and_targets_the_new_layout(small):
    opt, params, state = small
    meta = checkpoint_state.save_meta(state, 5, {"x": 1})
    assert meta["params"]["['w']"]["shape"] == [37]
    assert meta["params"]["['w']"]["stored"] == list(state.params["w"].shape)
    assert meta["optimizer_state"] == checkpoint_state._state_kinds(optax.adam(1e-2).init(
        params))
    assert meta["has_master"] is False and meta["data"] == 8
    assert set(checkpoint_state.save_tree(state)) == {"step", "params", "inner"}
    target = checkpoint_state.restore_target(opt, params, meta, 5, "DIR")
    assert set(target.item) == {"step", "params", "inner"}
    w = target.abstract["params"]["w"]
    assert w.shape == state.params["w"].shape and w.sharding == state.params["w"].sharding
    assert isinstance(target.args["params"]["w"], ocp.ArrayRestoreArgs)
    assert target.limit_gb >= 1 and not target.restore_loss_scale


def test_state_handler_refuses_another_tree_or_optimizer(small):
    opt, params, state = small
    meta = checkpoint_state.save_meta(state, 5, None)
    bad = dict(params, w=jnp.zeros(36))
    with pytest.raises(ValueError, match=r"params leaf \['w'\]: `like` has shape \(36,\) but "
                       "checkpoint step 5 in DIR holds \\(37,\\)"):
        checkpoint_state.restore_target(opt, bad, meta, 5, "DIR")
    with pytest.raises(ValueError, match=r"`like` has params leaf \['c'\]"):
        checkpoint_state.restore_target(opt, dict(params, c=jnp.zeros(2)), meta, 5, "DIR")
    sgd = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=3, min_shard_size=16)
    with pytest.raises(ValueError, match="holds the state of another optimizer"):
        checkpoint_state.restore_target(sgd, params, meta, 5, "DIR")


def test_nvme_restore_slots_name_every_saved_key():
    sds = jax.ShapeDtypeStruct((4,), np.float32)
    pair = (sds, ocp.ArrayRestoreArgs(global_shape=(4,), dtype=np.float32))
    scalar = (jax.ShapeDtypeStruct((), np.int32), ocp.ArrayRestoreArgs(dtype=np.int32))
    item = {"step": scalar, "master": {"w": pair}, "inner": {"mu": pair, "nu": pair}}
    target = checkpoint_state.RestoreTarget({"w": sds}, None, None, False, None, item,
                                            False, 1)
    slots, treedef, where = checkpoint_nvme._saved_slots(
        target, {"has_master": True, "has_loss_scale": True})
    assert treedef.num_leaves == len(slots) == 1 + 1 + 2 + 1 + 3
    assert {k: len(v) for k, v in where.items()} == {
        "step": 1, "master": 1, "inner": 2, "params": 1, "loss_scale": 3}
    read = {k for k, (_, t) in enumerate(slots) if t is not None}  # the saved params and
    assert read == set(where["step"] + where["master"] + where["inner"])  # scale: not read
