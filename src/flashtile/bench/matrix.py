"""`flashtile bench` / `bench matrix`: the standard matrix of shared/TARGETS.md, flashtile beside every
SDPA backend, measured in one run.

Shapes: bf16, 16384 tokens per run (batch = 16384 / seqlen), heads x head_dim = 2048. Three passes per shape:
the forward as training calls it (inputs that require grad: every kernel also saves what its backward needs),
the forward under no_grad (inference), and the backward alone.
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
TRAIN_GAP_LIMIT = 0.03  # the training forward may be this much slower than the inference forward (host costs)


def standard_shapes():
    for d in HEAD_DIMS:
        for n in SEQLENS:
            for causal in (False, True):
                yield d, n, TOKENS // n, MODEL_WIDTH // d, causal


def _no_grad(fn):
    if fn is None:
        return None

    def run():
        with torch.no_grad():
            return fn()
    return run


def _runner(name: str, q, k, v, causal: bool, pass_: str):
    """The callable to time for one kernel and pass, or None where the kernel does not run the case."""
    if name == "sdpa-math" and q.shape[1] > MATH_MAX_SEQLEN:
        return None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if name != "flashtile":
        if pass_ == "bwd":
            return peers.sdpa_backward_runner(name, q, k, v, causal)
        return peers.sdpa_runner(name, *leaves, causal) if pass_ == "fwd (train)" else \
            _no_grad(peers.sdpa_runner(name, q, k, v, causal))
    if pass_ == "fwd (train)":
        return lambda: api.attention(*leaves, causal=causal)
    if pass_ == "fwd (no_grad)":
        return _no_grad(lambda: api.attention(q, k, v, causal=causal))
    return peers.backward_runner(lambda: api.attention(*leaves, causal=causal), leaves)


# Passes timed in one set of rounds, taking turns: the training and inference forwards of every kernel, so that a
# drift of the GPU's clocks over the minutes a row takes falls on both alike (the train gap compares them).
TIMED_TOGETHER = (("fwd (train)", "fwd (no_grad)"), ("bwd",))
# Untimed rounds before the timed ones at each shape: the first round of a new shape read up to 10% off in either
# direction while the next three agreed within 1% (docs/notes.md, session thirteen), and a best-of-two would keep
# a lucky first round.
WARMUP_ROUNDS = 1


def run(dtype=torch.bfloat16, reps: int = 30, progress=None) -> dict:
    doc = {"kind": "matrix", "dtype": str(dtype).removeprefix("torch."), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(time.time_ns() % 2**63)
    for d, n, batch, heads, causal in standard_shapes():
        q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
        for passes in TIMED_TOGETHER:
            makers = {(name, pass_): partial(_runner, name, q, k, v, causal, pass_)
                      for pass_ in passes for name in KERNELS}
            measure.time_rounds(makers, reps=reps, rounds=WARMUP_ROUNDS)  # discarded
            times = measure.time_rounds(makers, reps=reps)
            for pass_ in passes:
                flops = measure.attention_flops(batch, heads, n, n, d, causal=causal, backward=pass_ == "bwd")
                row = {"d": d, "n": n, "b": batch, "h": heads, "causal": causal, "pass": pass_,
                       "tflops": {name: flops / times[name, pass_] / 1e9 if times[name, pass_] else None
                                  for name in KERNELS}}
                flash, ours = row["tflops"]["sdpa-flash"], row["tflops"]["flashtile"]
                peer_values = [t for name, t in row["tflops"].items() if name != "flashtile" and t]
                row["vs_flash"] = ours / flash if flash and ours else None
                row["vs_best"] = ours / max(peer_values) if peer_values and ours else None
                doc["rows"].append(row)
                if progress:
                    progress(row)
    doc["training"] = training_checks(dtype, reps)
    doc["train_gap"] = train_gap(doc["rows"])
    return doc


def train_gap(rows: list[dict]) -> dict:
    """flashtile's training forward against its inference forward, row by row: the largest shortfall
    (1 - train / no_grad TFLOP/s) and whether every row is within TRAIN_GAP_LIMIT."""
    speeds = {(r["d"], r["n"], r["causal"], r["pass"]): r["tflops"]["flashtile"] for r in rows}
    gaps = {f"d{d} n{n} causal{int(c)}": 1 - train / speeds[(d, n, c, "fwd (no_grad)")]
            for (d, n, c, p), train in speeds.items()
            if p == "fwd (train)" and train and speeds.get((d, n, c, "fwd (no_grad)"))}
    worst = max(gaps, key=gaps.get) if gaps else None
    return {"worst_row": worst, "worst_gap": gaps.get(worst), "limit": TRAIN_GAP_LIMIT,
            "every_row_within": bool(gaps) and all(g <= TRAIN_GAP_LIMIT for g in gaps.values())}


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
    gap = doc.get("train_gap")
    if gap and gap["worst_row"]:
        lines += ["", f"Training forward against inference forward (flashtile): the largest shortfall is "
                  f"{gap['worst_gap'] * 100:.1f}% ({gap['worst_row']}); every row within "
                  f"{gap['limit'] * 100:.0f}%: {'yes' if gap['every_row_within'] else 'no'}."]
    training = doc.get("training")
    if training:
        lines += ["", "Training checks: deterministic backward / default backward at b=1 n=16384 h=16 d=128: "
                  f"{training['deterministic_ratio_causal0']:.2f}× non-causal, "
                  f"{training['deterministic_ratio_causal1']:.2f}× causal. Peak memory of forward + backward at "
                  f"{training['peak_memory_shape']}: {training['peak_memory_ratio']:.2f}× the bytes of q, k, v, o, "
                  "dO, dQ, dK, dV."]
    return "\n".join(lines)
