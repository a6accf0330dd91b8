"""``zero()``: wrap any optax optimizer in a ZeRO-DP stage over a ``data`` mesh axis.

:class:`ZeroOptimizer` is a coordinator over pieces with one job each (issue 43): the
layout of a params tree (:mod:`zerojax.optimizer_layout`: the mesh axes, model specs,
layouts, specs and shardings), making the train state (:mod:`zerojax.optimizer_init`:
eager and born-sharded), the train step (:mod:`zerojax.step`, :mod:`zerojax.nvme_step`),
handing the weights back (:mod:`zerojax.optimizer_handback`) and the optax wrapper
(:mod:`zerojax.optimizer_tx`). Its methods delegate; their docstrings are the pieces'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax
from jax.sharding import Mesh

from zerojax.api import (
    optimizer_handback as handback,
    optimizer_init as init,
    optimizer_layout as layout,
    optimizer_tx,
)
from zerojax.api.config import ZeroConfig
from zerojax.api.optimizer_init import (  # noqa: F401 (the init's helpers, under their old names)
    _abstract_params,
    _check_params,
    _eager_eval,
    _last_dim_whole,
    _put,
    _unbox,
)
from zerojax.api.optimizer_layout import MeshAxes, TreeLayout, _axes_size  # noqa: F401
from zerojax.core import partition as part
from zerojax.core.mesh import check_mesh
from zerojax.core.state import LossScaleState, TrainState
from zerojax.engine.nvme_step import NvmeTrainStep
from zerojax.engine.step import TrainStep, build_train_step
from zerojax.tiers import nvme, offload


def _doc(piece: Callable) -> Callable:
    """The delegating method gets its piece's docstring (one text, in the piece)."""
    def take(method: Callable) -> Callable:
        method.__doc__ = piece.__doc__
        return method
    return take


class ZeroOptimizer:
    """An optax optimizer partitioned ZeRO-style over the ``data`` axis of a mesh.

    Build it with :func:`zero`. It lays out the train state per stage
    (:meth:`init_state`), compiles the train step (:meth:`train_step`) and gathers
    whole parameters back (:meth:`full_params`).
    """

    def __init__(self, tx: optax.GradientTransformation, mesh: Mesh, config: ZeroConfig):
        if not isinstance(tx, optax.GradientTransformation) and not (
                hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(
                f"zero() wraps an optax.GradientTransformation, got {type(tx).__name__}; "
                "pass e.g. optax.adamw(1e-3)."
            )
        self.inner = tx
        self.config = config
        self.mesh = check_mesh(mesh, config.data_axis)
        self._resolve_axes()
        self._full_params_fns: dict = {}  # (tree_key, partitioned) -> jitted gather
        self._init_jits: dict = {}  # (init_fn, argument shapes) -> init_sharded's jit
        self._init_plans: dict = {}  # (params tree, shapes, model specs) -> init_state's
        if config.bucket_size is not None and config.bucket_size < self.data_size:
            raise ValueError(
                f"bucket_size={config.bucket_size} is smaller than the {config.data_axis!r} "
                f"axis size {self.data_size}: a bucket holds at least one element per "
                f"device; use bucket_size >= {self.data_size}."
            )
        for option in ("offload_optimizer", "offload_params"):
            if getattr(config, option) is True:
                offload.check_backend(self.mesh, option)
        # offload_optimizer="nvme": the path checked and locked now, before training
        self._nvme = nvme.store_for(self) if nvme.is_nvme(config) else None
        quantized = [f"{name}={getattr(config, name)!r}" for name in
                     ("quantize_weights", "quantize_gradients")
                     if getattr(config, name) is not None]
        batch = set(self.batch_axes if isinstance(self.batch_axes, tuple)
                    else (self.batch_axes,))
        split = {a: int(s) for a, s in self.mesh.shape.items() if a not in batch and s > 1}
        if quantized and split:
            raise ValueError(
                f"{' and '.join(quantized)} on a mesh with model-parallel axes {split} is not "
                "implemented: ZeRO++ quantization is wired for data-parallel meshes (data, "
                "or replica x data). Use make_mesh(..., model=1), or drop the quantization.")

    def _resolve_axes(self) -> None:
        """The mesh axes (:func:`zerojax.optimizer_layout.resolve_axes`, decided here,
        once) as attributes (``zero_axis``, ``data_size``, ``batch_axes``, ``mode``...),
        and the layout of params trees over them (:class:`TreeLayout`)."""
        self.axes = layout.resolve_axes(self.config, self.mesh)
        for field in (f.name for f in dataclasses.fields(MeshAxes)):
            setattr(self, field, getattr(self.axes, field))
        self._layout = TreeLayout(self.inner, self.config, self.mesh, self.axes)

    def __repr__(self) -> str:
        return layout.describe(self.config, self.axes, self.mesh)

    # -- layout (optimizer_layout.TreeLayout) ---------------------------------------
    @property
    def _model_specs(self):  # (treedef, PartitionSpec tree) from init_state
        return self._layout._model_specs

    @property
    def _logical(self) -> dict:  # params treedef -> their own shapes
        return self._layout._logical

    @_doc(TreeLayout.param_layouts)
    def param_layouts(self, layouts: Any) -> Any:
        return self._layout.param_layouts(layouts)

    @_doc(TreeLayout._split_model_specs)
    def _split_model_specs(self, params: Any, model_specs: Any = None):
        return self._layout._split_model_specs(params, model_specs)

    @_doc(TreeLayout.layouts)
    def layouts(self, params: Any, pad: bool = True) -> Any:
        return self._layout.layouts(params, pad)

    @_doc(TreeLayout.logical_params)
    def logical_params(self, params: Any, like: Any = None) -> Any:
        return self._layout.logical_params(params, like)

    def _opt_shapes(self, params: Any):
        return self._layout._opt_shapes(params)

    @_doc(TreeLayout.opt_state_layouts)
    def opt_state_layouts(self, params: Any, pad: bool = True) -> Any:
        return self._layout.opt_state_layouts(params, pad)

    @_doc(TreeLayout.specs)
    def specs(self, params: Any, pad: bool = True) -> part.StageSpecs:
        return self._layout.specs(params, pad)

    @_doc(TreeLayout.shardings)
    def shardings(self, params: Any, pad: bool = True) -> part.StageSpecs:
        return self._layout.shardings(params, pad)

    @_doc(TreeLayout.input_shardings)
    def input_shardings(self, like: Any, model_specs: Any = None) -> Any:
        return self._layout.input_shardings(like, model_specs)

    @_doc(TreeLayout._remember)
    def _remember(self, params: Any, model_specs: Any = None) -> None:
        self._layout._remember(params, model_specs)

    # -- state (optimizer_init) -----------------------------------------------------
    @_doc(init.init_state)
    def init_state(self, params: Any, model_specs: Any = None) -> TrainState:
        return init.init_state(self, params, model_specs)

    @_doc(init.init_sharded)
    def init_sharded(self, init_fn: Callable, *args: Any, model_specs: Any = None
                     ) -> TrainState:
        return init.init_sharded(self, init_fn, *args, model_specs=model_specs)

    @_doc(init.lower_init_sharded)
    def lower_init_sharded(self, init_fn: Callable, *args: Any, model_specs: Any = None):
        return init.lower_init_sharded(self, init_fn, *args, model_specs=model_specs)

    def _sharded_init_jit(self, init_fn: Callable, args: tuple, model_specs: Any,
                          params_only: bool = False):
        return init.sharded_init_jit(self, init_fn, args, model_specs, params_only)

    @_doc(init.init_body)
    def _init_body(self, params: Any, shardings: part.StageSpecs, to_device: bool = False):
        return init.init_body(self, params, shardings, to_device)

    @_doc(init.train_state)
    def _train_state(self, placed: Any, opt_state: Any, params: Any) -> TrainState:
        return init.train_state(self, placed, opt_state, params)

    @_doc(init.loss_scale_state)
    def init_state_loss_scale(self) -> LossScaleState | None:
        return init.loss_scale_state(self)

    def train_step(self, loss_fn: Callable, *, has_aux: bool | None = None,
                   weighted: bool = False) -> TrainStep:
        """Compile ``step(state, batch) -> (state, metrics)`` for ``loss_fn(params, batch)``.

        ``loss_fn`` returns the mean loss over the batch it is given (or ``(loss, aux)``
        with ``has_aux=True``). The batch's leading dimension is split over ``data``.
        ``metrics["loss"]`` is the mean loss over the global batch.

        ``weighted=True``: ``loss_fn`` returns ``(loss_sum, weight)`` (or
        ``((loss_sum, weight), aux)``): the sum of the per-example or per-token losses
        of the batch it is given and the sum of their weights (e.g. the number of
        non-padding tokens). The step minimizes the global ``sum(loss_sum) /
        sum(weight)`` exactly as one device does on the whole batch, however the
        weight falls across devices and micro-batches (a shard of weight 0 is fine);
        ``metrics["loss"]`` is that global weighted mean. Use it for masked or padded
        losses: a mean of per-device means is not the global mean when the devices
        hold different weights. The weight is not differentiated.
        """
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        if not isinstance(weighted, bool):
            raise ValueError(f"weighted={weighted!r} must be True or False.")
        aux = self.config.has_aux if has_aux is None else has_aux
        if nvme.is_nvme(self.config):  # the state on disk: the gradient, then the update
            return NvmeTrainStep(loss_fn, self, bool(aux), weighted)  # bucket by bucket
        return build_train_step(loss_fn, self, bool(aux), weighted)

    # -- hand-back (optimizer_handback) ---------------------------------------------
    @_doc(handback.weights)
    def _weights(self, state: TrainState):
        return handback.weights(self, state)

    @_doc(handback.full_params)
    def full_params(self, state: TrainState, sharding: Any = None, *, like: Any = None
                    ) -> Any:
        return handback.full_params(self, state, sharding, like=like)

    @_doc(handback.target_shardings)
    def _target_shardings(self, logical: Any, sharding: Any) -> Any:
        return handback.target_shardings(self, logical, sharding)

    @_doc(handback.iter_full_params)
    def iter_full_params(self, state: TrainState, *, like: Any = None):
        return handback.iter_full_params(self, state, like=like)

    # -- optax interface (optimizer_tx) ---------------------------------------------
    @property
    @_doc(optimizer_tx.partitioned_tx)
    def tx(self) -> optax.GradientTransformation:
        return optimizer_tx.partitioned_tx(self)


def zero(tx: optax.GradientTransformation, mesh: Mesh, **options) -> ZeroOptimizer:
    """Wrap an optax optimizer in ZeRO-DP over the ``data`` axis of ``mesh``.

    Args:
      tx: any ``optax.GradientTransformation`` (adam, adamw, sgd, lion, adafactor,
        lamb, chains with ``clip_by_global_norm``, masked weight decay, ...).
      mesh: a ``jax.sharding.Mesh`` with a ``data`` axis (Auto or Explicit axes).
      **options: the fields of :class:`~zerojax.config.ZeroConfig` (``stage``,
        ``param_dtype``, ``reduce_dtype``, ``max_grad_norm``, ``accum_steps``,
        ``loss_scale``, ``min_shard_size``, ``donate``, ``has_aux``, ...).

    Example::

      mesh = zerojax.make_mesh(data=-1)
      opt = zerojax.zero(optax.adamw(1e-3), mesh, stage=2)
      state = opt.init_state(params)
      step = opt.train_step(loss_fn)
      state, metrics = step(state, batch)

    References:
      Rajbhandari, Rasley, Ruwase, He. ZeRO: Memory Optimizations Toward Training
      Trillion Parameter Models. SC20. arXiv:1910.02054.
    """
    return ZeroOptimizer(tx, mesh, ZeroConfig.from_kwargs(**options))
