#!/usr/bin/env bash
# The GPU machine's work, in calls that fit its 10-minute limit. Logs and results go to $OUT; a short
# summary is printed last. Usage: scripts/gpu.sh MODE, where MODE is
#   tests     every test; `tests K/N` the K-th of N shares of the test files, round robin (a fresh machine's
#             host build and the whole suite passed the 10-minute limit: run `tests 1/2`, then `tests 2/2`)
#   sanitize  the sanitizers (memcheck, racecheck, synccheck) and `flashtile check`
#   bench     `flashtile bench ladder` and the standard matrix (training and inference forward, backward)
#   serving   the decode rows (contiguous and paged caches) and the host overhead beside sdpa-flash
#   quick     the GPU kernel tests only;  tune  bench plus the tile sweeps of scripts/tune_*.py
set -uo pipefail
MODE=${1:-tests}
SHARD=${2:-}
OUT=${OUT:-/tmp/flashtile-out}
mkdir -p "$OUT/docs"
# FLASHTILE_HOST=on: every step runs the C++ host path (flashtile/host.py), built once by the first step.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FLASHTILE_CACHE_DIR=/tmp/flashtile-cache FLASHTILE_HOST=on
# FLASHTILE_SEED_CACHE=DIR: a kernel cache compiled on a CPU machine with the GPU's NVRTC major.minor
# (`FLASHTILE_CACHE_DIR=DIR flashtile compile --arch sm_90a`) and carried here; entries whose key differs are
# compiled again as usual.
# A seed's host/ folder (the C++ host path built on a GPU machine: FLASHTILE_HOST_OUT below) spares the next
# machine the build (about 220 s) while host.cpp, torch and the flags are unchanged; the folder's name digests them.
if [ -n "${FLASHTILE_SEED_CACHE:-}" ]; then
    mkdir -p "$FLASHTILE_CACHE_DIR" && cp -a "$FLASHTILE_SEED_CACHE"/. "$FLASHTILE_CACHE_DIR"/
    # ninja rebuilds an output older than its source, and this checkout's host.cpp is as new as the call; the
    # folder's digest already names host.cpp's content, so the source is dated back to before the seed's build.
    touch -d @0 src/flashtile/csrc/host.cpp
fi
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
step host host.log python3 -c "from flashtile import host; print('host path built:', host.extension())"
# FLASHTILE_HOST_OUT=1: the built host path comes back as $OUT/host.tar (unpack it into a seed cache).
if [ -n "${FLASHTILE_HOST_OUT:-}" ]; then
    tar -C "$FLASHTILE_CACHE_DIR" -cf "$OUT/host.tar" --exclude=flashtile.lock host
fi
if [ "$MODE" != sanitize ]; then  # the benchmarks too: a spec compiled inside a timed row is minutes lost
    step compile compile.log python3 -m flashtile compile
fi
# tests and sanitize are separate calls: together they passed the 10-minute limit on a fresh machine.
if [ "$MODE" = tests ]; then
    # tests/test_compile_all.py (every spec for four archs, no GPU needed) is CI's job; here the kernels run.
    # pytest-xdist, where installed, spreads the tests over processes sharing the GPU (a few minutes saved).
    parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
    files=(tests)
    if [ -n "$SHARD" ]; then
        k=${SHARD%/*} n=${SHARD#*/} files=()
        mapfile -t all < <(ls tests/test_*.py | grep -v test_compile_all.py)
        for i in "${!all[@]}"; do
            if [ $((i % n)) -eq $((k - 1)) ]; then files+=("${all[$i]}"); fi
        done
    fi
    step tests pytest.log python3 -m pytest -q -p no:cacheprovider $parallel --durations=20 "${files[@]}" \
        --ignore=tests/test_compile_all.py
elif [ "$MODE" = sanitize ]; then
    step memcheck sanitizer.log compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python3 scripts/sanitize.py
    step racecheck racecheck.log compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize.py 2
    step synccheck synccheck.log compute-sanitizer --tool synccheck --error-exitcode 1 python3 scripts/sanitize.py 4
    step check check.log python3 -m flashtile check
elif [ "$MODE" = quick ]; then
    step tests pytest.log python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_forward_features_gpu.py tests/test_backward_gpu.py
fi
if [ "$MODE" = bench ] || [ "$MODE" = tune ]; then
    step bench bench.log python3 -m flashtile bench ladder --shape 4,16,4096,64 --dtype bf16 --out "$OUT/docs"
    step matrix matrix.log python3 -m flashtile bench matrix --out "$OUT/docs"
fi
if [ "$MODE" = serving ] || [ "$MODE" = tune ]; then
    step decode decode.log python3 -m flashtile bench decode --out "$OUT/docs"
    step overhead overhead.log python3 scripts/overhead.py --out "$OUT/docs"
fi
if [ "$MODE" = tune ]; then
    step tune tune.log python3 scripts/tune_fwd.py
    step tune_bwd tune_bwd.log python3 scripts/tune_bwd.py
fi
touch "$OUT/pytest.log" "$OUT/overhead.log" "$OUT/bench.log" "$OUT/matrix.log" "$OUT/decode.log"
grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest.log" | cut -c1-300 | head -n 30
tail -n 3 "$OUT/pytest.log"
cat "$OUT/overhead.log"
tail -n 25 "$OUT/bench.log"
tail -n 80 "$OUT/matrix.log" | cut -c1-160
tail -n 12 "$OUT/decode.log" | cut -c1-200
# At most 8 files come back from the GPU machine: fold the logs into one, named by the mode (so that one call
# running several modes keeps each one's logs).
for log in "$OUT"/*.log; do echo "===== $(basename "$log")"; cat "$log"; done >"$OUT/logs-$MODE.txt"
rm -f "$OUT"/*.log
echo "==== summary ($MODE) ===="
printf '%s\n' "${summary[@]}"
