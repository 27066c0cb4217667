"""One forward and one backward call at a standard-matrix shape, for a profiler to capture.

Usage (on the GPU machine): ncu --kernel-name regex:'attn_(fwd|bwd)$' ... python scripts/profile_one.py
[head_dim [seqlen [causal [deterministic]]]] — 16384 tokens, heads x head_dim = 2048, bf16, as in the standard
matrix.
"""

import sys

import torch

import flashtile


def main(head_dim=128, seqlen=4096, causal=0, deterministic=0):
    batch, heads = 16384 // seqlen, 2048 // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flashtile.attention(q, k, v, causal=bool(causal), deterministic=bool(deterministic))
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
