"""Strong scaling of ring attention: forward + backward of one sequence on one GPU and over every GPU of the
machine, and the efficiency t(1 GPU) / (W · t(W GPUs)).

    PYTHONPATH=src python scripts/bench_ring.py [--out DIR] [tokens ...]

batch 1, 16 heads, head dim 128, bf16, causal, zigzag layout (issue 18's shapes: 131072 and 262144 tokens).
Times are medians of REPS calls after a warm-up, each call fenced by a synchronize and a barrier on every rank.
With --out, DIR/results/ring.json is written and DIR/performance.md regenerated.
"""

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashtile
from flashtile import distributed
from flashtile.bench import report
from flashtile.bench.system import describe

HEADS, HEAD_DIM = 16, 128
REPS = 3


def _leaves(n: int, device, generator):
    return [torch.randn(1, n, HEADS, HEAD_DIM, generator=generator, device=device, dtype=torch.bfloat16)
            for _ in range(4)]


def _median_seconds(step, barrier=lambda: None) -> float:
    step()  # warm-up: compiles, allocator
    times = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        barrier()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, sizes: list[int], found) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    for n in sizes:
        g = torch.Generator(device=device).manual_seed(n)
        q, k, v, dout = _leaves(n, device, g)
        if rank == 0:  # one GPU, the whole sequence, while the others wait at the barrier
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]

            def single():
                flashtile.attention(*leaves, causal=True).backward(dout)

            found[f"single_{n}"] = _median_seconds(single)
            del leaves
        dist.barrier()
        shards = [distributed.shard(t).requires_grad_() for t in (q, k, v)]
        dout_shard = distributed.shard(dout)
        del q, k, v, dout

        def ring():
            distributed.ring_attention(*shards, causal=True).backward(dout_shard)

        seconds = _median_seconds(ring, dist.barrier)
        if rank == 0:
            found[f"ring_{n}"] = seconds
        del shards
        torch.cuda.empty_cache()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="docs folder: results/ring.json is written there")
    parser.add_argument("tokens", nargs="*", type=int, default=[131072, 262144])
    args = parser.parse_args()
    world = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found = mp.Manager().dict()
    mp.spawn(_rank, args=(world, port, args.tokens, found), nprocs=world)
    rows = []
    print(f"forward + backward, b1 h{HEADS} d{HEAD_DIM} bf16 causal, zigzag over {world} GPUs")
    print(f"{'tokens':>8} {'1 GPU s':>9} {f'{world} GPUs s':>10} {'efficiency':>11}")
    for n in args.tokens:
        single, ring = found[f"single_{n}"], found[f"ring_{n}"]
        rows.append({"tokens": n, "single_s": single, "ring_s": ring, "efficiency": single / (world * ring)})
        print(f"{n:>8} {single:>9.3f} {ring:>10.3f} {single / (world * ring):>11.3f}")
    if args.out:
        path = Path(args.out) / "results" / "ring.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"world": world, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bf16",
                                    "causal": True, "layout": "zigzag", "rows": rows, "system": describe()}, indent=1))
        print(f"wrote {path} and {report.write_performance(Path(args.out))}")


if __name__ == "__main__":
    main()
