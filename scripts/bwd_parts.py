"""The kernels of one backward call, flashtile's and cuDNN's side by side: GPU time per kernel (torch.profiler).

    PYTHONPATH=src python scripts/bwd_parts.py [head_dim,seqlen,causal ...]

Rows are the standard matrix's shapes (16384 tokens, heads x head_dim = 2048, bf16); by default d128 n1k with and
without the causal mask, d64 n1k, d256 n1k and d128 n16k. For each row and each of the two, the call's total and
every kernel's share, averaged over REPS calls after one warm-up: how much of a backward the row kernels
(preprocess, dQ conversion) take beside the main kernel, and what cuDNN launches for the same work. A diagnostic,
not a comparison of speed: the profiler adds its own cost around each launch; `flashtile bench` is the comparison.
"""

import collections
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flashtile

ROWS = ["128,1024,0", "128,1024,1", "64,1024,0", "256,1024,0", "128,16384,0"]
REPS = 10
TOKENS, WIDTH = 16384, 2048
NAME_CHARS = 70


def kernel_times(fn) -> dict[str, float]:
    """Kernel name -> GPU microseconds per call of fn."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:NAME_CHARS]] += event.device_time_total / REPS
    return times


def main(rows: list[str]) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU us per backward call, {REPS} calls")
    for row in rows:
        d, n, causal = (int(x) for x in row.split(","))
        batch, heads = TOKENS // n, WIDTH // d
        q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        out = flashtile.attention(q, k, v, causal=bool(causal))
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out_cudnn = F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))
        calls = {
            "flashtile": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
            "sdpa-cudnn": lambda: torch.autograd.grad(out_cudnn, (qt, kt, vt), dout.transpose(1, 2),
                                                      retain_graph=True),
        }
        for name, call in calls.items():
            times = kernel_times(call)
            print(f"d{d} n{n} b{batch}{' causal' if causal else ''} {name}: {sum(times.values()):.1f} us")
            for kernel, us in sorted(times.items(), key=lambda item: -item[1]):
                print(f"  {us:9.1f}  {kernel}")


if __name__ == "__main__":
    main(sys.argv[1:] or ROWS)
