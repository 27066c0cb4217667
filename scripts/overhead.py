"""Where the host time of one small flashtile.attention call goes (cProfile over many warm calls)."""

import cProfile
import pstats

import torch

import flashtile
from flashtile.bench import measure

q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
print(f"kernel time of this call: {measure.time_cuda(lambda: flashtile.attention(q, k, v)) * 1e3:.1f} us")
print(f"host time per call: {measure.host_overhead_us(lambda: flashtile.attention(q, k, v)):.1f} us")
print(f"host time per torch.empty_like: {measure.host_overhead_us(lambda: torch.empty_like(q)):.1f} us")
profile = cProfile.Profile()
profile.enable()
for _ in range(3000):
    flashtile.attention(q, k, v)
profile.disable()
torch.cuda.synchronize()
pstats.Stats(profile).sort_stats("tottime").print_stats(18)
