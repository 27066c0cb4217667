"""One small call of every rung, for compute-sanitizer (memcheck / racecheck) on the GPU machine."""

import torch

import flashtile
from flashtile import ladder

for rung in ladder.RUNGS:
    for dtype in (torch.bfloat16, torch.float32):
        if dtype not in rung.dtypes:
            continue
        for (sq, sk, d, causal) in ((100, 77, 64, True), (65, 130, 128, False), (1, 33, 40, True)):
            q = torch.randn(2, sq, 4, d, device="cuda", dtype=dtype)
            k = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype)
            flashtile.attention(q, k, k, causal=causal, return_lse=True, rung=rung.name)
torch.cuda.synchronize()
print("sanitize: every rung ran")
