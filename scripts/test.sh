#!/usr/bin/env bash
# The test suite (what CI runs). Arguments are passed to pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh"
cd "$here/.."
# Two passes (tests/conftest.py): the suite compiled at LLVM -O0 (the tests marked
# full_opt deselected), then those tests at XLA's default level. Exit status 5 (no test
# selected, e.g. arguments naming only one pass's tests) counts as passing; both must.
status=0
"$PY" -m pytest -q "$@" || status=$?
if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
status=0
ZEROJAX_TEST_FULL_OPT=1 "$PY" -m pytest -q -m full_opt "$@" || status=$?
if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
exit 0
