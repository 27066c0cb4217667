"""Small calls of every rung and every forward feature, for compute-sanitizer (memcheck / racecheck)."""

import sys

import torch

import flashtile
from flashtile import ladder, ops

first_rung = int(sys.argv[1]) if len(sys.argv) > 1 else 0
for rung in ladder.RUNGS[first_rung:]:
    for dtype in (torch.bfloat16, torch.float32):
        if dtype not in rung.dtypes:
            continue
        for (sq, sk, d, causal) in ((100, 77, 64, True), (65, 130, 128, False), (1, 33, 40, True)):
            q = torch.randn(2, sq, 4, d, device="cuda", dtype=dtype)
            k = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype)
            flashtile.attention(q, k, k, causal=causal, return_lse=True, rung=rung.name)
# Rung 5 (Hopper) at its other head dim, with a window and GQA (its loop above covers d40/d64/d128).
if torch.cuda.get_device_capability() == (9, 0):
    q = torch.randn(2, 300, 4, 256, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 200, 2, 256, device="cuda", dtype=torch.bfloat16)
    flashtile.attention(q, k, k, window_size=(70, 5), return_lse=True, rung="hopper")
    # The tail split (d128, no mask): one unit past the blocks' round, 24 key tiles shared out in runs of one.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q = torch.randn(1, 128, sms + 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 3000, sms + 1, 128, device="cuda", dtype=torch.bfloat16)
    flashtile.attention(q, k, k, return_lse=True, rung="hopper")
for d, dv in ((96, 96), (192, 128), (256, 256)):
    q = torch.randn(1, 70, 4, d, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 90, 4, d, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 90, 4, dv, device="cuda", dtype=torch.float16)
    flashtile.attention(q, k, v, window_size=(20, 3), softcap=5.0, alibi_slopes=torch.rand(4, device="cuda"),
                        return_lse=True)
cu = torch.tensor([0, 5, 5, 80], dtype=torch.int32, device="cuda")
qv = torch.randn(80, 4, 128, device="cuda", dtype=torch.bfloat16)
flashtile.varlen_attention(qv, qv, qv, cu, cu, 75, 75, causal=True, return_lse=True)
# The backward kernels: plain, split passes (d256), score mods, deterministic, varlen.
for d, dv, options in ((64, 64, {"causal": True}), (128, 128, {"deterministic": True}), (256, 256, {}),
                       (128, 128, {"softcap": 5.0, "window_size": (20, 3)}), (192, 128, {"causal": True})):
    q = torch.randn(2, 70, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 150, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 150, 2, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flashtile.attention(q, k, v, **options).sum().backward()
qv = qv.detach().requires_grad_()
flashtile.varlen_attention(qv, qv, qv, cu, cu, 75, 75, causal=True).sum().backward()
# d256 varlen: the dQ pass's last key blocks by cp.async, its causal blocks of 128 queries.
wide_qv = torch.randn(80, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
flashtile.varlen_attention(wide_qv, wide_qv, wide_qv, cu, cu, 75, 75, causal=True).sum().backward()
# Offsets that lie (past the packed rows, falling, longer than max_seqlen): the kernels clamp them on the device.
lying = torch.tensor([0, 30, 10**6, 20, -5, 80], dtype=torch.int32, device="cuda")
out, lse = ops.forward(qv, qv, qv, lying, lying, 40, 40, 0.125, -1, 0, 0.0, None, False)
ops.backward_op(torch.randn_like(out), qv, qv, qv, out, lse, lying, lying, 40, 40, 0.125, -1, 0, 0.0, None, False)
# The gradient of the log-sum-exp enters between the preprocess and the main kernel.
q = torch.randn(2, 70, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
out, lse = flashtile.attention(q, q, q, causal=True, return_lse=True)
torch.autograd.grad((out, lse), q, (torch.randn_like(out), torch.randn_like(lse)))
# Decoding: the split parts and their merge (d256: the cp.async build), ragged lengths (one past the cache, one
# empty), pages of 16, 32, 48 (row-group builds) and 64 rows with one index outside the pool (the tensor maps bound
# every read).
wide = torch.randn(2, 1500, 2, 256, device="cuda", dtype=torch.bfloat16)
flashtile.attention(torch.randn(2, 1, 8, 256, device="cuda", dtype=torch.bfloat16), wide, wide, return_lse=True)
q = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
cache = torch.randn(3, 3000, 2, 128, device="cuda", dtype=torch.bfloat16)
flashtile.attention(q, cache, cache, return_lse=True)
lengths = torch.tensor([2999, 0, 5000], dtype=torch.int32, device="cuda")
flashtile.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, num_splits=3, return_softmax_lse=True)
if torch.cuda.get_device_capability() == (9, 0):
    for page in (16, 32, 48, 64):
        pages = torch.randn(3 * -(-3000 // page), page, 2, 128, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(pages.shape[0], device="cuda").view(3, -1).int()
        table[1, 2] = pages.shape[0] + 7
        flashtile.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lengths, block_table=table, num_splits=2)
torch.cuda.synchronize()
print("sanitize: every rung, the backward and decoding ran")
