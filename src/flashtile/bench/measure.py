"""How we count and how we time (../TARGETS conventions): FLOPs of attention, CUDA-event medians."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable

import torch

BWD_FLOP_FACTOR = 2.5  # backward = 2 matmuls recomputed + 3 for gradients over the forward's 2: FlashAttention's 2.5x


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    head_dim_v: int | None = None, causal: bool = False, backward: bool = False) -> float:
    """Matmul FLOPs of attention: 2*sq*sk*d for QK^T plus 2*sq*sk*dv for PV, per (batch, head).

    Causal counts half (the FlashAttention convention, exact for seqlen_q == seqlen_k up to the
    diagonal); backward counts 2.5x the forward.
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    flops = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim + head_dim_v)
    if causal:
        flops /= 2
    return flops * (BWD_FLOP_FACTOR if backward else 1.0)


# Warm-up lasts at least this long: an idle GPU's clocks take milliseconds to rise, and five calls of a 0.5 ms
# kernel did not cover that (the H200 matrix timed the first kernel of a short row ~10% low, 2026-11-29).
WARMUP_SECONDS = 0.05


def time_cuda(fn: Callable[[], object], reps: int = 30, warmup: int = 5) -> float:
    """Median milliseconds of `fn` over `reps` runs, each timed with its own pair of CUDA events, after at least
    `warmup` calls and WARMUP_SECONDS of warm-up."""
    start, calls = time.perf_counter(), 0
    while calls < warmup or time.perf_counter() - start < WARMUP_SECONDS:
        fn()
        torch.cuda.synchronize()  # the host's clock then follows the GPU's work, not the launch queue's
        calls += 1
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_cpu(fns: dict[Hashable, Callable[[], object]], reps: int = 5, warmup: int = 1) -> dict[Hashable, float]:
    """Median milliseconds of each callable on the host clock. They take turns, one call each per round, every
    other round in reverse order, so that neither load from other processes on a shared host nor a place in
    the order (after the heaviest call, say) falls on one of them more than on the others."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[Hashable, list[float]] = {name: [] for name in fns}
    for round_ in range(reps):
        for name, fn in (list(fns.items()) if round_ % 2 == 0 else list(reversed(fns.items()))):
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


HOST_TIMING_BATCH = 200  # calls per timed batch: well under the driver's ~1024 pending launches
HOST_WARMUP_CALLS = 50


def host_overhead_us(fns: dict[Hashable, Callable[[], object]], calls: int = 2000) -> dict[Hashable, float]:
    """Host microseconds per call of each callable: launch cost, not kernel time.

    Calls are timed in batches of HOST_TIMING_BATCH with the GPU drained before each batch: a batch fits in the
    driver's queue of pending launches (about 1024), so a kernel slower than its launch never makes the host wait
    inside the timed stretch (with one long run the queue fills and the host then waits for the GPU: the
    measurement becomes the kernel's time). The callables take turns, a batch each per round, every other round
    in reverse order, and each reports its median batch: the host's speed drifts by 10-20% within a minute on a
    shared machine (docs/notes.md), and a comparison must not rest on which callable met which stretch."""
    for fn in fns.values():
        for _ in range(HOST_WARMUP_CALLS):
            fn()
    samples: dict[Hashable, list[float]] = {name: [] for name in fns}
    for round_ in range(max(1, calls // HOST_TIMING_BATCH)):
        for name, fn in (list(fns.items()) if round_ % 2 == 0 else list(reversed(fns.items()))):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(HOST_TIMING_BATCH):
                fn()
            samples[name].append((time.perf_counter() - start) / HOST_TIMING_BATCH * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(batch) for name, batch in samples.items()}


# A median of 30 runs still dips by up to ~8% now and then on the H200 (docs/notes.md, session six): comparisons
# take each kernel's best median of this many rounds, every other round in reverse order, so that neither a dip
# nor a place in the order decides a ratio.
ROUNDS = 2


def time_rounds(makers: dict[Hashable, Callable[[], Callable[[], object] | None]], reps: int = 30,
                rounds: int = ROUNDS) -> dict[Hashable, float | None]:
    """Best median milliseconds per name over `rounds` rounds of `time_cuda`, alternating the order.

    `makers[name]()` builds the callable to time (None: the kernel does not run this case); it is built afresh
    each round and dropped right after, so a backward runner's graph does not outlive its timing.
    """
    best: dict[Hashable, float | None] = dict.fromkeys(makers)
    for round_ in range(rounds):
        for name in (list(makers) if round_ % 2 == 0 else list(reversed(makers))):
            fn = makers[name]()
            if fn is None:
                continue
            ms = time_cuda(fn, reps=reps)
            best[name] = ms if best[name] is None else min(best[name], ms)
            del fn
    return best

