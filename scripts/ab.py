"""A/B of the forward or the backward between source trees: each tree's code in its own process, in turns.

    python scripts/ab.py LABEL=SRC [LABEL=SRC ...] [--bwd | --deterministic] [--rounds N] [--rows d,n,causal ...]

SRC is a folder that holds the `flashtile` package, e.g. `src` for the working tree and, for the last commit,
`git archive HEAD src | tar -x -C /tmp/old` then `/tmp/old/src`. Every round runs one process per tree in
order, each under a timeout (a hung kernel costs that process, not the whole call); each process prints one
line: per row, flashtile's and sdpa-cudnn's TFLOP/s (the matrix's shapes: 16384 tokens, heads x head_dim = 2048,
bf16) and flashtile's largest difference from sdpa-flash: of the forward under no_grad, or with --bwd of the
backward alone (the gradients of q, k and v for a fixed dO, after one forward; the largest difference over dq,
dk and dv); --deterministic times flashtile's deterministic backward (its rows' fourth value: whether a second
backward gave the same bits). The first row runs twice and its
first timing is dropped (the GPU's clocks are still rising). A quick look while tuning; the committed comparison
is `flashtile bench matrix`.
"""

import json
import os
import subprocess
import sys

BWD_ROWS = ["64,1024,1", "64,16384,0", "128,1024,0", "128,4096,1", "128,16384,0", "128,16384,1", "256,16384,0"]
ROWS = ["64,1024,0", "64,1024,1", "64,4096,1", "128,1024,0", "128,1024,1", "256,1024,0", "256,1024,1",
        "128,16384,1", "64,16384,0", "64,1000,1", "128,1000,1"]
TIMEOUT_S = 120
TOKENS = 16384
WIDTH = 2048  # heads x head_dim


def child(label: str, mode: str, rows: list[str]) -> None:
    import contextlib

    import torch

    import flashtile
    from flashtile.bench import measure, peers

    backward, deterministic = mode != "fwd", mode == "det"
    result = {}
    for i, row in enumerate([rows[0]] + rows):
        d, n, causal = (int(x) for x in row.split(","))
        causal = bool(causal)
        heads, batch = WIDTH // d, max(1, TOKENS // n)
        q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = measure.attention_flops(batch, heads, n, n, d, causal=causal, backward=backward)
        if backward:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            ours = peers.backward_runner(
                lambda: flashtile.attention(*leaves, causal=causal, deterministic=deterministic), leaves)
            cudnn = peers.sdpa_backward_runner("sdpa-cudnn", q, k, v, causal)
            dout = torch.randn_like(q)
            flash = peers.sdpa_runner("sdpa-flash", *leaves, causal)
            expected = torch.autograd.grad(flash(), leaves, dout.transpose(1, 2))
            got, again = (torch.autograd.grad(flashtile.attention(*leaves, causal=causal, deterministic=deterministic),
                                              leaves, dout) for _ in range(2))
            error = max((g - e).abs().max().item() for g, e in zip(got, expected))
            repeatable = all(torch.equal(a, b) for a, b in zip(got, again))
        else:
            ours = lambda: flashtile.attention(q, k, v, causal=causal)  # noqa: E731
            cudnn = peers.sdpa_runner("sdpa-cudnn", q, k, v, causal)
            with torch.no_grad():
                expected = peers.sdpa_runner("sdpa-flash", q, k, v, causal)().transpose(1, 2)
                error = (ours() - expected).abs().max().item()
        with contextlib.nullcontext() if backward else torch.no_grad():
            ours_ms, cudnn_ms = measure.time_cuda(ours), measure.time_cuda(cudnn)
        if i > 0:
            result[row] = [round(flops / ours_ms / 1e9), round(flops / cudnn_ms / 1e9), round(error, 4)]
            if deterministic:
                result[row].append(repeatable)
    print(label, json.dumps(result), flush=True)


def main(argv: list[str]) -> None:
    trees, rows, rounds, mode = [], None, 2, "fwd"
    args = iter(argv)
    for arg in args:
        if arg == "--bwd":
            mode = "bwd"
        elif arg == "--deterministic":
            mode = "det"
        elif arg == "--rounds":
            rounds = int(next(args))
        elif arg == "--rows":
            rows = list(args)
        else:
            label, _, src = arg.partition("=")
            trees.append((label, os.path.abspath(src)))
    if not trees:
        sys.exit(__doc__)
    rows = rows or (ROWS if mode == "fwd" else BWD_ROWS)
    for _ in range(rounds):
        for label, src in trees:
            env = dict(os.environ, PYTHONPATH=src, PYTHONUNBUFFERED="1")
            try:
                subprocess.run([sys.executable, __file__, "--child", label, mode, *rows], env=env,
                               timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(label, "timed out", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main(sys.argv[1:])
