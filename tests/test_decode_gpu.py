"""The decode family on the GPU: one query token per sequence against a cache, every layout it takes, against the
fp64 reference with poisoned outputs."""

import pytest
import torch

import flashtile
from flashtile import api, decode
from flashtile.testing import compare, compare_grads

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch, seqlen_k, heads_q, heads_kv, d", [
    (3, 8192, 32, 8, 128),     # split in parts, GQA 4
    (1, 65536, 8, 1, 64),      # MQA, many parts
    (2, 4100, 16, 16, 256),    # no GQA, a length split in 4 parts of 1025
    (5, 777, 12, 4, 96),       # an odd length: one part
    (64, 1024, 64, 8, 128),    # enough blocks without splitting
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_a_token_against_its_cache(batch, seqlen_k, heads_q, heads_kv, d, dtype, causal, poisoned_outputs):
    q = torch.randn(batch, 1, heads_q, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=dtype) for _ in range(2))
    out, lse = flashtile.attention(q, k, v, causal=causal, return_lse=True)
    assert compare(q, k, v, out, lse, causal=causal).ok


def test_a_cache_longer_than_its_sequences(poisoned_outputs):
    """The live part of a preallocated cache: a view whose batch entries lie a whole buffer apart (no parts as
    a view: one part per sequence), and a strided q."""
    cache = torch.randn(2, 3, 16384, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = cache[0, :, :9000], cache[1, :, :9000]
    q = torch.randn(3, 1, 16, 3 * 128, device="cuda", dtype=torch.bfloat16)[..., :128]
    out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
    assert compare(q, k, v, out, lse, causal=True).ok


def test_repeated_calls_run_the_kept_plan():
    api._calls.clear()
    q = torch.randn(2, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 32768, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flashtile.attention(q, k, v)
    (call,) = api._calls.values()
    assert isinstance(call.forward_plan, decode.DecodePlan) and call.forward_plan.splits > 1
    for _ in range(3):
        q, k, v = (torch.randn_like(t) for t in (q, k, v))
        assert compare(q, k, v, flashtile.attention(q, k, v)).ok


def test_a_nan_key_poisons_its_kv_heads_query_heads_only():
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 16384, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k[1, 9000, 0, 5] = float("nan")
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    assert out[1, 0, :4].isnan().all() and lse[1, :4].isnan().all()
    assert not out[1, 0, 4:].isnan().any() and not out[0].isnan().any() and not lse[0].isnan().any()


def test_gradients_through_a_decode_step():
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 4096, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = flashtile.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    assert compare_grads(q, k, v, dout, torch.autograd.grad(out, (q, k, v), dout), causal=True).ok


def test_a_decode_step_is_captured_in_a_cuda_graph():
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(4, 16384, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flashtile.attention(q, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashtile.attention(q, k, v)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert compare(q, k, v, out).ok
