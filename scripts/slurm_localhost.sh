#!/usr/bin/env bash
# Issue 41: a real SLURM on this machine (Debian's slurm-wlm: slurmctld + slurmd on
# localhost, munge), then `srun -n 2` of tests/mp_worker.py's `launcher` mode (2
# processes x 4 CPU devices, zerojax.distributed.initialize() with no arguments):
# prints the start-up time to the first step, checks the losses and params after 4
# steps against one process with 8 devices, and the time from rank 1's SIGKILL to the
# job's end. Needs root and apt (installs slurmd slurmctld slurm-client munge, ~35 s),
# leaves no daemon running. Not part of CI: the mpirun runs already take CI's
# time for new tests (tests/test_mpirun.py); docs/multihost.md has its figures.
#
#   sudo bash scripts/slurm_localhost.sh       # ZEROJAX_ENV=newest: jax 0.12; PY=python
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -n "${PY:-}" ] || source "$root/scripts/setup.sh"   # PY=...: that python instead
if ! command -v slurmctld >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmd slurmctld slurm-client munge >/dev/null
fi
work="$(mktemp -d /tmp/zerojax-slurm.XXXXXX)"
host="$(hostname)"
cpus="$(nproc)"
mkdir -p "$work"/{state,spool,log} /run/munge /var/lib/munge /var/log/munge /etc/munge
cat > "$work/slurm.conf" <<EOF
ClusterName=zerojax
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$work/munge.socket
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
SlurmctldPort=26817
SlurmdPort=26818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="$work/slurm.conf"
[ -f /etc/munge/munge.key ] || { head -c 1024 /dev/urandom > /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
munged --force -S "$work/munge.socket" --pid-file "$work/munged.pid"
cleanup() {
  scontrol shutdown >/dev/null 2>&1 || true
  sleep 1
  for f in slurmd slurmctld munged; do
    [ -f "$work/$f.pid" ] && kill "$(cat "$work/$f.pid")" 2>/dev/null || true
  done
}
trap cleanup EXIT
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 30); do sinfo -h -o %T 2>/dev/null | grep -q idle && break; sleep 1; done
sinfo
out="$work/run.npz"
export PYTHONPATH="$root" XLA_FLAGS=--xla_force_host_platform_device_count=4 \
  JAX_PLATFORMS=cpu ZEROJAX_HEARTBEAT_TIMEOUT=5 PYTHONUNBUFFERED=1
t0=$(date +%s.%N)
srun -n 2 --kill-on-bad-exit=1 "$PY" "$root/tests/mp_worker.py" launcher "$out" \
  > "$work/srun.log" 2>&1 || true
t1=$(date +%s.%N)
grep -v Gloo "$work/srun.log" | grep -E "zerojax.distributed|first step|saved|dying|srun:" || true
"$PY" - "$work/srun.log" "$out" "$t0" "$t1" <<'EOF'
import os, re, sys
log, out, t0, t1 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
text = open(log).read()
first = min(map(float, re.findall(r"first step t=([\d.]+)", text)))
dying = float(re.search(r"dying t=([\d.]+)", text).group(1))
assert re.search(r"process 1 of 2 is pid \d+ on \S+, started by SLURM \(srun\)", text)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
import jax, numpy as np, optax, zerojax
from helpers import awkward_loss, awkward_params, max_rel_err, regression_batches
opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3, min_shard_size=16)
state, step = opt.init_state(awkward_params()), opt.train_step(awkward_loss)
losses = []
for b in regression_batches(4):
    state, m = step(state, b)
    losses.append(np.asarray(m["loss"]))
one = [np.stack(losses), *map(np.asarray, jax.tree.leaves(opt.full_params(state)))]
data = np.load(out)
got = [data[str(i)] for i in range(len(data.files))]
print(f"srun 2 x 4 (jax {jax.__version__}): first step {first - t0:.1f} s after srun started; "
      f"rank 1 SIGKILLed, job over {t1 - dying:.2f} s later; max |diff| to 1 x 8 "
      f"{max(float(np.max(np.abs(a - b))) for a, b in zip(got, one)):.3g}, rel "
      f"{max_rel_err(one, got):.3g}")
assert max_rel_err(one, got) <= 2e-6
EOF
