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
    api.clear_calls()
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


# flash_attn_with_kvcache read in place: ragged lengths, batch indices and pages, against the fp64 reference per
# sequence. The cache's rows past each sequence hold NaN: a kernel that reads them (or multiplies them by a zero
# probability) fails. The gathering fallback is disabled, so these cases prove the in-place path ran.
CACHE_HEADS_Q, CACHE_HEADS_KV, CACHE_DIM, CACHE_ROWS = 16, 4, 128, 4096
SEQLENS = [1, 3000, 4096, 1234]


@pytest.fixture
def in_place_only(monkeypatch):
    from flashtile.compat import kvcache

    def refuse(*args, **kwargs):
        raise AssertionError("the cache was gathered, not read in place")
    monkeypatch.setattr(kvcache, "_ragged", refuse)
    monkeypatch.setattr(kvcache, "attention", refuse)


def _cache_case(layout: str, dtype, seed: int, new: int = 0):
    """q, the caches (NaN past every sequence), the call's keyword arguments, and each sequence's valid rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(SEQLENS)
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    q = rand(batch, 1, CACHE_HEADS_Q, CACHE_DIM)
    lengths = [n - new for n in SEQLENS]  # rows before the call; `new` more are appended
    kwargs = {"cache_seqlens": torch.tensor(lengths, dtype=torch.int32, device="cuda")}
    if layout.startswith("paged"):
        page = int(layout.split("-")[1])
        per_seq = -(-CACHE_ROWS // page)
        table = torch.randperm(batch * per_seq, device="cuda", generator=g).view(batch, per_seq).int()
        k_cache, v_cache = (rand(batch * per_seq, page, CACHE_HEADS_KV, CACHE_DIM) for _ in range(2))
        kwargs["block_table"] = table
        where = lambda b, rows: (table[b, rows // page].long(), rows % page)  # noqa: E731
    else:
        entries = torch.tensor([2, 0, 5, 3], device="cuda") if layout == "batch-idx" else torch.arange(batch, device="cuda")
        k_cache, v_cache = (rand(6 if layout == "batch-idx" else batch, CACHE_ROWS, CACHE_HEADS_KV, CACHE_DIM)
                            for _ in range(2))
        if layout == "batch-idx":
            kwargs["cache_batch_idx"] = entries.int()
        where = lambda b, rows: (entries[b].expand_as(rows), rows)  # noqa: E731
    for b, n in enumerate(SEQLENS):
        past = torch.arange(n, CACHE_ROWS, device="cuda")
        k_cache[where(b, past)] = float("nan")
        v_cache[where(b, past)] = float("nan")
    return q, k_cache, v_cache, kwargs, where


@pytest.mark.parametrize("layout", ["dense", "batch-idx", "paged-16", "paged-32", "paged-48", "paged-96", "paged-256"])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_a_cache_is_read_in_place(layout, num_splits, in_place_only, poisoned_outputs):
    q, k_cache, v_cache, kwargs, where = _cache_case(layout, torch.bfloat16, seed=len(layout) + num_splits)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits, return_softmax_lse=True,
                                                 **kwargs)
    for b, n in enumerate(SEQLENS):
        rows = torch.arange(n, device="cuda")
        keys, values = k_cache[where(b, rows)][None], v_cache[where(b, rows)][None]
        check = compare(q[b:b + 1], keys, values, out[b:b + 1], lse[b:b + 1])
        assert check.ok, (b, check)


@pytest.mark.parametrize("layout", ["dense", "paged-16"])
def test_appended_keys_are_read_in_place(layout, in_place_only):
    q, k_cache, v_cache, kwargs, where = _cache_case(layout, torch.float16, seed=3, new=1)
    k, v = (torch.randn(len(SEQLENS), 1, CACHE_HEADS_KV, CACHE_DIM, device="cuda", dtype=torch.float16) for _ in range(2))
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    for b, n in enumerate(SEQLENS):
        rows = torch.arange(n, device="cuda")
        keys, values = k_cache[where(b, rows)][None], v_cache[where(b, rows)][None]
        assert torch.equal(keys[0, -1], k[b, 0]) and torch.equal(values[0, -1], v[b, 0])
        assert compare(q[b:b + 1], keys, values, out[b:b + 1]).ok


def test_a_nan_key_in_one_part_reaches_its_rows_through_the_merge(in_place_only):
    q, k_cache, v_cache, kwargs, where = _cache_case("paged-16", torch.bfloat16, seed=7)
    k_cache[where(2, torch.tensor([3333], device="cuda"))] = float("nan")  # sequence 2, one part of many
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, num_splits=8, **kwargs)
    assert out[2].isnan().all() and lse[2].isnan().all()
    assert not out[[0, 1, 3]].isnan().any() and not lse[[0, 1, 3]].isnan().any()


def test_an_empty_sequence_reads_zeros_beside_full_ones(in_place_only):
    q, k_cache, v_cache, kwargs, _ = _cache_case("dense", torch.bfloat16, seed=11)
    kwargs["cache_seqlens"][1] = 0
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, num_splits=4, **kwargs)
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert out[[0, 2, 3]].isfinite().all()


def test_a_paged_decode_step_is_captured_in_a_cuda_graph(in_place_only):
    """A read of the cache waits for nothing on the host: the public call is captured, and a replay reads the
    lengths, pages and queries the buffers hold then."""
    q, k_cache, v_cache, kwargs, where = _cache_case("paged-16", torch.bfloat16, seed=5)
    seqlens = kwargs["cache_seqlens"]
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)  # builds the plan
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kwargs)
    q.copy_(torch.randn_like(q))
    seqlens.copy_(torch.tensor([1, 100, 2049, 1000], dtype=torch.int32))  # within each sequence's valid rows
    graph.replay()
    torch.cuda.synchronize()
    for b, n in enumerate(seqlens.tolist()):
        rows = torch.arange(n, device="cuda")
        keys, values = k_cache[where(b, rows)][None], v_cache[where(b, rows)][None]
        assert compare(q[b:b + 1], keys, values, out[b:b + 1], lse[b:b + 1]).ok, b
