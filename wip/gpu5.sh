#!/usr/bin/env bash
# The d64 192 x 64 tile at 4 stages (lab/bn64) and 6 (lab/bn64s6) against main (lab/orig) at short causal rows;
# then the working tree (this branch) through the standard matrix, its rung-5 tests and a racecheck of its short
# causal rows. Carry lab/seed lab/orig lab/bn64 lab/bn64s6; the tail of the ab.py output needs 10 lines.
export FLASHTILE_HOST=off FLASHTILE_CACHE_DIR=/tmp/ftc PYTHONUNBUFFERED=1
mkdir -p /tmp/ftc && cp -a lab/seed/. /tmp/ftc/
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
PYTHONPATH=src timeout 200 python3 scripts/ab.py main=lab/orig/src bn64=lab/bn64/src bn64s6=lab/bn64s6/src --rounds 2 --rows 64,1024,1 64,512,1 64,1000,1 64,2048,1 64,4096,1 64,1024,0 2>&1 | tail -10
echo "ab $((SECONDS-t0)) s"
PYTHONPATH=src timeout 300 python3 -m flashtile bench matrix --out "$OUT/docs" > "$OUT/matrix.log" 2>&1
tail -n 62 "$OUT/matrix.log" | cut -c1-150
echo "matrix $((SECONDS-t0)) s"
PYTHONPATH=src timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_forward_features_gpu.py -k "hopper" 2>&1 | tail -3
echo "tests $((SECONDS-t0)) s"
PYTHONPATH=src timeout 120 compute-sanitizer --tool racecheck --racecheck-report hazard python3 -c "
import torch, flashtile
for d, sq, sk in ((64, 1000, 1000), (64, 1100, 700), (64, 333, 1024), (64, 2000, 1024)):
    q = torch.randn(2, sq, 4, d, device='cuda', dtype=torch.bfloat16); k = torch.randn(2, sk, 2, d, device='cuda', dtype=torch.bfloat16)
    flashtile.attention(q, k, k, causal=True, return_lse=True, rung='hopper')
torch.cuda.synchronize(); print('ran')" 2>&1 | tail -3
echo "racecheck $((SECONDS-t0)) s"
echo "total $((SECONDS-t0)) s"
