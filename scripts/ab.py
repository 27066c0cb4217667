"""A/B of the forward or the backward between source trees: each tree's code in its own process, in turns.

    python scripts/ab.py LABEL=SRC [LABEL=SRC ...] [--bwd] [--rounds N] [--rows d,n,causal ...]

SRC is a folder that holds the `flashtile` package, e.g. `src` for the working tree and, for the last commit,
`git archive HEAD src | tar -x -C /tmp/old` then `/tmp/old/src`. Every round runs one process per tree in
order, each under a timeout (a hung kernel costs that process, not the whole call); each process prints one
line: per row, flashtile's and sdpa-cudnn's TFLOP/s (the matrix's shapes: 16384 tokens, heads x head_dim = 2048,
bf16) and flashtile's largest difference from sdpa-flash: of the forward under no_grad, or with --bwd of the
backward alone (the gradients of q, k and v for a fixed dO, after one forward; the largest difference over dq,
dk and dv). The first row runs twice and its
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


def child(label: str, backward: bool, rows: list[str]) -> None:
    import torch

    from flashtile.bench import measure

    result = {}
    for i, row in enumerate([rows[0]] + rows):
        d, n, causal = (int(x) for x in row.split(","))
        heads, batch = WIDTH // d, max(1, TOKENS // n)
        q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = measure.attention_flops(batch, heads, n, n, d, causal=bool(causal), backward=backward)
        if backward:
            ours, cudnn, error = time_backward(q, k, v, bool(causal))
        else:
            ours, cudnn, error = time_forward(q, k, v, bool(causal))
        if i > 0:
            result[row] = [round(flops / ours / 1e9), round(flops / cudnn / 1e9), round(error, 4)]
    print(label, json.dumps(result), flush=True)


def time_forward(q, k, v, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import flashtile
    from flashtile.bench import measure

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with torch.no_grad():
        ours = measure.time_cuda(lambda: flashtile.attention(q, k, v, causal=causal))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = measure.time_cuda(lambda: sdpa(qt, kt, vt, is_causal=causal))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            expected = sdpa(qt, kt, vt, is_causal=causal).transpose(1, 2)
        error = (flashtile.attention(q, k, v, causal=causal) - expected).abs().max().item()
    return ours, cudnn, error


def time_backward(q, k, v, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import flashtile
    from flashtile.bench import measure

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    heads_first = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)
    out = flashtile.attention(*leaves, causal=causal)
    ours = measure.time_cuda(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        peer_out = sdpa(*heads_first, is_causal=causal)
        cudnn = measure.time_cuda(lambda: torch.autograd.grad(peer_out, heads_first, dout.transpose(1, 2),
                                                               retain_graph=True))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash_out = sdpa(*heads_first, is_causal=causal)
        expected = torch.autograd.grad(flash_out, heads_first, dout.transpose(1, 2))
    error = max((g - e.transpose(1, 2)).abs().max().item() for g, e in zip(grads, expected))
    return ours, cudnn, error


def main(argv: list[str]) -> None:
    trees, rows, rounds, backward = [], None, 2, False
    args = iter(argv)
    for arg in args:
        if arg == "--bwd":
            backward = True
        elif arg == "--rounds":
            rounds = int(next(args))
        elif arg == "--rows":
            rows = list(args)
        else:
            label, _, src = arg.partition("=")
            trees.append((label, os.path.abspath(src)))
    if not trees:
        sys.exit(__doc__)
    rows = rows or (BWD_ROWS if backward else ROWS)
    for _ in range(rounds):
        for label, src in trees:
            env = dict(os.environ, PYTHONPATH=src, PYTHONUNBUFFERED="1")
            try:
                subprocess.run([sys.executable, __file__, "--child", label, str(int(backward)), *rows], env=env,
                               timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(label, "timed out", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3] == "1", sys.argv[4:])
    else:
        main(sys.argv[1:])
