"""flash_attn_with_kvcache against an fp64 reference written here from FlashAttention-2's documented semantics:
appends in place, rotary (both pairings), ragged lengths, left padding, batch indices, paged caches, masks,
softcap, ALiBi, GQA and the LSE. The CPU cases run everywhere; the same cases run on the GPU in bf16."""

import math

import pytest
import torch

import flashtile
from flashtile.reference import attention_ref
from flashtile.testing import ABS_FLOOR, ERROR_RATIO

HEADS_Q, HEADS_KV, DIM = 4, 2, 32
ROTARY_HALF = 8  # rotary_dim 16 of 32


def _rotate_ref(x, cos, sin, positions, interleaved):
    """Rotary by complex multiplication, one position per row: x (s, heads, d), positions (s,)."""
    x = x.clone()
    half = cos.shape[1]
    turn = torch.polar(torch.ones_like(cos[positions]), torch.atan2(sin[positions], cos[positions]))  # (s, half)
    if interleaved:
        pairs = torch.complex(x[..., 0:2 * half:2], x[..., 1:2 * half:2])
        pairs = pairs * turn[:, None, :]
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = pairs.real, pairs.imag
    else:
        pairs = torch.complex(x[..., :half], x[..., half:2 * half]) * turn[:, None, :]
        x[..., :half], x[..., half:2 * half] = pairs.real, pairs.imag
    return x


def _reference(case, q, k_cache, v_cache, k, v, cos, sin, dtype=torch.float64):
    """(out, lse, k_cache, v_cache) after the call, per sequence, on copies."""
    k_cache, v_cache = k_cache.double().clone(), v_cache.double().clone()
    page = k_cache.shape[1]
    outs, lses = [], []
    moving = case["causal"] or case["window"] != (-1, -1)
    for b in range(q.shape[0]):
        length, start = case["seqlens"][b], case["leftpad"][b]

        def cache_row(p):
            if case["paged"]:
                return case["block_table"][b][p // page], p % page
            return case["batch_idx"][b], p

        qb = q[b].double()
        if k is not None:
            new = k.shape[1]
            kb = k[b].double()
            if cos is not None:
                kb = _rotate_ref(kb, cos.double(), sin.double(), torch.arange(length, length + new), case["interleaved"])
                rows = torch.arange(length, length + q.shape[1]) if moving else torch.full((q.shape[1],), length)
                qb = _rotate_ref(qb, cos.double(), sin.double(), rows, case["interleaved"])
            for i in range(new):
                k_cache[cache_row(length + i)] = kb[i]
                v_cache[cache_row(length + i)] = v[b, i].double()
            length += new
        keys = torch.stack([k_cache[cache_row(p)] for p in range(start, length)])
        values = torch.stack([v_cache[cache_row(p)] for p in range(start, length)])
        slopes = case["alibi"][b:b + 1] if case["alibi"] is not None else None
        out, lse = attention_ref(qb[None].to(dtype), keys[None].to(dtype), values[None].to(dtype),
                                 causal=case["causal"], window_size=case["window"], softcap=case["softcap"],
                                 alibi_slopes=slopes, dtype=dtype)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses), k_cache, v_cache


CASES = [
    # name, seqlen_q, new rows, seqlens, leftpad, batch_idx, paged page size, rotary, causal, window, softcap, alibi
    ("uniform", 1, 0, [20, 20, 20], None, None, 0, None, False, (-1, -1), 0.0, False),
    ("uniform-append", 1, 1, [20, 20, 20], None, None, 0, None, True, (-1, -1), 0.0, False),
    ("ragged-append", 3, 2, [5, 31, 17], None, None, 0, None, True, (-1, -1), 0.0, False),
    ("leftpad", 1, 1, [12, 30, 25], [4, 0, 9], None, 0, None, False, (-1, -1), 0.0, False),
    ("batch-idx", 2, 1, [8, 8, 8], None, [4, 0, 2], 0, None, True, (-1, -1), 0.0, False),
    ("paged-4", 1, 2, [3, 22, 13], None, None, 4, None, True, (-1, -1), 0.0, False),
    ("paged-16", 2, 1, [17, 40, 1], None, None, 16, None, False, (6, 0), 0.0, False),
    ("rotary-interleaved", 2, 2, [10, 3, 27], None, None, 0, True, True, (-1, -1), 0.0, False),
    ("rotary-halves", 1, 1, [10, 3, 27], None, None, 0, False, False, (-1, -1), 0.0, False),
    ("rotary-paged-leftpad", 3, 1, [14, 9, 30], [2, 0, 5], None, 8, True, True, (-1, -1), 0.0, False),
    ("window-softcap-alibi", 2, 1, [25, 25, 25], None, None, 0, None, True, (7, 0), 20.0, True),
    ("ragged-softcap-alibi", 1, 0, [25, 4, 11], None, None, 0, None, False, (-1, -1), 5.0, True),
]
CACHE_ROWS = 48


def _make(case_tuple, device, dtype, seed=0):
    (name, seqlen_q, new, seqlens, leftpad, batch_idx, page, rotary, causal, window, softcap, alibi) = case_tuple
    g = torch.Generator().manual_seed(seed)
    batch = len(seqlens)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    case = {"seqlens": seqlens, "leftpad": leftpad or [0] * batch, "paged": bool(page), "causal": causal,
            "window": window, "softcap": softcap, "interleaved": bool(rotary)}
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, return_softmax_lse=True)
    if page:
        blocks_per_seq = CACHE_ROWS // page
        order = torch.randperm(batch * blocks_per_seq, generator=g)  # blocks scattered over the pool
        table = order.view(batch, blocks_per_seq).int()
        case["block_table"] = table.tolist()
        kwargs["block_table"] = table.to(device)
        k_cache, v_cache = rand(batch * blocks_per_seq, page, HEADS_KV, DIM), rand(batch * blocks_per_seq, page, HEADS_KV, DIM)
    else:
        cache_batch = 5 if batch_idx else batch
        k_cache, v_cache = rand(cache_batch, CACHE_ROWS, HEADS_KV, DIM), rand(cache_batch, CACHE_ROWS, HEADS_KV, DIM)
        case["batch_idx"] = batch_idx or list(range(batch))
        if batch_idx:
            kwargs["cache_batch_idx"] = torch.tensor(batch_idx, dtype=torch.int32, device=device)
    uniform = len(set(seqlens)) == 1 and not leftpad and not batch_idx and not page
    kwargs["cache_seqlens"] = seqlens[0] if uniform and name == "uniform" else torch.tensor(seqlens, dtype=torch.int32,
                                                                                            device=device)
    if leftpad:
        kwargs["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=device)
    q = rand(batch, seqlen_q, HEADS_Q, DIM)
    k = rand(batch, new, HEADS_KV, DIM) if new else None
    v = rand(batch, new, HEADS_KV, DIM) if new else None
    cos = sin = None
    if rotary is not None:
        angles = torch.rand(CACHE_ROWS, ROTARY_HALF, generator=g) * 2 * math.pi
        cos, sin = angles.cos().to(device), angles.sin().to(device)
        kwargs.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary)
    case["alibi"] = None
    if alibi:
        case["alibi"] = torch.rand(batch, HEADS_Q, generator=g) * 0.3
        kwargs["alibi_slopes"] = case["alibi"].to(device)
    return case, q, k_cache, v_cache, k, v, cos, sin, kwargs


def _run(case_tuple, device, dtype):
    case, q, k_cache, v_cache, k, v, cos, sin, kwargs = _make(case_tuple, device, dtype)
    before = (k_cache.clone(), v_cache.clone())
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    args = (case, cpu(q), cpu(before[0]), cpu(before[1]), cpu(k), cpu(v), cpu(cos), cpu(sin))
    ref_out, ref_lse, ref_k, ref_v = _reference(*args)
    return out.cpu(), lse.cpu(), k_cache.cpu(), v_cache.cpu(), ref_out, ref_lse, ref_k, ref_v, args


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kvcache_on_cpu_matches_the_fp64_reference(case):
    out, lse, k_cache, v_cache, ref_out, ref_lse, ref_k, ref_v, _ = _run(case, "cpu", torch.float32)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache.double(), ref_k, atol=1e-6, rtol=1e-6)  # appended in place, rotated
    torch.testing.assert_close(v_cache.double(), ref_v, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kvcache_on_the_gpu_meets_the_bf16_rule(case):
    """bf16 on the GPU: the error against fp64 within ERROR_RATIO of PyTorch's own bf16 error (as every GPU test)."""
    out, lse, k_cache, _, ref_out, ref_lse, ref_k, _, args = _run(case, "cuda", torch.bfloat16)
    torch_out, torch_lse, _, _ = _reference(*args, dtype=torch.bfloat16)
    err = (out.double() - ref_out).abs().max().item()
    err_torch = (torch_out.double() - ref_out).abs().max().item()
    assert err <= ERROR_RATIO * err_torch + ABS_FLOOR, (err, err_torch)
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert lse_err <= ERROR_RATIO * (torch_lse.double() - ref_lse).abs().max().item() + ABS_FLOOR
    assert (k_cache.double() - ref_k).abs().max().item() <= 2 ** -7 * ref_k.abs().max().item()  # one bf16 rounding


def test_bad_arguments_are_named():
    q = torch.randn(2, 1, HEADS_Q, DIM)
    cache = torch.randn(2, 16, HEADS_KV, DIM)
    new = torch.randn(2, 1, HEADS_KV, DIM)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    call = flashtile.flash_attn_with_kvcache
    with pytest.raises(ValueError, match="k and v must be given together"):
        call(q, cache, cache.clone(), k=new, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="fit the cache"):
        call(q, cache, cache.clone(), new, new, cache_seqlens=torch.tensor([3, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens must be an int or"):
        call(q, cache, cache.clone(), cache_seqlens=torch.tensor([3, 5]))  # int64
    with pytest.raises(ValueError, match="block_table"):
        call(q, cache, cache.clone(), cache_seqlens=seqlens, block_table=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be"):
        call(q, cache, cache.clone(), new, new, rotary_cos=torch.ones(4, 8), rotary_sin=torch.ones(4, 8),
             cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="cache_batch_idx must index"):
        call(q, cache, cache.clone(), cache_seqlens=seqlens, cache_batch_idx=torch.tensor([0, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        call(q, cache, cache.clone(), new.double(), new.double(), cache_seqlens=seqlens)
