"""flashtile's CPU path beside torch's CPU SDPA, forward and forward + backward, at a few shapes.

    PYTHONPATH=src python scripts/cpu_speed.py [rounds]

fp32, torch's default threads. Every round runs each contender once, in turn (bench.measure.time_cpu), so
that load from other processes falls on all of them alike; the table gives medians over the rounds (ms) and
the speed-up of flashtile over SDPA (SDPA's time / flashtile's: 1.00x or more is at least as fast). The loop
columns force flashtile's chunked PyTorch loop (what serves softcap, ALiBi, windows) on the same shapes.
"""

import os
import sys

import torch
import torch.nn.functional as F

import flashtile
from flashtile.bench import measure
from flashtile.reference import attention_chunked, attention_chunked_backward

SHAPES = [
    # batch, heads_q, heads_kv, seqlen, head_dim, causal
    (1, 8, 8, 2048, 64, True),
    (1, 8, 8, 2048, 64, False),
    (1, 8, 8, 1024, 128, False),
    (1, 8, 8, 1024, 128, True),
    (1, 8, 2, 2048, 64, True),
    (2, 16, 4, 1024, 64, False),
    (1, 8, 8, 128, 64, True),      # small: per-call host time shows
    (4, 16, 4, 256, 64, False),
]
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7


def contenders(batch, heads_q, heads_kv, seqlen, head_dim, causal):
    """name -> no-argument callable, for one shape: forward and forward + backward of each."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen, heads_q, head_dim, generator=g)
    k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa_leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]  # SDPA's (b, h, s, d)

    def sdpa(*tensors):
        return F.scaled_dot_product_attention(*tensors, is_causal=causal, enable_gqa=heads_q != heads_kv)

    def flashtile_forward():
        with torch.no_grad():
            flashtile.attention(q, k, v, causal=causal)

    def sdpa_forward():
        with torch.no_grad():
            sdpa(*sdpa_leaves)

    def loop_train():
        out, lse = attention_chunked(q, k, v, causal=causal, torch_kernel=False)
        attention_chunked_backward(dout, q, k, v, out, lse, causal=causal, torch_kernel=False)

    return {
        "fwd flashtile": flashtile_forward,
        "fwd sdpa": sdpa_forward,
        "train flashtile": lambda: torch.autograd.grad(flashtile.attention(*leaves, causal=causal), leaves, dout),
        "train sdpa": lambda: torch.autograd.grad(sdpa(*sdpa_leaves), sdpa_leaves, dout.transpose(1, 2)),
        "fwd loop": lambda: attention_chunked(q, k, v, causal=causal, torch_kernel=False),
        "train loop": loop_train,
    }


def main():
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, median of {ROUNDS} rounds (ms); "
          f"speed-up = SDPA / flashtile; load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'shape':<28} {'fwd':>9} {'sdpa':>9} {'speed-up':>8} | {'fwd+bwd':>9} {'sdpa':>9} {'speed-up':>8} | "
          f"{'loop fwd':>9} {'loop f+b':>9}")
    for batch, heads_q, heads_kv, seqlen, head_dim, causal in SHAPES:
        t = measure.time_cpu(contenders(batch, heads_q, heads_kv, seqlen, head_dim, causal), reps=ROUNDS)
        heads = f"h{heads_q}" if heads_q == heads_kv else f"h{heads_q}/{heads_kv}"
        shape = f"b{batch} {heads} n{seqlen} d{head_dim}{' causal' if causal else ''}"
        fwd, train = t["fwd sdpa"] / t["fwd flashtile"], t["train sdpa"] / t["train flashtile"]
        print(f"{shape:<28} {t['fwd flashtile']:9.1f} {t['fwd sdpa']:9.1f} {fwd:7.2f}x | "
              f"{t['train flashtile']:9.1f} {t['train sdpa']:9.1f} {train:7.2f}x | "
              f"{t['fwd loop']:9.1f} {t['train loop']:9.1f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
