#!/usr/bin/env bash
# Create (or update) the project venv with everything the examples and tests need.
# torch is installed first and pinned: a bare `torch` requirement lets pip pull a
# multi-GB CUDA build on machines where the CPU build is the one wanted.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${WT_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${WT_TORCH_SPEC:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
bash scripts/install_editable.sh "$VENV/bin/python" ".[dev]"
"$VENV/bin/python" -c "import torch, wt_callbacks; print(f'venv ready: {\"$VENV\"} (torch {torch.__version__})')"
