"""flashtile's CPU path beside torch's CPU SDPA, forward and forward + backward, at a few shapes.

    PYTHONPATH=src python scripts/cpu_speed.py [rounds] [max_seqlen]

fp32 unless a row says bf16, torch's default threads. A row's seqlen is one length (seqlen_q = seqlen_k, shown
as n) or a pair (seqlen_q, seqlen_k): the decoding rows, a few queries against a long KV cache (shown as q and k).
flashtile's causal mask is bottom-right aligned and SDPA's is_causal top-left, so a causal row whose lengths
differ hands SDPA flashtile's mask as an explicit boolean attn_mask; the decoding rows of one query are not
causal, since under flashtile's mask one query sees every key anyway (SDPA's is_causal would show it only the
first). Every round runs each contender once, in turn (bench.measure.time_cpu), so that load from other
processes falls on all of them alike; the table gives medians over the rounds (ms) and the speed-up of flashtile
over SDPA (SDPA's time / flashtile's: 1.00x or more is at least as fast). A contender that takes less than
SAMPLE_MS runs several times per sample, so that the clock's resolution and one stray interrupt do not decide a
row. The loop columns force flashtile's chunked PyTorch loop (what serves softcap, ALiBi, windows) on the same
shapes. `max_seqlen` keeps only the rows whose longer sequence is at most that long.
"""

import os
import sys

import torch
import torch.nn.functional as F

import flashtile
from flashtile.bench import measure
from flashtile.reference import attention_chunked, attention_chunked_backward

SHAPES = [
    # batch, heads_q, heads_kv, seqlen or (seqlen_q, seqlen_k), head_dim, causal[, dtype]
    (1, 8, 8, 2048, 64, True),
    (1, 8, 8, 2048, 64, False),
    (1, 8, 8, 1024, 128, False),
    (1, 8, 8, 1024, 128, True),
    (1, 8, 2, 2048, 64, True),
    (2, 16, 4, 1024, 64, False),
    (1, 8, 8, 128, 64, True),      # small: per-call host time shows
    (4, 16, 4, 256, 64, False),
    (1, 2, 2, 8, 16, True),        # smaller still: fixed costs are most of the call
    (1, 16, 16, 16, 128, True),
    (1, 8, 8, 32, 64, True),
    (1, 8, 8, 64, 64, True),
    (1, 8, 8, 128, 64, False),
    (1, 8, 8, 32, 64, True, torch.bfloat16),
    (1, 8, 8, 128, 64, True, torch.bfloat16),
    # decoding: few queries against a long KV cache
    (1, 8, 8, (1, 4096), 64, False),
    (4, 32, 8, (1, 2048), 128, False),
    (1, 32, 8, (4, 8192), 128, True, torch.bfloat16),
    (8, 16, 16, (1, 1024), 64, False),
]
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7
MAX_SEQLEN = int(sys.argv[2]) if len(sys.argv) > 2 else None
SAMPLE_MS = 2.0  # a sample of a small shape repeats its call until about this long
SHAPE_WIDTH = 34  # the shape column: the longest label, a causal bf16 decoding row


def lengths(seqlen) -> tuple[int, int]:
    """A row's (seqlen_q, seqlen_k): its seqlen is one length for both or the pair."""
    return seqlen if isinstance(seqlen, tuple) else (seqlen, seqlen)


def sdpa_mask(seqlen_q: int, seqlen_k: int, causal: bool) -> dict:
    """SDPA's masking arguments for flashtile's mask: is_causal where the two agree (no mask or a square one),
    else flashtile's bottom-right causal mask as a boolean attn_mask (True: the query sees the key)."""
    if not causal or seqlen_q == seqlen_k:
        return {"is_causal": causal}
    sees = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(diagonal=seqlen_k - seqlen_q)
    return {"attn_mask": sees}


def contenders(batch, heads_q, heads_kv, seqlen, head_dim, causal, dtype=torch.float32):
    """name -> no-argument callable, for one shape: forward and forward + backward of each."""
    seqlen_q, seqlen_k = lengths(seqlen)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa_leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]  # SDPA's (b, h, s, d)
    masking = sdpa_mask(seqlen_q, seqlen_k, causal)

    def sdpa(*tensors):
        return F.scaled_dot_product_attention(*tensors, **masking, enable_gqa=heads_q != heads_kv)

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


def repeated(fns: dict) -> tuple[dict, dict]:
    """Each contender repeated enough times that its sample lasts about SAMPLE_MS; and those counts (its times
    are divided by its count)."""
    first = measure.time_cpu(fns, reps=1)
    counts = {name: max(1, round(SAMPLE_MS / max(ms, 1e-3))) for name, ms in first.items()}

    def loop(fn, calls):
        def run():
            for _ in range(calls):
                fn()
        return run
    return {name: loop(fn, counts[name]) for name, fn in fns.items()}, counts


def main():
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, median of {ROUNDS} rounds (ms); "
          f"speed-up = SDPA / flashtile; load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'shape':<{SHAPE_WIDTH}} {'fwd':>9} {'sdpa':>9} {'speed-up':>8} | "
          f"{'fwd+bwd':>9} {'sdpa':>9} {'speed-up':>8} | {'loop fwd':>9} {'loop f+b':>9}")
    for row in SHAPES:
        batch, heads_q, heads_kv, seqlen, head_dim, causal, *dtype = row
        seqlen_q, seqlen_k = lengths(seqlen)
        if MAX_SEQLEN is not None and max(seqlen_q, seqlen_k) > MAX_SEQLEN:
            continue
        fns, counts = repeated(contenders(*row))
        t = {name: ms / counts[name] for name, ms in measure.time_cpu(fns, reps=ROUNDS).items()}
        heads = f"h{heads_q}" if heads_q == heads_kv else f"h{heads_q}/{heads_kv}"
        lengths_shown = f"n{seqlen_q}" if seqlen_q == seqlen_k else f"q{seqlen_q} k{seqlen_k}"
        shape = (f"b{batch} {heads} {lengths_shown} d{head_dim}{' causal' if causal else ''}"
                 f"{' bf16' if dtype == [torch.bfloat16] else ''}")
        fwd, train = t["fwd sdpa"] / t["fwd flashtile"], t["train sdpa"] / t["train flashtile"]
        print(f"{shape:<{SHAPE_WIDTH}} {t['fwd flashtile']:9.4f} {t['fwd sdpa']:9.4f} {fwd:7.2f}x | "
              f"{t['train flashtile']:9.4f} {t['train sdpa']:9.4f} {train:7.2f}x | "
              f"{t['fwd loop']:9.4f} {t['train loop']:9.4f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
