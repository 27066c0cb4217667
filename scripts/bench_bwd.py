"""Backward timing at a few standard-matrix shapes: flashtile beside sdpa-flash and sdpa-cudnn (for tuning;
`flashtile bench` has the whole matrix)."""

import sys

import torch

import flashtile
from flashtile.bench import measure, peers

SHAPES = [(128, 16384, False), (128, 16384, True), (64, 4096, False), (256, 4096, False), (128, 1024, True)]
TOKENS, WIDTH = 16384, 2048
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20

for d, n, causal in SHAPES:
    b, h = TOKENS // n, WIDTH // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = measure.attention_flops(b, h, n, n, d, causal=causal, backward=True)
    cells = []
    for name in ("flashtile", "flashtile-det", "sdpa-flash", "sdpa-cudnn"):
        if name.startswith("flashtile"):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            det = name.endswith("det")
            fn = peers.backward_runner(lambda: flashtile.attention(*leaves, causal=causal, deterministic=det), leaves)
        else:
            fn = peers.sdpa_backward_runner(name, q, k, v, causal)
        cells.append(f"{name} {flops / measure.time_cuda(fn, reps=REPS) / 1e9:6.1f}" if fn else f"{name} -")
        del fn
    print(f"d{d} n{n} causal{int(causal)} bwd TFLOP/s: " + " | ".join(cells), flush=True)
