"""Paged decoding against page size and page order, in one run: is a paged cache paid for by its copies (boxes per
tile) or by where its pages lie (random order over the pool, or random only within runs of 2 MB)? Prints each
layout's error against an fp32 reference, then its TB/s (bytes of K and V / time), beside the contiguous cache.
Usage: python scripts/paged_locality.py [batch cache heads_q heads_kv]. Environment: FT_EXP_PAGES=16,256 (page
sizes; fewer orders), FT_EXP_TILE=block_n,stages,tma (the d128 Hopper decode tile of this process, an experiment).
"""

import os
import sys

import torch

from flashtile.bench import decode, measure
from flashtile.compat.kvcache import flash_attn_with_kvcache


def layout(k, v, page_size, order):
    batch, length = k.shape[:2]
    blocks = batch * length // page_size

    def pages(cache):
        shape = (blocks, page_size, *cache.shape[2:])
        paged = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        paged[order] = cache.reshape(shape)
        return paged
    return pages(k), pages(v), order.view(batch, length // page_size).to(torch.int32)


def paged_runner(q, k, v, lengths, page, order):
    """Built afresh each round (and dropped after it), so only one paged copy of the cache lives at a time."""
    kp, vp, table = layout(k, v, page, order)
    return lambda: flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lengths, block_table=table, causal=True)


def orders(blocks, page_size, device):
    """identity; random over the pool; random within runs of 2 MB of one head's K (local)."""
    group = max(1, (2 << 20) // (page_size * 8 * 128 * 2))
    local = torch.cat([torch.randperm(group, device=device) + s for s in range(0, blocks, group)])
    return {"sorted": torch.arange(blocks, device=device), "random": torch.randperm(blocks, device=device),
            "local": local[:blocks]}


def patch_tile():
    """FT_EXP_TILE=block_n,stages,tma: the decode build's d128 Hopper tile for this process (an experiment)."""
    import dataclasses
    import os
    from flashtile import specs
    if "FT_EXP_TILE" in os.environ:
        block_n, stages, tma = (int(x) for x in os.environ["FT_EXP_TILE"].split(","))
        tile = specs.DECODE_TILES_SM90[128]
        specs.DECODE_TILES_SM90[128] = dataclasses.replace(tile, block_n=block_n, stages=stages, tma=bool(tma))
        print("tile", specs.DECODE_TILES_SM90[128])
    return "FT_EXP_PAGES" in os.environ


def main():
    contiguous_only = patch_tile()
    b, n, hq, hkv = (int(x) for x in sys.argv[1:5]) if len(sys.argv) > 4 else (64, 32768, 64, 8)
    torch.manual_seed(0)
    q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, n, hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    runs = {"contiguous": lambda: (lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True))}
    pages = [int(x) for x in os.environ.get("FT_EXP_PAGES", "16,32,64,128,256").split(",") if x]
    for page in pages:
        for name, order in orders(b * n // page, page, "cuda").items():
            if (page in (32, 64, 128) or contiguous_only) and name != "random":
                continue
            runs[f"p{page} {name}"] = lambda page=page, order=order: paged_runner(q, k, v, lengths, page, order)
    reference = torch.softmax((q.float().view(b, hkv, hq // hkv, 128) @ k.float().permute(0, 2, 3, 1)) / 128 ** 0.5, -1) \
        @ v.float().transpose(1, 2)
    for name, make in runs.items():
        got = make()().float().view(b, hkv, hq // hkv, 128)
        print(f"  {name:16s} max |err| {(got - reference).abs().max().item():.2e}")
    times = measure.time_rounds(runs, reps=30)
    cache_bytes = 2 * k.numel() * k.element_size()
    print(f"b{b} n{n} {hq}/{hkv}")
    for name, ms in times.items():
        print(f"  {name:16s} {cache_bytes / ms / 1e9:6.2f} TB/s")


if __name__ == "__main__":
    main()
