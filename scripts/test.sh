#!/usr/bin/env bash
# Set up both venvs and run every test, the end-to-end tests against a real
# vLLM server included. Extra arguments go to pytest.
#   WT_SKIP_VLLM=1      skip building the vLLM venv (~3.5 GB); its tests then skip.
#   WT_TEST_WORKERS=N   pytest-xdist workers (default 2; 1 runs in one process).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${WT_VENV:-.venv}"
if [ "${WT_SKIP_VLLM:-0}" != "1" ]; then
  # Both venvs build at once: each install mostly waits on downloads and disk.
  vllm_log="$(mktemp)"
  bash scripts/vllm_env.sh >"$vllm_log" 2>&1 &
  vllm_pid=$!
fi
bash scripts/setup.sh
setup_rc=$?
if [ "${WT_SKIP_VLLM:-0}" != "1" ]; then
  wait "$vllm_pid"
  vllm_rc=$?
  cat "$vllm_log"
  rm -f "$vllm_log"
  [ "$vllm_rc" -eq 0 ] || exit 1
  export WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python"
  # This script installed vLLM: its tests must run, not skip.
  export WT_REQUIRE_VLLM=1
fi
[ "$setup_rc" -eq 0 ] || exit 1
WORKERS="${WT_TEST_WORKERS:-2}"
parallel=()
if [ "$WORKERS" -gt 1 ]; then
  # A module whole on one worker, the tests on the shared vLLM server together (tests/conftest.py).
  parallel=(-n "$WORKERS" --dist loadgroup --no-loadscope-reorder)
fi
"$VENV/bin/python" -m pytest -q -rs --durations=30 "${parallel[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
