#!/usr/bin/env bash
# The main job: trains a small flax model with ZeRO stages 0-3 on 8 simulated CPU
# devices and prints the loss and the per-device memory and traffic of each stage.
# Arguments are passed to examples/demo.py (try --help).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${DEVICES:-8}"
exec "$PY" "$here/../examples/demo.py" "$@"
