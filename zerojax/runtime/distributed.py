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
   (set by ``zerojax launch`` / ``python -m zerojax.launch`` on this machine);
3. the launcher's variables (:mod:`zerojax.launchers`): ``mpirun`` / ``mpiexec`` of Open
   MPI 4 and 5, MPICH / Intel MPI (Hydra), MVAPICH; ``srun`` (SLURM); a Kubernetes
   indexed Job or JobSet; torchrun-style ``RANK`` / ``WORLD_SIZE``. Under an MPI
   launcher with mpi4py importable (and agreeing with the launcher's ranks), rank 0's
   host and a free port are broadcast through it (MPI is finalized again after);
   else the variables name the coordinator (127.0.0.1 when every rank is on this
   node). Where nothing can name it (several nodes, no mpi4py) it raises
   :class:`zerojax.launchers.LauncherError` saying so and the fix;
4. JAX's own non-opt-in cluster detection for the rest (Cloud TPU; Kubernetes through
   its API when the ``kubernetes`` package is installed).

With none of these (a plain ``python train.py``) it does nothing: one process, whatever
is installed (JAX's opt-in mpi4py detection, present whenever mpi4py imports, is not
used). Never alone by mistake: a launcher's variables that say the world has N > 1
processes but cannot be used (a variable missing, no coordinator address) raise a
:class:`~zerojax.launchers.LauncherError` naming the launcher, the variables and the
fix, before any device is touched; after ``jax.distributed.initialize`` a world size
other than the launcher's raises too. ``ZEROJAX_NUM_PROCESSES=1`` alone runs one
process on purpose, whatever the launcher's variables say.

A multi-process job never hangs on one bad process:

- A process whose script raises exits at once with status 1, after printing the
  traceback and a line naming its rank and the exception (``sys.excepthook``; without
  it the interpreter's exit would wait in JAX's shutdown barrier for peers that wait in
  a collective for it).
- A process that makes no training step (``TrainStep`` call) while a peer waits for
  it in a step exits with status 1 (:data:`EXIT_FAILURE`) after :func:`stall_bound`
  seconds, ``max(stall_floor, 20 x its median step period)`` (floor 30 s; measured
  after the first two step calls; outside step calls, where compilation happens, and
  once its own last step has finished on its devices), saying how many steps it made;
  its peers end within a second, naming it.
  Whatever the reason, no step for ``progress_timeout`` seconds (default 600, or
  ``ZEROJAX_PROGRESS_TIMEOUT``) ends a process too.
- A process whose script ends posts its step count; a peer in a step it never made
  ends at once, naming it (a normal end, every process at the same step, ends none).
- A process that dies (killed, out of memory, a lost host), or exits as above, stops
  sending heartbeats to the coordination service; after ``heartbeat_timeout`` seconds
  every other process is ended by the service with an error that names the lost
  process ("The following tasks are unhealthy (stopped sending heartbeats): 1").
  The exits above (raise, stall, script end) are posted to the coordination service's
  key-value store, so peers end within a second without waiting for heartbeats.
  ``zerojax launch`` ends the others at once and names the process that failed or left
  first, with its last error line.
- Process 0 checks that the coordinator's port is free before starting the
  coordination service (a port in use is an error naming it, not a crash).
- ``TrainStep`` checks, at every step, that every process brought the same number of
  rows (:func:`check_rows`, through the key-value store: no device work).

What was run where: every path here is tested on one machine with several CPU
processes on 127.0.0.1 and gloo collectives (tests/test_multiprocess.py), also started
by a real mpirun of Open MPI 5 and MPICH, with and without mpi4py
(tests/test_mpirun.py), and by srun of a SLURM on localhost
(scripts/slurm_localhost.sh); each launcher's variables in tests/test_launchers.py.
GPU pods, Kubernetes and several machines were not run here (docs/multihost.md).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["initialize", "is_initialized", "process_slice", "split_batch", "check_rows",
           "note_progress", "step_period", "stall_bound"]

ENV_COORDINATOR = "ZEROJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROJAX_PROCESS_ID"
ENV_HEARTBEAT = "ZEROJAX_HEARTBEAT_TIMEOUT"
ENV_PROGRESS = "ZEROJAX_PROGRESS_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 30
ENV_STALL = "ZEROJAX_STALL_FLOOR"
DEFAULT_PROGRESS_TIMEOUT = 600
# A process that makes no step while its peers wait for it in one ends the job after
# max(STALL_FLOOR, STALL_FACTOR x its median step period), at most the progress timeout;
# the periods are measured after the first WARMUP_STEPS step calls (they compile).
STALL_FLOOR = 30.0
STALL_FACTOR = 20
WARMUP_STEPS = 2
POLL_S = 0.5  # how often the watchdog looks at its peers and its own progress
# at exit, how long to wait for the latest step to finish on every local device before
# counting it (a step that waits for a peer which left never does)
EXIT_STEP_WAIT_S = 2.0
_KV = "zerojax"  # the prefix of zerojax's keys in the coordination service
EXIT_FAILURE = 1  # a rank that raised or stalled

_initialized = False


def _env_number(name: str, kind: type = int, default: float | None = None) -> float | None:
    """Environment variable ``name`` as an int (``kind=float``: a number of seconds);
    ``default`` when it is unset or empty."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number of seconds"
        raise ValueError(f"environment variable {name}={value!r} must be {what}.") from None


def _cluster_detected() -> bool:
    """Whether JAX's own cluster detection finds a multi-process environment that
    :mod:`zerojax.launchers` does not read (Cloud TPU; Kubernetes through its API).

    Opt-in methods (``Mpi4pyCluster``: present whenever mpi4py imports) do not count:
    JAX skips them when given no ``cluster_detection_method``, and a plain ``python
    train.py`` with mpi4py installed would otherwise fail inside JAX ("coordinator_address
    should be defined")."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # private module moved: let jax decide
        return True
    try:
        return any(not env.opt_in_only_method and env.is_env_present()
                   for env in ClusterEnv._cluster_types)
    except Exception:
        return False


def _detect_launch():
    """The launcher's view (:func:`zerojax.launchers.detect`), its errors prefixed."""
    from zerojax.runtime import launchers

    try:
        return launchers.detect()
    except launchers.LauncherError as e:
        raise launchers.LauncherError(f"zerojax.distributed.initialize: {e}") from None


def _coordinator(launch) -> str:
    """``host:port`` of process 0's coordination service: from mpi4py (rank 0's host and
    a free port, broadcast) under an MPI launcher where mpi4py loads and agrees with the
    launcher's ranks; else from the launcher's variables; else an error (this process
    would otherwise run alone, or wait for a coordinator nobody serves)."""
    from zerojax.runtime import launchers

    why_mpi = ""
    if launch.mpi:
        address, why_mpi = _mpi4py_address(launch)
        if address is not None:
            return address
    if launch.address is not None:
        return launch.address
    mpi = (f"; mpi4py cannot give it: {why_mpi}" if launch.mpi else "")
    fixes = ("`pip install mpi4py` (built against this MPI) so rank 0's address is "
             "broadcast, or " if launch.mpi else "")
    raise launchers.LauncherError(
        f"zerojax.distributed.initialize: {launch.describe()} says this is process "
        f"{launch.rank} of {launch.size}, but the coordinator's address is unknown: "
        f"{launch.why_no_host}{mpi}. Run alone, this process would train by itself as "
        f"process 0 of 1 beside {launch.size - 1} others. Fix: {fixes}set "
        f"{ENV_COORDINATOR}=<rank 0's host>:<port> (with {ENV_NUM_PROCESSES} and "
        f"{ENV_PROCESS_ID}) in every process, or pass coordinator_address, num_processes "
        "and process_id to initialize().")


def _mpi4py_address(launch) -> tuple[str | None, str]:
    """(rank 0's ``host:port`` broadcast through mpi4py, "") or (None, why not). MPI is
    finalized again afterwards unless the script had loaded mpi4py.MPI itself."""
    from importlib.util import find_spec

    if find_spec("mpi4py") is None:
        return None, "mpi4py is not installed"
    preloaded = "mpi4py.MPI" in sys.modules
    try:
        from mpi4py import MPI
    except Exception as e:  # no libmpi found, or one of another ABI
        return None, f"mpi4py did not load ({type(e).__name__}: {str(e).splitlines()[0]})"
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if (rank, size) != (launch.rank, launch.size):
        # a singleton MPI init: mpi4py is built against another MPI than the launcher's
        if not preloaded:
            MPI.Finalize()
        return None, (f"its MPI sees rank {rank} of {size}, not the launcher's (mpi4py "
                      "built against another MPI library?)")
    from zerojax.runtime import launchers

    address = None
    if rank == 0:
        port = launchers._override_port(os.environ)
        if port is None:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        address = f"{socket.gethostname()}:{port}"
    address = comm.bcast(address, root=0)
    if not preloaded:
        MPI.Finalize()
    return address, ""


def _local_device_ids(launch) -> list[int] | None:
    """One device per process, the launcher's local rank, where several processes share
    a node's GPUs (as JAX does for SLURM); None (every visible device) on the CPU
    backend, with one process per node, or when the launcher already made one GPU
    visible (CUDA_VISIBLE_DEVICES of one entry)."""
    if launch.local_rank is None or launch.local_size == 1 or _cpu_backend():
        return None
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        visible = os.environ.get(name)
        if visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1:
            return None
    return [launch.local_rank]


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_ids: int | Sequence[int] | None = None,
               heartbeat_timeout: int | None = None,
               progress_timeout: float | None = None,
               stall_floor: float | None = None,
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
      stall_floor: a process that makes no step (no ``TrainStep`` call,
        no :func:`note_progress`) while a peer waits for it in a step ends the job after
        ``max(stall_floor, 20 x its median step period)`` seconds, at most
        ``progress_timeout`` (default: ``ZEROJAX_STALL_FLOOR``, else 30; see
        :func:`stall_bound`). Compiling does not count: the bound applies outside step
        calls, once the process's own last step has finished on its devices, and the
        period is measured from the third call on (the floor alone before).
      initialization_timeout: seconds to wait for every process to join.
      cpu_collectives: the CPU collectives implementation (``"gloo"``; ``"mpi"``), set
        for runs on the CPU backend (where the default cannot cross processes).

    In a multi-process run it also makes an uncaught exception end this process at
    once (status 1, the rank and the exception printed), so a rank that raises ends the
    job instead of hanging its peers. Call it before anything else touches jax devices.
    Calling it again is a no-op.
    """
    global _initialized, STALL_FLOOR
    if _initialized or jax.distributed.is_initialized():
        _initialized = True
        return jax.process_count() > 1
    heartbeat_timeout, progress_timeout, stall_floor = _timeouts(
        heartbeat_timeout, progress_timeout, stall_floor, initialization_timeout)
    target = _join_target(coordinator_address, num_processes, process_id, local_device_ids)
    if target is None:  # one process: nothing to join
        _initialized = True
        return False
    coordinator_address, num_processes, process_id, local_device_ids, launch = target
    if coordinator_address is not None and process_id == 0:
        _check_port_free(coordinator_address)
    if cpu_collectives and _cpu_backend():
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address, num_processes, process_id, local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout)
    _initialized = True
    if launch is not None:
        _check_launch_joined(launch, coordinator_address)
    if jax.process_count() > 1:
        atexit.register(_announce_exit)  # runs before JAX's own shutdown (registered later)
        _install_excepthook()
        STALL_FLOOR = float(stall_floor)
        _start_watchdog(float(progress_timeout))
        if launch is not None:  # zerojax launch names a dead process itself
            _watch_local_peers()
    return jax.process_count() > 1


def _timeouts(heartbeat_timeout, progress_timeout, stall_floor,
              initialization_timeout) -> tuple:
    """:func:`initialize`'s timeouts, the unset ones from the environment or the
    defaults, checked: ``(heartbeat_timeout, progress_timeout, stall_floor)``."""
    if heartbeat_timeout is None:
        heartbeat_timeout = _env_number(ENV_HEARTBEAT) or DEFAULT_HEARTBEAT_TIMEOUT
    if progress_timeout is None:
        progress_timeout = _env_number(ENV_PROGRESS, float, DEFAULT_PROGRESS_TIMEOUT)
    if (isinstance(progress_timeout, bool) or not isinstance(progress_timeout, int | float)
            or not progress_timeout >= 0):
        raise ValueError(f"progress_timeout={progress_timeout!r} must be a number of seconds "
                         ">= 0 (0 turns the check off).")
    if stall_floor is None:
        stall_floor = _env_number(ENV_STALL, float, STALL_FLOOR)
    if (isinstance(stall_floor, bool) or not isinstance(stall_floor, int | float)
            or not stall_floor > 0):
        raise ValueError(f"stall_floor={stall_floor!r} must be a number of seconds > 0.")
    for name, value, lo in (("heartbeat_timeout", heartbeat_timeout, 1),
                            ("initialization_timeout", initialization_timeout, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"{name}={value!r} must be a positive number of seconds (int).")
    return heartbeat_timeout, progress_timeout, stall_floor


def _join_target(coordinator_address, num_processes, process_id, local_device_ids):
    """What :func:`initialize` joins: ``(coordinator_address, num_processes,
    process_id, local_device_ids, launch)`` from the arguments, else the
    ``ZEROJAX_*`` variables, else a launcher's (``launch``: its :class:`Launch`, None
    for the first two); None when this is a single process."""
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _env_number(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_number(ENV_PROCESS_ID)
    if num_processes == 1 and coordinator_address is None and process_id in (None, 0):
        return None  # one process on purpose (ZEROJAX_NUM_PROCESSES=1), whatever a
        # launcher's variables say
    if coordinator_address is not None or num_processes is not None:
        if num_processes is None or process_id is None or coordinator_address is None:
            raise ValueError(
                f"initialize: coordinator_address={coordinator_address!r}, "
                f"num_processes={num_processes!r} and process_id={process_id!r} go together "
                f"(arguments, or the {ENV_COORDINATOR} / {ENV_NUM_PROCESSES} / "
                f"{ENV_PROCESS_ID} variables); give all three, or none to use the launcher's "
                "variables (mpirun, srun, Kubernetes, torchrun; docs/multihost.md).")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"initialize: process_id={process_id} must lie in "
                             f"[0, num_processes={num_processes}).")
        if num_processes == 1:
            return None
        return coordinator_address, num_processes, process_id, local_device_ids, None
    launch = _detect_launch()
    if launch is None:
        if not _cluster_detected():
            return None
        return coordinator_address, num_processes, process_id, local_device_ids, None
    if launch.size == 1:
        return None
    coordinator_address = _coordinator(launch)
    if local_device_ids is None and not os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        # [], not None: None would send JAX into its own cluster detection for
        # them (jax 0.12's Open MPI 5 detection then demands mpi4py)
        local_device_ids = _local_device_ids(launch) or []
    return coordinator_address, launch.size, launch.rank, local_device_ids, launch


def _check_launch_joined(launch, coordinator_address: str) -> None:
    """After joining by a launcher's variables: JAX joined as many processes as the
    launcher started; each says its pid and host, for a launcher that names a dead
    process by them."""
    if jax.process_count() != launch.size:
        raise RuntimeError(
            f"zerojax.distributed.initialize: {launch.describe()} says the job has "
            f"{launch.size} processes, but JAX joined {jax.process_count()} "
            f"(this one is {jax.process_index()}). Every process of the job must call "
            "initialize() with the same launcher environment.")
    if jax.process_count() > 1:
        # a launcher that reports a dead process by its pid (MPICH's Hydra) or host:
        # this line ties it to the rank
        print(f"zerojax.distributed: process {jax.process_index()} of {jax.process_count()} "
              f"is pid {os.getpid()} on {socket.gethostname()}, started by "
              f"{launch.launcher}, coordinator {coordinator_address}.", file=sys.stderr,
              flush=True)


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
            f"it: {ENV_COORDINATOR} or coordinator_address; under mpirun, srun, Kubernetes "
            "or torchrun: ZEROJAX_COORDINATOR_PORT=N in every process), or end the process "
            "holding it.")


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


_progress: dict[str, Any] = {
    "started": 0,      # TrainStep calls begun in this process
    "steps": 0,        # TrainStep calls that dispatched their step (and note_progress(True))
    "in_call": False,  # inside a TrainStep call (compiling, exchanging rows, dispatching)
    "last": time.monotonic(),  # the last sign of progress
    "begun": None,     # when the latest TrainStep call began
    "periods": deque(maxlen=32),  # seconds between consecutive step calls, after warm-up
    # the per-step row exchange: total time, of which waiting for late peers; count
    "exchange_s": 0.0, "exchange_wait_s": 0.0, "exchanges": 0,
    "pending": None,   # one output array of the latest step, until it is ready
    "ready_at": 0.0,   # when the latest step was first seen finished
}
_pending_lock = threading.Lock()
_down: dict[int, tuple[str, int, str]] = {}  # peer rank -> (kind, its steps, what happened)


def note_progress(step_done: bool = False) -> None:
    """Tell the progress watchdog this process is alive and making progress (a
    ``TrainStep`` call does; call it yourself in long phases without steps, e.g. an
    evaluation on one process while the others wait in the next step)."""
    _progress["last"] = time.monotonic()
    if step_done:
        _progress["steps"] += 1


def step_begins() -> None:
    """``TrainStep.__call__`` calls this first: counts the step, measures the period
    between step calls (after :data:`WARMUP_STEPS`, whose calls compile) and refuses a
    step that a peer which already left will never join."""
    now = time.monotonic()
    n, begun = _progress["started"], _progress["begun"]
    if n >= WARMUP_STEPS and begun is not None:  # not the first calls' compilation
        _progress["periods"].append(now - begun)
    _progress.update(started=n + 1, begun=now, last=now, in_call=True)
    for rank, (kind, steps, _what) in sorted(_down.items()):
        if kind == "exited" and steps <= n:
            raise RuntimeError(
                f"its peer process {rank} left (its script ended after {steps} training steps), so "
                f"step {n} (counting from 0) of this process can never finish: every "
                "process must make the same steps. Make every process run the same loop "
                "(the same number of batches: zerojax.distributed.split_batch).")


def step_dispatched(outputs: Any = None) -> None:
    """``TrainStep.__call__`` calls this when its step is dispatched, with the step's
    ``(state, metrics)``: one metrics array is kept to see when the step has finished
    on the devices (a process waiting for its own step, perhaps for a peer, is not
    stalled; nor is one whose step has not finished counted as having made it)."""
    leaf = None
    if outputs is not None:
        try:
            arrays = [x for x in jax.tree.leaves(outputs[1]) if isinstance(x, jax.Array)]
            leaf = arrays[0] if arrays else None
        except Exception:
            leaf = None
    with _pending_lock:
        _progress.update(in_call=False, last=time.monotonic(), pending=leaf)
        _progress["steps"] += 1


def _step_done() -> bool:
    """Whether this process's latest dispatched step has finished on its devices (and
    when that was first seen: ``ready_at``)."""
    with _pending_lock:
        leaf = _progress["pending"]
        if leaf is None:
            return True
        try:
            ready = leaf.is_ready()
        except Exception:  # deleted: read and freed, so finished
            ready = True
        if ready:
            _progress.update(pending=None, ready_at=time.monotonic())
        return ready


def step_period() -> float | None:
    """The median time between this process's step calls after warm-up (None before:
    fewer than two periods measured from the third call on)."""
    periods = sorted(_progress["periods"])
    return periods[len(periods) // 2] if len(periods) >= 2 else None


def stall_bound(progress_timeout: float | None = None) -> float:
    """Seconds a process may go without a step, outside step calls and with its own
    last step finished on its devices, while a peer waits for it in a step:
    ``max(STALL_FLOOR, STALL_FACTOR x step_period())`` (``STALL_FLOOR`` before the
    period is measured), at most the progress timeout."""
    period = step_period()
    bound = STALL_FLOOR if period is None else max(STALL_FLOOR, STALL_FACTOR * period)
    return min(bound, progress_timeout) if progress_timeout else bound


def _finished(wait: float = 0.0) -> int:
    """Steps this process finished: the one it is inside of (waiting for its peers'
    rows, compiling, dispatching) or whose results it waits for not counted.

    ``wait``: seconds to wait for the latest dispatched step to finish on every local
    device first. A script that read its step's loss has the loss from one device; the
    other local devices of that step may still be finishing their last ops (XLA:CPU
    runs each on its own thread), and without the wait such a step counted as not made.
    """
    if _progress["in_call"]:
        return _progress["started"] - 1
    deadline = time.monotonic() + wait
    while not _step_done() and time.monotonic() < deadline:
        time.sleep(0.005)
    return _progress["started"] - (not _step_done())


def _client():
    """JAX's coordination-service client (a key-value store every process reaches), or
    None (a private name: moved in some future JAX)."""
    try:
        from jax._src import distributed as jd

        return jd.global_state.client
    except Exception:  # pragma: no cover - moved
        return None


def _post_down(kind: str, what: str, steps: int | None = None) -> None:
    """Tell the peers (through the coordination service) that this process is ending:
    ``kind`` raised / stalled / exited, after ``steps`` training steps (default: those
    :func:`_finished` counts now). Best effort, 2 s at most."""
    client = _client()
    if client is None:
        return
    value = f"{kind}|{_finished() if steps is None else steps}|{what}"

    def post():
        try:
            client.key_value_set(f"{_KV}/down/{jax.process_index()}", value,
                                 allow_overwrite=True)
        except Exception:
            pass

    t = threading.Thread(target=post, daemon=True)
    t.start()
    t.join(2.0)


def _read_down(client) -> None:
    try:
        entries = client.key_value_dir_get(f"{_KV}/down/")
    except Exception:
        return
    me = jax.process_index()
    for key, value in entries:
        try:
            rank = int(key.rsplit("/", 1)[1])
            kind, steps, what = value.split("|", 2)
            if rank != me:
                _down.setdefault(rank, (kind, int(steps), what))
        except ValueError:
            continue


def _rank() -> str:
    try:
        return f"process {jax.process_index()} of {jax.process_count()}"
    except Exception:  # pragma: no cover - jax torn down
        return "this process"


def _announce_exit() -> None:
    """At interpreter exit, say so, and tell the peers how many steps this process
    made: a peer inside a later step (waiting in its collective for this one) then ends
    at once, naming this process, instead of waiting for a timeout. After a preemption
    stop (:mod:`zerojax.preemption`: every process stopped at the same step) it says so,
    and the launcher does not count it as leaving early."""
    from zerojax.runtime import preemption

    at = preemption.preempted_at()
    why = ("(its script ended)" if at is None else
           f"(it stopped for preemption at step {at}: SIGTERM)")
    # a step whose loss the script read has finished here, or within moments on the
    # other local devices; one still waiting for a peer that left does not finish
    finished = _finished(wait=EXIT_STEP_WAIT_S)
    print(f"zerojax.distributed: {_rank()} is exiting {why} after "
          f"{finished} training steps.", file=sys.stderr, flush=True)
    _post_down("exited", f"left: its script ended after {finished} training steps",
               steps=finished)
    _progress["closing"] = True  # JAX's shutdown follows: the watchdog stops its requests


def _install_excepthook() -> None:
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
            print(f"zerojax.distributed: {_rank()} raised {kind.__name__}: {value}; exiting "
                  "now so the job ends instead of waiting for this process (its peers are "
                  "told at once through the coordination service, and ended by the "
                  "launcher, or by the service after the heartbeat timeout).",
                  file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            _post_down("raised", f"raised {kind.__name__}: {str(value)[:300]}")
        finally:
            os._exit(EXIT_FAILURE)

    sys.excepthook = hook


def _die(message: str) -> None:
    print(f"zerojax.distributed: {_rank()} {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_FAILURE)


def _peers_ahead(client) -> list[int]:
    """The peers that began a step this process has not begun (they wait for it)."""
    try:
        entries = client.key_value_dir_get(f"{_KV}/rows/{_progress['started']}/")
    except Exception:
        return []
    return sorted(int(key.rsplit("/", 1)[1]) for key, _ in entries)


def _start_watchdog(timeout: float) -> None:
    """Every :data:`POLL_S` seconds: end this process when a peer failed, or left while
    this process is in a step the peer never made; when this process made no step for
    ``timeout`` seconds (the progress timeout; 0: off); or, after warm-up, for
    :func:`stall_bound` seconds while its peers wait for it in a step."""
    note_progress()
    client = _client()

    def watch():
        while True:
            time.sleep(POLL_S)
            if client is not None and not _progress.get("closing"):
                _read_down(client)
                for rank, (kind, steps, what) in sorted(_down.items()):
                    if kind != "exited":
                        _die(f"stops: its peer process {rank} {what}; exiting so the job "
                             f"ends (this process made {_finished()} training steps).")
                    if steps < _progress["started"]:
                        _die(f"stops: its peer process {rank} left (its script ended after "
                             f"{steps} training steps) while this process is in step "
                             f"{steps} (counting from 0), which needs it; exiting so the "
                             "job ends. Every process must make the same steps.")
            idle = time.monotonic() - _progress["last"]
            if timeout and idle > timeout:
                _post_down("stalled", f"made no training step for {idle:.0f} s (progress "
                           f"timeout {timeout:g} s) after {_finished()} steps")
                _die(f"made no training step for {idle:.0f} s (progress timeout "
                     f"{timeout:g} s) after {_finished()} steps: stuck (a data loader, a "
                     "deadlock, or a collective waiting for a peer that is gone). Exiting "
                     "so the job ends; if steps legitimately take longer, raise "
                     f"progress_timeout ({ENV_PROGRESS}).")
            # the short bound: outside step calls, its own step finished on the devices
            # (not waiting for a peer there), and a peer already in the next step
            bound = stall_bound(timeout)
            if (_progress["in_call"] or client is None or _progress.get("closing")
                    or not _step_done()):
                continue
            idle = time.monotonic() - max(_progress["last"], _progress["ready_at"])
            if idle <= bound:
                continue
            ahead = _peers_ahead(client)
            if ahead:
                n = _finished()
                period = step_period()
                how = (f"max({STALL_FLOOR:g} s, {STALL_FACTOR} x its step period "
                       f"{period:.3g} s)" if period is not None else
                       f"{STALL_FLOOR:g} s: its step period is not measured yet")
                what = (f"made no training step for {idle:.0f} s after {n} steps while "
                        f"process(es) {ahead} wait for it in step {n}")
                _post_down("stalled", what)
                _die(f"{what} (stall bound {bound:.0f} s: {how}; at most the progress "
                     "timeout): stuck (a data loader, a sleep, a deadlock). "
                     "Exiting so the job ends; if this process legitimately works this "
                     "long between steps (an evaluation on one process), call "
                     "zerojax.distributed.note_progress() in that work, or raise "
                     f"stall_floor ({ENV_STALL}).")

    threading.Thread(target=watch, name="zerojax-progress-watchdog", daemon=True).start()


def _watch_local_peers() -> None:
    """Under mpirun / srun: name a peer on this host that dies without a word (SIGKILL,
    the OOM killer) the moment it does: each process posts its pid and host; a thread
    waits on a pidfd of every peer on this host and, when one ends without having posted
    why (a raise, a stall, its script's end), prints so. The launchers end the job then,
    naming a pid at best (MPICH's Hydra: not always the dead one's, and it SIGKILLs the
    survivors within milliseconds, so this line may lose that race); this line names the
    rank. Peers on other hosts: the launcher, or the heartbeat bound."""
    client = _client()
    if client is None or not hasattr(os, "pidfd_open"):
        return
    me, host = jax.process_index(), socket.gethostname()
    try:
        client.key_value_set(f"{_KV}/pid/{me}", f"{os.getpid()}@{host}", allow_overwrite=True)
    except Exception:
        return

    def watch():
        import select

        fds = {}
        for rank in range(jax.process_count()):
            if rank == me:
                continue
            try:
                pid, _, where = client.blocking_key_value_get(f"{_KV}/pid/{rank}",
                                                              60_000).partition("@")
                if where == host:
                    fds[os.pidfd_open(int(pid))] = (rank, pid)
            except Exception:
                continue  # not posted in time, or already gone: the other paths cover it
        while fds and not _progress.get("closing"):
            ready, _, _ = select.select(list(fds), [], [], 1.0)
            for fd in ready:
                rank, pid = fds.pop(fd)
                os.close(fd)
                _read_down(client)
                if rank not in _down and not _progress.get("closing"):
                    print(f"zerojax.distributed: {_rank()}: its peer process {rank} (pid {pid} "
                          f"on {host}) ended without an exit notice: killed (SIGKILL, out of "
                          "memory) unless it printed an error of its own; the job ends.",
                          file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="zerojax-peer-watch", daemon=True).start()


def _is_timeout(error: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(error)


def _exchange(client, step: int, value: str) -> list[str]:
    """Every process's ``value`` for step call ``step``, through the coordination
    service's key-value store (no device work, so it never waits behind the steps in
    flight): one set, one directory read, a blocking read for each late peer, one
    delete of this process's key of two steps back (every peer has read it)."""
    me, count = jax.process_index(), jax.process_count()
    prefix = f"{_KV}/rows/{step}/"
    client.key_value_set(prefix + str(me), value, allow_overwrite=True)
    got = {int(key.rsplit("/", 1)[1]): v for key, v in client.key_value_dir_get(prefix)}
    got[me] = value
    waited = time.perf_counter()
    for rank in range(count):
        while rank not in got:  # the watchdog ends this process if that peer is gone
            try:
                got[rank] = client.blocking_key_value_get(prefix + str(rank), 1000)
            except Exception as e:
                if not _is_timeout(e):
                    raise
    _progress["exchange_wait_s"] += time.perf_counter() - waited
    if step >= 2:
        try:
            client.key_value_delete(f"{_KV}/rows/{step - 2}/{me}")
        except Exception:
            pass
    return [got[rank] for rank in range(count)]


def check_rows(rows: int | None) -> None:
    """Raise, on every process, if the processes bring different numbers of batch rows
    (each must feed its 1/P slice of the global batch; ``None``: a global jax.Array).

    Inside a ``TrainStep`` call (every call, every process: a short last batch on one
    process is caught at the step it appears) the counts go through the coordination
    service's key-value store, 0.5-2 ms a step on one machine; elsewhere (a call of
    your own) one all-gather of the counts."""
    if jax.process_count() == 1:
        return
    client = _client() if _progress["in_call"] else None
    step = _progress["started"] - 1
    t0 = time.perf_counter()
    if client is not None:
        values = _exchange(client, step, "global" if rows is None else str(int(rows)))
        _progress["exchange_s"] += time.perf_counter() - t0
        _progress["exchanges"] += 1
        where = f"at step {step} (counting from 0; {step} steps made before it) "
    else:
        from jax.experimental import multihost_utils

        values = [str(int(c)) for c in
                  np.ravel(multihost_utils.process_allgather(np.int32(-1 if rows is None
                                                                      else rows)))]
        values = ["global" if v == "-1" else v for v in values]
        where = ""
    if len(set(values)) > 1:
        counts = ", ".join(f"process {i}: {'a global jax.Array' if v == 'global' else v}"
                           for i, v in enumerate(values))
        message = (
            f"{where}the processes brought different numbers of batch rows: {counts}. "
            "Every process must feed the same number of rows at every step, its slice of "
            "the global batch (zerojax.distributed.split_batch(global_batch)); pad or drop "
            "the remainder (a short last batch included).")
        if client is not None:
            # said here, on every process, before any exits: process 0's exit ends the
            # coordination service, which aborts the others, perhaps before their
            # tracebacks print
            print(f"zerojax.distributed: {_rank()} refuses the step: ValueError: {message}",
                  file=sys.stderr, flush=True)
            _all_said(client, step)
        raise ValueError(message)


def _all_said(client, step: int, within: float = 5.0) -> None:
    """Post that this process reported step ``step``'s mismatch, then wait (at most
    ``within`` seconds) until every process has."""
    me, count = jax.process_index(), jax.process_count()
    try:
        client.key_value_set(f"{_KV}/said/{step}/{me}", "1", allow_overwrite=True)
    except Exception:
        return
    end = time.monotonic() + within
    for rank in range(count):
        left_ms = int(1000 * (end - time.monotonic()))
        if left_ms <= 0:
            return
        try:
            client.blocking_key_value_get(f"{_KV}/said/{step}/{rank}", left_ms)
        except Exception:
            return


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
