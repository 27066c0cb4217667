"""Exact attention in PyTorch: the fp64 reference, and the CPU path (torch's fused kernel where it serves, see
cpu_kernel.py; elsewhere a chunked online-softmax loop in plain PyTorch).

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

from . import cpu_kernel
from .forward import LOG2E, default_scale

QUERY_CHUNK = 256   # rows of queries per step of the CPU path
KEY_CHUNK = 256     # keys per step: the score block is (batch, heads, 256, 256), never seqlen x seqlen


def _scale_of(softmax_scale: float | None, q: torch.Tensor) -> float:
    """The softmax scale: as given, else 1 / sqrt(head_dim)."""
    return softmax_scale if softmax_scale is not None else default_scale(q.shape[-1])


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


def _lse_rule(lse: torch.Tensor, has_key: torch.Tensor | None) -> torch.Tensor:
    """-inf for rows that see no key (has_key None: every row sees one); any other non-finite LSE (a row that
    read a NaN or Inf) becomes NaN."""
    lse = torch.where(torch.isfinite(lse), lse, math.nan)
    return lse if has_key is None else lse.masked_fill(~has_key, float("-inf"))


def _all_finite(*xs: torch.Tensor) -> bool:
    """No NaN or Inf in any of xs, by the cheapest pass: the sum of their sums is then finite (unless it
    overflows: only a false alarm, which costs speed, never correctness). One Python float per tensor: a check
    of three small tensors costs a quarter of three `isfinite` reductions."""
    return math.isfinite(sum(x.sum(dtype=_accumulator_dtype(x.dtype)).item() for x in xs))


def _nonfinite_keys(x: torch.Tensor) -> torch.Tensor | None:
    """(..., seqlen) mask of the vectors of x (..., seqlen, dim) that hold a NaN or Inf; None if none does."""
    return None if _all_finite(x) else ~torch.isfinite(x).all(dim=-1)


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
    scale = _scale_of(softmax_scale, q)
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


def _lines_view(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(b, s, h_q, ...) -> its (b, h_kv, s, group, ...) view: the loop's layout, seen from the caller's."""
    batch, seqlen, heads_q = x.shape[:3]
    return x.view(batch, seqlen, heads_kv, heads_q // heads_kv, *x.shape[3:]).transpose(1, 2)


def _lines(x: torch.Tensor, heads_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """(b, s, h_q, ...) -> (b * h_kv, s * group, ...) contiguous in `dtype`: one problem per (batch, key/value
    head), its query heads interleaved row by row (a "line" is one query of one head), so that the lines of a
    chunk of rows are one contiguous slice and one bmm serves the whole group."""
    view = _lines_view(x, heads_kv)
    lines = torch.empty(view.shape, dtype=dtype, device=x.device)
    lines.copy_(view)
    return lines.view(view.shape[0] * heads_kv, view.shape[2] * view.shape[3], *x.shape[3:])


class _Chunks:
    """One problem laid out for the chunked loop (see _lines), with what every block needs. Scores are in
    base 2 (s * log2(e), so that softmax weights are exp2 of them: torch's exp2 is the cheaper exponential,
    most of all where weights underflow); q is pre-multiplied by scale * log2(e), or by scale / softcap with a
    softcap, which tanh then reads directly."""

    def __init__(self, q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes):
        self.dtype = _accumulator_dtype(q.dtype)
        self.batch, self.seqlen_q, heads_q, _ = q.shape
        self.seqlen_k, self.heads_kv = k.shape[1], k.shape[2]
        self.group = heads_q // self.heads_kv
        self.scale = _scale_of(softmax_scale, q)
        self.left, self.right = effective_window(causal, window_size)
        self.softcap = softcap
        self.q_factor = self.scale / softcap if softcap > 0 else self.scale * LOG2E
        self.q = _lines(q, self.heads_kv, self.dtype).mul_(self.q_factor)
        self.k = _lines(k, self.heads_kv, self.dtype)
        self.v = _lines(v, self.heads_kv, self.dtype)
        self.neg_slopes = None  # (b, h_kv, 1, group, 1): ALiBi subtracts slope * distance (times log2(e))
        if alibi_slopes is not None:
            slopes = alibi_slopes.to(self.dtype).expand(self.batch, heads_q) * -LOG2E
            self.neg_slopes = slopes.reshape(self.batch, self.heads_kv, 1, self.group, 1)

    def query_chunks(self, query_chunk: int):
        """(row0, row1, key_begin, key_end) of every query chunk: its rows, and the keys any of them may see."""
        for row0 in range(0, self.seqlen_q, query_chunk):
            row1 = min(row0 + query_chunk, self.seqlen_q)
            yield row0, row1, *_key_range(row0, row1, self.seqlen_q, self.seqlen_k, self.left, self.right)

    def by_row(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """A per-line tensor (b * h_kv, rows * group, ...) as its (b, h_kv, rows, group, ...) view."""
        return x.view(self.batch, self.heads_kv, rows, self.group, *x.shape[2:])

    def hidden(self, row0: int, row1: int, col0: int, col1: int) -> torch.Tensor | None:
        """(rows, cols) mask of the block's keys its rows may not see; None when every row sees every key."""
        offset = self.seqlen_k - self.seqlen_q
        if ((self.left < 0 or col0 >= row1 - 1 + offset - self.left)
                and (self.right < 0 or col1 - 1 <= row0 + offset + self.right)):
            return None
        rows = torch.arange(row0, row1, device=self.q.device)
        cols = torch.arange(col0, col1, device=self.q.device)
        return ~visible(rows, cols, self.seqlen_q, self.seqlen_k, self.left, self.right)

    def has_key(self, row0: int, row1: int) -> torch.Tensor | None:
        """(rows,) mask of the rows that see some key; None when all of them do."""
        rows = torch.arange(row0, row1, device=self.q.device)
        has_key = sees_a_key(rows, self.seqlen_q, self.seqlen_k, self.left, self.right)
        return None if bool(has_key.all()) else has_key

    def scores(self, q_lines: torch.Tensor, row0: int, row1: int, col0: int, col1: int):
        """Base-2 scores of a block, (b * h_kv, rows * group, cols), soft-capped and ALiBi-biased but not
        masked; and the tanh of the soft cap (None without one), which the backward's chain rule reads."""
        s = torch.bmm(q_lines, self.k[:, col0:col1].transpose(1, 2))
        tanh = None
        if self.softcap > 0:
            tanh = s.tanh_()
            s = tanh * (self.softcap * LOG2E)
        if self.neg_slopes is not None:
            rows = torch.arange(row0, row1, device=s.device)
            cols = torch.arange(col0, col1, device=s.device)
            distance = (rows[:, None] + (self.seqlen_k - self.seqlen_q) - cols[None, :]).abs().to(s.dtype)
            self.by_row(s, row1 - row0).addcmul_(self.neg_slopes, distance[:, None, :])
        return s, tanh


def _masked_fill_rows(c: _Chunks, x: torch.Tensor, rows: int, mask: torch.Tensor | None, value: float) -> None:
    """Fill x (b * h_kv, rows * group, cols) in place where the (rows, cols) mask is set, in every head."""
    if mask is not None:
        c.by_row(x, rows).masked_fill_(mask[:, None, :], value)


def _chunked_forward(q, k, v, *, causal, softmax_scale, window_size, softcap, alibi_slopes, query_chunk,
                     key_chunk):
    """FlashAttention's algorithm in plain PyTorch: stream key chunks past each query chunk with an online
    softmax, in place on one (b * h_kv, query_chunk * group, key_chunk) score block at a time."""
    c = _Chunks(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes)
    out, lse = _empty_outputs(q, v.shape[-1])
    out_lines, lse_lines = _lines_view(out, c.heads_kv), _lines_view(lse.transpose(1, 2), c.heads_kv)
    bad_v = _nonfinite_keys(c.v)
    v_finite = _finite(c.v, bad_v)
    if bad_v is not None:
        bad_v = bad_v.view(c.batch, c.heads_kv, 1, 1, c.seqlen_k)
    for row0, row1, key_begin, key_end in c.query_chunks(query_chunk):
        rows = row1 - row0
        q_lines = c.q[:, row0 * c.group:row1 * c.group]
        m = torch.full(q_lines.shape[:2], float("-inf"), dtype=c.dtype, device=q.device)
        denom = torch.zeros_like(m)
        acc = torch.zeros(*q_lines.shape[:2], v.shape[-1], dtype=c.dtype, device=q.device)
        for col0 in range(key_begin, key_end, key_chunk):
            col1 = min(col0 + key_chunk, key_end)
            s, _ = c.scores(q_lines, row0, row1, col0, col1)
            hidden = c.hidden(row0, row1, col0, col1)
            _masked_fill_rows(c, s, rows, hidden, float("-inf"))
            # Online softmax: raise the running max, rescale what was accumulated under the old one.
            m_new = torch.maximum(m, s.amax(dim=-1))
            shift = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # nothing visible yet
            p = s.sub_(shift[..., None]).exp2_()
            correction = (m - shift).exp2_()
            denom.mul_(correction).add_(p.sum(dim=-1))
            acc.mul_(correction[..., None]).baddbmm_(p, v_finite[:, col0:col1])
            if bad_v is not None:  # rows that see a NaN/Inf value vector: NaN (p v_finite skipped it)
                reads = bad_v[..., col0:col1] if hidden is None else bad_v[..., col0:col1] & ~hidden[:, None, :]
                c.by_row(acc, rows).masked_fill_(reads.any(dim=-1, keepdim=True), math.nan)
            m = m_new
        has_key = c.has_key(row0, row1)
        o = c.by_row(acc.div_(denom[..., None]), rows)
        row_lse = c.by_row(denom.log2_().add_(m).mul_(1.0 / LOG2E), rows)
        row_lse = _lse_rule(row_lse, None if has_key is None else has_key[:, None])
        if has_key is not None:
            o.masked_fill_(~has_key[:, None, None], 0.0)
        out_lines[:, :, row0:row1] = o
        lse_lines[:, :, row0:row1] = row_lse
    return out, lse


def _chunked_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, window_size, softcap, alibi_slopes,
                      query_chunk, key_chunk, dlse=None):
    """FlashAttention-2's backward in plain PyTorch: recompute each score block from the saved LSE, never
    store P. P and dS are exactly 0 where the mask hides a key, and the products that spread them over rows
    or keys read NaN/Inf vectors as 0, so a NaN reaches only the gradients that depend on it."""
    c = _Chunks(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes)
    dout_lines = _lines(dout, c.heads_kv, c.dtype)
    delta = _lines((dout.to(c.dtype) * out.to(c.dtype)).sum(dim=-1), c.heads_kv, c.dtype)  # rowsum(dO * O)
    if dlse is not None:  # the loss uses the LSE too: d lse_i / d s_ij = P_ij, so dS = P (dP - D + dLSE)
        delta.sub_(_lines(dlse.transpose(1, 2), c.heads_kv, c.dtype))
    lse = _lines(lse.transpose(1, 2), c.heads_kv, c.dtype).mul_(LOG2E)  # base 2, as the scores
    lse.masked_fill_(torch.isneginf(lse), float("inf"))  # a row that sees no key: P = exp2(s - inf) = 0
    q_finite, k_finite, v_finite = (_finite(x, _nonfinite_keys(x)) for x in (c.q, c.k, c.v))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dq_lines = _lines_view(dq, c.heads_kv)
    dk_lines, dv_lines = torch.zeros_like(c.k), torch.zeros_like(c.v)
    for row0, row1, key_begin, key_end in c.query_chunks(query_chunk):
        rows, chunk = row1 - row0, slice(row0 * c.group, row1 * c.group)
        q_lines, dout_chunk = c.q[:, chunk], dout_lines[:, chunk]
        lse_chunk, delta_chunk = lse[:, chunk], delta[:, chunk]
        dq_chunk = torch.zeros_like(q_lines)
        for col0 in range(key_begin, key_end, key_chunk):
            col1 = min(col0 + key_chunk, key_end)
            s, tanh = c.scores(q_lines, row0, row1, col0, col1)
            hidden = c.hidden(row0, row1, col0, col1)
            p = s.sub_(lse_chunk[..., None]).exp2_()
            _masked_fill_rows(c, p, rows, hidden, 0.0)
            dv_lines[:, col0:col1].baddbmm_(p.transpose(1, 2), dout_chunk)
            ds = torch.bmm(dout_chunk, v_finite[:, col0:col1].transpose(1, 2)).sub_(delta_chunk[..., None]).mul_(p)
            if tanh is not None:  # d(softcap * tanh(u / softcap)) / du = 1 - tanh^2
                ds.mul_(tanh.square_().neg_().add_(1.0))
            _masked_fill_rows(c, ds, rows, hidden, 0.0)
            dq_chunk.baddbmm_(ds, k_finite[:, col0:col1])
            dk_lines[:, col0:col1].baddbmm_(ds.transpose(1, 2), q_finite[:, chunk])
        dq_lines[:, :, row0:row1] = c.by_row(dq_chunk.mul_(c.scale), rows)
    dk, dv = torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for grad, lines in ((dk, dk_lines.mul_(c.scale / c.q_factor)), (dv, dv_lines)):
        view = _lines_view(grad, c.heads_kv)
        view.copy_(lines.view(view.shape))
    return dq, dk, dv


def _torch_kernel_serves(q, k, v, left, right, softcap, alibi_slopes) -> bool:
    """Whether torch's fused CPU kernel takes this call: it serves the options (cpu_kernel.serves) and q, k, v
    are finite (read last: one pass over each)."""
    return cpu_kernel.serves(q, k, v, left, right, softcap, alibi_slopes) and _all_finite(q, k, v)


def attention_chunked(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, query_chunk=QUERY_CHUNK, key_chunk=KEY_CHUNK, torch_kernel=True):
    """The CPU path's forward: torch's fused FlashAttention kernel where it serves (cpu_kernel.py), else
    FlashAttention's algorithm in plain PyTorch (the chunked loop; `torch_kernel=False` forces it).

    Extra memory is a few (batch * heads, query_chunk, key_chunk) blocks, whatever the sequence length.
    Arithmetic is fp32 (fp64 for fp64 inputs). Returns ``(out, lse)`` with out in the input dtype and lse
    fp32, shaped like :func:`attention_ref`'s and contiguous.
    """
    left, right = effective_window(causal, window_size)
    if torch_kernel and _torch_kernel_serves(q, k, v, left, right, softcap, alibi_slopes):
        return cpu_kernel.forward(q, k, v, _scale_of(softmax_scale, q), causal=right == 0)
    return _chunked_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                            softcap=softcap, alibi_slopes=alibi_slopes, query_chunk=query_chunk, key_chunk=key_chunk)


def attention_chunked_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, query_chunk=QUERY_CHUNK, key_chunk=KEY_CHUNK,
                               torch_kernel=True, dlse=None):
    """The CPU path's backward, on the kernel :func:`attention_chunked` chooses for the same arguments. `out`
    and `lse` are what a forward returned for these inputs and options; `dout` is the gradient of the loss
    with respect to `out`. Arithmetic is fp32 (fp64 for fp64 inputs). Returns ``(dq, dk, dv)`` shaped and
    typed like q, k, v and contiguous; with GQA dk and dv sum over the query heads that share a key/value head.
    `dlse` (batch, heads_q, seqlen_q) is the gradient of the loss with respect to `lse`, if the loss uses it:
    the chunked loop serves it (torch's kernel derives D from out alone).
    """
    left, right = effective_window(causal, window_size)
    if torch_kernel and dlse is None and _torch_kernel_serves(q, k, v, left, right, softcap, alibi_slopes):
        return cpu_kernel.backward(dout, q, k, v, out, lse, _scale_of(softmax_scale, q), causal=right == 0)
    return _chunked_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                             query_chunk=query_chunk, key_chunk=key_chunk, dlse=dlse)


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


def varlen_apply_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, dlse=None,
                          **options):
    """:func:`attention_chunked_backward` on each sequence of a packed varlen batch (see :func:`varlen_apply`).

    dout/q/out (total_q, heads_q, d), k/v (total_k, heads_kv, d), lse (heads_q, total_q); returns
    ``(dq, dk, dv)`` shaped like q, k, v (zero for positions outside every sequence).
    """
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, sk, slopes in _sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes):
        grads = attention_chunked_backward(dout[sq][None], q[sq][None], k[sk][None], v[sk][None], out[sq][None],
                                           lse[:, sq][None], alibi_slopes=slopes,
                                           dlse=None if dlse is None else dlse[:, sq][None], **options)
        dq[sq], dk[sk], dv[sk] = (grad[0] for grad in grads)
    return dq, dk, dv
