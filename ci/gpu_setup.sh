#!/usr/bin/env bash
# Install diffusion-kv into a GPU machine's existing Python (its own torch and Triton stay),
# offline: missing pure-Python wheels come from ${DKV_WHEELS:-.devwheels} (stevedore, pbr,
# pytest, pluggy, iniconfig, packaging, setuptools, wheel), fetched beforehand with
#   pip download --no-deps -d .devwheels stevedore pbr pytest pluggy iniconfig packaging setuptools wheel
# and, optionally, pytest-xdist execnet nvidia-cudnn-frontend (the last for CPython 3.12, manylinux)
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${DKV_WHEELS:-.devwheels}"
py="${PYTHON:-python3}"
missing=()
for mod in stevedore pbr pytest pluggy iniconfig packaging setuptools wheel; do
  "$py" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[gpu-setup] installing ${missing[*]} from $wheels"
  "$py" -m pip install -q --no-index --find-links "$wheels" "${missing[@]}"
fi
# optional, when their wheels were fetched too: pytest-xdist (ci/gpu_run.sh spreads the suite's
# Triton compilation over the host's cores) and the cuDNN frontend (the experimental cuda:cudnn
# backend and its tests, which skip without it)
for pair in "xdist:pytest-xdist execnet" "cudnn:nvidia-cudnn-frontend"; do
  mod="${pair%%:*}"; pkgs="${pair#*:}"
  first="${pkgs%% *}"
  if ! "$py" -c "import $mod" 2>/dev/null && ls "$wheels"/"${first//-/_}"-*.whl >/dev/null 2>&1; then
    echo "[gpu-setup] installing $pkgs from $wheels"
    # shellcheck disable=SC2086
    "$py" -m pip install -q --no-index --no-deps --find-links "$wheels" $pkgs || echo "[gpu-setup] $pkgs not installed"
  fi
done
"$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .
"$py" -c 'import torch, triton, diffusion_kv; print("[gpu-setup] torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())'
