"""The deterministic_reduce configs that 2 processes x 4 devices train bit for bit like
1 process x 8 (issue 41), shared by tests/mp_worker.py (which trains them under
``zerojax launch`` and ``mpirun``), tests/test_multiprocess.py and tests/test_mpirun.py
(which compare), and the 1 x 8 run they are compared with, computed once a session."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from helpers import awkward_loss, awkward_params, regression_batches

DETERMINISTIC = {"0-det": (0, {"deterministic_reduce": True}),
                 "1-det": (1, {"deterministic_reduce": True}),
                 "2-det": (2, {"deterministic_reduce": True, "bucket_size": 512}),
                 "3-det": (3, {"deterministic_reduce": True, "max_grad_norm": 0.5})}


@functools.cache
def deterministic_one_process(name: str, steps: int = 10) -> list:
    """``[losses, *full params]`` of DETERMINISTIC[name] (Adam 1e-2, the awkward model)
    after ``steps`` steps in this process on 8 devices."""
    import zerojax

    stage, options = DETERMINISTIC[name]
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=stage,
                       min_shard_size=16, **options)
    state, step = opt.init_state(awkward_params()), opt.train_step(awkward_loss)
    losses = []
    for b in regression_batches(steps):
        state, metrics = step(state, b)
        losses.append(np.asarray(metrics["loss"]))
    return [np.stack(losses), *map(np.asarray, jax.tree.leaves(opt.full_params(state)))]
