#!/usr/bin/env bash
# Set up a development environment in .venv (or $DKV_VENV): CPU torch first, then
# diffusion-kv with its test extra, then the test plugin distributions under tests/fixtures.
# Idempotent: re-running only refreshes the editable install.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DKV_VENV:-.venv}"
torch_pin="${DKV_TORCH_PIN:-torch==2.13.0}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[bootstrap] creating $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "[bootstrap] installing $torch_pin"
  "$py" -m pip install -q --disable-pip-version-check "$torch_pin"
fi
echo "[bootstrap] installing diffusion-kv[test] and the test plugin distributions"
"$py" -m pip install -q --disable-pip-version-check -e '.[test]' \
  ./tests/fixtures/dkv-test-plugins ./tests/fixtures/dkv-test-plugins-dup ./tests/fixtures/dkv-test-plugins-hostile
# Triton runs the CUDA tier's kernels under its interpreter on CPU in the tests; Triton 3.6's
# interpreter needs NumPy < 2.4 (it converts 1-element arrays with int()).
"$py" -m pip install -q --disable-pip-version-check "triton==3.6.0" "numpy<2.4"
echo "[bootstrap] ready: $venv ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
