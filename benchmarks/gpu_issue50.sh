#!/bin/bash
# Issue 50's GPU rows (and issue 51's NVMe-on-GPU figure) in one call on a lent GPU, each
# part within its own time cap so the call ends inside its lease:
#   OUT=/tmp/gpu bash benchmarks/gpu_issue50.sh        # <= 7.8 minutes (the caps below)
# 1. the offloaded update's leaf cut into constant-size pieces (compiles on the GPU?
#    bitwise? peak) against whole-leaf buckets: benchmarks/offload_buckets_gpu.py;
# 2. the speed rows: stage 3 bf16 with / without offload_optimizer (and delayed_update)
#    at 8K and 64K tokens a step: benchmarks/gpu_lease.sh SET=offload (gpu.py rows);
# 3. per-layer fetch against a plain jax.device_put of the same bytes, and the GPT step
#    with param_fetch='layer' / 'whole': benchmarks/offload.py --fetch;
# 4. a model whose state is >= 3x the device memory the process is given, trained with
#    host offload, its losses against the same model with enough memory:
#    benchmarks/offload_big.py;
# 5. no offload vs host vs NVMe tier, losses and master-weight bits: tier_parity.py;
# 6. the optimizer step on the CPU under the GPU's pass (ZeRO-Offload's schedule), probed
#    with plain JAX before it is built: benchmarks/host_adam_probe.py.
# Everything goes to $OUT/log.txt (and gpu_lease.sh's rows.jsonl / env.txt).
set -u
: "${OUT:?set OUT to a folder for the results}"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=$OUT/log.txt; S=$(date +%s)
mark() { echo "=== $1 at $(( $(date +%s) - S )) s" | tee -a "$L"; }
mark "buckets"
timeout "${T_BUCKETS:-75}" python3 benchmarks/offload_buckets_gpu.py --layers 8 --width 2048 --steps 3 >> "$L" 2>&1
mark "speed"
(OUT=$OUT BUDGET="${T_SPEED:-170}" ROW_CAP=85 STEPS=3 WARMUP=1 SET=offload bash benchmarks/gpu_lease.sh) >> "$L" 2>&1
mark "fetch"
timeout "${T_FETCH:-45}" python3 benchmarks/offload.py --fetch --layers 8 >> "$L" 2>&1
OG=""; grep -q "offload_gradients" zerojax/engine/step.py && OG="--option offload_gradients=true"
mark "big $OG"
timeout "${T_BIG:-110}" python3 benchmarks/offload_big.py --layers 12 --mem-fraction 0.022 --timeout 72 $OG >> "$L" 2>&1
mark "parity"
timeout "${T_PARITY:-35}" python3 benchmarks/tier_parity.py --stages 3 >> "$L" 2>&1
mark "host adam"
timeout "${T_HOST:-35}" python3 benchmarks/host_adam_probe.py --repeat 2 >> "$L" 2>&1
mark "end"
