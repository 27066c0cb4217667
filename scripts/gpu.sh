#!/usr/bin/env bash
# One call on the GPU machine: tests, sanitizer, check, benchmark. Logs and results go to $OUT; a short
# summary is printed last. Usage: scripts/gpu.sh [full|quick]   (quick: GPU tests only, no sanitizer)
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-/tmp/flashtile-out}
mkdir -p "$OUT/docs"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FLASHTILE_CACHE_DIR=/tmp/flashtile-cache
summary=()
step() {  # step NAME LOGFILE COMMAND...
    local name=$1 log=$2; shift 2
    local t0=$SECONDS
    "$@" >"$OUT/$log" 2>&1
    local rc=$?
    summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$log" | cut -c1-90)")")
    return $rc
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -m flashtile info 2>&1 | tail -n 12
step compile compile.log python3 -m flashtile compile
if [ "$MODE" = full ]; then
    step tests pytest.log python3 -m pytest -q -p no:cacheprovider tests
else
    step tests pytest.log python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_forward_features_gpu.py
fi
if [ "$MODE" = full ]; then
    step memcheck sanitizer.log compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python3 scripts/sanitize.py
    step racecheck racecheck.log compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize.py 2
fi
step check check.log python3 -m flashtile check
step bench bench.log python3 -m flashtile bench ladder --shape 4,16,4096,64 --dtype bf16 --out "$OUT/docs"
step matrix matrix.log python3 -m flashtile bench matrix --out "$OUT/docs"
if [ "$MODE" = tune ]; then step tune tune.log python3 scripts/tune_fwd.py; cat "$OUT/tune.log"; fi
step overhead overhead.log python3 scripts/overhead.py
grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest.log" | cut -c1-300 | head -n 30
tail -n 3 "$OUT/pytest.log"
cat "$OUT/overhead.log"
tail -n 25 "$OUT/bench.log"
tail -n 42 "$OUT/matrix.log"
# At most 8 files come back from the GPU machine: fold the logs into one.
for log in "$OUT"/*.log; do echo "===== $(basename "$log")"; cat "$log"; done >"$OUT/logs.txt"
rm -f "$OUT"/*.log
echo "==== summary ($MODE) ===="
printf '%s\n' "${summary[@]}"
