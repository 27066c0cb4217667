"""Rung 4's backward against fp64 autograd of the reference: every feature, determinism, CUDA graphs, compile."""

import itertools

import pytest
import torch

import flashtile
from feature_cases import DTYPES, case_id, feature_cases, feature_options
from flashtile.reference import attention_ref, varlen_apply
from flashtile.testing import compare_grads

pytestmark = pytest.mark.gpu  # skipped where no CUDA device exists (conftest.py)

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128), (40, 40), (136, 136)]
SEQLENS = [(1, 1), (63, 63), (1000, 1000), (63, 1000), (1000, 63), (257, 129), (4097, 4097), (1, 300)]

CASES = feature_cases(HEAD_DIMS, SEQLENS)


def _inputs(batch, sq, sk, hq, hkv, d, dv, dtype):
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(batch, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(batch, sk, hkv, dv, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_gradients_of_every_feature(case, poisoned_grads):
    batch, sq, sk, hq, hkv, d, dv, dtype, features = case
    torch.manual_seed(sum(map(ord, str(case))))
    q, k, v = _inputs(batch, sq, sk, hq, hkv, d, dv, dtype)
    options = feature_options(features, hq, batch, per_batch=batch > 1 and sq % 2 == 1)
    out = flashtile.attention(q, k, v, **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    result = compare_grads(q, k, v, dout, grads, **options)
    assert result.ok, f"{case}: {result}"


VARLEN = [
    ([1, 63, 1000, 17], [1, 63, 1000, 17], {}),
    ([5, 300, 1], [700, 64, 3], {"causal": True}),
    ([129, 1, 777], [129, 1, 777], {"causal": True, "alibi": True}),
    ([100, 200, 300], [50, 400, 300], {"window_size": (32, 32), "softcap": 10.0}),
    ([64, 64, 64, 64], [128, 0, 64, 1], {"causal": True}),  # an empty key sequence: its rows see nothing
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("lengths_q,lengths_k,features", VARLEN)
def test_varlen_gradients(lengths_q, lengths_k, features, d, dv, dtype, poisoned_grads):
    hq, hkv = 4, 2
    cu_q = torch.tensor([0] + list(itertools.accumulate(lengths_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(itertools.accumulate(lengths_k)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths_q), hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), hkv, dv, device="cuda", dtype=dtype, requires_grad=True)
    options = feature_options(features, hq, len(lengths_q), per_batch=True)
    out = flashtile.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def packed_ref(q, k, v, dtype, alibi_slopes=None, **kw):
        return varlen_apply(lambda *a, **o: attention_ref(*a, dtype=dtype, **o), q, k, v, cu_q, cu_k,
                            alibi_slopes=alibi_slopes, **kw)

    result = compare_grads(q, k, v, dout, grads, fn=packed_ref, **options)
    assert result.ok, result


def test_strided_views_of_a_packed_qkv(poisoned_grads):
    """Gradients flow into one (b, s, 3, h, d) buffer through non-contiguous views (deterministic mode, so the
    two backward passes below agree bitwise)."""
    qkv = torch.randn(2, 777, 3, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(dim=2)
    out = flashtile.attention(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert compare_grads(q, k, v, dout, grads, causal=True).ok
    (packed,) = torch.autograd.grad(out, qkv, dout)
    assert torch.equal(packed[:, :, 0], grads[0]) and torch.equal(packed[:, :, 2], grads[2])


@pytest.mark.parametrize("features", [{"causal": True}, {}, {"window_size": (200, 10)}], ids=str)
@pytest.mark.parametrize("heads", [(16, 16), (16, 2)], ids=str)
# On Hopper: 64, 128 and 256 run wgmma/bwd.cu (its layouts), 96 mma/bwd.cu, 192 mma/bwd_grid.cu.
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_deterministic_backward_is_bitwise_repeatable(features, heads, head_dim):
    torch.manual_seed(0)
    q, k, v = _inputs(2, 1500, 1500, *heads, head_dim, head_dim, torch.bfloat16)
    out = flashtile.attention(q, k, v, deterministic=True, **features)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(9):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert compare_grads(q, k, v, dout, first, **features).ok


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_varlen_backward_is_bitwise_repeatable(head_dim, causal):
    """Sequences that end inside a query tile: a tile's rows past its sequence belong to the next one, whose
    adds run in other turns."""
    torch.manual_seed(1)
    lengths = [100, 1, 777, 300, 65]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flashtile.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal,
                                     deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(9):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))

    def packed_ref(q, k, v, dtype, **kw):
        return varlen_apply(lambda *a, **o: attention_ref(*a, dtype=dtype, **o), q, k, v, cu, cu, **kw)

    assert compare_grads(q, k, v, dout, first, fn=packed_ref, causal=causal).ok


def test_a_cuda_graph_captures_and_replays_a_training_step():
    torch.manual_seed(0)
    q, k, v = _inputs(2, 300, 300, 8, 2, 64, 64, torch.bfloat16)
    weight = torch.randn(2, 300, 8, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        out = flashtile.attention(q, k, v, causal=True)
        return torch.autograd.grad((out.float() * weight).sum(), (q, k, v))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = step()
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
        graph.replay()
        expected = step()
        assert all(torch.equal(a, b) for a, b in zip(static_grads, expected))


def test_torch_compile_fullgraph_trains_a_block():
    torch.manual_seed(0)
    dim, heads = 256, 4

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, heads, dim // heads)).unbind(dim=2)
            return x + self.proj(flashtile.attention(q, k, v, causal=True).flatten(-2))

    block = Block().cuda().to(torch.bfloat16)
    x = torch.randn(2, 512, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True)
    eager_out = block(x)
    eager_grad = torch.autograd.grad(eager_out.float().square().sum(), x)[0]
    out = compiled(x)
    grad = torch.autograd.grad(out.float().square().sum(), x)[0]
    torch.testing.assert_close(out, eager_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grad, eager_grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_heads_in_groups_when_scratch_is_bounded(varlen, monkeypatch, poisoned_grads):
    """Past SCRATCH_LIMIT_BYTES the backward runs one group of heads at a time; force it on a small problem."""
    from flashtile import backward

    monkeypatch.setattr(backward, "SCRATCH_LIMIT_BYTES", 1)  # one key/value head per launch
    torch.manual_seed(3)
    q, k, v = _inputs(2, 200, 300, 8, 2, 64, 64, torch.bfloat16)
    options = {"causal": True, "alibi_slopes": torch.rand(2, 8, device="cuda")}
    if varlen:
        cu_q = torch.tensor([0, 200, 400], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
        q, k, v = (t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v))
        out = flashtile.varlen_attention(q, k, v, cu_q, cu_k, 200, 300, **options)

        def fn(q, k, v, dtype, alibi_slopes=None, **kw):
            return varlen_apply(lambda *a, **o: attention_ref(*a, dtype=dtype, **o), q, k, v, cu_q, cu_k,
                                alibi_slopes=alibi_slopes, **kw)
    else:
        out = flashtile.attention(q, k, v, **options)
        fn = attention_ref
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    result = compare_grads(q, k, v, dout, grads, fn=fn, **options)
    assert result.ok, result


def test_the_first_cuda_work_of_the_backward_thread_is_ours():
    """autograd runs CUDA backwards on a thread of its own, with no current context until the CUDA runtime runs
    there: in a fresh process whose backward starts with flashtile's launches, the launch makes the device's
    primary context current instead of failing with CUDA_ERROR_INVALID_CONTEXT."""
    import subprocess
    import sys

    script = ("import torch, flashtile\n"
              "q, k, v = (torch.randn(1, 64, 2, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)"
              " for _ in range(3))\n"
              "out = flashtile.attention(q, k, v, causal=True)\n"
              "dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))\n"
              "torch.cuda.synchronize()\n"
              "assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()\n"
              "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
