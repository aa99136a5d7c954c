#!/usr/bin/env bash
# Set up both venvs and run every test, the end-to-end tests against a real
# vLLM server included. Extra arguments go to pytest.
#   WT_SKIP_VLLM=1  skip building the vLLM venv (~3.5 GB); its tests then skip.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
VENV="${WT_VENV:-.venv}"
if [ "${WT_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/vllm_env.sh || exit 1
  export WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python"
  # This script installed vLLM: its tests must run, not skip.
  export WT_REQUIRE_VLLM=1
fi
"$VENV/bin/python" -m pytest -q -rs --durations=30 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
