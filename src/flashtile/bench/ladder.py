"""`flashtile bench ladder`: every rung and every SDPA backend at one shape, in one run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch

from .. import api, dispatch, jit, ladder, registry
from ..forward import FwdProblem
from ..reference import attention_chunked
from . import measure, peers


CPU_REPS = 5                                     # rounds of timed calls on CPU (median)
CPU_SDPA_BACKENDS = ("sdpa-flash", "sdpa-math")  # the first, torch's default CPU kernel, is the baseline


def _inputs(batch, heads, seqlen, head_dim, dtype, device):
    g = torch.Generator(device=device).manual_seed(int(time.time()))  # fresh random inputs every run
    return [torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype, generator=g) for _ in range(3)]


def run(shape: tuple[int, int, int, int], dtype: torch.dtype, causal: bool, reps: int = 30,
        progress=None) -> dict:
    """Time every rung and peer at (batch, heads, seqlen, head_dim). Returns the results document."""
    batch, heads, seqlen, head_dim = shape
    flops = measure.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal)
    doc = {"kind": "ladder", "shape": dict(batch=batch, heads=heads, seqlen=seqlen, head_dim=head_dim),
           "dtype": str(dtype).removeprefix("torch."), "causal": causal, "flops": flops, "rows": []}
    rows = doc["rows"]

    def add(name, kind, ms, note=""):
        rows.append(dict(name=name, kind=kind, ms=ms, tflops=flops / ms / 1e9 if ms else None, note=note))
        if progress:
            progress(name, ms)

    if not torch.cuda.is_available():
        doc["kind"] = "ladder-cpu"
        q, k, v = _inputs(batch, heads, seqlen, head_dim, dtype, "cpu")
        ours = {"flashtile (cpu)": lambda: api.attention(q, k, v, causal=causal),
                "chunked loop (cpu)": lambda: attention_chunked(q, k, v, causal=causal, torch_kernel=False)}
        peer_runners = {f"{backend} (cpu)": peers.sdpa_runner(backend, q, k, v, causal)
                        for backend in CPU_SDPA_BACKENDS}
        timed = measure.time_cpu({**ours, **{name: fn for name, fn in peer_runners.items() if fn}}, reps=CPU_REPS)
        for name in (*ours, *peer_runners):
            add(name, "flashtile" if name in ours else "peer", timed.get(name),
                "" if name in timed else "not available for these inputs")
        return _with_speedups(doc, baseline=f"{CPU_SDPA_BACKENDS[0]} (cpu)")

    q, k, v = _inputs(batch, heads, seqlen, head_dim, dtype, "cuda")
    variant = dispatch.variant_of(FwdProblem(q, k, v, head_dim**-0.5, (-1, 0) if causal else (-1, -1)), "fwd")
    for rung in ladder.RUNGS:
        if rung.unsupported(variant):
            continue
        ms = measure.time_cuda(lambda: api.attention(q, k, v, causal=causal, rung=rung.name),
                               reps=reps if rung.number > 0 else max(5, reps // 3))
        add(f"{rung.number} {rung.name}", "rung", ms)
    for backend in peers.SDPA_BACKENDS:
        runner = peers.sdpa_runner(backend, q, k, v, causal)
        if runner is not None:
            add(backend, "peer", measure.time_cuda(runner, reps=reps))
        else:
            add(backend, "peer", None, "not available for these inputs")
    doc["runtime"] = runtime_costs(dtype)
    return _with_speedups(doc, baseline=f"0 {ladder.RUNGS[0].name}")


def _with_speedups(doc: dict, baseline: str) -> dict:
    base = next((r["ms"] for r in doc["rows"] if r["name"] == baseline), None)
    doc["baseline"] = baseline
    for r in doc["rows"]:
        r["speedup"] = base / r["ms"] if base and r["ms"] else None
    return doc


def _cold_compile_seconds(spec) -> float:
    """NVRTC time for `spec` in a new Python process (an in-process NVRTC call can reuse warm state)."""
    code = ("import sys; from flashtile import jit; from flashtile.specs import KernelSpec, KvBox; "
            f"m = jit.compile_spec({spec!r}, use_cache=False); print(m.seconds)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    return float(done.stdout.strip().splitlines()[-1])


def runtime_costs(dtype: torch.dtype) -> dict:
    """Cold NVRTC compile and disk-cache load of the top rung's spec, and host time per warm call."""
    small = [torch.randn(1, 128, 4, 64, device="cuda", dtype=dtype) for _ in range(3)]
    problem = FwdProblem(*small, scale=0.125, window=(-1, -1))
    _, spec = registry.choose(dispatch.variant_of(problem, "fwd"))
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, {"FLASHTILE_CACHE_DIR": tmp}):
        cold = _cold_compile_seconds(spec)               # NVRTC in a fresh process: nothing warm
        jit.clear_memo()
        cached = jit.compile_spec(spec)                  # from the entry the cold compile just wrote
        assert cached.origin == "disk", cached.origin
    jit.clear_memo()
    # The same host's cost of a small torch op, timed in turns with it: host speed varies between machines and
    # hours (torch.add measured 6.9 and 11.6 us on the same kind of H200 host on one day), so the overhead is read
    # beside it.
    times = measure.host_overhead_us({"flashtile": lambda: api.attention(*small),
                                      "torch.add": lambda: torch.add(small[0], small[0])})
    overhead, torch_op = times["flashtile"], times["torch.add"]
    return {"spec": spec.name, "cold_compile_s": cold, "cached_load_ms": cached.seconds * 1e3,
            "host_overhead_us": overhead, "overhead_shape": "1x128x4x64", "torch_op_us": torch_op}
