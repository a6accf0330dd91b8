#!/usr/bin/env bash
# Creates .venv and installs zerojax with its pinned dev dependencies, once per
# change of pyproject.toml. Sourced by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.zerojax-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv" >&2
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing zerojax[dev] into $venv (pinned versions from pyproject.toml)" >&2
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet -e "$root[dev]" >&2
  echo "$want" > "$stamp"
fi
PY="$venv/bin/python"
export PY
