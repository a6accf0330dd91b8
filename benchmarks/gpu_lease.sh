#!/bin/bash
# benchmarks/gpu.py's rows on a lent GPU, one process each (as gpu.py runs them there),
# within a time budget: each row's result is appended to $OUT/rows.jsonl as it ends, so
# a lease that runs out still returns the rows done; the table is printed at the end.
#   OUT=/tmp/gpu BUDGET=440 STEPS=5 WARMUP=2 bash benchmarks/gpu_lease.sh
#   OUT=/tmp/gpu BUDGET=390 ROW_CAP=200 STEPS=3 WARMUP=1 SET=offload bash benchmarks/gpu_lease.sh
# (ROW_CAP: seconds a row may take at most, default 170)
# Rows in priority order (the lines of ROWS below; SET=offload: issue 50's speed
# rows, stage 3 bf16 with and without offload_optimizer and delayed_update at 8K and
# 64K tokens a step, ratios printed after the table); zerojax from this checkout.
set -u
: "${OUT:?set OUT to a folder for the results}"
cd "$(dirname "$0")/.."
if [ "${SET:-}" = offload ]; then ROWS=$(cat <<'ROWS_END'
zerojax stage 3, offload_optimizer, delayed_update, accum 8
zerojax stage 3, param_dtype=bf16, accum 8
zerojax stage 3, offload_optimizer, delayed_update
zerojax stage 3, param_dtype=bf16
zerojax stage 3, offload_optimizer, accum 8
zerojax stage 3, offload_optimizer, delayed_update, one bucket
zerojax stage 3, offload_optimizer
ROWS_END
)
else ROWS=$(cat <<'ROWS_END'
jax.jit + optax
zerojax stage 3, param_dtype=bf16
zerojax stage 0
zerojax stage 3
zerojax stage 1, param_dtype=bf16
zerojax stage 3, offload_optimizer
zerojax stage 3, Pa+cpu
zerojax stage 3, offload_optimizer+params
zerojax stage 2, param_dtype=bf16
zerojax stage 1
zerojax stage 2
zerojax stage 0, param_dtype=bf16
zerojax stage 1, offload_optimizer
zerojax stage 2, offload_optimizer
ROWS_END
)
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
budget=${BUDGET:-480}; start=$(date +%s); : > "$OUT/rows.jsonl"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import sys, jax, flax, optax, orbax.checkpoint as o; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
while IFS= read -r row; do
  [ -z "$row" ] && continue
  left=$((budget - ($(date +%s) - start)))
  if [ $left -lt 45 ]; then echo "{\"row\": \"$row\", \"fits\": false, \"error\": \"the time budget was spent\"}" >> $OUT/rows.jsonl; continue; fi
  cap=${ROW_CAP:-170}; t=$(( left < cap ? left : cap ))
  t0=$(date +%s)
  timeout $t python3 benchmarks/gpu.py --one-row "$row" --steps ${STEPS:-5} --warmup ${WARMUP:-2} > $OUT/row.out 2>>$OUT/stderr.log
  rc=$?
  if grep -q '^RESULT ' $OUT/row.out; then grep '^RESULT ' $OUT/row.out | sed 's/^RESULT //' >> $OUT/rows.jsonl
  else echo "{\"row\": \"$row\", \"fits\": false, \"error\": \"rc $rc after $(( $(date +%s) - t0 )) s\"}" >> $OUT/rows.jsonl; tail -3 $OUT/stderr.log; fi
  echo "# $row: rc $rc, $(( $(date +%s) - t0 )) s"
done <<< "$ROWS"
rm -f $OUT/row.out
python3 - <<'PY'
import json, os, sys
sys.path.insert(0, "benchmarks")
import gpu
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/rows.jsonl")]
print(gpu.table(rows))
print("\n".join(gpu.ratio_lines(rows)))
PY
