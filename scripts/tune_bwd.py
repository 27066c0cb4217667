"""Sweep backward tile shapes at standard-matrix sizes; prints TFLOP/s beside torch's flash backward, and the
deterministic mode's time over the default's for each tile.

Usage (on the GPU machine): python scripts/tune_bwd.py [d ...] — a lab bench for choosing rows of
specs.BWD_TILES_* (the 16-keys-per-warp kernel, bwd.cu) and specs.BWD_GRID_TILES (the warp-grid kernel,
bwd_grid.cu); the reasons in those tables come from runs of this script.
"""

import sys

import torch

import flashtile
from flashtile import backward, jit, specs
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
ORIGINAL_GRID_TILE, ORIGINAL_TILE = specs.bwd_grid_tile, specs.bwd_tile


def _use(tile=None, grid_tile=None):
    """Make bwd_spec pick exactly this tile of one kernel."""
    specs.bwd_grid_tile = lambda head_dim, arch, score_mods=False: grid_tile
    specs.bwd_tile = (lambda head_dim, arch, score_mods=False: tile) if tile else ORIGINAL_TILE
    backward._modules.clear()


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
            cases = [("bwd", c, specs.BwdTile(*c[:3], d > 128, "candidate"), None) for c in CANDIDATES[d]]
            cases += [("grid", c, None, specs.BwdGridTile(*c, "candidate")) for c in GRID_CANDIDATES[d]]
            for kernel, cand, tile, grid_tile in cases:
                _use(tile, grid_tile)
                spec = specs.bwd_spec("bf16", d, d, "sm_90a")
                if spec.smem_bytes > specs.SMEM_LIMIT["sm_90a"]:
                    continue
                res = jit.compile_spec(spec).resources[spec.entries[1]]
                times = {}
                for deterministic in (False, True):
                    run = peers.backward_runner(
                        lambda: flashtile.attention(*leaves, causal=causal, deterministic=deterministic), leaves)
                    times[deterministic] = measure.time_cuda(run, reps=10)
                    del run
                row.append(f"{kernel}{cand}[{res.registers}r{'/spill' if res.spill_stores else ''}]="
                           f"{flops / times[False] / 1e9:.0f} det {times[True] / times[False]:.2f}x")
            print("  ".join(row), flush=True)
    _use()
    specs.bwd_grid_tile = ORIGINAL_GRID_TILE


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or sorted(CANDIDATES))
