"""Exact attention in plain PyTorch: the fp64 reference, and the chunked online-softmax CPU path.

Both follow one definition (also kernels/common/params.cuh and mask.cuh). For query i and key j of a
(batch, head) problem with seqlen_q queries and seqlen_k keys:

    s_ij = scale * q_i . k_j
    s_ij = softcap * tanh(s_ij / softcap)                     if softcap > 0
    s_ij = s_ij - slope_h * |i + seqlen_k - seqlen_q - j|     if ALiBi slopes are given
    j visible  iff  i + off - left <= j <= i + off + right,  off = seqlen_k - seqlen_q  (bottom-right aligned;
                    a negative bound is unbounded; causal sets right = 0)
    o_i = sum_j softmax_j(s_i) v_j,   lse_i = log sum_j exp(s_ij)  over visible j

A row that sees no key has o_i = 0 and lse_i = -inf. Layout (batch, seqlen, heads, head_dim); GQA when
heads_q is a multiple of heads_kv: query head h reads key/value head h // (heads_q // heads_kv).

Non-finite inputs reach exactly the rows that read them. Scores follow IEEE arithmetic: a NaN in q_i, in a
visible k_j or in slope_h makes row i's output and LSE NaN, and so does an Inf in q_i or slope_h (it makes a
score +inf, inf - inf or leaves only -inf scores: no softmax exists). A NaN or Inf in a visible v_j makes
o_i NaN (lse_i does not read v). A row never reads what its mask hides, nor another row's inputs: those
rows, and every gradient that depends on no poisoned row, stay exact. -inf is the LSE of rows that see no
key and of no other row.
"""

from __future__ import annotations

import math

import torch

QUERY_CHUNK = 256   # rows of queries per step of the CPU path
KEY_CHUNK = 512     # keys per step: the score block is (batch, heads, 256, 512), never seqlen x seqlen


def effective_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    left, right = window_size
    return left, (0 if causal else right)


def visible(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int,
            left: int, right: int) -> torch.Tensor:
    """Boolean (len(rows), len(cols)) mask of which keys each query row may see."""
    diag = rows[:, None] + (seqlen_k - seqlen_q)
    ok = torch.ones(len(rows), len(cols), dtype=torch.bool, device=rows.device)
    if left >= 0:
        ok &= cols[None, :] >= diag - left
    if right >= 0:
        ok &= cols[None, :] <= diag + right
    return ok


def sees_a_key(rows: torch.Tensor, seqlen_q: int, seqlen_k: int, left: int, right: int) -> torch.Tensor:
    """Boolean (len(rows),): which query rows see at least one key (the others give 0 and LSE -inf)."""
    diag = rows + (seqlen_k - seqlen_q)
    first = (diag - left).clamp_min(0) if left >= 0 else torch.zeros_like(rows)
    last = (diag + right).clamp_max(seqlen_k - 1) if right >= 0 else torch.full_like(rows, seqlen_k - 1)
    return first <= last


def _lse_rule(lse: torch.Tensor, has_key: torch.Tensor) -> torch.Tensor:
    """-inf for rows that see no key; any other non-finite LSE (a row that read a NaN or Inf) becomes NaN."""
    lse = torch.where(torch.isfinite(lse), lse, math.nan)
    return lse.masked_fill(~has_key, float("-inf"))


def _nonfinite_keys(x: torch.Tensor) -> torch.Tensor | None:
    """(..., seqlen) mask of the key/value vectors of x (..., seqlen, dim) that hold a NaN or Inf; None if none."""
    bad = ~torch.isfinite(x).all(dim=-1)
    return bad if bool(bad.any()) else None


def _finite(x: torch.Tensor, bad: torch.Tensor | None) -> torch.Tensor:
    """x with the vectors that `bad` marks set to 0: what a product may multiply by a zero weight."""
    return x if bad is None else x.masked_fill(bad[..., None], 0.0)


def _capped_scores(q, k, scale, softcap):
    """Scores (b, h_kv, group, rows, cols) = scale * q . k, soft-capped when softcap > 0; no ALiBi, no mask."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    return s


def _bias_and_mask(s, rows, cols, alibi_slopes, seqlen_q, seqlen_k, left, right):
    """Subtract the ALiBi bias from capped scores `s` and set the positions a row may not see to -inf."""
    if alibi_slopes is not None:
        distance = (rows[:, None] + (seqlen_k - seqlen_q) - cols[None, :]).abs().to(s.dtype)
        s = s - alibi_slopes[..., None, None] * distance
    return s.masked_fill(~visible(rows, cols, seqlen_q, seqlen_k, left, right), float("-inf"))


def _scores(q, k, rows, cols, scale, softcap, alibi_slopes, seqlen_q, seqlen_k, left, right):
    """Scores (batch, heads_kv, group, rows, cols) with every option applied and -inf where masked."""
    capped = _capped_scores(q, k, scale, softcap)
    return _bias_and_mask(capped, rows, cols, alibi_slopes, seqlen_q, seqlen_k, left, right)


def _group_heads(x: torch.Tensor, heads_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """(b, s, h_q, d) query-shaped tensor -> (b, h_kv, group, s, d) in `dtype`."""
    batch, seqlen, heads_q, dim = x.shape
    return x.to(dtype).permute(0, 2, 1, 3).reshape(batch, heads_kv, heads_q // heads_kv, seqlen, dim)


def _split_heads(q, k, v, alibi_slopes, dtype):
    """(b, s, h, d) inputs -> (b, h_kv, group, s, d) queries and (b, h_kv, s, d) keys/values, in `dtype`."""
    batch, heads_q, heads_kv = q.shape[0], q.shape[2], k.shape[2]
    qh = _group_heads(q, heads_kv, dtype)
    kh = k.to(dtype).permute(0, 2, 1, 3)
    vh = v.to(dtype).permute(0, 2, 1, 3)
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).expand(batch, heads_q).reshape(batch, heads_kv, heads_q // heads_kv)
    return qh, kh, vh, slopes


def _merge_heads(o: torch.Tensor) -> torch.Tensor:
    """(b, h_kv, group, s, d) -> (b, s, h_q, d)."""
    batch, heads_kv, group, seqlen, dim = o.shape
    return o.reshape(batch, heads_kv * group, seqlen, dim).permute(0, 2, 1, 3)


def attention_ref(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, dtype=torch.float64):
    """Exact attention computed all at once in `dtype` (fp64 by default) on the inputs' device.

    Returns ``(out, lse)``: out (batch, seqlen_q, heads_q, head_dim_v) and lse (batch, heads_q, seqlen_q),
    both in `dtype`.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    left, right = effective_window(causal, window_size)
    qh, kh, vh, slopes = _split_heads(q, k, v, alibi_slopes, dtype)
    rows = torch.arange(seqlen_q, device=q.device)
    cols = torch.arange(seqlen_k, device=q.device)
    s = _scores(qh, kh, rows, cols, scale, softcap, slopes, seqlen_q, seqlen_k, left, right)
    lse = torch.logsumexp(s, dim=-1)
    has_key = sees_a_key(rows, seqlen_q, seqlen_k, left, right)
    p = torch.exp(s - lse[..., None]).masked_fill(~has_key[:, None], 0.0)  # no key: exp(-inf + inf) -> 0
    bad_v = _nonfinite_keys(vh)
    o = torch.einsum("bhgqk,bhkd->bhgqd", p, _finite(vh, bad_v))
    if bad_v is not None:
        seen = visible(rows, cols, seqlen_q, seqlen_k, left, right)
        o = o.masked_fill((seen & bad_v[:, :, None, None, :]).any(dim=-1)[..., None], math.nan)
    batch, heads_q = q.shape[0], q.shape[2]
    return _merge_heads(o), _lse_rule(lse, has_key).reshape(batch, heads_q, seqlen_q)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The CPU path computes in fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _key_range(row0: int, row1: int, seqlen_q: int, seqlen_k: int, left: int, right: int) -> tuple[int, int]:
    """Keys [begin, end) that any query row in [row0, row1) may see (mirrors Mask in kernels/common/mask.cuh)."""
    offset = seqlen_k - seqlen_q
    begin = 0 if left < 0 else max(0, row0 + offset - left)
    end = seqlen_k if right < 0 else min(seqlen_k, max(0, row1 - 1 + offset + right + 1))
    return begin, end


def _empty_outputs(q: torch.Tensor, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path's results, laid out as the GPU's: out (batch, seqlen_q, heads_q, head_dim_v) in q's dtype
    and lse (batch, heads_q, seqlen_q) fp32, both contiguous."""
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty(batch, seqlen_q, heads_q, head_dim_v, dtype=q.dtype, device=q.device)
    return out, torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=q.device)


def _chunked_setup(q, k, v, causal, softmax_scale, window_size, alibi_slopes):
    """What the chunked forward and backward both start from: accumulator dtype, scale, window bounds, and
    the inputs split into (batch, heads_kv, group, ...) heads in that dtype."""
    acc_dtype = _accumulator_dtype(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    left, right = effective_window(causal, window_size)
    return (acc_dtype, scale, left, right, *_split_heads(q, k, v, alibi_slopes, acc_dtype))


def attention_chunked(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, query_chunk=QUERY_CHUNK, key_chunk=KEY_CHUNK):
    """FlashAttention's algorithm in plain PyTorch: stream keys in chunks with an online softmax.

    Extra memory is one (batch, heads, query_chunk, key_chunk) score block, whatever the sequence
    length. Arithmetic is fp32 (fp64 for fp64 inputs). Returns ``(out, lse)`` with out in the input dtype
    and lse fp32, shaped like :func:`attention_ref`'s and contiguous.
    """
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    acc_dtype, scale, left, right, qh, kh, vh, slopes = _chunked_setup(q, k, v, causal, softmax_scale,
                                                                       window_size, alibi_slopes)
    heads_kv, group = qh.shape[1], qh.shape[2]
    out, lse = _empty_outputs(q, v.shape[-1])
    out_heads = out.view(batch, seqlen_q, heads_kv, group, v.shape[-1]).permute(0, 2, 3, 1, 4)
    lse_heads = lse.view(batch, heads_kv, group, seqlen_q)
    bad_v = _nonfinite_keys(vh)
    v_finite = _finite(vh, bad_v)

    for row0 in range(0, seqlen_q, query_chunk):
        row1 = min(row0 + query_chunk, seqlen_q)
        rows = torch.arange(row0, row1, device=q.device)
        q_blk = qh[:, :, :, row0:row1]
        m = torch.full((batch, heads_kv, group, row1 - row0), float("-inf"), dtype=acc_dtype, device=q.device)
        denom = torch.zeros_like(m)
        acc = torch.zeros(batch, heads_kv, group, row1 - row0, v.shape[-1], dtype=acc_dtype, device=q.device)
        key_begin, key_end = _key_range(row0, row1, seqlen_q, seqlen_k, left, right)
        for col0 in range(key_begin, key_end, key_chunk):
            col1 = min(col0 + key_chunk, key_end)
            cols = torch.arange(col0, col1, device=q.device)
            s = _scores(q_blk, kh[:, :, col0:col1], rows, cols, scale, softcap, slopes,
                        seqlen_q, seqlen_k, left, right)
            # Online softmax: raise the running max, rescale what was accumulated under the old one.
            m_new = torch.maximum(m, s.amax(dim=-1))
            shift = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # nothing visible yet
            correction = torch.exp(m - shift)
            p = torch.exp(s - shift[..., None])
            denom = denom * correction + p.sum(dim=-1)
            acc = acc * correction[..., None] + torch.einsum("bhgqk,bhkd->bhgqd", p, v_finite[:, :, col0:col1])
            if bad_v is not None:
                seen = visible(rows, cols, seqlen_q, seqlen_k, left, right)
                acc = acc.masked_fill((seen & bad_v[:, :, None, None, col0:col1]).any(dim=-1)[..., None], math.nan)
            m = m_new
        has_key = sees_a_key(rows, seqlen_q, seqlen_k, left, right)
        out_heads[:, :, :, row0:row1] = (acc / denom[..., None]).masked_fill(~has_key[:, None], 0.0)
        lse_heads[:, :, :, row0:row1] = _lse_rule(m + torch.log(denom), has_key)

    return out, lse


def _backward_block(q, k, q_finite, k_finite, v_finite, dout, lse, delta, rows, cols, scale, softcap, slopes,
                    seqlen_q, seqlen_k, left, right):
    """Gradients of one (query chunk, key chunk) block: (dq, dk, dv) contributions, shaped like q, k, v.

    The probabilities are recomputed from the saved log-sum-exp, P = exp(S - lse); then
    dV = P^T dO, dP = dO V^T, dS = P * (dP - D). ALiBi and the mask shift the score by constants, so dS
    reaches the capped score unchanged; the softcap's derivative, 1 - tanh^2 = 1 - (capped / softcap)^2,
    takes it back to the raw score scale * q . k, whence dQ = scale * dS K and dK = scale * dS^T Q.
    P and dS are exactly 0 where the mask hides a key, and the products that spread them over rows or keys
    read the *_finite operands (NaN/Inf vectors zeroed): a NaN reaches only the rows and keys that read it.
    """
    capped = _capped_scores(q, k, scale, softcap)
    s = _bias_and_mask(capped, rows, cols, slopes, seqlen_q, seqlen_k, left, right)
    hidden = ~visible(rows, cols, seqlen_q, seqlen_k, left, right)
    p = torch.exp(s - lse[..., None]).masked_fill(hidden, 0.0)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dout)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dout, v_finite)
    ds = p * (dp - delta[..., None])
    if softcap > 0:
        ds = ds * (1 - (capped / softcap) ** 2)
    ds = ds.masked_fill(hidden, 0.0)
    dq = scale * torch.einsum("bhgqk,bhkd->bhgqd", ds, k_finite)
    dk = scale * torch.einsum("bhgqk,bhgqd->bhkd", ds, q_finite)
    return dq, dk, dv


def attention_chunked_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, query_chunk=QUERY_CHUNK, key_chunk=KEY_CHUNK):
    """FlashAttention-2's backward pass in plain PyTorch: recompute each score block, never store P.

    `out` and `lse` are what :func:`attention_chunked` returned for these inputs and options; `dout` is
    the gradient of the loss with respect to `out`. With D = rowsum(dout * out), every query chunk visits
    the key chunks it may see, as the forward did, and adds up the block gradients of
    :func:`_backward_block`. Extra memory is a few (batch, heads, query_chunk, key_chunk) blocks besides
    the gradients themselves. Arithmetic is fp32 (fp64 for fp64 inputs). Returns ``(dq, dk, dv)`` shaped
    and typed like q, k, v; with GQA dk and dv sum over the query heads that share a key/value head.
    """
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    acc_dtype, scale, left, right, qh, kh, vh, slopes = _chunked_setup(q, k, v, causal, softmax_scale,
                                                                       window_size, alibi_slopes)
    heads_kv, group = qh.shape[1], qh.shape[2]
    doh = _group_heads(dout, heads_kv, acc_dtype)
    delta = (doh * _group_heads(out, heads_kv, acc_dtype)).sum(dim=-1)
    lse = lse.to(acc_dtype).reshape(batch, heads_kv, group, seqlen_q)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # a row that sees no key: P = exp(s - inf) = 0
    dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
    q_finite, k_finite, v_finite = (_finite(x, _nonfinite_keys(x)) for x in (qh, kh, vh))

    for row0 in range(0, seqlen_q, query_chunk):
        row1 = min(row0 + query_chunk, seqlen_q)
        rows = torch.arange(row0, row1, device=q.device)
        key_begin, key_end = _key_range(row0, row1, seqlen_q, seqlen_k, left, right)
        for col0 in range(key_begin, key_end, key_chunk):
            col1 = min(col0 + key_chunk, key_end)
            cols = torch.arange(col0, col1, device=q.device)
            dq_blk, dk_blk, dv_blk = _backward_block(
                qh[:, :, :, row0:row1], kh[:, :, col0:col1], q_finite[:, :, :, row0:row1], k_finite[:, :, col0:col1],
                v_finite[:, :, col0:col1], doh[:, :, :, row0:row1],
                lse[..., row0:row1], delta[..., row0:row1], rows, cols, scale, softcap, slopes,
                seqlen_q, seqlen_k, left, right)
            dq[:, :, :, row0:row1] += dq_blk
            dk[:, :, col0:col1] += dk_blk
            dv[:, :, col0:col1] += dv_blk

    return (_merge_heads(dq).to(q.dtype).contiguous(), dk.permute(0, 2, 1, 3).to(k.dtype).contiguous(),
            dv.permute(0, 2, 1, 3).to(v.dtype).contiguous())


def _sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes):
    """(query slice, key slice, ALiBi slopes) of each sequence of a packed varlen batch; per-batch slopes
    (batch, heads) are taken row by row, per-head slopes (heads,) are shared."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        yield slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1]), slopes


def varlen_apply(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, **options):
    """Run a dense attention function `fn` on each sequence of a packed varlen batch.

    q (total_q, heads_q, d), k/v (total_k, heads_kv, d); returns out (total_q, heads_q, dv) and
    lse (heads_q, total_q), the FlashAttention varlen layout.
    """
    outs, lses = [], []
    for sq, sk, slopes in _sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes):
        o, lse = fn(q[sq][None], k[sk][None], v[sk][None], alibi_slopes=slopes, **options)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def varlen_apply_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, **options):
    """:func:`attention_chunked_backward` on each sequence of a packed varlen batch (see :func:`varlen_apply`).

    dout/q/out (total_q, heads_q, d), k/v (total_k, heads_kv, d), lse (heads_q, total_q); returns
    ``(dq, dk, dv)`` shaped like q, k, v (zero for positions outside every sequence).
    """
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, sk, slopes in _sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes):
        grads = attention_chunked_backward(dout[sq][None], q[sq][None], k[sk][None], v[sk][None], out[sq][None],
                                           lse[:, sq][None], alibi_slopes=slopes, **options)
        dq[sq], dk[sk], dv[sk] = (grad[0] for grad in grads)
    return dq, dk, dv
