#!/usr/bin/env bash
# Creates .venv and installs zerojax with its dev dependencies, at the exact versions
# CI tests (constraints.txt), once per change of pyproject.toml or constraints.txt.
# pyproject.toml declares the supported ranges; constraints.txt pins what we test.
# Sourced by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.zerojax-installed"
want="$(cat "$root/pyproject.toml" "$root/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv" >&2
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing zerojax[dev] into $venv (versions pinned by constraints.txt)" >&2
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet -e "$root[dev]" -c "$root/constraints.txt" >&2
  echo "$want" > "$stamp"
fi
PY="$venv/bin/python"
export PY
