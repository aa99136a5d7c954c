#!/usr/bin/env bash
# Set up both venvs and run every test, the end-to-end tests against a real
# vLLM server included. Extra arguments go to pytest.
#   WT_SKIP_VLLM=1      skip building the vLLM venv (~3.5 GB); its tests then skip.
#   WT_TEST_WORKERS=N   pytest-xdist workers (default 3; 1 runs in one process).
#                       3 on 2 cores: the tests wait a lot (server starts, the
#                       timeouts the fault tests run into), and a third worker
#                       runs meanwhile (one machine, one run each: pytest took
#                       1069 s with 2 workers, 772 s with 3, cores 30% idle).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${WT_VENV:-.venv}"
WORKERS="${WT_TEST_WORKERS:-3}"
case "$WORKERS" in
  '' | *[!0-9]*) echo "WT_TEST_WORKERS must be a number of workers, got '$WORKERS'" >&2; exit 2 ;;
esac
# Both venvs, pip's downloads and the tiny models take about 6 GiB: a full
# disk otherwise shows only as pip's "No space left on device" mid-install.
for dir in . "${TMPDIR:-/tmp}"; do
  free_kib=$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 {print $4}')
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((7 * 1024 * 1024)) ]; then
    echo "warning: $(( free_kib / 1024 )) MiB free at $(cd "$dir" && pwd); a full setup needs about 6 GiB" >&2
  fi
done
vllm_pid="" vllm_log=""
# An interrupted run must not leave a vLLM install going that the next run would race.
trap '[ -n "$vllm_pid" ] && kill -- "-$vllm_pid" 2>/dev/null; [ -n "$vllm_log" ] && rm -f "$vllm_log"' EXIT
if [ "${WT_SKIP_VLLM:-0}" != "1" ]; then
  # Both venvs build at once: each install mostly waits on downloads and disk.
  vllm_log="$(mktemp)"
  setsid bash scripts/vllm_env.sh >"$vllm_log" 2>&1 &  # its own process group: the trap reaches pip too
  vllm_pid=$!
fi
bash scripts/setup.sh
setup_rc=$?
if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid"
  vllm_rc=$?
  vllm_pid=""
  cat "$vllm_log"
  if [ "$vllm_rc" -ne 0 ]; then
    echo "scripts/vllm_env.sh failed (exit $vllm_rc, output above)" >&2
    exit 1
  fi
  export WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python"
  # This script installed vLLM: its tests must run, not skip.
  export WT_REQUIRE_VLLM=1
fi
if [ "$setup_rc" -ne 0 ]; then
  echo "scripts/setup.sh failed (exit $setup_rc)" >&2
  exit 1
fi
parallel=()
if [ "$WORKERS" -gt 1 ]; then
  # A module whole on one worker (its module-scoped servers start once), the
  # modules that start vLLM servers first (tests/conftest.py). Not loadgroup:
  # pytest-xdist 3.8 cannot tag node ids under pytest 9.2, so its groups are ignored.
  parallel=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
fi
"$VENV/bin/python" -m pytest -q -rs --durations=30 ${parallel[@]+"${parallel[@]}"} "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
