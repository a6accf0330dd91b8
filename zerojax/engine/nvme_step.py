"""The NVMe tier's train step: the gradient as the in-memory step computes it (one
program, :func:`zerojax.step.build_grad_fn`), then the optax update bucket by bucket
with the optimizer state read from and written back to the files of
:mod:`zerojax.nvme` (see that module's docstring for the files, the buckets and the
overlap of reads, update and writes).

It sits above both the step (whose gradient program, batch placement and loss-scale
update it reuses) and the tier's files (:mod:`zerojax.nvme`), so that the step can
check for the tier's state without importing this module: imports run one way
(``ZeroOptimizer.step`` picks this class for ``offload_optimizer="nvme"``).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType

from zerojax.core import collectives as C
from zerojax.core.mesh import constrain
from zerojax.core.partition import pad_tree, partitioned_specs, shardings, unpad_tree
from zerojax.core.state import TrainState
from zerojax.engine import step as S
from zerojax.runtime import distributed, hostmem
from zerojax.tiers import offload
from zerojax.tiers.nvme import (
    NvmeParams,
    NvmeState,
    NvmeWriteError,
    _chain,
    _program,
    _readers,
    _shape,
    _shared_scalars,
    disk_threshold,
    is_nvme_params,
    read_params,
)


class NvmeTrainStep:
    """``step(state, batch, rng=None) -> (state, metrics)`` with the optimizer state on
    disk (see the module docstring). ``timings``: per call, seconds of the gradient
    program and of the bucketed update, and the bytes read and written."""

    def __init__(self, loss_fn, opt, has_aux: bool, weighted: bool):
        cfg = opt.config
        self._opt, self._cfg = opt, cfg
        self._has_aux = has_aux
        self._grad_fn = S.build_grad_fn(loss_fn, opt, has_aux, weighted)
        self._plain = S.TrainStep(None, opt.mesh, opt.row_size, opt.row_axes,
                                  cfg.accum_steps, None, seq=S.seq_of(opt))
        # the gradients come out in the layout XLA gives them (Layout.AUTO: a kernel's
        # gradient column-major as its dot made it), as the one-program step hands them
        # to its update; each bucket program is then compiled for that layout (jit
        # follows its arguments'). Row-major, they rounded 1 ulp apart in Adam's moments
        # (jax 0.12 fp32; a model axis at step 3 on 0.10.2 too).
        from jax.experimental.layout import Format, Layout

        self._grad_jit = jax.jit(self._grad_part, static_argnums=(1,),
                                 out_shardings=(Format(Layout.AUTO),) + (None,) * 7)
        self._plans: dict = {}
        self.overlap = True  # benchmarks turn it off: read, update, write one after another
        self.timings: list[dict] = []
        if any(t == AxisType.Explicit for t in opt.mesh.axis_types):
            raise NotImplementedError(
                "offload_optimizer='nvme' on a mesh with Explicit axes is not implemented: "
                "build the mesh with Auto axes (zerojax.make_mesh's default).")

    @property
    def batch_sharding(self):
        return self._plain.batch_sharding

    def place_batch(self, batch):
        return self._plain.place_batch(batch)

    def lower(self, *a, **k):
        raise NotImplementedError(
            "offload_optimizer='nvme' runs as several programs (the gradient, then one "
            "update per bucket); there is no single program to lower. Analyse the step "
            "with offload_optimizer=True (the same programs' arithmetic).")

    # the gradient: as the in-memory step computes it
    def _grad_part(self, params, master_dtypes, loss_scale, step, batch, rng):
        opt, cfg = self._opt, self._cfg
        mixed, stage = cfg.param_dtype is not None, cfg.stage
        logical = opt.logical_params(params)
        lay_tree = opt.layouts(logical)
        if mixed:
            grad_dtypes = list(master_dtypes)
            owned = None
        elif stage in (1, 2):
            owned = S._slice_params(params, lay_tree, opt.mesh, opt.zero_axis)
            grad_dtypes = [x.dtype for x in jax.tree.leaves(owned)]
        else:
            owned = params
            grad_dtypes = [x.dtype for x in jax.tree.leaves(owned)]
        scale = None if loss_scale is None else loss_scale.scale
        grads, loss, aux, sum_sq = self._grad_fn(params, batch, scale, grad_dtypes, lay_tree, rng)
        grad_norm = jnp.sqrt(sum_sq)
        metrics = {"loss": loss, "grad_norm": grad_norm}
        if cfg.max_grad_norm is not None:
            metrics["grad_norm_clipped"] = jnp.minimum(grad_norm, cfg.max_grad_norm)
        finite = jnp.asarray(True) if loss_scale is None else jnp.isfinite(sum_sq)
        new_ls = None
        if loss_scale is not None:
            new_ls = S.next_loss_scale(loss_scale, finite, cfg)
            metrics["loss_scale"] = loss_scale.scale
            metrics["skipped"] = ~finite
        if self._has_aux:
            metrics["aux"] = aux
        new_step = step + finite.astype(jnp.int32)
        return grads, owned, finite, grad_norm, scale, metrics, new_ls, new_step

    def _plan(self, state: TrainState, params, owned, grads, finite, grad_norm, scale):
        """Per params structure: the traced update, its buckets and their programs."""
        opt, cfg = self._opt, self._cfg
        handle: NvmeState = state.opt_state
        key = (jax.tree.structure(params), tuple(tuple(x.shape) for x in jax.tree.leaves(params)))
        if key in self._plans:
            return self._plans[key]
        mixed, stage, mesh = cfg.param_dtype is not None, cfg.stage, opt.mesh
        logical = opt.logical_params(params)
        lay_tree = opt.layouts(logical)
        opt_lays = opt.opt_state_layouts(logical)
        specs = opt.specs(logical)
        shs = handle.store.shardings
        by_leaf = {e["leaf"]: e for e in handle.store.leaves}
        structs = [handle.small[i] if i in handle.small else jax.ShapeDtypeStruct(
            tuple(by_leaf[i]["shape"]), np.dtype(by_leaf[i]["dtype"]), sharding=shs[i])
            for i in range(handle.treedef.num_leaves)]
        opt_tree = jax.tree.unflatten(handle.treedef, structs)
        own_tree = opt_tree.master if mixed else owned
        inner_tree = opt_tree.inner if mixed else opt_tree
        own_leaves, own_def = jax.tree.flatten(own_tree)
        inner_leaves, inner_def = jax.tree.flatten(inner_tree)
        grad_leaves, grad_def = jax.tree.flatten(grads)
        n_own, n_inner, n_grad = len(own_leaves), len(inner_leaves), len(grad_leaves)
        grad_dtypes = [x.dtype for x in own_leaves]
        part_sh = shardings(mesh, partitioned_specs(lay_tree))
        inner_sh = shardings(mesh, specs.opt_state.inner if mixed else specs.opt_state)
        inner_lays = opt_lays.inner if mixed else opt_lays
        own_lays = lay_tree if stage > 0 else None
        scaled = scale is not None
        tx = opt.inner

        laid = (part_sh if stage > 0 else shardings(mesh, specs.params), inner_sh)

        def fn(*leaves):  # the in-memory offloaded update (step._offloaded_update's fn)
            own = jax.tree.unflatten(own_def, leaves[:n_own])
            inner = jax.tree.unflatten(inner_def, leaves[n_own:n_own + n_inner])
            g = jax.tree.unflatten(grad_def, leaves[n_own + n_inner:n_own + n_inner + n_grad])
            rest = leaves[n_own + n_inner + n_grad:]
            fin, norm = rest[0], rest[1]
            sc = rest[2] if scaled else None
            if not scaled:  # as the in-memory step: no loss scale, every step is finite
                fin = jnp.asarray(True)
            g = S.finish_grads(g, grad_dtypes, sc)
            if cfg.max_grad_norm is not None:
                g = S.clip_by_global_norm(g, norm, cfg.max_grad_norm)
            p = unpad_tree(own, own_lays)
            updates, new_inner = tx.update(unpad_tree(g, own_lays),
                                           unpad_tree(inner, inner_lays), p)
            new_own = pad_tree(optax.apply_updates(p, updates), own_lays)
            new_inner = pad_tree(new_inner, inner_lays)
            return S.update_tail((new_own, new_inner), (own, inner), fin, laid,
                                 cfg.param_dtype)

        if stage == 0:
            raise AssertionError("stage 0 is refused by the config")
        extra = [finite, grad_norm] + ([scale] if scaled else [])
        operands = [*own_leaves, *inner_leaves, *grad_leaves, *extra]
        # which operand is which opt_state leaf (its index in jax.tree.leaves(opt_state))
        opt_index = {}
        if mixed:
            for j in range(n_own + n_inner):
                opt_index[j] = j  # MasterState(master, inner) flattens master first
        else:
            for j in range(n_inner):
                opt_index[n_own + j] = j
        on_disk = [opt_index.get(j) is not None and opt_index[j] not in handle.small
                   for j in range(len(operands))]
        closed = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*operands)
        ops: list = []
        out_refs = offload._inline(closed.jaxpr, closed.consts, list(range(len(operands))), ops,
                                   [len(operands)])
        itemsizes = [np.dtype(x.dtype).itemsize for x in operands]
        elems = max(1, cfg.nvme_buffer_size // max(4, max(itemsizes)))
        plan = offload._Plan(ops, operands, on_disk, elems, disk_threshold(cfg))
        if plan.reads_cross or any(plan.bucket(o[2][0]) == offload.CROSS for o in ops if o[2]):
            raise NotImplementedError(
                f"offload_optimizer='nvme' with {type(tx).__name__} whose update reads a norm "
                "of the whole update (e.g. chain(adam, clip_by_global_norm)) is not "
                "implemented: it would read the state from disk twice a step. Clip the "
                "gradients first: max_grad_norm=..., or chain(clip_by_global_norm, adam).")
        # outputs: new owned (n_own), new inner (n_inner), compute (n_own if mixed)
        out_leaf = {}  # output position -> opt_state leaf index
        if mixed:
            for j in range(n_own + n_inner):
                out_leaf[j] = j
        else:
            for j in range(n_inner):
                out_leaf[n_own + j] = j
        buckets = []
        for b, members in enumerate(plan.buckets):
            outs = [k for k, r in enumerate(out_refs) if plan.bucket(r) == b]
            for k in outs:
                leaf = out_leaf.get(k)
                if leaf is not None and leaf not in handle.small:
                    reads = [m for m in members if opt_index.get(m) == leaf]
                    if not reads:
                        raise NotImplementedError(
                            f"opt_state leaf {by_leaf[leaf]['path']}'s new value is computed "
                            "without its old one in the same bucket: the NVMe tier writes "
                            "leaves in place and cannot run this optimizer.")
            buckets.append((sorted(members), outs))
        rest = [k for k, r in enumerate(out_refs) if plan.bucket(r) == -1]
        for k in rest:
            leaf = out_leaf.get(k)
            if leaf is not None and leaf not in handle.small:
                raise NotImplementedError(
                    f"opt_state leaf {by_leaf[leaf]['path']}'s new value does not read its "
                    "old one: the NVMe tier updates leaves in place, bucket by bucket, and "
                    "cannot run this optimizer.")
        # the small values no offloaded leaf is needed for (the step count, Adam's bias
        # corrections) computed once, first, and passed to every bucket: as the
        # in-memory step computes them once for all its leaves (XLA:CPU rewrites a
        # division by a scalar it computes in the same program, 1 ulp apart)
        pre = _shared_scalars(ops, plan, len(operands))
        given = frozenset(pre)
        full = _readers(ops)
        for r in out_refs:
            if not isinstance(r, tuple):
                full[r] += 1
        pre_prog = _program(ops, pre, pre, full_readers=full)
        cache: dict = {}
        progs = [_program(ops, [out_refs[k] for k in outs], outs, given, full, cache)
                 for b, (_, outs) in enumerate(buckets)]
        # the small leaves' updates (scalars throughout): compiled as they are, each
        # scalar already read as often as in the one-program step
        # Leaves below min_shard_size that are not scalars (a bias of 64 elements at the
        # default 128) are updated here too: as the buckets, with the extra uses (else
        # XLA rewrites their division by a bias correction, 1 ulp apart: measured 2-6
        # of 64 of a bias's moments at step 2)
        vec = [k for k in rest if not isinstance(out_refs[k], tuple)
               and _shape(out_refs[k], ops) not in ((), None)]
        scal = [k for k in rest if k not in vec]
        rest_progs = [_program(ops, [out_refs[k] for k in scal], scal, given, full,
                               extra_uses=False)]
        if vec:
            rest_progs.append(_program(ops, [out_refs[k] for k in vec], vec, given, full))
        rest_prog = _chain(rest_progs)
        # offload_params="nvme": output position -> params leaf written to its file (the
        # new params: the compute copy with param_dtype, else the new owned params)
        param_out, param_sh = {}, {}
        if isinstance(state.params, NvmeParams):
            first = n_own + n_inner if mixed else 0
            sts = jax.tree.leaves(state.params.structs)
            for e in state.params.store.param_leaves:
                param_out[first + e["leaf"]] = e["leaf"]
                param_sh[first + e["leaf"]] = sts[e["leaf"]].sharding
        built = dict(buckets=buckets, progs=progs, rest=rest, rest_prog=rest_prog,
                     param_out=param_out, param_sh=param_sh,
                     pre_prog=pre_prog,
                     opt_index=opt_index, out_leaf=out_leaf, n_own=n_own, n_inner=n_inner,
                     n_grad=n_grad, own_def=own_def, inner_def=inner_def, shs=shs,
                     lay_tree=lay_tree, specs=specs, mixed=mixed, on_disk=on_disk)
        if stage in (1, 2):
            def gather(compute):
                new = C.gather_params(compute, lay_tree, mesh, opt.zero_axis, cfg.bucket_size)
                return constrain(new, shardings(mesh, specs.params))

            built["gather"] = jax.jit(gather)
        self._plans[key] = built
        return built

    def __call__(self, state: TrainState, batch: Any, rng: Any = None):
        distributed.step_begins()
        handle = state.opt_state
        if not isinstance(handle, NvmeState):
            raise TypeError(
                "this step's optimizer keeps the optimizer state on disk "
                "(offload_optimizer='nvme'), but state.opt_state is "
                f"{type(handle).__name__}: make the state with this optimizer's init_state, or "
                "move it through a checkpoint (CheckpointManager.save / restore(opt, ...)).")
        cfg = self._cfg
        on_disk = is_nvme_params(cfg)
        if on_disk != isinstance(state.params, NvmeParams):
            have = ("on disk (made with offload_params='nvme')" if not on_disk else
                    f"{type(state.params).__name__} (made without offload_params='nvme')")
            raise TypeError(
                f"this step's optimizer has offload_params={cfg.offload_params!r}, but "
                f"state.params is {have}: make the state with this optimizer's init_state, "
                "or move it through a checkpoint (CheckpointManager.save / restore(opt, ...)).")
        store = self._opt._nvme
        store.check(handle)  # this optimizer's files, this generation, whole
        if on_disk:
            store.check(state.params)
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
            raise ValueError(
                "this TrainState was donated to an earlier step call and its buffers are "
                "deleted: use the state that call returned.")
        mixed = cfg.param_dtype is not None
        t0 = time.perf_counter()
        batch = self.place_batch(batch)
        # offload_params="nvme": the param shards read into device memory, read ahead
        params = read_params(state.params) if on_disk else state.params
        t_params = time.perf_counter() - t0
        master_dtypes = None
        if mixed:
            by_leaf = {e["leaf"]: e for e in store.leaves}
            master_dtypes = tuple(
                handle.small[i].dtype if i in handle.small else np.dtype(by_leaf[i]["dtype"])
                for i in range(len(jax.tree.leaves(params))))
        grads, owned, finite, grad_norm, scale, metrics, new_ls, new_step = self._grad_jit(
            params, master_dtypes, state.loss_scale, state.step, batch,
            S._check_key(rng))
        plan = self._plan(state, params, owned, grads, finite, grad_norm, scale)
        jax.block_until_ready(grads)
        # the new generation's 'updating' manifest, durable before the first leaf write
        # and before the old params are freed: failing, the state held is intact
        gen = store.generation + 1
        store.begin(gen)
        held = [params, grads, owned]  # handed over: _step frees each when done with it
        del params, grads, owned
        try:
            return self._step(state, plan, held, finite, grad_norm, scale,
                              metrics, new_ls, new_step, gen, t0, t_params)
        except NvmeWriteError as err:
            if err.state is not None:  # every leaf written, the manifest not: as it says
                raise
            raise store.failed(gen, err) from err
        except Exception as err:
            raise store.failed(gen, err) from err

    def _step(self, state, plan, held: list, finite, grad_norm, scale, metrics,
              new_ls, new_step, gen, t0, t_params):
        """The rest of the step, from the gradients: the bucketed update, the new state,
        its manifest."""
        params, grads, owned = held
        held.clear()
        cfg, store = self._cfg, self._opt._nvme
        handle = state.opt_state
        on_disk, mixed = is_nvme_params(cfg), cfg.param_dtype is not None
        if (cfg.donate or on_disk) and (mixed or cfg.stage in (1, 2)):
            # the old params are read by the gradient only (donate=True, as the in-memory
            # step donates them; read from disk, the step's own): freed before the new
            # ones are made
            for x in jax.tree.leaves(params):
                x.delete()
        del params
        grad_leaves = jax.tree.leaves(grads)
        del grads  # each bucket's gradients are freed once it is updated
        t1 = time.perf_counter()
        out, nread, nwritten = self._update(plan, handle, owned, grad_leaves, finite, grad_norm,
                                            scale)
        del owned
        t2 = time.perf_counter()
        n_own, n_inner = plan["n_own"], plan["n_inner"]
        small = {}
        for k, leaf in plan["out_leaf"].items():
            if leaf in handle.small:
                small[leaf] = out[k]
        first = n_own + n_inner if mixed else 0  # the new params' outputs
        if on_disk:  # written to their files by the update; the small ones kept
            old = state.params
            new_params = NvmeParams(store, gen, old.treedef,
                                    {j: out[first + j] for j in old.small}, old.structs)
        else:
            compute = jax.tree.unflatten(plan["own_def"], [out[first + j]
                                                           for j in range(n_own)])
            new_params = plan["gather"](compute) if "gather" in plan else compute
        new_handle = NvmeState(store, gen, handle.treedef, small)
        new_state = TrainState(new_step, new_params, new_handle, new_ls)
        # the I/O threads' and the buckets' freed buffers back to the system: glibc
        # keeps them in its arenas otherwise (the process then held more host memory
        # than with host offload, which holds the whole state: issue 40)
        jax.block_until_ready(new_params)
        hostmem.release_freed_memory()
        self.timings.append({"grad_s": t1 - t0, "update_s": t2 - t1, "read_bytes": nread,
                             "written_bytes": nwritten, "params_read_s": t_params})
        # every leaf written: the clean manifest, durable, moves the generation
        store.pending = (gen, int(new_step))
        try:
            store.retry_pending()
        except NvmeWriteError as err:
            err.state, err.metrics = new_state, metrics
            raise
        distributed.step_dispatched((new_state, metrics))
        return new_state, metrics

    def _update(self, plan, handle: NvmeState, owned, grad_leaves: list, finite, grad_norm,
                scale):
        """Every bucket read, updated and written back; returns the outputs kept in
        memory (by output position) and the bytes read and written."""
        store = handle.store
        by_leaf = {e["leaf"]: e for e in store.leaves}
        shs = plan["shs"]
        n_own, n_inner = plan["n_own"], plan["n_inner"]
        own_leaves = [] if plan["mixed"] else jax.tree.leaves(owned)
        operands: dict = {}
        for j in range(n_own + n_inner):
            leaf = plan["opt_index"].get(j)
            if leaf is None:
                operands[j] = own_leaves[j]
            elif leaf in handle.small:
                operands[j] = handle.small[leaf]
        for j in range(len(grad_leaves)):
            operands[n_own + n_inner + j] = grad_leaves[j]
        n_grad = len(grad_leaves)
        grad_refs = set(range(n_own + n_inner, n_own + n_inner + n_grad))
        grad_leaves.clear()
        later = set(plan["rest_prog"].inputs) | set(plan["pre_prog"].inputs)
        extra = [finite, grad_norm] + ([scale] if scale is not None else [])
        for j, x in enumerate(extra):
            operands[n_own + n_inner + n_grad + j] = x
        operands.update(plan["pre_prog"](operands, {}))
        out: dict = {}
        counts = {"read": 0, "written": 0}
        lock = threading.Lock()

        def read(b):
            members, _ = plan["buckets"][b]
            got = {}
            for m in members:
                if plan["on_disk"][m]:
                    e = by_leaf[plan["opt_index"][m]]
                    got[m] = store.read(e, shs[e["leaf"]])
                    with lock:
                        counts["read"] += e["nbytes"]
            return got

        param_out = plan["param_out"]
        param_by = {e["leaf"]: e for e in store.param_leaves}

        stopped: list = []  # a write failed: no more are begun (the step fails anyway)

        def write(b, results):
            if stopped:
                return
            try:
                write_leaves(results)
            except BaseException:
                stopped.append(b)
                raise

        def write_leaves(results):
            for k, x in results.items():
                if k in param_out:  # a new param: its file (laid out as stored)
                    e = param_by[param_out[k]]
                    if x.sharding != plan["param_sh"][k]:
                        x = jax.device_put(x, plan["param_sh"][k])
                else:
                    e = by_leaf[plan["out_leaf"][k]]
                store.write(e, x)
                with lock:
                    counts["written"] += e["nbytes"]

        nb = len(plan["buckets"])
        slots = threading.BoundedSemaphore(store.buffer_count)
        if not self.overlap:
            for b in range(nb):
                got = read(b)
                res = plan["progs"][b](operands, got)
                self._drop_grads(plan["progs"][b], operands, grad_refs, later)
                jax.block_until_ready(res)
                write(b, self._split(plan, handle, res, out))
        else:
            with cf.ThreadPoolExecutor(1) as reader, cf.ThreadPoolExecutor(1) as writer:
                def read_slot(b):
                    slots.acquire()
                    return read(b)

                def write_slot(b, res):
                    try:
                        write(b, res)
                    finally:
                        slots.release()

                reads = {0: reader.submit(read_slot, 0)}
                writes = []
                for b in range(nb):
                    if stopped:  # a write failed: the step fails with its error below
                        break
                    if b + 1 < nb:
                        reads[b + 1] = reader.submit(read_slot, b + 1)
                    got = reads.pop(b).result()
                    res = plan["progs"][b](operands, got)
                    self._drop_grads(plan["progs"][b], operands, grad_refs, later)
                    del got
                    writes.append(writer.submit(write_slot, b, self._split(plan, handle, res, out)))
                    del res
                for w in writes:
                    w.result()
        rest = plan["rest_prog"](operands, {})
        for k, x in rest.items():
            if k in param_out:  # a param whose update reads no disk leaf (plain SGD)
                write(-1, {k: x})
            else:
                out[k] = x
        return out, counts["read"], counts["written"]

    @staticmethod
    def _drop_grads(prog, operands: dict, grad_refs: set, later: set) -> None:
        """Forget the gradients only this bucket read (freed when its update is done)."""
        for r in prog.inputs:
            if r in grad_refs and r not in later:
                operands.pop(r, None)

    @staticmethod
    def _split(plan, handle, res: dict, out: dict) -> dict:
        """A bucket's outputs: those of disk leaves (to write) returned, the rest kept."""
        to_disk = {}
        for k, x in res.items():
            leaf = plan["out_leaf"].get(k)
            if (leaf is not None and leaf not in handle.small) or k in plan["param_out"]:
                to_disk[k] = x
            else:
                out[k] = x
        return to_disk
