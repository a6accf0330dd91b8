#!/usr/bin/env bash
# The test suite (what CI runs). Arguments are passed to pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh"
cd "$here/.."
exec "$PY" -m pytest -q "$@"
