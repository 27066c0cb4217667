"""Property tests (hypothesis): the CPU path equals the fp64 reference, forward and backward, for any shape,
mask, GQA grouping, softcap, ALiBi and chunk sizes, on the chunked loop and on whichever kernel serves."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.reference import attention_chunked, attention_chunked_backward, attention_ref

FP64_TOL = 1e-9


@st.composite
def problems(draw):
    batch, heads_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    seqlen_q, seqlen_k = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    head_dim, head_dim_v = draw(st.sampled_from([4, 8, 12])), draw(st.sampled_from([4, 8]))
    options = {"causal": draw(st.booleans()),
               "window_size": (draw(st.integers(-1, 12)), draw(st.integers(-1, 12))),
               "softcap": draw(st.sampled_from([0.0, 1.5])),
               "softmax_scale": draw(st.sampled_from([None, 0.3]))}
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    q = torch.randn(batch, seqlen_q, heads_kv * group, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        options["alibi_slopes"] = torch.rand(heads_kv * group, generator=g, dtype=torch.float64)
    chunks = {"query_chunk": draw(st.integers(1, 16)), "key_chunk": draw(st.integers(1, 16)),
              "torch_kernel": draw(st.booleans())}
    return q, k, v, options, chunks


@settings(max_examples=60, deadline=None)
@given(problems())
def test_chunked_forward_matches_the_reference(problem):
    q, k, v, options, chunks = problem
    out, lse = attention_chunked(q, k, v, **options, **chunks)
    ref_out, ref_lse = attention_ref(q, k, v, **options)
    assert torch.allclose(out, ref_out, atol=FP64_TOL)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    seen = ~torch.isinf(ref_lse)
    assert torch.allclose(lse[seen].double(), ref_lse[seen], atol=1e-5)  # the chunked LSE is fp32


@settings(max_examples=60, deadline=None)
@given(problems())
def test_chunked_backward_matches_autograd_of_the_reference(problem):
    q, k, v, options, chunks = problem
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, **options)
    dout = torch.randn_like(ref_out)
    expected = torch.autograd.grad(ref_out, leaves, dout)
    got = attention_chunked_backward(dout, q, k, v, ref_out.detach(), ref_lse.detach(), **options, **chunks)
    for ours, theirs in zip(got, expected):
        assert torch.isfinite(ours).all()
        assert torch.allclose(ours, theirs, atol=FP64_TOL, rtol=FP64_TOL)
