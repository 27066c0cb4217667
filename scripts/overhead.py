"""Host time per call of a small attention, flashtile beside sdpa-flash in one process, as training and
inference call it; then where flashtile's time goes, piece by piece. Usage: overhead.py [--out DIR]
(writes DIR/results/overhead.json)."""

import argparse
import ctypes
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile import dispatch, host, launch, ops
from flashtile.bench import measure, report
from flashtile.bench.system import describe
from flashtile.forward import FwdProblem
from flashtile.jit import cuda_module

SHAPE = (1, 128, 8, 64)  # (batch, seqlen, heads, head_dim): the GPU time is negligible, the host's is all
CALLS = 2000


def _leaves(requires_grad: bool):
    return [torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad) for _ in range(3)]


def per_call_table() -> dict:
    """Wall microseconds per call: forward with inputs that require grad, forward + backward, forward under
    no_grad; flashtile and sdpa-flash on the same inputs, timed in turns (measure.host_overhead_us)."""
    q, k, v = _leaves(True)
    dout = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    doutt = dout.transpose(1, 2)

    def ours():
        return flashtile.attention(q, k, v, causal=True)

    def theirs():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def ours_no_grad():
        with torch.no_grad():
            return ours()

    def theirs_no_grad():
        with torch.no_grad():
            return theirs()

    rows = {}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for name, fns in (("forward, inputs require grad", (ours, theirs)),
                          ("forward + backward", (lambda: ours().backward(dout), lambda: theirs().backward(doutt))),
                          ("forward under no_grad", (ours_no_grad, theirs_no_grad))):
            rows[name] = measure.host_overhead_us(dict(zip(("flashtile", "sdpa-flash"), fns)), calls=CALLS)
            with host.python_path():  # the same calls planned anew on the Python path
                rows[name]["flashtile, Python path"] = measure.host_overhead_us({0: fns[0]}, calls=CALLS)[0]
    return rows


class _AllocatingCall:
    """A call whose forward allocates what flashtile's does (out, lse) and launches nothing, on the Python path."""

    host = None

    def forward(self, q, k, v):
        return torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)


def pieces() -> dict:
    """Each piece of flashtile's calls at the table's shape, timed alone, warm."""
    q, k, v = _leaves(True)
    dout = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    problem = FwdProblem(q, k, v, SHAPE[-1] ** -0.5, (-1, 0), want_lse=True)
    call = dispatch.planned_call(problem, "auto", False, True)
    plan = call.forward_plan
    out, lse = plan.run(q, k, v)
    # The launch's own copy of the params this run packed (and its tensor maps): the per-thread buffer is packed
    # again by every Python-path launch, and a forward kernel launched with the backward's params reads nonsense.
    args, packed = launch._ParamsBuffer(), launch._params_buffer
    ctypes.memmove(args.buffer, packed.buffer, len(packed.buffer))
    ctypes.memmove(args.extra_address, packed.extra_address, launch.EXTRA_BYTES)
    options = (True, None, (-1, -1), 0.0, False, False, "auto")
    _no_grad(flashtile.attention, q, k, v, causal=True)  # kept: in the extension's table where it is built
    table = host.kept_calls()
    driver = cuda_module("cuda.bindings.driver")
    step = plan.launches[0]
    argv = args.argv_address if plan.kv_box is None else args.argv2_address
    stream = torch.cuda.current_stream().cuda_stream
    allocating = _AllocatingCall()
    node = flashtile.attention(q, k, v, causal=True).grad_fn  # the C++ node where the host path is built

    def one_launch():
        driver.cuLaunchKernel(step.kernel.function, *step.grid, step.threads, 1, 1, step.smem, stream, argv, 0)
    one_launch.params = args  # argv points into it: it lives as long as the piece

    return {
        "flashtile.attention, no_grad (whole call)": lambda: _no_grad(flashtile.attention, q, k, v, causal=True),
        "the extension's kept call, looked up and run": lambda: _no_grad(table.run, q, k, v, options) if table else None,
        "FwdPlan.run (allocate out and lse, pack, launch)": lambda: plan.run(q, k, v),
        "the host path's forward (the same, in C++)": lambda: call.host.run(q, k, v) if call.host else None,
        "one launch (cuda.bindings' cuLaunchKernel)": one_launch,
        "the autograd node over a call that only allocates": lambda: ops.attention(q, k, v, allocating),
        "BwdPlan.run (allocate, pack, 3 launches)": lambda: call.backward(dout, q, k, v, out, lse),
        "the host path's backward node, called directly": lambda: node(dout, None),
        "torch.empty_like": lambda: torch.empty_like(q),
        "torch.add (a small torch op)": lambda: torch.add(q, q),
    }


def _no_grad(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="docs folder: results/overhead.json is written there")
    args = parser.parse_args()
    host.extension()  # the path users settle on: wait for a background host-path build
    host.wait()
    table = per_call_table()
    print(f"wall us per call, {'x'.join(map(str, SHAPE))} bf16 causal (batch x seqlen x heads x head_dim)")
    print(f"host path: {'C++' if host.extension() is not None else 'Python'} ({host.MODE_ENV}={host.mode()})")
    columns = list(next(iter(table.values())))
    print(f"{'call':<32} " + " ".join(f"{c:>24}" for c in columns))
    for name, row in table.items():
        print(f"{name:<32} " + " ".join(f"{row[c]:>24.1f}" for c in columns))
    print()
    parts = measure.host_overhead_us(pieces(), calls=CALLS)
    for name, us in parts.items():
        print(f"{name:<45} {us:7.2f} us")
    if args.out:
        path = Path(args.out) / "results" / "overhead.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"shape": SHAPE, "dtype": "bf16", "causal": True, "per_call_us": table,
                                    "pieces_us": parts, "system": describe()}, indent=1))
        print(f"wrote {path} and {report.write_performance(Path(args.out))}")


if __name__ == "__main__":
    main()
