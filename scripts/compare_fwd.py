"""The forward rungs beside cuDNN and FlashAttention-2 at the standard matrix's token count, in one process: a
quick look while a kernel is being tuned (the committed comparison is `flashtile bench matrix`).

    PYTHONPATH=src python scripts/compare_fwd.py [head_dim,seqlen,causal ...]
    PYTHONPATH=src python scripts/compare_fwd.py --tiles [head_dim,seqlen,causal ...]

16384 tokens and heads x head_dim = 2048 as in the matrix, bf16; TFLOP/s, each the better median of two rounds.
--tiles times rung 5's tile table row for each head dim against its variants (TILE_VARIANTS) instead.
"""

import dataclasses
import sys

import torch

import flashtile
from flashtile import api, registry, specs
from flashtile.bench import measure, peers

RUNGS = ("hopper", "pipelined")
PEERS = ("sdpa-cudnn", "sdpa-flash")
DEFAULT = ["64,16384,0", "128,1024,0", "128,16384,0", "128,16384,1", "256,4096,0", "256,16384,1"]


def main(cases) -> None:
    print(f"{'d':>4} {'n':>6} {'causal':>6} " + " ".join(f"{n:>11}" for n in RUNGS + PEERS) + "   hopper/cudnn")
    for case in cases:
        d, n, causal = (int(x) for x in case.split(","))
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = measure.attention_flops(b, h, n, n, d, causal=bool(causal))
        runners = {r: (lambda r=r: flashtile.attention(q, k, v, causal=bool(causal), rung=r)) for r in RUNGS}
        runners.update({p: peers.sdpa_runner(p, q, k, v, bool(causal)) for p in PEERS})
        best = {name: min(measure.time_cuda(fn, reps=20) for _ in range(2)) for name, fn in runners.items()}
        tflops = {name: flops / ms / 1e9 for name, ms in best.items()}
        print(f"{d:>4} {n:>6} {causal:>6} " + " ".join(f"{tflops[name]:>11.0f}" for name in runners)
              + f"   {tflops['hopper'] / tflops['sdpa-cudnn']:.2f}", flush=True)


# Rung 5 tile variants: changes to a HOPPER_FWD_TILES row, by name.
TILE_VARIANTS = {
    "table": {},
    "no-pingpong": {"pingpong": False},
    "2-stages": {"stages": 2},
    "4-stages": {"stages": 4},
    "128-rows": {"block_m": 128},
}


def tiles(cases) -> None:
    print(f"{'d':>4} {'n':>6} {'causal':>6} " + " ".join(f"{n:>12}" for n in TILE_VARIANTS) + "  (TFLOP/s)")
    for case in cases:
        d, n, causal = (int(x) for x in case.split(","))
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = measure.attention_flops(b, h, n, n, d, causal=bool(causal))
        row = specs.HOPPER_FWD_TILES[d]
        results = []
        for changes in TILE_VARIANTS.values():
            tile = dataclasses.replace(row, **changes)
            if specs.hopper_fwd_smem(d, d, tile) > specs.smem_limit("sm_90a"):
                results.append(float("nan"))
                continue
            specs.HOPPER_FWD_TILES[d] = tile
            registry.choose.cache_clear()
            api.clear_calls()
            ms = min(measure.time_cuda(lambda: flashtile.attention(q, k, v, causal=bool(causal), rung="hopper"),
                                       reps=20) for _ in range(2))
            results.append(flops / ms / 1e9)
        specs.HOPPER_FWD_TILES[d] = row
        registry.choose.cache_clear()
        api.clear_calls()
        print(f"{d:>4} {n:>6} {causal:>6} " + " ".join(f"{r:>12.0f}" for r in results), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--tiles"]:
        tiles(args[1:] or DEFAULT)
    else:
        main(args or DEFAULT)
