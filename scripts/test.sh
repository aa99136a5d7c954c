#!/usr/bin/env bash
# Set up the venv and run every test. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
VENV="${WT_VENV:-.venv}"
"$VENV/bin/python" -m pytest -q -rs "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
