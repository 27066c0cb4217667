"""The FlashAttention-2 front door: flash_attn_func and its packed and varlen variants."""

import inspect

import numpy as np
import pytest
import torch

import flashtile
from compat_helpers import ATOL, grads_of, rand
from flashtile.reference import attention_ref

pytestmark = pytest.mark.usefixtures("fresh_warnings")


def dense(batch=2, sq=9, sk=13, hq=4, hkv=2, d=16, dv=None):
    return rand(batch, sq, hq, d, seed=1), rand(batch, sk, hkv, d, seed=2), rand(batch, sk, hkv, dv or d, seed=3)


FA2_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
               ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
FA2_SIGNATURES = {
    "flash_attn_func": ["q", "k", "v"],
    "flash_attn_qkvpacked_func": ["qkv"],
    "flash_attn_kvpacked_func": ["q", "kv"],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
}


@pytest.mark.parametrize("name", sorted(FA2_SIGNATURES))
def test_fa2_signatures(name):
    expected = [(p, inspect.Parameter.empty) for p in FA2_SIGNATURES[name]] + FA2_OPTIONS
    if name == "flash_attn_varlen_func":
        expected.append(("block_table", None))
    params = inspect.signature(getattr(flashtile.compat, name)).parameters.values()
    assert [(p.name, p.default) for p in params] == expected
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def test_fa2_names_are_exported_at_top_level():
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
                 "flash_attn_kvpacked_func", "flash_attn_with_kvcache", "sdpa", "register_hf"):
        assert name in flashtile.__all__ and getattr(flashtile, name) is getattr(flashtile.compat, name)


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (3, -1), 0.0), (False, (2, 1), 5.0)])
def test_flash_attn_func_positional_like_fa2_users(causal, window, softcap):
    q, k, v = dense()
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4])
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, 0.0, 0.3, causal, window, softcap, slopes, False, True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, softmax_scale=0.3, window_size=window, softcap=softcap,
                                     alibi_slopes=slopes)
    assert s_dmask is None and out.shape == (2, 9, 4, 16) and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=ATOL)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=ATOL)


def test_flash_attn_func_defaults_return_only_out():
    q, k, v = dense()
    out = flashtile.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, flashtile.attention(q, k, v), rtol=0, atol=0)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v)[0], rtol=0, atol=ATOL)
    causal = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
    torch.testing.assert_close(causal.double(), attention_ref(q, k, v, causal=True)[0], rtol=0, atol=ATOL)


@pytest.mark.parametrize("dropout_p", [0.1, 1e-9])
def test_dropout_is_refused(dropout_p):
    q, k, v = dense()
    with pytest.raises(ValueError, match="dropout is not supported yet"):
        flashtile.flash_attn_func(q, k, v, dropout_p)
    with pytest.raises(ValueError, match="dropout is not supported yet"):
        flashtile.flash_attn_qkvpacked_func(rand(1, 5, 3, 2, 8), dropout_p=dropout_p)
    with pytest.raises(TypeError, match="dropout_p"):
        flashtile.flash_attn_func(q, k, v, "0.1")


def varlen_batch(lengths_q=(3, 7, 1), lengths_k=(5, 7, 4), hq=4, hkv=2, d=16):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = rand(sum(lengths_q), hq, d, seed=4)
    k, v = rand(sum(lengths_k), hkv, d, seed=5), rand(sum(lengths_k), hkv, d, seed=6)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def test_flash_attn_varlen_func_matches_each_sequence():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_batch()
    out, lse, s_dmask = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, None, True,
                                                         (-1, -1), 0.0, None, False, True, None)
    assert s_dmask is None and lse.shape == (4, q.shape[0])
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref_out, ref_lse = attention_ref(q[sq][None], k[sk][None], v[sk][None], causal=True)
        torch.testing.assert_close(out[sq].double(), ref_out[0], rtol=0, atol=ATOL)
        torch.testing.assert_close(lse[:, sq].double(), ref_lse[0], rtol=0, atol=ATOL)
    as_tensors = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(max_q), torch.tensor(max_k),
                                                  causal=True)
    torch.testing.assert_close(as_tensors, out, rtol=0, atol=0)


@pytest.mark.parametrize("extra_q,extra_k", [(5, 3), (4, 0), (0, 6)])
def test_varlen_rows_past_the_last_sequence_are_padding(extra_q, extra_k):
    """As in FlashAttention-2, packed tensors may be longer than their sequences (batches padded to fixed sizes, as
    for CUDA graphs): the extra rows, here NaN, are not attended; their outputs are zero, their LSE -inf, and they get
    no gradient."""
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_batch()
    ref_out, ref_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                           return_attn_probs=True)
    padded = [torch.cat([t, torch.full((extra, *t.shape[1:]), float("nan"))]).requires_grad_()
              for t, extra in ((q, extra_q), (k, extra_k), (v, extra_k))]
    out, lse, _ = flashtile.flash_attn_varlen_func(*padded, cu_q, cu_k, max_q, max_k, causal=True,
                                                   return_attn_probs=True)
    used = q.shape[0]
    assert out.shape == padded[0].shape and lse.shape == (q.shape[1], used + extra_q)
    torch.testing.assert_close(out[:used], ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse[:, :used], ref_lse, rtol=0, atol=0)
    assert bool((out[used:] == 0).all()) and bool(torch.isneginf(lse[:, used:]).all())
    out.sum().backward()
    for t, rows in zip(padded, (used, k.shape[0], v.shape[0])):
        assert bool(t.grad[:rows].isfinite().all()) and bool((t.grad[rows:] == 0).all())


@pytest.mark.parametrize("page", [1, 4, 16])
def test_varlen_with_a_block_table_reads_paged_keys(page):
    """Paged K/V (num_blocks, page, heads, d): each sequence's keys are rows 0 .. len of its blocks, which sit
    anywhere in the pool; the result and the gradients equal the packed call's on the same keys."""
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_batch()
    lengths = cu_k.diff().tolist()
    blocks_per_seq = -(-max(lengths) // page)
    pool = 3 * blocks_per_seq + 2
    table = torch.randperm(pool, generator=torch.Generator().manual_seed(page))[:3 * blocks_per_seq].view(3, -1).int()
    k_pages, v_pages = rand(pool, page, *k.shape[1:], seed=20), rand(pool, page, *v.shape[1:], seed=21)
    for b, length in enumerate(lengths):
        for row in range(length):
            block, offset = table[b, row // page], row % page
            k_pages[block, offset] = k[cu_k[b] + row]
            v_pages[block, offset] = v[cu_k[b] + row]
    k_pages.requires_grad_()
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max_q, max_k, causal=True,
                                                   return_attn_probs=True, block_table=table)
    ref_out, ref_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                           return_attn_probs=True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    grad_pages, = torch.autograd.grad(out.sum(), k_pages)
    grad_k, = torch.autograd.grad(flashtile.flash_attn_varlen_func(q, k.requires_grad_(), v, cu_q, cu_k, max_q, max_k,
                                                                   causal=True).sum(), k)
    for b, length in enumerate(lengths):  # every used row gets its key's gradient, unused rows none
        for row in range(length):
            torch.testing.assert_close(grad_pages[table[b, row // page], row % page], grad_k[cu_k[b] + row])
    used = sum(lengths)
    assert int((grad_pages.abs().sum(dim=(-1, -2)) > 0).sum()) == used


def test_a_bad_block_table_is_named():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_batch()
    pages = rand(4, 4, *k.shape[1:], seed=3)
    with pytest.raises(ValueError, match="block_table must be"):
        flashtile.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, max_q, max_k, block_table=torch.zeros(3, 1))
    with pytest.raises(ValueError, match="fit the block table"):
        flashtile.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, max_q, max_k,
                                         block_table=torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="index the cache"):
        flashtile.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, max_q, max_k,
                                         block_table=torch.full((3, 2), 9, dtype=torch.int32))


def test_qkvpacked_gives_gradients_to_the_packed_tensor():
    qkv = rand(2, 11, 3, 4, 16, seed=8, requires_grad=True)
    out, (grad,) = grads_of(lambda t: flashtile.flash_attn_qkvpacked_func(t, causal=True), qkv)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    ref, grads = grads_of(lambda *t: flashtile.flash_attn_func(*t, causal=True), q, k, v)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(grad, torch.stack(grads, dim=2), rtol=0, atol=ATOL)
    assert grad.abs().sum() > 0


def test_kvpacked_gqa_gives_gradients_to_the_packed_tensor():
    q = rand(2, 7, 4, 16, seed=9, requires_grad=True)
    kv = rand(2, 12, 2, 2, 16, seed=10, requires_grad=True)
    out, (grad_q, grad_kv) = grads_of(lambda a, b: flashtile.flash_attn_kvpacked_func(a, b, softmax_scale=0.2), q, kv)
    k, v = (kv.detach()[:, :, i].clone().requires_grad_() for i in range(2))
    q2 = q.detach().clone().requires_grad_()
    ref, (ref_q, ref_k, ref_v) = grads_of(lambda *t: flashtile.flash_attn_func(*t, softmax_scale=0.2), q2, k, v)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(grad_q, ref_q, rtol=0, atol=ATOL)
    torch.testing.assert_close(grad_kv, torch.stack([ref_k, ref_v], dim=2), rtol=0, atol=ATOL)


def test_varlen_packed_variants():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_batch(lengths_q=(3, 7, 1), lengths_k=(3, 7, 1), hkv=4)
    qkv = torch.stack([q, k, v], dim=1).requires_grad_()
    out, (grad,) = grads_of(lambda t: flashtile.flash_attn_varlen_qkvpacked_func(t, cu_q, 7, causal=True), qkv)
    ref = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_q, 7, 7, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert grad.shape == qkv.shape and grad.abs().sum() > 0

    q, k, v, cu_q, cu_k, max_q, max_k = varlen_batch()
    kv = torch.stack([k, v], dim=1).requires_grad_()
    out, lse, none = flashtile.compat.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k,
                                                                      return_attn_probs=True)
    ref, ref_lse = flashtile.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    out.sum().backward()
    assert none is None and kv.grad.abs().sum() > 0


def test_fa2_window_size_forms_of_its_own_suite():
    """FlashAttention-2's tests pass window_size=torch.randint(0, seqlen_k, (2,)): a 2-element integer tensor."""
    window = torch.randint(0, 13, (2,), generator=torch.Generator().manual_seed(0))
    as_ints = tuple(window.tolist())
    q, k, v = dense()
    expected = flashtile.flash_attn_func(q, k, v, window_size=as_ints)
    torch.testing.assert_close(expected.double(), attention_ref(q, k, v, window_size=as_ints)[0], rtol=0, atol=ATOL)
    for form in (window, tuple(window), tuple(window.numpy())):
        torch.testing.assert_close(flashtile.flash_attn_func(q, k, v, window_size=form), expected, rtol=0, atol=0)
        out = flashtile.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), window_size=form)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    qkv = rand(2, 13, 3, 4, 16, seed=8)
    torch.testing.assert_close(flashtile.flash_attn_qkvpacked_func(qkv, causal=True, window_size=window),
                               flashtile.flash_attn_qkvpacked_func(qkv, causal=True, window_size=as_ints),
                               rtol=0, atol=0)

    q, k, v, cu_q, cu_k, max_q, max_k = varlen_batch()
    expected = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=as_ints)
    for call in (lambda w: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=w),
                 lambda w: flashtile.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], dim=1), cu_q, cu_k,
                                                                     max_q, max_k, window_size=w)):
        torch.testing.assert_close(call(window), expected, rtol=0, atol=0)
    packed = rand(11, 3, 4, 16, seed=9)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    torch.testing.assert_close(flashtile.flash_attn_varlen_qkvpacked_func(packed, cu, 7, window_size=window),
                               flashtile.flash_attn_varlen_qkvpacked_func(packed, cu, 7, window_size=as_ints),
                               rtol=0, atol=0)


def test_fa2_bounds_past_the_sequence_are_unbounded():
    """FlashAttention-2 reads a bound at or past the sequence as unbounded, at any size (here past int32)."""
    q, k, v = dense()
    torch.testing.assert_close(flashtile.flash_attn_func(q, k, v, window_size=(2**31, 0)),
                               flashtile.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_batch()
    torch.testing.assert_close(
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=np.array([2**40, 2**40])),
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k), rtol=0, atol=0)


def test_fa2_scale_and_softcap_take_numpy_numbers_and_0d_tensors():
    q, k, v = dense()
    scale, softcap = torch.tensor(0.3), np.float32(5.0)
    torch.testing.assert_close(flashtile.flash_attn_func(q, k, v, softmax_scale=scale, softcap=softcap),
                               flashtile.flash_attn_func(q, k, v, softmax_scale=scale.item(), softcap=float(softcap)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("call,error,match", [
    (lambda: flashtile.flash_attn_qkvpacked_func(rand(2, 5, 2, 4, 8)), ValueError, r"qkv must have shape"),
    (lambda: flashtile.flash_attn_qkvpacked_func(rand(5, 3, 4, 8)), ValueError, r"qkv must have shape"),
    (lambda: flashtile.flash_attn_kvpacked_func(rand(2, 5, 4, 8), rand(2, 5, 3, 4, 8)), ValueError, r"kv must"),
    (lambda: flashtile.flash_attn_kvpacked_func(rand(2, 5, 4, 8), [1, 2]), TypeError, r"kv must be a torch.Tensor"),
    (lambda: flashtile.flash_attn_func(rand(2, 5, 4, 8), rand(2, 5, 3, 8), rand(2, 5, 3, 8)), ValueError, "heads"),
    (lambda: flashtile.flash_attn_func(*dense(), window_size=(-2, 0)), ValueError, "window_size"),
    (lambda: flashtile.flash_attn_func(*dense(), window_size=torch.tensor([2.0, 0.0])), ValueError, "window_size"),
    (lambda: flashtile.flash_attn_func(*dense(), softmax_scale=1e39), ValueError, "softmax_scale"),
    (lambda: flashtile.flash_attn_func(*dense(), softcap=1e39), ValueError, "softcap"),
    (lambda: flashtile.flash_attn_varlen_func(*varlen_batch()[:5], 7, "7"), ValueError, "max_seqlen_k"),
    (lambda: flashtile.flash_attn_varlen_func(*varlen_batch((1, 1), (1, 1))[:5], 1, torch.tensor(True)), ValueError,
     "max_seqlen_k must be a positive int"),
])
def test_fa2_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
