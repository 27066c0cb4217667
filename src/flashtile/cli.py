"""The `flashtile` command: info, check, compile, bench, explain."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "fp16": torch.float16, "f32": torch.float32,
           "fp32": torch.float32}
_ARCH = re.compile(r"sm_\d{2,3}[af]?")   # NVRTC's real targets: sm_80, sm_90a, sm_100a, sm_120f


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shape must be batch,heads,seqlen,head_dim (positive ints), got {text!r}")
    return tuple(int(p) for p in parts)


def _arch(text: str) -> str:
    if not _ARCH.fullmatch(text):
        raise argparse.ArgumentTypeError(f"--arch must be sm_ and a compute capability, e.g. sm_80, sm_89, sm_90a, "
                                         f"sm_100a; got {text!r}")
    return text


def cmd_info(args) -> int:
    from . import host, jit, ladder, specs
    from .bench.system import describe
    from .family import Variant

    facts = describe()
    for key, value in facts.items():
        print(f"{key:>14}: {value}")
    print(f"{'cache dir':>14}: {jit.cache_dir()}")
    print(f"{'host path':>14}: {host.describe()}")
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        variant = Variant("fwd", torch.bfloat16, 64, 64, frozenset(), specs.arch_of(capability))
        runnable = [f"{r.number} {r.name}" for r in ladder.RUNGS if r.unsupported(variant) is None]
        print(f"{'rungs here':>14}: {', '.join(runnable)}")
    else:
        print(f"{'rungs here':>14}: none (no CUDA device); CPU tensors use the chunked PyTorch path")
    return 0


def _check_cases():
    """(shape, causal) cases for `check`: odd lengths, seqlen_q != seqlen_k, GQA, padded head dims."""
    return [((2, 17, 17, 2, 2, 64), False), ((1, 1000, 1000, 4, 2, 64), True), ((1, 1, 300, 2, 1, 128), True),
            ((2, 333, 129, 2, 2, 40), True), ((1, 1024, 1024, 2, 2, 128), False), ((1, 4097, 4097, 1, 1, 64), True)]


def cmd_check(args) -> int:
    from . import api, dispatch, ladder
    from .forward import FwdProblem
    from .testing import compare

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(time.time_ns() % 2**63)  # fresh inputs every run
    failures = 0
    targets = [r for r in ladder.RUNGS if device == "cuda"] or [None]
    for rung in targets:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            if rung is not None and dtype not in rung.dtypes:
                continue
            for (b, sq, sk, hq, hkv, d), causal in _check_cases():
                if rung is not None and d > rung.max_head_dim:
                    continue
                if device == "cpu" and sq * sk > 400_000:
                    continue
                q = torch.randn(b, sq, hq, d, device=device, generator=gen).to(dtype)
                k = torch.randn(b, sk, hkv, d, device=device, generator=gen).to(dtype)
                v = torch.randn(b, sk, hkv, d, device=device, generator=gen).to(dtype)
                name = rung.name if rung else "auto"
                if rung is not None and rung.unsupported(dispatch.variant_of(
                        FwdProblem(q, k, v, d**-0.5, (-1, 0) if causal else (-1, -1)), "fwd")):
                    continue
                out, lse = api.attention(q, k, v, causal=causal, return_lse=True, rung=name)
                result = compare(q, k, v, out, lse, causal=causal)
                failures += not result.ok
                label = f"{rung.number} {rung.name}" if rung else "cpu-chunked"
                print(f"{'ok  ' if result.ok else 'FAIL'} {label:<12} {str(dtype):<15} "
                      f"b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} causal={int(causal)}  {result}")
    failures += _check_backward(device, gen)
    print(f"{failures} failure(s)" if failures else "all checks passed")
    return 1 if failures else 0


def _check_backward(device: str, gen: torch.Generator) -> int:
    """dQ, dK, dV of `flashtile.attention` against fp64 autograd of the reference; returns the failure count."""
    from . import api
    from .testing import compare_grads

    failures = 0
    for dtype in (torch.float16, torch.bfloat16) if device == "cuda" else (torch.float32,):
        for (b, sq, sk, hq, hkv, d), causal in _check_cases():
            if device == "cpu" and sq * sk > 400_000:
                continue
            q, k, v = (torch.randn(b, s, h, d, device=device, generator=gen).to(dtype).requires_grad_()
                       for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
            out = api.attention(q, k, v, causal=causal)
            dout = torch.randn(out.shape, device=device, generator=gen).to(dtype)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            result = compare_grads(q, k, v, dout, grads, causal=causal)
            failures += not result.ok
            print(f"{'ok  ' if result.ok else 'FAIL'} {'backward':<12} {str(dtype):<15} "
                  f"b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} causal={int(causal)}  {result}")
    return failures


def cmd_compile(args) -> int:
    from . import jit, registry, specs

    arch = args.arch
    if arch is None:
        if not torch.cuda.is_available():
            print("no CUDA device: name a target with --arch (e.g. sm_90a)", file=sys.stderr)
            return 2
        arch = specs.arch_of(torch.cuda.get_device_capability())
    todo = registry.all_specs(arch)
    spills, start = [], time.perf_counter()
    try:
        from rich.progress import track
    except ImportError:
        def track(items, description=""):
            return items
    for spec in track(todo, description=f"compiling {len(todo)} specs for {arch}"):
        module = jit.compile_spec(spec)
        spills += [f"{spec.name}:{k}" for k, r in module.resources.items() if r.spill_stores or r.spill_loads]
    print(f"{len(todo)} specs ready for {arch} in {time.perf_counter() - start:.1f} s (cache: {jit.cache_dir()})")
    if spills:
        print("register spills in: " + ", ".join(spills))
    return 0


def cmd_bench(args) -> int:
    from . import host
    from .bench import decode as decode_bench
    from .bench import ladder as ladder_bench
    from .bench import matrix as matrix_bench
    from .bench import report
    from .bench.system import describe

    host.extension()  # timings are taken on the path users settle on: wait for a background host-path build
    host.wait()
    if args.what == "decode":
        if not torch.cuda.is_available():
            print("No CUDA GPU here: the decode benchmark needs one.")
            return 1
        doc = decode_bench.run(_DTYPES[args.dtype], reps=args.reps, quick=args.quick,
                               progress=lambda r: print(f"  {decode_bench.progress_line(r)}", flush=True))
    elif args.what == "matrix":
        if not torch.cuda.is_available():
            print("No CUDA GPU here: the standard matrix needs one (try `flashtile bench ladder` for the CPU path).")
            return 1
        doc = matrix_bench.run(_DTYPES[args.dtype], reps=args.reps, progress=lambda r: print(
            f"  d={r['d']} n={r['n']} causal={int(r['causal'])} {r['pass']}: flashtile "
            f"{r['tflops']['flashtile'] or 0:.0f} TFLOP/s, {r['vs_flash'] or 0:.2f}x sdpa-flash, "
            f"{r['vs_best'] or 0:.2f}x best", flush=True))
    else:
        if not torch.cuda.is_available():
            print("No CUDA GPU here: timing the CPU path against torch's CPU SDPA instead.")
        doc = ladder_bench.run(args.shape, _DTYPES[args.dtype], args.causal, reps=args.reps,
                               progress=lambda name, ms: print(f"  {name:<18} {ms if ms is None else round(ms, 3)} ms",
                                                              flush=True))
    doc["system"] = describe()
    report.print_table(doc)
    if args.out is not None:
        for path in report.save(doc, Path(args.out)):
            print(f"wrote {path}")
    return 0


def _window(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window must be left,right (ints, -1 = unbounded), got {text!r}") from None
    return left, right


def cmd_explain(args) -> int:
    from .explain import REFERENCE_MACHINES, explain

    batch, heads, seqlen, head_dim = args.shape
    heads_kv = args.heads_kv or heads
    seqlen_k = args.seqlen_k or seqlen
    head_dim_v = args.head_dim_v or head_dim
    on_gpu = torch.cuda.is_available() and args.arch is None
    if not on_gpu and args.arch is None:
        print("no CUDA device: name a target with --arch, one of " + ", ".join(sorted(REFERENCE_MACHINES)),
              file=sys.stderr)
        return 2
    device = "cuda" if on_gpu else "meta"
    dtype = _DTYPES[args.dtype]
    q = torch.empty(batch, seqlen, heads, head_dim, device=device, dtype=dtype)
    k = torch.empty(batch, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype)
    v = torch.empty(batch, seqlen_k, heads_kv, head_dim_v, device=device, dtype=dtype)
    slopes = torch.rand(heads, device=device) if args.alibi else None
    try:
        print(explain(q, k, v, causal=args.causal, window_size=args.window, softcap=args.softcap,
                      alibi_slopes=slopes, arch=args.arch, measure_time=not args.no_time))
    except (TypeError, ValueError) as err:
        print(f"flashtile explain: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashtile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GPU, architecture, driver, NVRTC, cache dir, rungs that run here")
    sub.add_parser("check", help="every rung against the fp64 reference on fresh random inputs")
    p = sub.add_parser("compile", help="precompile every kernel spec for this GPU or --arch")
    p.add_argument("--arch", type=_arch, help="target such as sm_80, sm_89, sm_90a (default: this GPU)")
    p = sub.add_parser("bench", help="time flashtile beside torch's SDPA backends")
    p.add_argument("what", nargs="?", default="matrix", choices=["matrix", "ladder", "decode"],
                   help="matrix (default): the standard matrix of TARGETS.md; ladder: every rung at one shape; "
                        "decode: one query token against contiguous and paged caches, in TB/s")
    p.add_argument("--shape", type=_shape, default=(4, 16, 4096, 64), help="batch,heads,seqlen,head_dim")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--reps", type=int, default=30, help="timed runs per kernel (median reported)")
    p.add_argument("--quick", action="store_true", help="decode only: a smoke run (short caches, few runs)")
    p.add_argument("--out", help="docs folder to write results/ and performance.md into (default: write no files); "
                                 "the repository's own docs take --out docs")
    p = sub.add_parser("explain", help="which kernel serves a call and why, its tile, FLOPs, bytes and roofline bound")
    p.add_argument("--shape", type=_shape, default=(4, 16, 4096, 128), help="batch,heads,seqlen,head_dim of q")
    p.add_argument("--seqlen-k", type=int, help="keys per sequence (default: seqlen)")
    p.add_argument("--heads-kv", type=int, help="heads of k and v (GQA/MQA; default: heads)")
    p.add_argument("--head-dim-v", type=int, help="head dim of v (default: head_dim)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--window", type=_window, default=(-1, -1), help="left,right sliding window (-1 = unbounded)")
    p.add_argument("--softcap", type=float, default=0.0)
    p.add_argument("--alibi", action="store_true", help="with ALiBi slopes")
    p.add_argument("--arch", type=_arch, help="explain for this target without a GPU (e.g. sm_90a); default: this GPU")
    p.add_argument("--no-time", action="store_true", help="do not time the call on the GPU")
    args = parser.parse_args(argv)
    if args.command == "bench" and args.quick and args.what != "decode":
        parser.error("--quick applies to `flashtile bench decode` only")
    commands = {"info": cmd_info, "check": cmd_check, "compile": cmd_compile, "bench": cmd_bench,
                "explain": cmd_explain}
    return commands[args.command](args)
