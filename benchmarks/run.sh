#!/usr/bin/env bash
# Every benchmark, one after the other (they must not share the CPUs), results
# into benchmarks/results/: JSON, markdown and the throughput plot. Sets up the
# project venv and the vLLM venv first (as the tests do). More than 30 minutes on
# 2 cores. Set WT_SKIP_VLLM=1 to leave out the vLLM comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="${WT_VENV:-.venv}/bin/python"
OUT=benchmarks/results
mkdir -p "$OUT"
"$PY" benchmarks/transfer_throughput.py --out "$OUT/transfer.json"
"$PY" benchmarks/transfer_throughput.py --params 200M,496M --cycles 2 --configs "bf16 shm" --out "$OUT/transfer_bf16_shm.json"
"$PY" benchmarks/fsdp2_gather.py --out "$OUT/fsdp2_gather.json"
"$PY" benchmarks/fsdp2_gather.py --params 200M --out "$OUT/fsdp2_gather_200M.json"
"$PY" benchmarks/sharded_sync.py --out "$OUT/sharded_sync.json"
"$PY" benchmarks/callback_overhead.py --repeats 7 --out "$OUT/callback_overhead.json"
"$PY" benchmarks/checkpoint_format_cost.py --out "$OUT/checkpoint_format.json"
"$PY" benchmarks/soak.py --target receiver --rounds 2000 --out "$OUT/soak_receiver.json"
if [ "${WT_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/vllm_env.sh
  WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python" \
    "$PY" benchmarks/vllm_push_vs_reload.py --out "$OUT/vllm_push_vs_reload.json" --md "$OUT/vllm_push_vs_reload.md"
  WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python" \
    "$PY" benchmarks/vllm_update_memory.py --out "$OUT/vllm_update_memory.json"
  WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python" \
    "$PY" benchmarks/soak.py --target vllm --rounds 300 --at 10,100,300 --out "$OUT/soak_vllm.json"
  WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python" \
    "$PY" benchmarks/sync_under_load.py --target vllm --size llama-74M --seconds 180 --out "$OUT/sync_under_load.json"
  WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python" \
    "$PY" benchmarks/async_send.py --out "$OUT/async_send.json" --md "$OUT/async_send.md"
  WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python" \
    "$PY" benchmarks/async_send.py --split-cores --out "$OUT/async_send_split.json" --md "$OUT/async_send_split.md"
  WT_VLLM_PYTHON="$(cd "${WT_VLLM_VENV:-.venv-vllm}" && pwd)/bin/python" \
    "$PY" benchmarks/lora_sync.py --out "$OUT/lora_sync.json"
fi
echo "results in $OUT/"
