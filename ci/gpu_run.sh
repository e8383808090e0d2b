#!/usr/bin/env bash
# One GPU-machine call for the issue-41 figures: set-up (ci/gpu_setup.sh), the GPU suite with
# its JUnit XML, the bench sections that carry the figures (fp8_e4m3 pages beside 16-bit ones),
# and the demo; everything under ${OUT:-gpu-out}. Each step has its own time limit so a slow one
# leaves the others their share (a whole call is capped at 10 minutes on the lent machines).
#   bash ci/gpu_run.sh            # then read $OUT/gpu-tests.log, bench-*.json, demo.txt
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
bash ci/gpu_setup.sh > "$OUT/setup.log" 2>&1; el "setup rc=$?"; tail -1 "$OUT/setup.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# pytest-xdist spreads the suite's Triton compilation over the host's cores; -v keeps a per-test
# record even when the time limit stops the run before the JUnit report is written
timeout "${DKV_TESTS_S:-200}" python3 -m pytest -v -n "${DKV_TEST_WORKERS:-6}" -p no:cacheprovider tests/gpu \
    --junitxml="$OUT/gpu-junit.xml" > "$OUT/gpu-tests.log" 2>&1
el "tests rc=$?"; grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/gpu-tests.log" | tail -12
timeout "${DKV_BENCH_S:-100}" python3 -m diffusion_kv.cli bench --sections host,e2e,stream \
    --kv-cache-dtype fp8_e4m3 --json --output "$OUT/bench-e2e.json" --no-progress > /dev/null 2> "$OUT/bench-e2e.err"
el "bench host,e2e,stream rc=$?"
timeout "${DKV_BENCH_S:-100}" python3 -m diffusion_kv.cli bench --sections attention --block-sizes 128 \
    --kv-cache-dtype fp8_e4m3 --json --output "$OUT/bench-attn.json" --no-progress > /dev/null 2> "$OUT/bench-attn.err"
el "bench attention rc=$?"
timeout 30 python3 -m diffusion_kv.cli demo --no-progress > "$OUT/demo.txt" 2>&1; el "demo rc=$?"; cat "$OUT/demo.txt"
OUT="$OUT" python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for name in ("bench-e2e.json", "bench-attn.json"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        print(name, "missing")
        continue
    r = json.load(open(path))
    print(name, r["environment"].get("gpu"), "errors:", r.get("errors"))
    e = r.get("e2e")
    if e:
        q = {k: round(v.get("ratio_vs_16bit_paged", 0), 2) for k, v in e["kv_cache_dtypes"].items()}
        print(f"e2e graph {e['speedup']:.2f}x eager {e['speedup_eager']:.2f}x ideal {e['ideal_speedup']:.1f}; vs 16-bit {q}")
    for h in r.get("host", []):
        print(f"prepare {h['rows']} rows: {h['prepare_us']:.0f} us")
    st = r.get("stream")
    if st:
        print("stream", st.get("speedup"), "eager", (st.get("eager") or {}).get("speedup"))
    for c in r.get("attention", []):
        if "error" in c:
            print(c["case"], c["error"][:100])
            continue
        print(c["case"], {k: round(v["ratio_vs_best_dense"], 2) for k, v in c["paged"].items() if "ratio_vs_best_dense" in v})
PY
