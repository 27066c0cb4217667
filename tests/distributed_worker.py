"""One rank of tests/test_distributed.py: ring attention on this rank's shard against attention on the whole
sequence; writes what it found as JSON.

Usage: distributed_worker.py RANK WORLD PORT LAYOUT CAUSAL OUT [cuda]
  cpu (default): gloo, fp64; the largest errors against flashtile.attention on the whole sequence.
  cuda: NCCL, bf16 on GPU RANK; rank 0 compares the unsharded output, LSE and gradients with the fp64 reference
  under the tests' bf16 rule (testing.compare), beside single-GPU flashtile on the same inputs.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import flashtile
from flashtile import distributed
from flashtile.testing import compare, compare_grads


def _inputs(n: int, dtype, device, generator):
    q = torch.randn(2, n, 4, 64, generator=generator, device=device).to(dtype)  # GQA: 4 query heads, 2 kv heads
    k = torch.randn(2, n, 2, 64, generator=generator, device=device).to(dtype)
    v = torch.randn(2, n, 2, 64, generator=generator, device=device).to(dtype)
    dout = torch.randn(2, n, 4, 64, generator=generator, device=device).to(dtype)
    return q, k, v, dout


def _ring(q, k, v, dout, layout: str, causal: bool):
    """The unsharded output, LSE and gradients of ring attention over this group's shards of q, k, v."""
    leaves = [distributed.shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    out, lse = distributed.ring_attention(*leaves, causal=causal, layout=layout, return_lse=True)
    out.backward(distributed.shard(dout, layout=layout))
    return (distributed.unshard(out.detach(), layout=layout), distributed.unshard(lse.detach(), layout=layout, seq_dim=2),
            [distributed.unshard(leaf.grad, layout=layout) for leaf in leaves])


def main_cpu(rank: int, world: int, layout: str, causal: bool) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(7)  # the same whole sequence on every rank
    q, k, v, dout = _inputs(16 * world, torch.float64, "cpu", g)
    out, lse, grads = _ring(q, k, v, dout, layout, causal)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = flashtile.attention(*full, causal=causal, return_lse=True)
    ref_out.backward(dout)
    errors = {"out": (out - ref_out.detach()).abs().max().item(), "lse": (lse - ref_lse.detach()).abs().max().item()}
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, full):
        errors[name] = (grad - ref.grad).abs().max().item()
    return errors


def main_cuda(rank: int, world: int, layout: str, causal: bool) -> dict:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    g = torch.Generator(device=device).manual_seed(7)  # Philox: the same whole sequence on every GPU
    q, k, v, dout = _inputs(1024 * world, torch.bfloat16, device, g)
    out, lse, grads = _ring(q, k, v, dout, layout, causal)
    if rank != 0:
        return {}
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    single_out, single_lse = flashtile.attention(*full, causal=causal, return_lse=True)
    single_out.backward(dout)
    found = {"ring": (compare(q, k, v, out, lse, causal=causal), compare_grads(q, k, v, dout, grads, causal=causal)),
             "single": (compare(q, k, v, single_out.detach(), single_lse.detach(), causal=causal),
                        compare_grads(q, k, v, dout, [t.grad for t in full], causal=causal))}
    return {name: {"forward_ok": fwd.ok, "grads_ok": bwd.ok, "forward": str(fwd), "grads": str(bwd)}
            for name, (fwd, bwd) in found.items()}


def main(rank: int, world: int, port: str, layout: str, causal: bool, out_path: str, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    result = (main_cuda if device == "cuda" else main_cpu)(rank, world, layout, causal)
    dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1", sys.argv[6],
         sys.argv[7] if len(sys.argv) > 7 else "cpu")
