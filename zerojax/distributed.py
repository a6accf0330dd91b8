"""Multi-process (multi-host) runs through ``jax.distributed``.

One process per host (or per GPU) runs the same program; ``jax.devices()`` then lists
every device of every process, ``zerojax.make_mesh(data=-1)`` spans them all, and each
process feeds the step its own slice of the global batch::

    zerojax.distributed.initialize()          # before any other jax call
    mesh = zerojax.make_mesh(data=-1)
    opt = zerojax.zero(optax.adamw(1e-3), mesh, stage=3)
    state = opt.init_state(params)            # the same params (same seed) everywhere
    step = opt.train_step(loss_fn)
    state, metrics = step(state, local_batch) # rows [i*B/P, (i+1)*B/P) of the global batch

Where the coordinator and ranks come from, first match wins:

1. the arguments of :func:`initialize`;
2. ``ZEROJAX_COORDINATOR_ADDRESS``, ``ZEROJAX_NUM_PROCESSES``, ``ZEROJAX_PROCESS_ID``
   (set by ``python -m zerojax.cli.launch`` for processes on this machine);
3. JAX's own cluster detection (SLURM, Open MPI, Kubernetes/GKE, Cloud TPU), which
   ``jax.distributed.initialize()`` does when given nothing.

With none of these (a plain ``python train.py``) it does nothing: one process.

A multi-process job never hangs on one bad process:

- A process whose script raises exits at once with status 1, after printing the
  traceback and a line naming its rank and the exception (``sys.excepthook``; without
  it the interpreter's exit would wait in JAX's shutdown barrier for peers that wait in
  a collective for it).
- A process that makes no training step (``TrainStep`` call) for ``progress_timeout``
  seconds (default 600, or ``ZEROJAX_PROGRESS_TIMEOUT``) prints how many steps it made
  and exits with status 1 (:data:`EXIT_FAILURE`): a stuck data loader, a deadlock, or
  a collective waiting for a peer that is gone. The stuck process made fewer steps
  than its peers and times out first.
- A process that dies (killed, out of memory, a lost host), or exits as above, stops
  sending heartbeats to the coordination service; after ``heartbeat_timeout`` seconds
  every other process is ended by the service with an error that names the lost
  process ("The following tasks are unhealthy (stopped sending heartbeats): 1").
  ``python -m zerojax.cli.launch`` ends the others at once and names the process that
  failed or left first, with its last error line.
- Process 0 checks that the coordinator's port is free before starting the
  coordination service (a port in use is an error naming it, not a crash).
- ``TrainStep`` checks, once per batch shape, that every process brought the same
  number of rows (:func:`check_rows`).

What was run where: every path here is tested on one machine with several CPU
processes on 127.0.0.1 and gloo collectives (tests/test_multiprocess.py). GPU pods
and SLURM use the same JAX calls; they were not run here (see docs/multihost.md).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["initialize", "is_initialized", "process_slice", "split_batch", "check_rows",
           "note_progress"]

ENV_COORDINATOR = "ZEROJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROJAX_PROCESS_ID"
ENV_HEARTBEAT = "ZEROJAX_HEARTBEAT_TIMEOUT"
ENV_PROGRESS = "ZEROJAX_PROGRESS_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 30
DEFAULT_PROGRESS_TIMEOUT = 600
EXIT_FAILURE = 1  # a rank that raised or stalled

_initialized = False


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer.") from None


def _cluster_detected() -> bool:
    """Whether JAX's own cluster detection finds a multi-process environment."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # private module moved: let jax decide
        return True
    try:
        return any(env.is_env_present() for env in ClusterEnv._cluster_types)
    except Exception:
        return False


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_ids: int | Sequence[int] | None = None,
               heartbeat_timeout: int | None = None,
               progress_timeout: float | None = None,
               initialization_timeout: int = 300,
               cpu_collectives: str | None = "gloo") -> bool:
    """Join a multi-process run (``jax.distributed.initialize``); returns whether this
    is one (False: a single process, nothing done).

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes, process_id: this run's size and this process's rank.
      local_device_ids: the local devices this process uses (e.g. its GPU).
      heartbeat_timeout: seconds without a heartbeat after which a process counts as
        dead and every other process is ended with an error naming it (default:
        ``ZEROJAX_HEARTBEAT_TIMEOUT``, set by ``zerojax.cli.launch``, else 30).
      progress_timeout: seconds without a training step (a ``TrainStep`` call, or
        :func:`note_progress`) after which this process reports it is stuck and exits
        with status 1, so the job ends instead of hanging (default:
        ``ZEROJAX_PROGRESS_TIMEOUT``, else 600; it counts from ``initialize``, so it
        must cover start-up and the first step's compilation). ``0`` turns it off.
      initialization_timeout: seconds to wait for every process to join.
      cpu_collectives: the CPU collectives implementation (``"gloo"``; ``"mpi"``), set
        for runs on the CPU backend (where the default cannot cross processes).

    In a multi-process run it also makes an uncaught exception end this process at
    once (status 1, the rank and the exception printed), so a rank that raises ends the
    job instead of hanging its peers. Call it before anything else touches jax devices.
    Calling it again is a no-op.
    """
    global _initialized
    if _initialized or jax.distributed.is_initialized():
        _initialized = True
        return jax.process_count() > 1
    if heartbeat_timeout is None:
        heartbeat_timeout = _env_int(ENV_HEARTBEAT) or DEFAULT_HEARTBEAT_TIMEOUT
    if progress_timeout is None:
        env = os.environ.get(ENV_PROGRESS)
        try:
            progress_timeout = float(env) if env not in (None, "") else DEFAULT_PROGRESS_TIMEOUT
        except ValueError:
            raise ValueError(f"environment variable {ENV_PROGRESS}={env!r} must be a number "
                             "of seconds.") from None
    if (isinstance(progress_timeout, bool) or not isinstance(progress_timeout, int | float)
            or not progress_timeout >= 0):
        raise ValueError(f"progress_timeout={progress_timeout!r} must be a number of seconds "
                         ">= 0 (0 turns the check off).")
    for name, value, lo in (("heartbeat_timeout", heartbeat_timeout, 1),
                            ("initialization_timeout", initialization_timeout, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"{name}={value!r} must be a positive number of seconds (int).")
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    explicit = coordinator_address is not None or num_processes is not None
    if explicit:
        if num_processes is None or process_id is None or coordinator_address is None:
            raise ValueError(
                f"initialize: coordinator_address={coordinator_address!r}, "
                f"num_processes={num_processes!r} and process_id={process_id!r} go together "
                f"(arguments, or the {ENV_COORDINATOR} / {ENV_NUM_PROCESSES} / "
                f"{ENV_PROCESS_ID} variables); give all three, or none to use JAX's "
                "cluster detection (SLURM, Open MPI, Kubernetes).")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"initialize: process_id={process_id} must lie in "
                             f"[0, num_processes={num_processes}).")
        if num_processes == 1:
            _initialized = True
            return False
    elif not _cluster_detected():
        _initialized = True
        return False
    if explicit and process_id == 0:
        _check_port_free(coordinator_address)
    if cpu_collectives and _cpu_backend():
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address, num_processes, process_id, local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout)
    _initialized = True
    if jax.process_count() > 1:
        atexit.register(_announce_exit)  # runs before JAX's own shutdown (registered later)
        _install_excepthook()
        if progress_timeout:
            _start_watchdog(float(progress_timeout))
    return jax.process_count() > 1


def _check_port_free(address: str) -> None:
    """Process 0 serves the coordinator on ``address``'s port: say so clearly when
    something already listens there (JAX itself crashes with a segfault)."""
    port = address.rpartition(":")[2]
    try:
        port_number = int(port)
    except ValueError:
        raise ValueError(f"coordinator address {address!r} must be host:port.") from None
    busy = port_in_use(port_number)
    if busy:
        raise RuntimeError(
            f"the coordinator port {port_number} ({address}) is already in use on this "
            f"host ({busy}); process 0 serves the coordination service there. Pick "
            "another port (the launcher: --port N, or --port 0 for a free one; without "
            f"it: {ENV_COORDINATOR} or coordinator_address), or end the process holding it.")


def port_in_use(port: int) -> str | None:
    """Why ``port`` cannot serve the coordinator on this host (something listens
    there), or None. SO_REUSEADDR: a port left in TIME_WAIT counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as e:
            return e.strerror or str(e)
    return None


_progress = {"steps": 0, "last": time.monotonic()}


def note_progress(step_done: bool = False) -> None:
    """Tell the progress watchdog this process is making progress (``TrainStep`` calls
    it before and after each step; call it yourself in long phases without steps,
    e.g. evaluation, or set a larger ``progress_timeout``)."""
    _progress["last"] = time.monotonic()
    if step_done:
        _progress["steps"] += 1


def _rank() -> str:
    try:
        return f"process {jax.process_index()} of {jax.process_count()}"
    except Exception:  # pragma: no cover - jax torn down
        return "this process"


def _announce_exit() -> None:
    """At interpreter exit, say so: JAX's shutdown then waits for every peer, and a peer
    still training waits in its next collective for this one; the launcher names the
    process that left first when the others then fail. After a preemption stop
    (:mod:`zerojax.preemption`: every process stopped at the same step) it says so, and
    the launcher does not count it as leaving early."""
    from zerojax import preemption

    at = preemption.preempted_at()
    why = ("(its script ended)" if at is None else
           f"(it stopped for preemption at step {at}: SIGTERM)")
    print(f"zerojax.distributed: {_rank()} is exiting {why} after "
          f"{_progress['steps']} training steps.", file=sys.stderr, flush=True)


def _install_excepthook() -> None:
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
            print(f"zerojax.distributed: {_rank()} raised {kind.__name__}: {value}; exiting "
                  "now so the job ends instead of waiting for this process (its peers are "
                  "ended by the launcher, or by the coordination service after the "
                  "heartbeat timeout).", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(EXIT_FAILURE)

    sys.excepthook = hook


def _start_watchdog(timeout: float) -> None:
    note_progress()

    def watch():
        while True:
            time.sleep(min(1.0, timeout / 10))
            idle = time.monotonic() - _progress["last"]
            if idle > timeout:
                print(f"zerojax.distributed: {_rank()} made no training step for "
                      f"{idle:.0f} s (progress timeout {timeout:g} s) after "
                      f"{_progress['steps']} steps: stuck (a data loader, a deadlock, or a "
                      "collective waiting for a peer that is gone). Exiting so the job "
                      f"ends; if steps legitimately take longer, raise progress_timeout "
                      f"({ENV_PROGRESS}).", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(EXIT_FAILURE)

    threading.Thread(target=watch, name="zerojax-progress-watchdog", daemon=True).start()


def check_rows(rows: int) -> None:
    """Raise, on every process, if the processes bring different numbers of batch rows
    (each must feed its 1/P slice of the global batch). One all-gather of the counts."""
    from jax.experimental import multihost_utils

    counts = [int(c) for c in np.ravel(multihost_utils.process_allgather(np.int32(rows)))]
    if len(set(counts)) > 1:
        raise ValueError(
            f"the processes brought different numbers of batch rows: "
            f"{', '.join(f'process {i}: {c}' for i, c in enumerate(counts))}. Every process "
            "must feed the same number of rows, its slice of the global batch "
            "(zerojax.distributed.split_batch(global_batch)); pad or drop the remainder.")


def _cpu_backend() -> bool:
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    return platforms.split(",")[0].strip() == "cpu"


def is_initialized() -> bool:
    """Whether this process is part of a multi-process run."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def process_slice(global_batch_size: int, process_index: int | None = None,
                  process_count: int | None = None) -> slice:
    """The rows of a global batch of ``global_batch_size`` this process feeds:
    ``[i*B/P, (i+1)*B/P)``."""
    i = jax.process_index() if process_index is None else process_index
    p = jax.process_count() if process_count is None else process_count
    if global_batch_size % p:
        raise ValueError(f"global batch size {global_batch_size} does not divide by the "
                         f"{p} processes; use a multiple of {p}.")
    per = global_batch_size // p
    return slice(i * per, (i + 1) * per)


def split_batch(batch: Any, process_index: int | None = None,
                process_count: int | None = None, *, batch_dim: int = 0) -> Any:
    """This process's slice (:func:`process_slice`) of every leaf of a global host
    batch, along ``batch_dim`` (1 for ``(accum_steps, batch, ...)`` batches)."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        return batch
    size = np.shape(leaves[0])[batch_dim]
    rows = process_slice(size, process_index, process_count)
    index = (slice(None),) * batch_dim + (rows,)
    return jax.tree.map(lambda x: np.asarray(x)[index], batch)
