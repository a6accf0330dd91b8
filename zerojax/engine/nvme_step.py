"""The NVMe tier's train step: the gradient as the in-memory step computes it (one
program, :func:`zerojax.step.build_grad_fn`), then the optax update bucket by bucket
with the optimizer state read from and written back to the files of
:mod:`zerojax.nvme` (see that module's docstring for the files, the buckets and the
overlap of reads, update and writes).

It sits above both the step (whose gradient program, batch placement and loss-scale
update it reuses) and the tier's files (:mod:`zerojax.nvme`), so that the step can
check for the tier's state without importing this module: imports run one way
(``ZeroOptimizer.step`` picks this class for ``offload_optimizer="nvme"``).

A coordinator (issue 43) over its pieces: the bucket plan (:mod:`zerojax.engine.nvme_plan`,
pure), the update's programs (:mod:`zerojax.engine.nvme_update`, built once per params
structure and kept in ``_plans``) and the reads and writes overlapped with them
(:mod:`zerojax.engine.nvme_pipeline`); this class keeps the checks of the state it is given,
the gradient program, and the step's bookkeeping around the update (the manifests, the
new state, ``timings``).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core.mesh import is_explicit
from zerojax.core.state import TrainState
from zerojax.engine import nvme_pipeline, nvme_plan, nvme_update, step as S
from zerojax.runtime import distributed, hostmem
from zerojax.tiers import offload
from zerojax.tiers.nvme import (
    NvmeParams,
    NvmeState,
    NvmeWriteError,
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
        if is_explicit(opt.mesh):
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
        else:  # (the update's operands on the device: params read into host memory moved)
            owned = offload.to_device(params)
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
        """Per params structure: the traced update, its buckets and their programs
        (:func:`zerojax.engine.nvme_update.build`), built once."""
        # shapes and dtypes of every operand the plan was traced with: one optimizer may
        # step states of the same structure and shapes in other dtypes (params made bf16
        # without param_dtype), whose update is another program
        key = (jax.tree.structure(params),
               tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(
                   (params, owned, grads, scale))))
        if key not in self._plans:
            self._plans[key] = nvme_update.build(self._opt, state, params, owned, grads, finite,
                                                 grad_norm, scale)
        return self._plans[key]

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
        # (param_fetch="layer": into host memory, fetched layer by layer by the program)
        params = (read_params(state.params, offload.HOST if cfg.param_fetch == "layer"
                              else "device") if on_disk else state.params)
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
        out, io = self._update(plan, handle, owned, grad_leaves, finite, grad_norm, scale)
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
        # buffer_peak_bytes: the most bytes of buckets held in host buffers at once
        # (read, not yet written back): at most nvme_buffer_count x nvme_buffer_size
        self.timings.append({"grad_s": t1 - t0, "update_s": t2 - t1,
                             "read_bytes": io.read_bytes, "written_bytes": io.written_bytes,
                             "params_read_s": t_params, "buffer_peak_bytes": io.peak})
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
        """Every bucket read, updated and written back (:mod:`zerojax.engine.nvme_pipeline`);
        returns the outputs kept in memory (by output position) and the
        :class:`~zerojax.engine.nvme_pipeline.BucketIO` (bytes read, written, buffers)."""
        n_own, n_inner = plan["n_own"], plan["n_inner"]
        own_leaves = [] if plan["mixed"] else jax.tree.leaves(owned)
        operands: dict = {}
        for j in range(n_own + n_inner):
            leaf = plan["opt_index"].get(j)
            if leaf is None:
                operands[j] = own_leaves[j]
            elif leaf in handle.small:
                operands[j] = handle.small[leaf]
        first, n_grad = n_own + n_inner, len(grad_leaves)
        operands.update((first + j, x) for j, x in enumerate(grad_leaves))
        grad_refs = set(range(first, first + n_grad))
        grad_leaves.clear()
        later = set(plan["rest_prog"].inputs) | set(plan["pre_prog"].inputs)
        extra = [finite, grad_norm] + ([scale] if scale is not None else [])
        operands.update((first + n_grad + j, x) for j, x in enumerate(extra))
        operands.update(plan["pre_prog"](operands, {}))
        out: dict = {}
        io = nvme_pipeline.BucketIO(handle.store, plan)
        last = {r: b for b, p in enumerate(plan["progs"]) for r in p.inputs}

        def update(b, got):
            prog, region = plan["progs"][b], plan["regions"][b]
            res = prog(operands, got)
            del got
            for r in prog.inputs:  # the gradients no later bucket reads: freed now
                if r in grad_refs and r not in later and last[r] == b:
                    operands.pop(r, None)
            if not self.overlap:
                jax.block_until_ready(res)
            if region is None:
                return nvme_plan.to_disk_outputs(res, plan["out_leaf"], handle.small,
                                                 plan["param_out"], out)
            kept: dict = {}  # a piece of a cut group: what stays in memory put in place
            to_disk = nvme_plan.to_disk_outputs(res, plan["out_leaf"], handle.small,
                                                plan["param_out"], kept)
            for k, x in kept.items():
                out[k] = nvme_pipeline.put_piece(out.get(k), x, region, plan["out_shapes"][k])
            return to_disk

        nvme_pipeline.run(len(plan["buckets"]), io, update, self.overlap,
                          handle.store.buffer_count)
        for k, x in plan["rest_prog"](operands, {}).items():
            if k in plan["param_out"]:  # a param whose update reads no disk leaf (plain SGD)
                io.write(-1, {k: x})
            else:
                out[k] = x
        return out, io
