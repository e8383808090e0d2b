#!/usr/bin/env bash
# Build the offline payload that lets a GPU machine import vLLM 0.26.0's CUDA FlashAttention backend
# (for diffusion-kv's cuda:vllm-flash-attn) without installing vLLM or reaching the network.
#
# Target: Linux x86_64, CPython 3.12, torch 2.11.0+cu130 and triton 3.6 already installed (with the
# packages a torch image has: numpy, packaging, setuptools, filelock, fsspec, jinja2, sympy, networkx),
# glibc >= 2.31 (llguidance's wheel), an SM90 GPU (the payload keeps FA3 and drops FA2).
#
# usage: ci/gpu_vllm_bundle.sh [VLLM_WHEEL] [OUT_DIR]
#   VLLM_WHEEL       vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl (arg 1 or env VLLM_WHEEL)
#   OUT_DIR          where the payload goes (arg 2 or env VLLM_BUNDLE_OUT; default ./vllm-bundle)
#   PART_BYTES       split size (default 54525952 = 52 MiB: one part per 64 MiB carry, with room)
#   XZ_THREADS       xz threads (default 2; the block size is fixed, so the output does not depend on it)
#   PYTHON / PIP     interpreter and pip used here (default python3, "$PYTHON -m pip")
#
# Output: vllm.tar.xz.partN (the trimmed wheel tree: vllm/ + vllm-0.26.0.dist-info/), wheels.tar.xz.partN
# (wheels/*.whl, the import closure below) and SHA256SUMS. On the GPU machine (each part carried in
# one call while the machine stays warm; docs/vllm-omni.md "vLLM's CUDA backend on the H200"):
#   cat vllm.tar.xz.part* | xz -dc | tar -x -C /tmp/site
#   cat wheels.tar.xz.part* | xz -dc | tar -x -C /tmp/vb
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/vb/wheels/*.whl
#   PYTHONPATH=/tmp/site DIFFUSION_KV_BACKEND=vllm-flash-attn diffusion-kv conformance --platform cuda
#
# How the package list was found: vLLM's tree on PYTHONPATH, `import` of every module the seam uses
# (and the CUDA platform's import path with the extension modules stubbed), adding the missing
# distribution each time; versions are those pip resolves under vLLM 0.26.0's specifiers for cp312 manylinux x86_64 among uploads
# before 2026-07-26 (vLLM 0.26.0 was uploaded 2026-07-25), pinned here with their wheel hashes.
# Not included (declared but never imported on this path): typer, shellingham, annotated-doc,
# markdown-it-py, mdurl, hf-xet, and vLLM's serving/multimodal/quantisation extras.
set -euo pipefail

WHEEL="${1:-${VLLM_WHEEL:-}}"
OUT="${2:-${VLLM_BUNDLE_OUT:-vllm-bundle}}"
PART_BYTES="${PART_BYTES:-54525952}"
XZ_THREADS="${XZ_THREADS:-2}"
PY="${PYTHON:-python3}"
read -r -a PIP <<<"${PIP:-$PY -m pip}"
WHEEL_SHA256=adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de
MTIME='2026-07-25 00:00:00Z'
log() { echo "[vllm-bundle] $*"; }

[ -n "$WHEEL" ] && [ -f "$WHEEL" ] || { echo "usage: $0 VLLM_WHEEL [OUT_DIR] (vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl)" >&2; exit 2; }
got=$(sha256sum "$WHEEL" | cut -d' ' -f1)
if [ "$got" != "$WHEEL_SHA256" ]; then
  echo "[vllm-bundle] $WHEEL has sha256 $got, not vLLM 0.26.0's $WHEEL_SHA256" >&2
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

# The import closure: name==version --hash (cp312 manylinux x86_64 / py3 wheels).
cat >"$work/wheels.txt" <<'EOF'
aiohappyeyeballs==2.7.1 --hash=sha256:9243213661e29250eb41368e5daa826fc017156c3b8a11440826b2e3ed376472
aiohttp==3.14.3 --hash=sha256:543906c127fb1d929b95076db19b83fa2d46751006ff1e23b093aa5ac4d8db42
aiosignal==1.4.0 --hash=sha256:053243f8b92b990551949e63930a839ff0cf0b0ebbe0597b0f3fb19e1a0fe82e
annotated-types==0.8.0 --hash=sha256:f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0
anyio==4.15.1 --hash=sha256:6152fdbbf9a77fdec97731721bebf7c4c44f7c29b424b0065826173efc7ed101
apache-tvm-ffi==0.1.10 --hash=sha256:73d478395a8625dd92fde7b7fd92b4719f18f480b78336e422cb66cc7985213d
attrs==26.1.0 --hash=sha256:c647aa4a12dfbad9333ca4e71fe62ddc36f4e63b2d260a37a8b83d2f043ac309
cachetools==7.2.0 --hash=sha256:3045213f186b89fdd95d94441354c4bd87c570b7a38d8c3fd1d9dd37f6dc90d8
cbor2==6.1.3 --hash=sha256:2226d32e102e375737656ad5d141ad8c6ae3e705e04e263f24756f0eb379c6c1
certifi==2026.7.22 --hash=sha256:62f22742b58a1a33014a2b6b706588a8d7e2a88ae7bd1a6ebe8c992928483775
charset-normalizer==3.4.9 --hash=sha256:5e226f6218febc71f6c1fc2fafb91c226f75bdc1d8fb12d66823716e891608fd
click==8.5.0 --hash=sha256:255bc9599cf7748b4b1a446ccc735421bd08a2ae529a8b88597d3de5664ee360
cloudpickle==3.1.2 --hash=sha256:9acb47f6afd73f60dc1df93bb801b472f05ff42fa6c84167d25cb206be1fbf4a
einops==0.8.2 --hash=sha256:54058201ac7087911181bfec4af6091bb59380360f069276601256a76af08193
frozenlist==1.8.0 --hash=sha256:494a5952b1c597ba44e0e78113a7266e656b9794eec897b19ead706bd7074383
h11==0.16.0 --hash=sha256:63cf8bbe7522de3bf65932fda1d9c2772064ffb3dae62d55932da54b31cb6c86
httpcore==1.0.9 --hash=sha256:2d400746a40668fc9dec9810239072b40b4484b640a8c38fd654a024c7a1bf55
httpcore2==2.13.1 --hash=sha256:e1e05d4f25f7d7d496bfb96748f6f4b67657b03da069b3a68c36069f3db73d0a
httpx==0.28.1 --hash=sha256:d909fcccc110f8c7faf814ca82a9a4d816bc5a6dbfea25d6591d6985b8ba59ad
httpx2==2.13.1 --hash=sha256:6dff50fabc270ee5fd25d845d0b078ed20564579744d6d962850975996d2f9a4
huggingface-hub==1.33.0 --hash=sha256:04e434b06e100eddbce9a6e817d72693a7884b10a79bd67ab48080d5c07eb899
idna==3.20 --hash=sha256:ab7ae7122974553370f0bdb919e1a960b2cd1bc1ef0276416d896db81c14582c
jiter==0.16.0 --hash=sha256:46add52f4ad47a08bfb1219f3e673da972191489a33016edefdb5ea55bfa8c48
llguidance==1.7.6 --hash=sha256:ceec951d29a74309984e3be0fe7f5f56c1362434cd937abd517b259a60908b1e
msgspec==0.21.1 --hash=sha256:21995e74b5c598c2e004110ad66ec7f1b8c20bf2bcf3b2de8fd9a3094422d3ff
multidict==6.7.1 --hash=sha256:bfde23ef6ed9db7eaee6c37dcec08524cb43903c60b285b172b6c094711b3961
openai==3.22.1 --hash=sha256:43ff3de5457a8beb4afa177d4e0ba6841cfadd5219ebc62297fde6c8a9d401a6
openai-harmony==0.0.8 --hash=sha256:c007d277218a50db8839e599ed78e0fffe5130f614c3f6d93ae257f282071a29
pillow==12.3.0 --hash=sha256:78cb2c6865a35ab8ff8b75fd122f6033b92a62c82801110e48ddd6c936a45d91
prometheus-client==0.26.0 --hash=sha256:fa93d06737aa02bacd05794768508bb97d2fbee28cb3bca04eaae92f0ca953d6
propcache==0.5.2 --hash=sha256:6f328175a2cde1f0ff2c4ed8ce968b9dcfb55f3a7153f39e2957ed994da13476
psutil==7.2.2 --hash=sha256:076a2d2f923fd4821644f5ba89f059523da90dc9014e85f8e45a5774ca5bc6f9
py-cpuinfo==9.0.0 --hash=sha256:859625bc251f64e21f077d099d4162689c762b5d6a4c3c97553d56241c9674d5
pybase64==1.4.3 --hash=sha256:bb632edfd132b3eaf90c39c89aa314beec4e946e210099b57d40311f704e11d4
pydantic==2.13.4 --hash=sha256:45a282cde31d808236fd7ea9d919b128653c8b38b393d1c4ab335c62924d9aba
pydantic-core==2.46.4 --hash=sha256:926c9541b14b12b1681dca8a0b75feb510b06c6341b70a8e500c2fdcff837cce
pygments==2.21.0 --hash=sha256:2363c69b61c4a97c838da3b130dcd6468f4848992b21a82f2a63ec34377137d9
pyyaml==6.0.3 --hash=sha256:ba1cc08a7ccde2d2ec775841541641e4548226580ab850948cbfda66a1befcdc
pyzmq==27.1.0 --hash=sha256:43ad9a73e3da1fab5b0e7e13402f0b2fb934ae1c876c51d0afff0e7c052eca31
regex==2026.7.19 --hash=sha256:9dce8ec9695f531a1b8a6f314fd4b393adcccf2ea861db480cdf97a301d01a68
requests==2.34.2 --hash=sha256:2a0d60c172f83ac6ab31e4554906c0f3b3588d37b5cb939b1c061f4907e278e0
rich==15.0.0 --hash=sha256:33bd4ef74232fb73fe9279a257718407f169c09b78a87ad3d296f548e27de0bb
safetensors==0.8.0 --hash=sha256:fd6f3f93c9a0a7cc2788ee63fb763353d4bd2e89b0751bc78fcf7dda00bea774
sniffio==1.3.1 --hash=sha256:2f6da418d1f1e0fddd844478f41680e794e6051915791a034ff65e5f100525a2
tokenizers==0.23.2 --hash=sha256:41c2f84d172449b4dadb9cdc508e3e364076613c35b16e76ecfe47a60d1e3305
tqdm==4.70.1 --hash=sha256:c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73
transformers==5.18.0 --hash=sha256:d79e5a515a572ee3deb33eb0d578be47d91e70c75d54cf21bf6eede6edef14a9
truststore==0.10.4 --hash=sha256:adaeaecf1cbb5f4de3b1959b42d41f6fab57b2b1666adb59e89cb0b53361d981
typing-extensions==4.16.0 --hash=sha256:481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8
typing-inspection==0.4.4 --hash=sha256:65b8397ba37ccbce054456aaccddfc91e6e3083c92824df348d96ca832f3f147
urllib3==2.8.0 --hash=sha256:0cf3cae568d36aa9576b28dfb35f11328f1cb974ca7647d9475ebb86c75ac6e3
uvloop==0.22.1 --hash=sha256:7b5b1ac819a3f946d3b2ee07f09149578ae76066d70b44df3fa990add49a82e4
xgrammar==0.2.3 --hash=sha256:fdf081fab29694302d41d61dcf52fad7d253879a718bc6afc68db0a0dabd7f19
yarl==1.24.5 --hash=sha256:f08c7513ecef5aad65687bfdf6bc601ae9fccd04a42904501f8f7141abad9eb9
EOF

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
