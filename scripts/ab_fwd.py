"""A/B of the forward between source trees: each tree's code in its own process, the trees taking turns.

    python scripts/ab_fwd.py LABEL=SRC [LABEL=SRC ...] [--rounds N] [--rows d,n,causal ...]

SRC is a folder that holds the `flashtile` package, e.g. `src` for the working tree and, for the last commit,
`git archive HEAD src | tar -x -C /tmp/old` then `/tmp/old/src`. Every round runs one process per tree in
order, each under a timeout (a hung kernel costs that process, not the whole call); each process prints one
line: per row, flashtile's and sdpa-cudnn's TFLOP/s under no_grad (the matrix's shapes: 16384 tokens, heads x
head_dim = 2048, bf16) and flashtile's largest difference from sdpa-flash. The first row runs twice and its
first timing is dropped (the GPU's clocks are still rising). A quick look while tuning; the committed comparison
is `flashtile bench matrix`.
"""

import json
import os
import subprocess
import sys

ROWS = ["64,1024,0", "64,1024,1", "64,4096,1", "128,1024,0", "128,1024,1", "256,1024,0", "256,1024,1",
        "128,16384,1", "64,16384,0", "64,1000,1", "128,1000,1"]
TIMEOUT_S = 120
TOKENS = 16384
WIDTH = 2048  # heads x head_dim


def child(label: str, rows: list[str]) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import flashtile
    from flashtile.bench import measure

    result = {}
    for i, row in enumerate([rows[0]] + rows):
        d, n, causal = (int(x) for x in row.split(","))
        heads, batch = WIDTH // d, max(1, TOKENS // n)
        q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        flops = measure.attention_flops(batch, heads, n, n, d, causal=bool(causal))
        with torch.no_grad():
            ours = measure.time_cuda(lambda: flashtile.attention(q, k, v, causal=bool(causal)))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = measure.time_cuda(lambda: sdpa(qt, kt, vt, is_causal=bool(causal)))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                expected = sdpa(qt, kt, vt, is_causal=bool(causal)).transpose(1, 2)
            error = (flashtile.attention(q, k, v, causal=bool(causal)) - expected).abs().max().item()
        if i > 0:
            result[row] = [round(flops / ours / 1e9), round(flops / cudnn / 1e9), round(error, 4)]
    print(label, json.dumps(result), flush=True)


def main(argv: list[str]) -> None:
    trees, rows, rounds = [], ROWS, 2
    args = iter(argv)
    for arg in args:
        if arg == "--rounds":
            rounds = int(next(args))
        elif arg == "--rows":
            rows = list(args)
        else:
            label, _, src = arg.partition("=")
            trees.append((label, os.path.abspath(src)))
    if not trees:
        sys.exit(__doc__)
    for _ in range(rounds):
        for label, src in trees:
            env = dict(os.environ, PYTHONPATH=src, PYTHONUNBUFFERED="1")
            try:
                subprocess.run([sys.executable, __file__, "--child", label, *rows], env=env, timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(label, "timed out", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1:])
