#!/usr/bin/env bash
# The main job: trains a character-level GPT on the Python standard library's own
# source with ZeRO on 8 simulated CPU devices; shows a progress bar, writes the loss
# curve to zerojax-demo-loss.png, prints a text sample and the per-device memory and
# traffic of every ZeRO stage. A few minutes on 2 cores.
# Arguments are passed to `zerojax train` (try --help); DEVICES=16 simulates 16 devices.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh"
exec "$PY" -m zerojax.cli train --devices "${DEVICES:-8}" "$@"
