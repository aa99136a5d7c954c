#!/usr/bin/env bash
# The GPU check: the tests marked `gpu` (tests/test_gpu.py) on a CUDA machine.
#
#   bash scripts/gpu_check.sh WHEEL_DIR [pytest args...]
#
# For a machine without a package registry where torch (CUDA), lightning,
# accelerate, transformers, pytest and requests are installed: whatever of
# fastapi, uvicorn, pydantic and deepspeed is missing is installed, with its
# dependencies, from the wheels in WHEEL_DIR (README, "GPU check", says how to
# download them), then this package (editable, no dependencies), then the gpu
# tests run, each of which must pass. Without CUDA nothing is installed and
# every gpu test skips (exit 0). PYTHON selects the interpreter (default: python).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:?usage: bash scripts/gpu_check.sh WHEEL_DIR [pytest args...]}"
shift
PYTHON="${PYTHON:-python}"

"$PYTHON" - <<'PY' || { echo "gpu_check: $PYTHON cannot import torch" >&2; exit 1; }
import platform
import torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"GPU 0: {props.name}, {props.total_memory / 2**30:.0f} GiB ({torch.cuda.device_count()} visible)")
else:
    print("no CUDA device: the gpu tests skip")
PY

if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  [ -d "$WHEELS" ] || { echo "gpu_check: WHEEL_DIR $WHEELS is not a directory" >&2; exit 1; }
  missing=()
  for module in fastapi uvicorn pydantic deepspeed; do
    "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" || missing+=("$module")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing from $WHEELS: ${missing[*]}"
    "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}" || exit 1
  fi
  if ! "$PYTHON" -c "import wt_callbacks.integrations" 2>/dev/null; then
    # --no-deps: never touch the CUDA torch. The isolated build takes
    # setuptools and wheel from WHEEL_DIR too.
    "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" --no-deps -e . || exit 1
  fi
  export WT_REQUIRE_GPU=1  # a gpu test that cannot run here fails instead of skipping
fi

# Only the gpu module is collected: the others import dev-only packages
# (omegaconf, jsonargparse, ray, ...) that a GPU machine need not have.
"$PYTHON" -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_gpu.py "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "gpu_check: no tests marked gpu were collected" >&2
  exit 1
fi
exit "$rc"
