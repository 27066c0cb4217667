"""`flashtile bench` / `bench matrix`: the standard matrix of shared/TARGETS.md, flashtile beside every
SDPA backend, measured in one run.

Shapes: bf16, 16384 tokens per run (batch = 16384 / seqlen), heads x head_dim = 2048.
"""

from __future__ import annotations

import time
from functools import partial

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


def _runner(name: str, q, k, v, causal: bool, backward: bool):
    if name == "sdpa-math" and q.shape[1] > MATH_MAX_SEQLEN:
        return None
    if name != "flashtile":
        return (peers.sdpa_backward_runner if backward else peers.sdpa_runner)(name, q, k, v, causal)
    if not backward:
        return lambda: api.attention(q, k, v, causal=causal)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return peers.backward_runner(lambda: api.attention(*leaves, causal=causal), leaves)


def run(dtype=torch.bfloat16, reps: int = 30, progress=None) -> dict:
    doc = {"kind": "matrix", "dtype": str(dtype).removeprefix("torch."), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(time.time_ns() % 2**63)
    for d, n, batch, heads, causal in standard_shapes():
        q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
        for backward in (False, True):
            flops = measure.attention_flops(batch, heads, n, n, d, causal=causal, backward=backward)
            row = {"d": d, "n": n, "b": batch, "h": heads, "causal": causal, "pass": "bwd" if backward else "fwd",
                   "tflops": {}}
            makers = {name: partial(_runner, name, q, k, v, causal, backward) for name in KERNELS}
            for name, ms in measure.time_rounds(makers, reps=reps).items():
                row["tflops"][name] = flops / ms / 1e9 if ms else None
            flash, ours = row["tflops"]["sdpa-flash"], row["tflops"]["flashtile"]
            peer_values = [t for name, t in row["tflops"].items() if name != "flashtile" and t]
            row["vs_flash"] = ours / flash if flash and ours else None
            row["vs_best"] = ours / max(peer_values) if peer_values and ours else None
            doc["rows"].append(row)
            if progress:
                progress(row)
    doc["training"] = training_checks(dtype, reps)
    return doc


DETERMINISTIC_SHAPE = (1, 16384, 16, 128)   # (batch, seqlen, heads, head_dim): the d128 n16k row
PEAK_MEMORY_SHAPE = (1, 65536, 16, 128)


def training_checks(dtype, reps: int) -> dict:
    """Deterministic backward time over the default (both causal settings), and the peak memory of one
    forward + backward against the bytes of q, k, v, o, dO, dQ, dK, dV themselves."""
    result = {}
    batch, n, heads, d = DETERMINISTIC_SHAPE
    for causal in (False, True):
        leaves = [torch.randn(batch, n, heads, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]
        makers = {deterministic: partial(peers.backward_runner, partial(api.attention, *leaves, causal=causal,
                                                                          deterministic=deterministic), leaves)
                  for deterministic in (False, True)}
        times = measure.time_rounds(makers, reps=reps)
        result[f"deterministic_ratio_causal{int(causal)}"] = times[True] / times[False]
    batch, n, heads, d = PEAK_MEMORY_SHAPE
    q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    tensors_bytes = 8 * q.numel() * q.element_size()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = api.attention(q, k, v, causal=True)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    # q, k, v are allocated before `base`; count them back in with everything the pass created.
    peak = torch.cuda.max_memory_allocated() - base + 3 * q.numel() * q.element_size()
    result["peak_memory_ratio"] = peak / tensors_bytes
    result["peak_memory_shape"] = "b=%d n=%d h=%d d=%d causal" % PEAK_MEMORY_SHAPE
    return result


def markdown(doc: dict) -> str:
    lines = ["TFLOP/s (forward 4·b·h·n²·d, halved when causal; backward 2.5× that, timed alone). `vs flash` = "
             "flashtile / sdpa-flash (FlashAttention-2 inside torch); `vs best` = flashtile / the fastest SDPA "
             "backend.", "",
             "| d | n | b | causal | pass | " + " | ".join(KERNELS) + " | vs flash | vs best |",
             "|---|---|---|---|---|" + "---:|" * (len(KERNELS) + 2)]
    for r in doc["rows"]:
        cells = [f"{r['tflops'][k]:.0f}" if r["tflops"][k] else "-" for k in KERNELS]
        ratios = " | ".join(f"{r[key]:.2f}" if r[key] else "-" for key in ("vs_flash", "vs_best"))
        lines.append(f"| {r['d']} | {r['n']} | {r['b']} | {int(r['causal'])} | {r['pass']} | " + " | ".join(cells)
                     + f" | {ratios} |")
    training = doc.get("training")
    if training:
        lines += ["", "Training checks: deterministic backward / default backward at b=1 n=16384 h=16 d=128: "
                  f"{training['deterministic_ratio_causal0']:.2f}× non-causal, "
                  f"{training['deterministic_ratio_causal1']:.2f}× causal. Peak memory of forward + backward at "
                  f"{training['peak_memory_shape']}: {training['peak_memory_ratio']:.2f}× the bytes of q, k, v, o, "
                  "dO, dQ, dK, dV."]
    return "\n".join(lines)
