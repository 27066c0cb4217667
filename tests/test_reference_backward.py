"""The CPU backward pass against autograd through the fp64 reference: the chunked loop on every case
(torch_kernel=False), torch's fused kernel on the cases it serves."""

import pytest
import torch

from flashtile.reference import (
    attention_chunked,
    attention_chunked_backward,
    attention_ref,
    varlen_apply,
    varlen_apply_backward,
)
from flashtile.testing import ABS_FLOOR, ERROR_RATIO
from nonfinite_cases import NONFINITE_CASES, case_id, check, expected_nan, make

CHUNKS = {"query_chunk": 16, "key_chunk": 32}  # small, so several query and key chunks meet in every case
FP64_RELATIVE_TOLERANCE = 1e-9

CASES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, dim_v, causal, window, softcap, alibi
    (2, 63, 63, 2, 2, 16, 16, False, (-1, -1), 0.0, None),
    (1, 17, 63, 4, 2, 16, 16, True, (-1, -1), 0.0, None),      # causal, seqlen_q < seqlen_k, GQA
    (1, 63, 17, 2, 1, 16, 8, True, (-1, -1), 0.0, None),       # causal, seqlen_q > seqlen_k: first rows see nothing
    (2, 63, 63, 2, 2, 8, 12, False, (5, 3), 0.0, None),
    (1, 63, 17, 4, 1, 8, 8, False, (4, 3), 0.0, None),         # window: rows at both ends see nothing
    (1, 33, 47, 4, 2, 16, 16, True, (-1, -1), 2.0, None),      # softcap small enough to bend the scores
    (2, 47, 33, 2, 2, 16, 16, False, (-1, -1), 0.0, "heads"),
    (2, 33, 47, 4, 2, 16, 16, True, (7, -1), 3.0, "batch"),    # softcap then ALiBi
    (1, 1, 63, 2, 2, 16, 16, True, (-1, -1), 0.0, None),
    (1, 63, 1, 2, 2, 16, 16, False, (-1, -1), 1.5, "heads"),
    (1, 1, 1, 1, 1, 8, 8, False, (-1, -1), 0.0, None),
]


def make_inputs(case, dtype=torch.float64, seed=0):
    batch, sq, sk, hq, hkv, d, dv, causal, window, softcap, alibi = case
    g = torch.Generator().manual_seed(seed * 1000 + CASES.index(case))
    q = torch.randn(batch, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(batch, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(batch, sk, hkv, dv, generator=g).to(dtype)
    dout = torch.randn(batch, sq, hq, dv, generator=g).to(dtype)
    slopes = {None: None, "heads": torch.rand(hq, generator=g), "batch": torch.rand(batch, hq, generator=g)}[alibi]
    options = {"causal": causal, "window_size": window, "softcap": softcap, "alibi_slopes": slopes}
    return q, k, v, dout, options


def autograd_grads(q, k, v, dout, dtype, **options):
    """(dq, dk, dv) from PyTorch's autograd through attention_ref computed in `dtype`."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, _ = attention_ref(q, k, v, dtype=dtype, **options)
    return torch.autograd.grad(out, (q, k, v), dout.to(dtype))


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("torch_kernel", [False, True], ids=["loop", "auto"])
@pytest.mark.parametrize("case", CASES)
def test_fp64_backward_matches_autograd_of_reference(case, torch_kernel):
    q, k, v, dout, options = make_inputs(case)
    out, lse = attention_ref(q, k, v, **options)
    grads = attention_chunked_backward(dout, q, k, v, out, lse, **options, **CHUNKS, torch_kernel=torch_kernel)
    for name, grad, want, x in zip("qkv", grads, autograd_grads(q, k, v, dout, torch.float64, **options), (q, k, v)):
        assert grad.shape == x.shape and grad.dtype == x.dtype, name
        assert torch.isfinite(grad).all(), name
        scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
        assert max_error(grad, want) <= FP64_RELATIVE_TOLERANCE * scale, f"d{name}"
    blind = torch.isneginf(lse).permute(0, 2, 1)  # (batch, seqlen_q, heads_q): rows that see no key
    assert (grads[0][blind] == 0).all()


@pytest.mark.parametrize("torch_kernel", [False, True], ids=["loop", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4], CASES[7]])
def test_low_precision_error_within_twice_pytorchs(case, dtype, torch_kernel):
    """The FlashAttention rule (flashtile.testing), on the CPU forward's own out and fp32 lse."""
    q, k, v, dout, options = make_inputs(case, dtype, seed=1)
    out, lse = attention_chunked(q, k, v, **options, **CHUNKS, torch_kernel=torch_kernel)
    grads = attention_chunked_backward(dout, q, k, v, out, lse, **options, **CHUNKS, torch_kernel=torch_kernel)
    exact = autograd_grads(q.double(), k.double(), v.double(), dout, torch.float64, **options)
    torch_grads = autograd_grads(q, k, v, dout, dtype, **options)
    for name, grad, want, theirs in zip("qkv", grads, exact, torch_grads):
        assert grad.dtype == dtype and torch.isfinite(grad).all(), name
        ours, torch_error = max_error(grad, want), max_error(theirs, want)
        assert ours <= ERROR_RATIO * torch_error + ABS_FLOOR, f"d{name}: {ours:.2e} vs torch {torch_error:.2e}"


KERNEL_CASES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, causal: what torch's fused kernel serves
    (2, 63, 63, 2, 2, 16, False),
    (1, 63, 63, 4, 2, 16, True),
    (1, 17, 63, 4, 1, 16, True),    # seqlen_q < seqlen_k: prefix and diagonal parts, dq summed
    (2, 63, 17, 2, 1, 8, True),     # seqlen_q > seqlen_k: the first rows see nothing
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_torch_kernel_route_backward(case, dtype, torch_kernel_calls):
    """Forward and backward on torch's fused kernel, within the FlashAttention rule; in fp64 the backward
    alone, from the reference's fp64 LSE (the forward's is fp32), to 1e-9 of autograd through the reference."""
    batch, sq, sk, hq, hkv, d, causal = case
    g = torch.Generator().manual_seed(sq * sk)
    q, k, v = (torch.randn(batch, s, h, d, generator=g).to(dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    dout = torch.randn(batch, sq, hq, d, generator=g).to(dtype)
    if dtype == torch.float64:
        out, lse = attention_ref(q, k, v, causal=causal)
    else:
        out, lse = attention_chunked(q, k, v, causal=causal)
    grads = attention_chunked_backward(dout, q, k, v, out, lse, causal=causal)
    assert torch_kernel_calls == (["backward"] if dtype == torch.float64 else ["forward", "backward"])
    exact = autograd_grads(q.double(), k.double(), v.double(), dout, torch.float64, causal=causal)
    torch_grads = autograd_grads(q, k, v, dout, dtype, causal=causal)
    for name, grad, want, theirs, x in zip("qkv", grads, exact, torch_grads, (q, k, v)):
        assert grad.shape == x.shape and grad.dtype == dtype and grad.is_contiguous(), name
        if dtype == torch.float64:
            assert max_error(grad, want) <= FP64_RELATIVE_TOLERANCE * max(want.abs().max().item(), 1.0), f"d{name}"
        else:
            ours, torch_error = max_error(grad, want), max_error(theirs, want)
            assert ours <= ERROR_RATIO * torch_error + ABS_FLOOR, f"d{name}: {ours:.2e} vs torch {torch_error:.2e}"


class ChunkedAttention(torch.autograd.Function):
    """attention_chunked forward, attention_chunked_backward backward: what gradcheck differentiates."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        out, lse = attention_chunked(q, k, v, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, dout):
        return *attention_chunked_backward(dout, *ctx.saved_tensors, **ctx.options), None


@pytest.mark.parametrize("options", [
    {"causal": True},
    {"softcap": 1.5, "alibi_slopes": torch.tensor([0.3, 0.7]), "window_size": (3, 2)},
])
def test_gradcheck(options):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 7, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 5, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 5, 1, 3, generator=g, dtype=torch.float64, requires_grad=True)
    options = dict(options, query_chunk=3, key_chunk=2)
    assert torch.autograd.gradcheck(lambda q, k, v: ChunkedAttention.apply(q, k, v, options), (q, k, v))


def cumulative(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_varlen_backward_matches_per_sequence_autograd():
    lengths_q, lengths_k = [3, 17, 0, 1, 20], [5, 17, 4, 9, 6]
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lengths_q), 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    options = {"causal": True, "softcap": 2.0, "alibi_slopes": torch.rand(len(lengths_q), 4, generator=g)}
    out, lse = varlen_apply(attention_ref, q, k, v, cu_q, cu_k, **options)
    grads = varlen_apply_backward(dout, q, k, v, out, lse, cu_q, cu_k, query_chunk=4, key_chunk=8, **options)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        sq, sk = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
        dense = dict(options, alibi_slopes=options["alibi_slopes"][b])
        want = autograd_grads(q[sq][None], k[sk][None], v[sk][None], dout[sq][None], torch.float64, **dense)
        for grad, part, w in zip(grads, (sq, sk, sk), want):
            torch.testing.assert_close(grad[part], w[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("setup,poison", NONFINITE_CASES, ids=[case_id(c) for c in NONFINITE_CASES])
def test_nonfinite_input_poisons_exactly_the_gradients_that_depend_on_it(setup, poison):
    """The chunked backward after the chunked forward: a NaN reaches the gradients of the rows that read it
    and of the keys those rows see; all others match the fp64 gradients of the clean inputs."""
    (q, k, v, clean_options), (pq, pk, pv, options), dout = make(setup, poison)
    chunks = {"query_chunk": 16, "key_chunk": 8, "torch_kernel": False}
    out, lse = attention_chunked(pq, pk, pv, **options, **chunks)
    grads = attention_chunked_backward(dout, pq, pk, pv, out, lse, **options, **chunks)
    want = autograd_grads(q, k, v, dout, torch.float64, **clean_options)
    nan = expected_nan(setup, poison)
    for name, grad, w in zip(("dq", "dk", "dv"), grads, want):
        check(name, grad, w, nan[name], atol=1e-4)
