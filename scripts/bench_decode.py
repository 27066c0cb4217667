"""Decode bandwidth beside torch's SDPA backends, in one run: one query token per sequence against a
contiguous cache, d128 bf16; effective TB/s = bytes of K and V read / time (TARGETS.md's decode rows).
Usage (on the GPU machine): python scripts/bench_decode.py [--out DIR] (writes DIR/results/decode.json and
regenerates DIR/performance.md)."""

import argparse
import json
from functools import partial
from pathlib import Path

import torch

import flashtile
from flashtile.bench import measure, peers, report
from flashtile.bench.system import describe

ROWS = [(64, 32768, 64, 8), (8, 131072, 32, 8), (128, 4096, 32, 8), (32, 8192, 32, 32), (1, 65536, 32, 8)]
KERNELS = ("flashtile", "sdpa-flash", "sdpa-cudnn")


def runner(name, q, k, v):
    if name == "flashtile":
        return lambda: flashtile.attention(q, k, v, causal=True)
    return peers.sdpa_runner(name, q, k, v, causal=False)  # one token: causal masks nothing (SDPA aligns top-left)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="docs folder: results/decode.json and performance.md are written there")
    args = parser.parse_args()
    rows = []
    print(f"{'batch, cache, heads q/kv':<26}" + "".join(f"{k:>12}" for k in KERNELS) + "   (TB/s)")
    for batch, cache, heads_q, heads_kv in ROWS:
        q = torch.randn(batch, 1, heads_q, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, cache, heads_kv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kv_bytes = 2 * k.numel() * k.element_size()
        times = measure.time_rounds({name: partial(runner, name, q, k, v) for name in KERNELS})
        cells = "".join(f"{kv_bytes / ms / 1e9:>12.2f}" if ms else f"{'-':>12}" for ms in times.values())
        print(f"{f'{batch}, {cache // 1024}k, {heads_q}/{heads_kv}':<26}{cells}", flush=True)
        rows.append({"batch": batch, "cache": cache, "heads_q": heads_q, "heads_kv": heads_kv,
                     "tbps": {name: kv_bytes / ms / 1e9 if ms else None for name, ms in times.items()}})
    if args.out:
        path = Path(args.out) / "results" / "decode.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kind": "decode", "dtype": "bf16", "head_dim": 128, "rows": rows,
                                    "system": describe()}, indent=1))
        print(f"wrote {path} and {report.write_performance(Path(args.out))}")


if __name__ == "__main__":
    main()
