"""`flashtile bench` / `bench matrix`: the standard matrix of shared/TARGETS.md, flashtile beside every
SDPA backend, measured in one run.

Shapes: bf16, 16384 tokens per run (batch = 16384 / seqlen), heads x head_dim = 2048.
"""

from __future__ import annotations

import time

import torch

from .. import api
from . import measure, peers

HEAD_DIMS = (64, 128, 256)
SEQLENS = (1024, 4096, 16384)
TOKENS = 16384
MODEL_WIDTH = 2048
MATH_MAX_SEQLEN = 4096  # sdpa-math materialises seqlen^2 scores per head: skipped beyond this, as in TARGETS.md
KERNELS = ("flashtile", *peers.SDPA_BACKENDS)


def standard_shapes():
    for d in HEAD_DIMS:
        for n in SEQLENS:
            for causal in (False, True):
                yield d, n, TOKENS // n, MODEL_WIDTH // d, causal


def run(dtype=torch.bfloat16, reps: int = 30, progress=None) -> dict:
    doc = {"kind": "matrix", "dtype": str(dtype).removeprefix("torch."), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(time.time_ns() % 2**63)
    for d, n, batch, heads, causal in standard_shapes():
        q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
        flops = measure.attention_flops(batch, heads, n, n, d, causal=causal)
        row = {"d": d, "n": n, "b": batch, "h": heads, "causal": causal, "pass": "fwd", "tflops": {}}
        for name in KERNELS:
            if name == "flashtile":
                fn = lambda: api.attention(q, k, v, causal=causal)  # noqa: E731
            elif name == "sdpa-math" and n > MATH_MAX_SEQLEN:
                fn = None
            else:
                fn = peers.sdpa_runner(name, q, k, v, causal)
            row["tflops"][name] = flops / measure.time_cuda(fn, reps=reps) / 1e9 if fn else None
        peer_values = [t for name, t in row["tflops"].items() if name != "flashtile" and t]
        row["vs_flash"] = row["tflops"]["flashtile"] / row["tflops"]["sdpa-flash"] if row["tflops"]["sdpa-flash"] else None
        row["vs_best"] = row["tflops"]["flashtile"] / max(peer_values) if peer_values else None
        doc["rows"].append(row)
        if progress:
            progress(row)
    return doc


def markdown(doc: dict) -> str:
    lines = ["TFLOP/s (forward 4·b·h·n²·d, halved when causal). `vs flash` = flashtile / sdpa-flash "
             "(FlashAttention-2 inside torch); `vs best` = flashtile / the fastest SDPA backend.", "",
             "| d | n | b | causal | pass | " + " | ".join(KERNELS) + " | vs flash | vs best |",
             "|---|---|---|---|---|" + "---:|" * (len(KERNELS) + 2)]
    for r in doc["rows"]:
        cells = [f"{r['tflops'][k]:.0f}" if r["tflops"][k] else "-" for k in KERNELS]
        lines.append(f"| {r['d']} | {r['n']} | {r['b']} | {int(r['causal'])} | {r['pass']} | " + " | ".join(cells)
                     + f" | {r['vs_flash']:.2f} | {r['vs_best']:.2f} |")
    return "\n".join(lines)
