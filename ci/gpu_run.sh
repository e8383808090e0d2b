#!/usr/bin/env bash
# One GPU-machine call for the issue-41 figures: set-up (ci/gpu_setup.sh), the GPU suite with
# its JUnit XML, the bench sections that carry the figures (fp8_e4m3 pages beside 16-bit ones),
# the demo, then the host profiles (prepare, the eager layer, the end-to-end kernels) packed in
# $OUT/profiles.tgz; everything under ${OUT:-gpu-out}. Each step has its own time limit, and no
# step starts past DKV_CALL_S seconds (default 560: a call is capped at 10 minutes on the lent
# machines, with the start on top), so a short device budget still gets the suite first.
#   bash ci/gpu_run.sh            # then read $OUT/gpu-tests.log, bench-*.json, demo.txt
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
# at most 8 files come back from a lent machine's $OUT: the set-up log, the bench stderr and the
# host profiles go into one $OUT/profiles.tgz at the end
mkdir -p "$OUT/profiles"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
call_s="${DKV_CALL_S:-560}"
# within LIMIT CMD...: CMD under its own time limit, cut to what is left of the call; skipped
# (status 124) when less than 15 s is left
within() {
  local left=$(( call_s - ($(date +%s) - t0) ))
  [ "$left" -gt "$1" ] && left=$1
  shift
  if [ "$left" -lt 15 ]; then echo "[skipped, the call's time is spent] $*" >&2; return 124; fi
  timeout "$left" "$@"
}
bash ci/gpu_setup.sh > "$OUT/profiles/setup.log" 2>&1; el "setup rc=$?"; tail -1 "$OUT/profiles/setup.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# pytest-xdist (when installed) spreads the suite's Triton compilation over the host's cores; -v
# keeps a per-test record even when the time limit stops the run before the JUnit report is written
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${DKV_TEST_WORKERS:-6}")
within ${DKV_TESTS_S:-200} python3 -m pytest -v ${workers[@]+"${workers[@]}"} -p no:cacheprovider tests/gpu \
    --junitxml="$OUT/gpu-junit.xml" > "$OUT/gpu-tests.log" 2>&1
el "tests rc=$?"; grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/gpu-tests.log" | tail -12
within ${DKV_BENCH_S:-100} python3 -m diffusion_kv.cli bench --sections host,e2e,stream \
    --kv-cache-dtype fp8_e4m3 --json --output "$OUT/bench-e2e.json" --no-progress > /dev/null 2> "$OUT/profiles/bench-e2e.err"
el "bench host,e2e,stream rc=$?"
within ${DKV_BENCH_S:-100} python3 -m diffusion_kv.cli bench --sections attention --block-sizes 128 \
    --kv-cache-dtype fp8_e4m3 --json --output "$OUT/bench-attn.json" --no-progress > /dev/null 2> "$OUT/profiles/bench-attn.err"
el "bench attention rc=$?"
within 30 python3 -m diffusion_kv.cli demo --no-progress > "$OUT/demo.txt" 2>&1; el "demo rc=$?"; cat "$OUT/demo.txt"
# host profiles, packed in one file with the logs above (what the prepare, eager and replay figures are made of)
for rows in 2 64; do
  within 20 env PYTHONPATH=. python3 benchmarks/profile_prepare.py "$rows" 4096 > "$OUT/profiles/prepare-$rows.txt" 2>&1
done
within 60 env PYTHONPATH=. python3 benchmarks/profile_eager_layer.py --json "$OUT/profiles/eager-layer.json" \
    > "$OUT/profiles/eager-layer.txt" 2>&1
within 60 env PYTHONPATH=. python3 benchmarks/profile_e2e.py > "$OUT/profiles/e2e.txt" 2>&1
el "profiles"; head -1 "$OUT"/profiles/prepare-*.txt 2>/dev/null
tar -C "$OUT" -czf "$OUT/profiles.tgz" profiles && rm -rf "$OUT/profiles"
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
