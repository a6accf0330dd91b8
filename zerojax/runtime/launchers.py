"""Which launcher started this process, read from its environment variables (issue 41).

:func:`detect` reads the variables that ``mpirun`` / ``mpiexec`` (Open MPI 4 and 5,
MPICH's Hydra, Intel MPI, MVAPICH), ``srun`` (SLURM), a Kubernetes indexed Job or
JobSet and torchrun set in every process they start, and returns a :class:`Launch`:
the launcher's name, this process's rank, the world size, the local rank, and the
coordinator's address where the variables name it. It is a pure function of the
environment (no JAX, no device, no network), so the table below is unit-tested with
fake environments (tests/test_launchers.py).

=====================  ==========================================  =====================
launcher               rank / size / local rank                     coordinator host
=====================  ==========================================  =====================
Open MPI 4 and 5       ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` /       Open MPI 4: mpirun's
(``mpirun``)           ``_LOCAL_RANK`` (``_LOCAL_SIZE``)            host in
                                                                    ``OMPI_MCA_orte_hnp_uri``;
                                                                    5: one node (local size
                                                                    = size): 127.0.0.1;
                                                                    else mpi4py
MPICH / Intel MPI      ``PMI_RANK`` / ``PMI_SIZE`` /                one node
(Hydra ``mpiexec``)    ``MPI_LOCALRANKID`` (``MPI_LOCALNRANKS``)    (``MPI_LOCALNRANKS`` =
                                                                    size): 127.0.0.1; else
                                                                    mpi4py
MVAPICH2               ``MV2_COMM_WORLD_RANK`` / ``_SIZE`` /        one node: 127.0.0.1;
                       ``_LOCAL_RANK`` (``_LOCAL_SIZE``)            else mpi4py
SLURM (``srun``)       ``SLURM_PROCID`` / ``SLURM_STEP_NUM_TASKS``  the first host of
                       / ``SLURM_LOCALID``                          ``SLURM_STEP_NODELIST``
Kubernetes indexed     ``JOB_COMPLETION_INDEX`` (+ ``JOB_INDEX``    ``MASTER_ADDR``, else
Job / JobSet           x pods per Job) / ``WORLD_SIZE``             pod 0's name from
                       (set it in the manifest)                     ``HOSTNAME`` and the
                                                                    pod's subdomain
torchrun-style         ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``   ``MASTER_ADDR``
=====================  ==========================================  =====================

The port: ``ZEROJAX_COORDINATOR_PORT`` or ``JAX_COORDINATOR_PORT`` if set; torchrun's
``MASTER_PORT`` + 1 (torchrun's own store listens on ``MASTER_PORT``), a plain
``MASTER_PORT`` as it is; Kubernetes 55527 (JAX's); else one derived from the job's
identity (the same in every process of the job, different between jobs: Open MPI's job
id or PMIx namespace, Hydra's proxy process, SLURM's job and step ids) in
[61440, 65535], as JAX picks it. Process 0 checks it is free before serving there.

The MPI launchers first in that order (``mpirun`` inside an ``sbatch`` allocation
inherits ``SLURM_*`` variables of the batch step), then SLURM, Kubernetes, torchrun.
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec

ENV_PORT = "ZEROJAX_COORDINATOR_PORT"
K8S_PORT = 55527  # JAX's K8sCluster default
PORT_LOW, PORT_SPAN = 65536 - 4096, 4096  # JAX's ephemeral range for derived ports


@dataclass(frozen=True)
class Launch:
    """What the launcher's variables say about this process."""

    launcher: str                   # "Open MPI 5 (mpirun)", "SLURM (srun)", ...
    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    host: str | None                # the coordinator's host; None: the variables don't say
    port: int | None
    variables: dict[str, str] = field(default_factory=dict)  # the variables it read
    mpi: bool = False               # an MPI launcher: mpi4py can broadcast rank 0's address
    why_no_host: str = ""           # when host is None: why not, and the fix

    @property
    def address(self) -> str | None:
        return None if self.host is None or self.port is None else f"{self.host}:{self.port}"

    def describe(self) -> str:
        seen = ", ".join(f"{k}={v}" for k, v in self.variables.items())
        return f"{self.launcher} ({seen})"


class LauncherError(RuntimeError):
    """The launcher's variables say this process is one of several, but they cannot be
    used as they are (a variable missing or wrong, no way to name the coordinator)."""


def _int(env: Mapping[str, str], name: str, launcher: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise LauncherError(f"{launcher}: the environment variable {name}={value!r} must be "
                            "an integer (it is the launcher's; was it overwritten?).") from None


def _derived_port(key: str) -> int:
    """A port every process of one job derives alike from ``key`` (the job's identity)."""
    return PORT_LOW + zlib.crc32(key.encode()) % PORT_SPAN


def _override_port(env: Mapping[str, str]) -> int | None:
    for name in (ENV_PORT, "JAX_COORDINATOR_PORT"):
        port = _int(env, name, "the coordinator port")
        if port is not None:
            if not 0 < port < 65536:
                raise LauncherError(f"{name}={port} is not a port (1-65535).")
            return port
    return None


def _hydra_proxy(pid: int | None = None) -> int | None:
    """The pid of the nearest ``hydra_pmi_proxy`` above this process (MPICH's per-node
    proxy: the same for every rank on a node, also through wrapper scripts), or None."""
    pid = os.getppid() if pid is None else pid
    for _ in range(16):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if comm.startswith("hydra_pmi_prox"):
            return pid
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
        if pid <= 1:
            return None
    return None


def _mpi(env, launcher, rank_var, size_var, local_var, local_size_var, key, extra=()):
    rank, size = _int(env, rank_var, launcher), _int(env, size_var, launcher)
    local_rank, local_size = _int(env, local_var, launcher), _int(env, local_size_var, launcher)
    names = (rank_var, size_var, local_var, local_size_var, *extra)
    seen = {k: env[k] for k in names if k in env}
    if rank is None or size is None:
        missing = [k for k in (rank_var, size_var) if k not in env]
        raise LauncherError(f"{launcher}: {', '.join(missing)} is not set but {seen} are; "
                            "the launcher's environment is incomplete (a wrapper that drops "
                            "variables?). Pass them through, or call "
                            "zerojax.distributed.initialize(address, num_processes, "
                            "process_id).")
    host, why = None, ""
    if local_size is not None and local_size == size:
        host = "127.0.0.1"  # every rank on this node
    else:
        why = (f"the ranks span several nodes ({local_size_var}={local_size} of "
               f"{size_var}={size}) and {launcher}'s variables do not name rank 0's host")
    return dict(launcher=launcher, rank=rank, size=size, local_rank=local_rank,
                local_size=local_size, host=host, port=_derived_port(key), variables=seen,
                mpi=True, why_no_host=why)


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``node[001-004,007],gpu2`` -> ``node001``."""
    head = nodelist.split(",", 1)[0] if "[" not in nodelist.split(",", 1)[0] else nodelist
    if "[" not in head:
        return head.strip()
    prefix, rest = head.split("[", 1)
    first = rest.split(",", 1)[0].split("-", 1)[0].rstrip("]")
    return prefix + first


def _open_mpi(env):
    hnp = env.get("OMPI_MCA_orte_hnp_uri")
    if hnp:  # Open MPI 4 (ORTE): mpirun's host, as JAX's OmpiCluster reads it
        key = hnp.split(".", 1)[0]
        found = _mpi(env, "Open MPI 4 (mpirun)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", key,
                     ("OMPI_MCA_orte_hnp_uri",))
        uri = hnp.split(";", 1)[1] if ";" in hnp else hnp
        addr = uri.split("://", 1)[-1]
        if addr.startswith("["):
            host = addr[1:].split("]", 1)[0].split(",", 1)[0]
        else:
            host = addr.split(",", 1)[0].rsplit(":", 1)[0]
        if host and found["host"] is None:
            found.update(host=host, why_no_host="")
        return found
    key = env.get("PMIX_NAMESPACE") or env.get("OMPI_FILE_LOCATION", "") + str(os.getppid())
    version = "5" if "PMIX_NAMESPACE" in env or "PRTE_LAUNCHED" in env else "4/5"
    return _mpi(env, f"Open MPI {version} (mpirun)", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE", key, ("PMIX_NAMESPACE",))


def _hydra(env):
    launcher = ("Intel MPI (mpiexec.hydra)" if "I_MPI_ROOT" in env or "I_MPI_HYDRA_TOPOLIB" in env
                else "MPICH (Hydra mpiexec)")
    proxy = _hydra_proxy()
    key = f"{env.get('PMI_HOSTNAME', socket.gethostname())}/{proxy or os.getppid()}"
    return _mpi(env, launcher, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                key)


def _mvapich(env):
    key = env.get("MPIRUN_ID") or f"{socket.gethostname()}/{os.getppid()}"
    return _mpi(env, "MVAPICH2 (mpirun_rsh)", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", key, ("MPIRUN_ID",))


def _slurm(env):
    launcher = "SLURM (srun)"
    names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID",
             "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_ID",
             "SLURM_STEP_ID")
    seen = {k: env[k] for k in names if k in env}
    rank = _int(env, "SLURM_PROCID", launcher)
    size = _int(env, "SLURM_STEP_NUM_TASKS", launcher)
    if size is None:
        tasks = _int(env, "SLURM_NTASKS", launcher)
        if tasks is not None and tasks > 1:  # the batch script itself, not an srun task
            raise LauncherError(
                f"SLURM: this process runs in an allocation of SLURM_NTASKS={tasks} tasks "
                "but was not started by srun (SLURM_STEP_NUM_TASKS is not set: the batch "
                f"script itself, {seen}). Start it with `srun python ...` so every task "
                "runs, or set ZEROJAX_NUM_PROCESSES=1 to run it as one process on purpose.")
        return None
    if rank is None:
        raise LauncherError(f"SLURM: SLURM_PROCID is not set but {seen} are; start the "
                            "script with srun.")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    port = _derived_port(f"slurm/{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "")  # "2(x3),1": tasks on each node
    alone = bool(per_node) and all(x.split("(")[0] == "1" for x in per_node.split(","))
    return dict(launcher=launcher, rank=rank, size=size,
                local_rank=_int(env, "SLURM_LOCALID", launcher), local_size=1 if alone else None,
                host=_first_host(nodes) if nodes else None, port=port, variables=seen,
                why_no_host="SLURM_STEP_NODELIST is not set")


def _kubernetes(env):
    launcher = ("Kubernetes JobSet" if "JOBSET_NAME" in env else "Kubernetes indexed Job")
    names = ("JOB_COMPLETION_INDEX", "WORLD_SIZE", "JOBSET_NAME", "JOB_INDEX",
             "REPLICATED_JOB_REPLICAS", "HOSTNAME", "MASTER_ADDR", "MASTER_PORT")
    seen = {k: env[k] for k in names if k in env}
    index = _int(env, "JOB_COMPLETION_INDEX", launcher)
    size = _int(env, "WORLD_SIZE", launcher)
    if size is None and "KUBERNETES_SERVICE_HOST" in env and find_spec("kubernetes"):
        return None  # JAX's K8sCluster reads the Job's parallelism through the API
    if size is None:
        raise LauncherError(
            f"{launcher}: JOB_COMPLETION_INDEX={index} says this pod is one of an indexed "
            "Job's, but the world size is not in its environment (Kubernetes sets none). "
            "Add `env: [{name: WORLD_SIZE, value: \"<the Job's parallelism x Jobs>\"}]` to "
            "the pod template (docs/multihost.md has a manifest), or set "
            "ZEROJAX_NUM_PROCESSES=1 to run it as one process on purpose.")
    jobs = _int(env, "REPLICATED_JOB_REPLICAS", launcher) or 1
    job_index = _int(env, "JOB_INDEX", launcher) or 0
    if size % jobs:
        raise LauncherError(f"{launcher}: WORLD_SIZE={size} does not divide by "
                            f"REPLICATED_JOB_REPLICAS={jobs} (pods per Job).")
    rank = job_index * (size // jobs) + index
    host, why = env.get("MASTER_ADDR") or None, ""
    if host is None:
        name = env.get("HOSTNAME") or socket.gethostname()
        suffix = f"-{job_index}-{index}" if "JOBSET_NAME" in env else f"-{index}"
        fqdn = socket.getfqdn(name) if "JOBSET_NAME" not in env else name
        if not name.endswith(suffix):
            why = (f"the pod's HOSTNAME={name!r} does not end in {suffix!r} (an indexed "
                   "Job's pod names)")
        elif "JOBSET_NAME" in env:  # JobSet: <jobset>-<rjob>-<job>-<pod>.<jobset> (its service)
            host = f"{name[:-len(suffix)]}-0-0.{env['JOBSET_NAME']}"
        elif fqdn.startswith(name + "."):  # <job>-<i>.<subdomain>...: pod 0 is <job>-0
            host = f"{name[:-len(suffix)]}-0{fqdn[len(name):]}"
        else:
            why = ("the pod has no subdomain (no headless Service), so pod 0 has no name "
                   "the others can resolve: add a headless Service and `subdomain:` to the "
                   "Job (docs/multihost.md), or set MASTER_ADDR")
    port = _int(env, "MASTER_PORT", launcher) or K8S_PORT
    return dict(launcher=launcher, rank=rank, size=size, local_rank=None, local_size=None,
                host=host, port=port, variables=seen, why_no_host=why)


def _torchrun(env):
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "torchrun-style (RANK/WORLD_SIZE)"
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT")
    seen = {k: env[k] for k in names if k in env}
    rank, size = _int(env, "RANK", launcher), _int(env, "WORLD_SIZE", launcher)
    if rank is None or size is None:
        missing = "RANK" if rank is None else "WORLD_SIZE"
        raise LauncherError(f"{launcher}: {missing} is not set but {seen} are; set RANK, "
                            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every process.")
    port = _int(env, "MASTER_PORT", launcher)
    if port is not None and "TORCHELASTIC_RUN_ID" in env:
        port += 1  # torchrun's own rendezvous store listens on MASTER_PORT
    host = env.get("MASTER_ADDR") or None
    return dict(launcher=launcher, rank=rank, size=size,
                local_rank=_int(env, "LOCAL_RANK", launcher),
                local_size=_int(env, "LOCAL_WORLD_SIZE", launcher), host=host, port=port,
                variables=seen,
                why_no_host="MASTER_ADDR / MASTER_PORT are not set" if host is None or
                port is None else "")


# (what marks the launcher, its reader), first match wins
_LAUNCHERS = (
    (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), _open_mpi),
    (("PMI_SIZE", "PMI_RANK"), _hydra),
    (("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"), _mvapich),
    (("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), _slurm),
    (("JOB_COMPLETION_INDEX",), _kubernetes),
    (("WORLD_SIZE", "RANK"), _torchrun),
)


def detect(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launcher that started this process, from ``environ`` (default ``os.environ``),
    or None (no launcher's variables: a plain ``python train.py``).

    Raises :class:`LauncherError` when a launcher's variables are there but unusable (a
    world of N > 1 that cannot be joined as they are), naming them and the fix."""
    env = os.environ if environ is None else environ
    for marks, read in _LAUNCHERS:
        if any(env.get(m) not in (None, "") for m in marks):
            found = read(env)
            if found is None:
                continue
            override = _override_port(env)
            if override is not None:
                found["port"] = override
            launch = Launch(**found)
            if launch.size < 1 or not 0 <= launch.rank < launch.size:
                raise LauncherError(f"{launch.describe()}: rank {launch.rank} does not lie in "
                                    f"[0, world size {launch.size}).")
            return launch
    return None
