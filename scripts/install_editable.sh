#!/usr/bin/env bash
# Install this checkout, editable, into the venv of PYTHON: install_editable.sh PYTHON [SPEC]
# (SPEC defaults to "." ; e.g. ".[dev]"). scripts/test.sh builds both venvs at
# once, and an editable install writes the checkout's egg-info: one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$1"
SPEC="${2:-.}"
mkdir -p build
if command -v flock >/dev/null; then
  flock build/install.lock "$PY" -m pip install --quiet -e "$SPEC"
else
  "$PY" -m pip install --quiet -e "$SPEC"
fi
