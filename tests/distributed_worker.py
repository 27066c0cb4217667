"""One rank of tests/test_distributed.py: ring attention on this rank's shard against flashtile.attention on the
whole sequence; writes the largest errors as JSON. Usage: distributed_worker.py RANK WORLD PORT LAYOUT CAUSAL OUT"""

import json
import os
import sys

import torch
import torch.distributed as dist

import flashtile
from flashtile import distributed


def main(rank: int, world: int, port: str, layout: str, causal: bool, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(7)  # the same whole sequence on every rank
    n, heads_q, heads_kv = 16 * world, 4, 2  # GQA: 4 query heads share 2 kv heads
    q = torch.randn(2, n, heads_q, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, n, heads_kv, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, n, heads_kv, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(2, n, heads_q, 16, generator=g, dtype=torch.float64)
    leaves = [distributed.shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    out, lse = distributed.ring_attention(*leaves, causal=causal, layout=layout, return_lse=True)
    out.backward(distributed.shard(dout, layout=layout))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = flashtile.attention(*full, causal=causal, return_lse=True)
    ref_out.backward(dout)
    errors = {"out": (distributed.unshard(out.detach(), layout=layout) - ref_out.detach()).abs().max().item(),
              "lse": (distributed.unshard(lse.detach(), layout=layout, seq_dim=2) - ref_lse.detach()).abs().max().item()}
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, full):
        errors[name] = (distributed.unshard(leaf.grad, layout=layout) - ref.grad).abs().max().item()
    dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(errors, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1", sys.argv[6])
