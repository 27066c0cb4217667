"""Sweep rung-4 tile shapes at the standard-matrix sizes; prints TFLOP/s beside torch's flash and cuDNN.

Usage (on the GPU machine): python scripts/tune_fwd.py [d ...]   — not part of the library: a lab bench
for choosing rows of specs.FWD_TILES_*; the reasons in that table come from runs of this script.
"""

import sys
from functools import partial

import torch

from flashtile import jit, launch, ladder, specs
from flashtile.bench import measure, peers
from flashtile.forward import FwdProblem
from flashtile.specs import KernelSpec

# head_dim -> [(block_m, block_n, warps, stages, min_blocks[, wide[, tma]])]; stages 1: K and V take turns
CANDIDATES = {
    64: [(128, 64, 4, 2, 1), (128, 64, 4, 2, 1, 0, 1), (128, 64, 4, 1, 1)],
    128: [(128, 32, 4, 2, 1), (128, 64, 4, 2, 1), (128, 64, 4, 2, 1, 0, 1)],
    256: [(128, 64, 8, 2, 1), (64, 64, 4, 1, 2), (64, 64, 4, 1, 2, 1), (128, 64, 8, 1, 1)],
}
# Taking turns (one K and one V buffer) halves the ring's shared memory: at d256 a 64 x 64 tile then needs 96 KB
# and two blocks share an SM (FlashAttention-2's d256 configuration on H100).

SEQLENS = (1024, 4096, 16384)


def spec_of(d, bm, bn, warps, stages, min_blocks, wide=0, tma=0):
    tile = specs.Tile(bm, bn, warps, stages, min_blocks, "candidate", bool(wide), bool(tma))
    return KernelSpec(specs.PIPELINED_SOURCE, ("attn_fwd",), "bf16", "sm_90a", specs.fwd_defines(d, d, tile),
                      specs.fwd_smem(d, d, tile), kv_maps=specs.fwd_kv_box(tile))


def main(dims):
    for d in dims:
        heads = 2048 // d
        for seqlen in SEQLENS:
            batch = 16384 // seqlen
            q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in (False, True):
                flops = measure.attention_flops(batch, heads, seqlen, seqlen, d, causal=causal)
                row = [f"d{d} n{seqlen} c{int(causal)}"]
                for name in ("sdpa-flash", "sdpa-cudnn"):
                    run = peers.sdpa_runner(name, q, k, v, causal)
                    row.append(f"{name}={flops / measure.time_cuda(run) / 1e9:.0f}" if run else f"{name}=-")
                expected = peers.sdpa_runner("sdpa-flash", q, k, v, causal)().transpose(1, 2).float()
                for cand in CANDIDATES[d]:
                    spec = spec_of(d, *cand)
                    if spec.smem_bytes > specs.smem_limit("sm_90a"):
                        continue
                    res = jit.compile_spec(spec).resources["attn_fwd"]
                    module = launch.load(spec, 0)
                    problem = FwdProblem(q, k, v, d**-0.5, (-1, 0) if causal else (-1, -1))
                    run = partial(ladder.BY_NAME["pipelined"].plan(problem, module).run, q, k, v)
                    # A fast tile is no use if it is wrong: its largest difference from sdpa-flash rides along.
                    error = (run()[0].float() - expected).abs().max().item()
                    ms = measure.time_cuda(run)
                    row.append(f"{cand}[{res.registers}r{'/spill' if res.spill_stores else ''}]={flops / ms / 1e9:.0f}"
                               f" err={error:.0e}")
                print("  ".join(row), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or sorted(CANDIDATES))
