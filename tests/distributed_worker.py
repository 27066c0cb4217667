"""One rank of tests/test_distributed.py: ring attention on this rank's shard against attention on the whole
sequence; writes what it found as JSON.

Usage: distributed_worker.py RANK WORLD PORT LAYOUT CAUSAL OUT [cpu|cuda|varlen] [LEFT,RIGHT]
  cpu (default): gloo, fp64; the largest errors against flashtile.attention on the whole sequence, with the
  sliding window LEFT,RIGHT (default -1,-1).
  varlen: gloo, fp64, a packed batch of documents (ring_varlen_attention) against flashtile.varlen_attention.
  cuda: NCCL, bf16 on GPU RANK; rank 0 compares the unsharded output, LSE and gradients with the fp64 reference
  under the tests' bf16 rule (testing.compare), beside single-GPU flashtile on the same inputs.
  cuda-varlen: the same for a packed batch of documents (ring_varlen_attention; the window is not used).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import flashtile
from flashtile import distributed
from flashtile.reference import attention_ref, varlen_apply
from flashtile.testing import Comparison, compare, compare_grads


def _inputs(n: int, dtype, device, generator):
    q = torch.randn(2, n, 4, 64, generator=generator, device=device).to(dtype)  # GQA: 4 query heads, 2 kv heads
    k = torch.randn(2, n, 2, 64, generator=generator, device=device).to(dtype)
    v = torch.randn(2, n, 2, 64, generator=generator, device=device).to(dtype)
    dout = torch.randn(2, n, 4, 64, generator=generator, device=device).to(dtype)
    return q, k, v, dout


def _ring(q, k, v, dout, layout: str, causal: bool, window=(-1, -1)):
    """The unsharded output, LSE and gradients of ring attention over this group's shards of q, k, v."""
    leaves = [distributed.shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    out, lse = distributed.ring_attention(*leaves, causal=causal, window_size=window, layout=layout, return_lse=True)
    out.backward(distributed.shard(dout, layout=layout))
    return (distributed.unshard(out.detach(), layout=layout), distributed.unshard(lse.detach(), layout=layout, seq_dim=2),
            [distributed.unshard(leaf.grad, layout=layout) for leaf in leaves])


def main_cpu(rank: int, world: int, layout: str, causal: bool, window=(-1, -1)) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(7)  # the same whole sequence on every rank
    q, k, v, dout = _inputs(16 * world, torch.float64, "cpu", g)
    out, lse, grads = _ring(q, k, v, dout, layout, causal, window)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = flashtile.attention(*full, causal=causal, window_size=window, return_lse=True)
    ref_out.backward(dout)
    errors = {"out": (out - ref_out.detach()).abs().max().item(), "lse": (lse - ref_lse.detach()).abs().max().item()}
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, full):
        errors[name] = (grad - ref.grad).abs().max().item()
    return errors


# Documents of a packed batch per rank count (total 32 x world tokens): short and long ones, one crossing every
# chunk boundary of both layouts, and an empty one.
DOCUMENTS = {2: [5, 17, 3, 0, 24, 15], 4: [5, 17, 3, 40, 0, 15, 48]}


def main_varlen(rank: int, world: int, layout: str, causal: bool, window=(-1, -1)) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(7)
    lengths = DOCUMENTS[world]
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    q, k, v, dout = (t[0] for t in _inputs(sum(lengths), torch.float64, "cpu", g))  # (tokens, heads, dim)
    leaves = [distributed.shard(t, layout=layout, seq_dim=0).requires_grad_() for t in (q, k, v)]
    out, lse = distributed.ring_varlen_attention(*leaves, cu, causal=causal, layout=layout, return_lse=True)
    out.backward(distributed.shard(dout, layout=layout, seq_dim=0))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    longest = max(lengths)
    ref_out, ref_lse = flashtile.varlen_attention(*full, cu, cu, longest, longest, causal=causal, return_lse=True)
    ref_out.backward(dout)
    errors = {"out": (distributed.unshard(out.detach(), layout=layout, seq_dim=0) - ref_out.detach()).abs().max().item(),
              "lse": (distributed.unshard(lse.detach(), layout=layout, seq_dim=1) - ref_lse.detach()).abs().max().item()}
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, full):
        errors[name] = (distributed.unshard(leaf.grad, layout=layout, seq_dim=0) - ref.grad).abs().max().item()
    return errors


def main_cuda(rank: int, world: int, layout: str, causal: bool, window=(-1, -1)) -> dict:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    g = torch.Generator(device=device).manual_seed(7)  # Philox: the same whole sequence on every GPU
    q, k, v, dout = _inputs(1024 * world, torch.bfloat16, device, g)
    out, lse, grads = _ring(q, k, v, dout, layout, causal, window)
    if rank != 0:
        return {}
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    single_out, single_lse = flashtile.attention(*full, causal=causal, window_size=window, return_lse=True)
    single_out.backward(dout)
    options = dict(causal=causal, window_size=window)
    found = {"ring": (compare(q, k, v, out, lse, **options), compare_grads(q, k, v, dout, grads, **options)),
             "single": (compare(q, k, v, single_out.detach(), single_lse.detach(), **options),
                        compare_grads(q, k, v, dout, [t.grad for t in full], **options))}
    return _verdicts(found)


def _verdicts(found: dict) -> dict:
    return {name: {"forward_ok": fwd.ok, "grads_ok": bwd.ok, "forward": str(fwd), "grads": str(bwd)}
            for name, (fwd, bwd) in found.items()}


def _compare_varlen(q, k, v, cu, out, lse, causal: bool) -> Comparison:
    """testing.compare's rule for a packed batch: errors against fp64 within ERROR_RATIO of PyTorch's own."""
    ref_out, ref_lse = varlen_apply(attention_ref, q, k, v, cu, cu, causal=causal)
    torch_out, torch_lse = varlen_apply(lambda *a, **kw: attention_ref(*a, dtype=q.dtype, **kw), q, k, v, cu, cu,
                                        causal=causal)
    err = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    return Comparison(err(out, ref_out), err(torch_out, ref_out), err(lse, ref_lse), err(torch_lse, ref_lse),
                      finite=bool(torch.isfinite(out).all()))


def main_cuda_varlen(rank: int, world: int, layout: str, causal: bool, window=(-1, -1)) -> dict:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    g = torch.Generator(device=device).manual_seed(7)
    total = 1024 * world
    lengths = [total // 20, total // 3, 3, 0, total // 4]  # and the rest: documents crossing chunk boundaries
    lengths.append(total - sum(lengths))
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device=device)
    q, k, v, dout = (t[0] for t in _inputs(total, torch.bfloat16, device, g))
    leaves = [distributed.shard(t, layout=layout, seq_dim=0).requires_grad_() for t in (q, k, v)]
    out, lse = distributed.ring_varlen_attention(*leaves, cu, causal=causal, layout=layout, return_lse=True)
    out.backward(distributed.shard(dout, layout=layout, seq_dim=0))
    out = distributed.unshard(out.detach(), layout=layout, seq_dim=0)
    lse = distributed.unshard(lse.detach(), layout=layout, seq_dim=1)
    grads = [distributed.unshard(leaf.grad, layout=layout, seq_dim=0) for leaf in leaves]
    if rank != 0:
        return {}
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    longest = max(lengths)
    single_out, single_lse = flashtile.varlen_attention(*full, cu, cu, longest, longest, causal=causal, return_lse=True)
    single_out.backward(dout)

    def reference(q, k, v, dtype, causal):
        return varlen_apply(lambda *a, **kw: attention_ref(*a, dtype=dtype, **kw), q, k, v, cu, cu, causal=causal)

    found = {"ring": (_compare_varlen(q, k, v, cu, out, lse, causal),
                      compare_grads(q, k, v, dout, grads, fn=reference, causal=causal)),
             "single": (_compare_varlen(q, k, v, cu, single_out.detach(), single_lse.detach(), causal),
                        compare_grads(q, k, v, dout, [t.grad for t in full], fn=reference, causal=causal))}
    return _verdicts(found)


def main(rank: int, world: int, port: str, layout: str, causal: bool, out_path: str, device: str,
         window: tuple[int, int]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    modes = {"cpu": main_cpu, "cuda": main_cuda, "varlen": main_varlen, "cuda-varlen": main_cuda_varlen}
    result = modes[device](rank, world, layout, causal, window)
    dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1", sys.argv[6],
         sys.argv[7] if len(sys.argv) > 7 else "cpu",
         tuple(int(b) for b in sys.argv[8].split(",")) if len(sys.argv) > 8 else (-1, -1))
