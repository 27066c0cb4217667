"""torch's fused FlashAttention CPU kernel, under flashtile's conventions.

``aten::_scaled_dot_product_flash_attention_for_cpu`` (what ``F.scaled_dot_product_attention`` runs on CPU) and
its backward take (batch, heads, seqlen, head_dim) views, GQA included, and return the natural-log LSE as
(batch, heads, seqlen_q). Its causal mask is top-left aligned, flashtile's bottom-right; they agree when
seqlen_q == seqlen_k, and the other shapes reduce to that one (see :func:`forward`). It serves attention
without softcap, ALiBi or a sliding window, with head_dim_v == head_dim, on finite inputs only, which the
caller checks beforehand: with a NaN or Inf its masked-out zeros spread NaN to rows that never read it, and
some rows that do read one come out finite (a NaN dropped), so its outputs cannot tell either case.
"""

from __future__ import annotations

import torch

# The forward through its Python binding where torch has one: the operator overload's Python layer costs ~2 us a
# call, a third of the whole kernel at small sizes.
_forward = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu",
                   torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
NO_DROPOUT = 0.0


def serves(q, k, v, left: int, right: int, softcap: float, alibi_slopes) -> bool:
    """Whether the kernel computes these shapes and options as flashtile defines them (finite inputs aside)."""
    return (softcap == 0 and alibi_slopes is None and left < 0 and right in (-1, 0)
            and q.shape[-1] == v.shape[-1] and q.shape[1] > 0 and k.shape[1] > 0)


def _heads_first(*tensors):
    """(b, s, h, d) -> (b, h, s, d) views, the kernel's layout."""
    return [t.transpose(1, 2) for t in tensors]


def forward(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) as reference.attention_chunked returns them: contiguous (b, s_q, h_q, d) in q's dtype and
    (b, h_q, s_q) fp32.

    seqlen_q > seqlen_k (causal): the first seqlen_q - seqlen_k rows see no key, the rest are a square causal
    problem. seqlen_q < seqlen_k: every row sees the first seqlen_k - seqlen_q keys whole, then a square causal
    problem; the two partial results merge by their LSEs.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    qt, kt, vt = _heads_first(q, k, v)
    if not causal or seqlen_q == seqlen_k:
        out, lse = _forward(qt, kt, vt, NO_DROPOUT, causal, scale=scale)
    elif seqlen_q > seqlen_k:
        blind = seqlen_q - seqlen_k
        seen_out, seen_lse = _forward(qt[:, :, blind:], kt, vt, NO_DROPOUT, True, scale=scale)
        out = torch.zeros(qt.shape, dtype=q.dtype, device=q.device)
        lse = torch.full(qt.shape[:3], float("-inf"), dtype=seen_lse.dtype, device=q.device)
        out[:, :, blind:], lse[:, :, blind:] = seen_out, seen_lse
    else:
        shift = seqlen_k - seqlen_q
        whole_out, whole_lse = _forward(qt, kt[:, :, :shift], vt[:, :, :shift], NO_DROPOUT, False, scale=scale)
        diag_out, diag_lse = _forward(qt, kt[:, :, shift:], vt[:, :, shift:], NO_DROPOUT, True, scale=scale)
        lse = torch.logaddexp(whole_lse, diag_lse)
        out = (whole_out.to(lse.dtype) * (whole_lse - lse).exp_()[..., None]).addcmul_(
            diag_out.to(lse.dtype), (diag_lse - lse).exp_()[..., None]).to(q.dtype)
    return out.transpose(1, 2).contiguous(), lse.float().contiguous()


def backward(dout, q, k, v, out, lse, scale: float, causal: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv), contiguous and shaped like q, k, v, for the (out, lse) :func:`forward` returned.

    The kernel's backward recomputes P = exp(S - lse) and D = rowsum(dO * O) from the LSE and output it is
    given, so each part of a split problem, given the whole problem's out and lse, yields its exact share.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    dot, qt, kt, vt, ot = _heads_first(dout, q, k, v, out)
    if not causal or seqlen_q == seqlen_k:
        dq, dk, dv = _backward(dot, qt, kt, vt, ot, lse, NO_DROPOUT, causal, scale=scale)
    elif seqlen_q > seqlen_k:
        blind = seqlen_q - seqlen_k
        dq = torch.zeros(qt.shape, dtype=q.dtype, device=q.device)
        dq[:, :, blind:], dk, dv = _backward(dot[:, :, blind:], qt[:, :, blind:], kt, vt, ot[:, :, blind:],
                                             lse[:, :, blind:], NO_DROPOUT, True, scale=scale)
    else:
        shift = seqlen_k - seqlen_q
        dq, dk_whole, dv_whole = _backward(dot, qt, kt[:, :, :shift], vt[:, :, :shift], ot, lse, NO_DROPOUT,
                                           False, scale=scale)
        dq_diag, dk_diag, dv_diag = _backward(dot, qt, kt[:, :, shift:], vt[:, :, shift:], ot, lse, NO_DROPOUT,
                                              True, scale=scale)
        dq = dq + dq_diag
        dk, dv = torch.cat([dk_whole, dk_diag], dim=2), torch.cat([dv_whole, dv_diag], dim=2)
    return tuple(g.transpose(1, 2).contiguous() for g in (dq, dk, dv))
