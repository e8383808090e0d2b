#!/usr/bin/env bash
# Install diffusion-kv into a GPU machine's existing Python (its own torch and Triton stay),
# offline: missing pure-Python wheels come from ${DKV_WHEELS:-.devwheels} (stevedore, pbr,
# pytest, pluggy, iniconfig, packaging, setuptools, wheel), fetched beforehand with
#   pip download --no-deps -d .devwheels stevedore pbr pytest pluggy iniconfig packaging setuptools wheel
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
"$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .
"$py" -c 'import torch, triton, diffusion_kv; print("[gpu-setup] torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())'
