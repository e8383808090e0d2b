#!/usr/bin/env bash
# Build the offline payload that lets a GPU machine import vLLM's CUDA FlashAttention backend (for
# diffusion-kv's cuda:vllm-flash-attn) and, for vLLM 0.30.0, vLLM-Omni 0.30.0 with its diffusion models,
# without installing vLLM or reaching the network.
#
# Releases (picked from the wheel's file name; each has its wheel hash below and its import closure,
# pinned with wheel hashes, in ci/gpu_bundle/vllm-RELEASE.txt):
#   0.26.0  vLLM only; its compiled ops link torch 2.11's C++ API: the GPU image's torch 2.11.0+cu130.
#   0.30.0  vLLM + vLLM-Omni 0.30.0 (its wheel is in the closure). vLLM 0.30.0 pins torch 2.13.0, but its
#           two extensions kept here (_C_stable_libtorch and vllm_flash_attn/_vllm_fa3_C) use only torch's
#           stable C ABI (aoti_torch_* / torch_* shims), and every symbol they import is exported by
#           torch 2.11.0+cu130 (checked with nm -D against that wheel), so they load on the image's torch.
#
# Target: Linux x86_64, CPython 3.12, torch 2.11.0+cu130 and triton 3.6 already installed (with the
# packages the 'cuda' image ships), glibc >= 2.31, an SM90 GPU (the payload keeps FA3 and drops FA2).
#
# usage: ci/gpu_vllm_bundle.sh [VLLM_WHEEL] [OUT_DIR]
#   VLLM_WHEEL       vllm-0.26.0-... or vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl (arg 1 or env VLLM_WHEEL),
#                    from `pip download --no-deps vllm==RELEASE`
#   OUT_DIR          where the payload goes (arg 2 or env VLLM_BUNDLE_OUT; default ./vllm-bundle)
#   PART_BYTES       split size (default 54525952 = 52 MiB: one part per 64 MiB carry, with room)
#   XZ_THREADS       xz threads (default 2; the block size is fixed, so the output does not depend on it)
#   PYTHON / PIP     interpreter and pip used here (default python3, "$PYTHON -m pip")
#
# Output: vllm.tar.xz.partN (the trimmed wheel tree: vllm/ + vllm-RELEASE.dist-info/), wheels.tar.xz.partN
# (wheels/*.whl, the import closure) and SHA256SUMS. On the GPU machine (each part carried in one call
# while the machine stays warm; docs/vllm-omni.md "vLLM's CUDA backend on the H200"):
#   cat vllm.tar.xz.part* | xz -dc | tar -x -C /tmp/site
#   cat wheels.tar.xz.part* | xz -dc | tar -x -C /tmp/vb
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/vb/wheels/*.whl
#   PYTHONPATH=/tmp/site DIFFUSION_KV_BACKEND=vllm-flash-attn diffusion-kv conformance --platform cuda
#
# How the 0.26.0 list was found: vLLM's tree on PYTHONPATH, `import` of every module the seam uses
# (and the CUDA platform's import path with the extension modules stubbed), adding the missing
# distribution each time; versions are those pip resolves under vLLM 0.26.0's specifiers for cp312
# manylinux x86_64 among uploads before 2026-07-26 (vLLM 0.26.0 was uploaded 2026-07-25). The 0.30.0
# list's header says how it was found.
set -euo pipefail

WHEEL="${1:-${VLLM_WHEEL:-}}"
OUT="${2:-${VLLM_BUNDLE_OUT:-vllm-bundle}}"
PART_BYTES="${PART_BYTES:-54525952}"
XZ_THREADS="${XZ_THREADS:-2}"
PY="${PYTHON:-python3}"
read -r -a PIP <<<"${PIP:-$PY -m pip}"
log() { echo "[vllm-bundle] $*"; }

[ -n "$WHEEL" ] && [ -f "$WHEEL" ] || { echo "usage: $0 VLLM_WHEEL [OUT_DIR] (vllm-0.26.0- or vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl)" >&2; exit 2; }
RELEASE=$(basename "$WHEEL" | cut -d- -f2)
case "$RELEASE" in
  0.26.0) WHEEL_SHA256=adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de; MTIME='2026-07-25 00:00:00Z' ;;
  0.30.0) WHEEL_SHA256=ef52ee58c410ead0b8afb190838fa4cbcb52075596f67862a03859d984966ac4; MTIME='2026-09-22 00:00:00Z' ;;
  *) echo "[vllm-bundle] no recipe for vLLM $RELEASE (known: 0.26.0, 0.30.0)" >&2; exit 2 ;;
esac
CLOSURE="$(cd "$(dirname "$0")" && pwd)/gpu_bundle/vllm-$RELEASE.txt"
got=$(sha256sum "$WHEEL" | cut -d' ' -f1)
if [ "$got" != "$WHEEL_SHA256" ]; then
  echo "[vllm-bundle] $WHEEL has sha256 $got, not vLLM $RELEASE's $WHEEL_SHA256" >&2
  [ "${ALLOW_OTHER_WHEEL:-0}" = 1 ] || exit 2
fi
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/vllm.tar.xz.part* "$OUT"/wheels.tar.xz.part* "$OUT"/SHA256SUMS
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT

# Dropped from the wheel: never imported on the FlashAttention path (FA3 on SM90), each checked by
# grep: FA2 (vllm_flash_attn tries it under try/except), FA4's CuTe sources (FA4 is then reported
# unavailable), the MoE extension (imported under contextlib.suppress), DeepGEMM (MoE/FP8 only,
# imported lazily under try/except), fmha_sm100 (MiniMax-M3 only) and the Rust frontend binary.
DROP='vllm/vllm_flash_attn/_vllm_fa2_C vllm/_moe_C vllm/third_party/deep_gemm/ vllm/vllm_flash_attn/cute/ vllm/vllm-rs vllm/third_party/fmha_sm100/'
# 0.30.0 also: the optional kernels its platform imports under try/except or contextlib.suppress
# (_qutlass_C; _moe_C_stable_libtorch is covered by the _moe_C prefix), MLA/DeepSelect/KDA kernels
# of other model families (imported under try/except or lazily), the Rust tool parser (lazy) and
# FA4's TML sources. vllm/third_party/pynvml.py stays: vLLM's and vLLM-Omni's CUDA detection import it.
if [ "$RELEASE" = 0.30.0 ]; then
  DROP="$DROP vllm/_qutlass_C vllm/_flashmla_C vllm/_flashmla_extension_C vllm/_deepselect_C vllm/_flashkda_C vllm/_rust_tool_parser vllm/third_party/tml_fa4/"
fi

# The import closure: name==version --hash (cp312 manylinux x86_64 / py3 wheels).
grep -v "^#" "$CLOSURE" >"$work/wheels.txt"

log "trimming $WHEEL"
"$PY" - "$WHEEL" "$work/tree" "$DROP" <<'EOF'
import os, sys, zipfile
whl, dest, drop = sys.argv[1], sys.argv[2], tuple(sys.argv[3].split())
z = zipfile.ZipFile(whl)
kept = dropped = 0
names = []
for info in z.infolist():
    if info.filename.startswith(drop):
        dropped += info.file_size
        names.append(info.filename)
        continue
    z.extract(info, dest)
    kept += info.file_size
dist = [n for n in os.listdir(dest) if n.endswith(".dist-info")][0]
with open(os.path.join(dest, dist, "TRIMMED"), "w") as fh:
    fh.write("Removed from the wheel by diffusion-kv's ci/gpu_vllm_bundle.sh:\n" + "\n".join(sorted(names)) + "\n")
print(f"[vllm-bundle] kept {kept / 2**20:.1f} MiB, dropped {dropped / 2**20:.1f} MiB ({len(names)} files)")
EOF

tarxz() {  # tarxz DIR OUTFILE MEMBERS... : reproducible tar, xz -9 with a fixed block size
  local dir=$1 out=$2; shift 2
  tar --sort=name --format=gnu --mtime="$MTIME" --owner=0 --group=0 --numeric-owner --mode='u=rwX,go=rX' \
    -C "$dir" -cf - "$@" | xz -9 --threads="$XZ_THREADS" --block-size=201326592 >"$out"
}
split_parts() {  # split_parts FILE : FILE.part1, FILE.part2, ... in $OUT
  split -b "$PART_BYTES" -a 1 --numeric-suffixes=1 "$1" "$OUT/$(basename "$1").part"
}

log "compressing the vLLM tree (xz -9, a few minutes)"
tarxz "$work/tree" "$work/vllm.tar.xz" vllm "$(cd "$work/tree" && ls -d vllm-*.dist-info)"
split_parts "$work/vllm.tar.xz"

log "downloading $(grep -c == "$work/wheels.txt") wheels"
plat=()
for p in manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux_2_12_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64; do plat+=(--platform "$p"); done
"${PIP[@]}" download -q --disable-pip-version-check --no-deps --require-hashes --only-binary=:all: \
  --python-version 3.12 --implementation cp "${plat[@]}" -d "$work/dl" -r "$work/wheels.txt" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
[ "$(ls "$work/dl" | wc -l)" -eq "$(grep -c == "$work/wheels.txt")" ] || { echo "[vllm-bundle] wheel download incomplete" >&2; exit 1; }

# Wheels are re-zipped uncompressed (same entries, order, timestamps: pip installs them the same) so
# that xz compresses the whole tar; static libraries (*.a, link-time only: xgrammar's 62 MB
# libxgrammar.a) are left out, with their RECORD lines.
mkdir -p "$work/w/wheels"
"$PY" - "$work/dl" "$work/w/wheels" <<'EOF'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
for name in sorted(os.listdir(src)):
    zin = zipfile.ZipFile(os.path.join(src, name))
    dropped = {i.filename for i in zin.infolist() if i.filename.endswith(".a")}
    with zipfile.ZipFile(os.path.join(dst, name), "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if info.filename in dropped:
                continue
            data = zin.read(info)
            if dropped and info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(True) if l.split(b",")[0].decode() not in dropped)
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr, out.create_system = info.external_attr, info.create_system
            zout.writestr(out, data, compress_type=zipfile.ZIP_STORED)
    if dropped:
        print(f"[vllm-bundle] {name}: left out {sorted(dropped)}")
EOF
log "compressing the wheels"
tarxz "$work/w" "$work/wheels.tar.xz" wheels
split_parts "$work/wheels.tar.xz"

(cd "$OUT" && sha256sum vllm.tar.xz.part* wheels.tar.xz.part* >SHA256SUMS)
