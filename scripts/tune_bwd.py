"""Sweep backward tile shapes at standard-matrix sizes; prints TFLOP/s beside torch's flash backward, and the
deterministic mode's time over the default's for each tile.

Usage (on the GPU machine): python scripts/tune_bwd.py [d ...] — a lab bench for choosing rows of
specs.BWD_TILES_* (the 16-keys-per-warp kernel, mma/bwd.cu), specs.BWD_GRID_TILES (the warp-grid kernel,
mma/bwd_grid.cu) and specs.BWD_WGMMA_TILES (the Hopper kernel, wgmma/bwd.cu); the reasons in those tables come
from runs of this script. Every candidate's largest gradient difference from sdpa-flash rides along.
"""

import sys

import torch
import torch.nn.functional as F

import flashtile
from flashtile import api, jit, registry, specs
from flashtile.family import Variant
from flashtile.bench import measure, peers

CANDIDATES = {  # head_dim -> [(block_m, block_n, stages)] for bwd.cu
    64: [(64, 128, 2), (128, 128, 2)],
    128: [(32, 128, 2), (64, 128, 2)],
    192: [(64, 64, 2)],
    256: [(64, 64, 2)],
}
GRID_CANDIDATES = {  # head_dim -> [(block_m, block_n, warps, stages, keys_sdp, keys_dkv, queries_dq)] for bwd_grid.cu
    64: [(64, 128, 8, 2, 4, 4, 2), (64, 64, 4, 2, 2, 2, 2)],
    128: [(64, 128, 8, 2, 4, 4, 2), (64, 128, 8, 2, 4, 4, 4), (64, 128, 8, 1, 4, 4, 2)],
    192: [(64, 64, 8, 2, 4, 2, 4)],
    256: [(64, 64, 8, 2, 4, 2, 2)],
}
# head_dim -> wgmma/bwd.cu's tiles: the table's own and its measured alternatives
WGMMA_CANDIDATES = {d: [tile, *specs.BWD_WGMMA_ALTERNATIVES.get(d, ())] for d, tile in specs.BWD_WGMMA_TILES.items()}
ORIGINAL = specs.bwd_grid_tile, specs.bwd_tile, dict(specs.BWD_WGMMA_TILES)


def _use(d, tile=None, grid_tile=None, wgmma_tile=None):
    """Make the registry pick exactly this tile of one kernel for head dim d (no tiles: the library's own choice).
    The Hopper kernel's tile goes into its table, so that its deterministic build is derived as the library's is."""
    specs.BWD_WGMMA_TILES.clear()
    specs.BWD_WGMMA_TILES.update(ORIGINAL[2])
    if not (tile or grid_tile or wgmma_tile):
        specs.bwd_grid_tile, specs.bwd_tile = ORIGINAL[:2]
    else:
        specs.bwd_grid_tile = lambda head_dim, arch, score_mods=False: grid_tile
        specs.bwd_tile = (lambda head_dim, arch, score_mods=False: tile) if tile else ORIGINAL[1]
        specs.BWD_WGMMA_TILES[d] = wgmma_tile
    registry.choose.cache_clear()
    api.clear_calls()


def main(dims):
    for d in dims:
        heads, seqlen = 2048 // d, 16384
        leaves = [torch.randn(1, seqlen, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(3)]
        for causal in (False, True):
            flops = measure.attention_flops(1, heads, seqlen, seqlen, d, causal=causal, backward=True)
            run = peers.sdpa_backward_runner("sdpa-flash", *leaves, causal)
            row = [f"d{d} n{seqlen} c{int(causal)} sdpa-flash={flops / measure.time_cuda(run, reps=10) / 1e9:.0f}"]
            del run
            dout = torch.randn_like(leaves[0])
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                expected = torch.autograd.grad(F.scaled_dot_product_attention(
                    *(x.transpose(1, 2) for x in leaves), is_causal=causal).transpose(1, 2), leaves, dout)
            cases = [("bwd", c, specs.BwdTile(*c[:3], d > 128, "candidate"), None, None) for c in CANDIDATES[d]]
            cases += [("grid", c, None, specs.BwdGridTile(*c, "candidate"), None) for c in GRID_CANDIDATES[d]]
            cases += [("wgmma", (c.block_m, c.block_n, c.stages, f"dq_turns={c.dq_turns}",
                                 f"dq_buffers={c.dq_buffers}"), None, None, c) for c in WGMMA_CANDIDATES.get(d, ())]
            for kernel, cand, tile, grid_tile, wgmma_tile in cases:
                _use(d, tile, grid_tile, wgmma_tile)
                _, spec = registry.choose(Variant("bwd", torch.bfloat16, d, d, frozenset(), "sm_90a"))
                if spec.smem_bytes > specs.smem_limit("sm_90a"):
                    continue
                res = jit.compile_spec(spec).resources[spec.entries[1]]
                grads = torch.autograd.grad(flashtile.attention(*leaves, causal=causal), leaves, dout)
                error = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, expected))
                times = {}
                for deterministic in (False, True):
                    run = peers.backward_runner(
                        lambda: flashtile.attention(*leaves, causal=causal, deterministic=deterministic), leaves)
                    times[deterministic] = measure.time_cuda(run, reps=10)
                    del run
                row.append(f"{kernel}{cand}[{res.registers}r{'/spill' if res.spill_stores else ''}]="
                           f"{flops / times[False] / 1e9:.0f} det {times[True] / times[False]:.2f}x err={error:.0e}")
            print("  ".join(row), flush=True)
    _use(0)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or sorted(CANDIDATES))
