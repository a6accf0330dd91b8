#!/usr/bin/env bash
# The test suite (what CI runs). Arguments are passed to pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh"
cd "$here/.."
# Passes (tests/conftest.py): the suite compiled at LLVM -O0 (the tests marked full_opt
# deselected), then those tests at XLA's default level. With pytest-xdist installed (a
# dev dependency) the -O0 pass is two: the modules not marked serial on
# ZEROJAX_TEST_WORKERS workers (default 2; a module stays in one worker, so its
# module-scoped fixtures compile once), then the serial ones (process groups, memory and
# seconds measured) alone; the full_opt pass likewise. ZEROJAX_TEST_WORKERS=1 runs each
# pass in one process.
# Exit status 5 (no test selected, e.g. arguments naming only one pass's tests) counts
# as passing; every pass must pass.
run() {
  local status=0
  "$@" || status=$?
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
}
workers="${ZEROJAX_TEST_WORKERS:-2}"
if [ "$workers" != 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
  run "$PY" -m pytest -q -n "$workers" --dist loadfile -m "not serial" "$@"
  run "$PY" -m pytest -q -m serial "$@"
  # the full_opt pass split alike (test_sharded_init's in-process tests beside test_zeropp's)
  ZEROJAX_TEST_FULL_OPT=1 run "$PY" -m pytest -q -n "$workers" --dist loadfile \
    -m "full_opt and not serial" "$@"
  ZEROJAX_TEST_FULL_OPT=1 run "$PY" -m pytest -q -m "full_opt and serial" "$@"
else
  run "$PY" -m pytest -q "$@"
  ZEROJAX_TEST_FULL_OPT=1 run "$PY" -m pytest -q -m full_opt "$@"
fi
exit 0
