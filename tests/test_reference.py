"""The reference against a direct formula, and the CPU path against the reference: torch's fused kernel
where it serves, the chunked loop everywhere (forced with torch_kernel=False)."""

import math

import pytest
import torch

from flashtile.reference import attention_chunked, attention_ref, varlen_apply
from nonfinite_cases import NONFINITE_CASES, blind_rows, case_id, check, expected_nan, make


def direct(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """Attention written out literally, one (batch, head) at a time, in fp64."""
    batch, seqlen_q, heads_q, dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    out = torch.zeros(batch, seqlen_q, heads_q, v.shape[-1], dtype=torch.float64)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=torch.float64)
    left, right = window[0], 0 if causal else window[1]
    for b in range(batch):
        for h in range(heads_q):
            hk = h // (heads_q // heads_kv)
            s = q[b, :, h].double() @ k[b, :, hk].double().T / math.sqrt(dim)
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            for i in range(seqlen_q):
                for j in range(seqlen_k):
                    diag = i + seqlen_k - seqlen_q
                    if slopes is not None:
                        s[i, j] -= slopes[h].item() * abs(diag - j)
                    if (left >= 0 and j < diag - left) or (right >= 0 and j > diag + right):
                        s[i, j] = -math.inf
            for i in range(seqlen_q):
                if torch.isinf(s[i]).all():
                    continue
                p = torch.softmax(s[i], dim=0)
                out[b, i, h] = p @ v[b, :, hk].double()
                lse[b, h, i] = torch.logsumexp(s[i], dim=0)
    return out, lse


CASES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, dim_v, causal, window, softcap, alibi
    (1, 1, 1, 1, 1, 8, 8, False, (-1, -1), 0.0, False),
    (2, 5, 7, 2, 2, 3, 5, False, (-1, -1), 0.0, False),
    (1, 9, 4, 4, 2, 16, 16, True, (-1, -1), 0.0, False),   # seqlen_q > seqlen_k: the first rows see nothing
    (2, 6, 11, 3, 1, 8, 4, True, (-1, -1), 0.0, False),    # MQA, causal, bottom-right aligned
    (1, 13, 13, 2, 2, 8, 8, False, (2, 1), 0.0, False),
    (1, 7, 12, 2, 1, 8, 8, True, (3, -1), 5.0, True),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_direct_formula(case):
    batch, sq, sk, hq, hkv, d, dv, causal, window, softcap, alibi = case
    g = torch.Generator().manual_seed(hash(case) % 2**31)
    q = torch.randn(batch, sq, hq, d, generator=g)
    k = torch.randn(batch, sk, hkv, d, generator=g)
    v = torch.randn(batch, sk, hkv, dv, generator=g)
    slopes = torch.rand(hq, generator=g) if alibi else None
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    want_out, want_lse = direct(q, k, v, causal, window, softcap, slopes)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    q, k, v = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    out, lse = attention_ref(q, k, v, causal=True)  # rows 0..3 sit left of the bottom-right diagonal
    assert torch.isneginf(lse[0, 0, :4]).all() and torch.isfinite(lse[0, 0, 4:]).all()
    assert (out[0, :4] == 0).all()
    for torch_kernel in (False, True):
        chunked_out, chunked_lse = attention_chunked(q, k, v, causal=True, torch_kernel=torch_kernel)
        assert (chunked_out[0, :4] == 0).all() and torch.isneginf(chunked_lse[0, 0, :4]).all()


CHUNKED_CASES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, dim_v, causal, window, softcap, alibi, dtype
    (2, 300, 700, 4, 2, 32, 32, False, (-1, -1), 0.0, False, torch.float32),
    (1, 700, 300, 2, 2, 64, 40, True, (-1, -1), 0.0, False, torch.float32),
    (1, 513, 513, 2, 1, 16, 16, False, (100, 7), 0.0, True, torch.float32),
    (2, 257, 1025, 2, 2, 24, 24, True, (-1, -1), 20.0, False, torch.float64),
    (1, 333, 333, 2, 2, 64, 64, True, (-1, -1), 0.0, False, torch.bfloat16),
    (1, 100, 1000, 2, 2, 64, 64, False, (50, 50), 0.0, False, torch.float16),
]


@pytest.mark.parametrize("case", CHUNKED_CASES)
def test_chunked_path_matches_reference(case):
    batch, sq, sk, hq, hkv, d, dv, causal, window, softcap, alibi, dtype = case
    g = torch.Generator().manual_seed(len(case) * sq + sk)
    q = torch.randn(batch, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(batch, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(batch, sk, hkv, dv, generator=g).to(dtype)
    slopes = torch.rand(batch, hq, generator=g) if alibi else None
    options = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    out, lse = attention_chunked(q, k, v, query_chunk=128, key_chunk=200, torch_kernel=False, **options)
    ref_out, ref_lse = attention_ref(q, k, v, **options)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.is_contiguous() and lse.is_contiguous()
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=max(tol, 1e-5), equal_nan=False)


KERNEL_CASES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, causal: what torch's fused kernel serves
    (2, 300, 700, 4, 4, 32, False),
    (1, 333, 333, 4, 2, 64, True),
    (2, 100, 1000, 6, 1, 64, True),    # seqlen_q < seqlen_k: a whole prefix of keys, then the square diagonal
    (1, 700, 300, 4, 2, 40, True),     # seqlen_q > seqlen_k: the first 400 rows see no key
    (1, 1, 257, 2, 2, 128, True),
]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_torch_kernel_route_matches_reference(case, dtype, torch_kernel_calls):
    batch, sq, sk, hq, hkv, d, causal = case
    g = torch.Generator().manual_seed(sq * sk)
    q, k, v = (torch.randn(batch, s, h, d, generator=g).to(dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    out, lse = attention_chunked(q, k, v, causal=causal)
    assert torch_kernel_calls == ["forward"]
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.is_contiguous() and lse.is_contiguous()
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=TOLERANCE[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=max(TOLERANCE[dtype], 1e-5))


@pytest.mark.parametrize("options", [{"softcap": 5.0}, {"window_size": (9, -1)}, {"window_size": (-1, 3)},
                                     {"alibi_slopes": torch.rand(2)}], ids=["softcap", "window-left", "window-right",
                                                                           "alibi"])
def test_what_torch_kernel_cannot_serve_takes_the_loop(options, torch_kernel_calls):
    q, k, v = (torch.randn(1, 20, 2, 8) for _ in range(3))
    attention_chunked(q, k, v, **options)
    attention_chunked(q, k, v[..., :4], causal=True)  # head_dim_v != head_dim
    q[0, 3, 1, 2] = math.nan
    attention_chunked(q, k, v)  # non-finite input
    assert torch_kernel_calls == []


def test_varlen_apply_matches_per_sequence_calls():
    lengths_q, lengths_k = [3, 17, 1], [5, 17, 9]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = torch.randn(21, 4, 8), torch.randn(31, 2, 8), torch.randn(31, 2, 8)
    out, lse = varlen_apply(attention_ref, q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == (21, 4, 8) and lse.shape == (4, 21)
    o1, l1 = attention_ref(q[3:20][None], k[5:22][None], v[5:22][None], causal=True)
    torch.testing.assert_close(out[3:20], o1[0])
    torch.testing.assert_close(lse[:, 3:20], l1[0])


@pytest.mark.parametrize("setup,poison", NONFINITE_CASES, ids=[case_id(c) for c in NONFINITE_CASES])
@pytest.mark.parametrize("path", ["reference", "chunked", "auto"])
def test_nonfinite_input_poisons_exactly_the_rows_that_read_it(path, setup, poison):
    (q, k, v, clean_options), (pq, pk, pv, options), _ = make(setup, poison)
    want_out, want_lse = attention_ref(q, k, v, **clean_options)
    if path == "reference":
        out, lse = attention_ref(pq, pk, pv, **options)
    else:  # "auto" leaves the choice to attention_chunked, which sends non-finite inputs to the loop
        out, lse = attention_chunked(pq, pk, pv, query_chunk=16, key_chunk=8, torch_kernel=path == "auto",
                                     **options)
    nan = expected_nan(setup, poison)
    check("out", out, want_out, nan["out"], atol=1e-5)
    check("lse", lse, want_lse, nan["lse"], atol=1e-5)
    blind = blind_rows(setup)
    assert (out.transpose(1, 2)[blind] == 0).all() and torch.isneginf(lse[blind]).all()
