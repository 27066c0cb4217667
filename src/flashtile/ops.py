"""flashtile as PyTorch operators: ``torch.ops.flashtile.forward`` and ``torch.ops.flashtile.backward``.

Both are ``torch.library`` custom ops with fake (meta) implementations, so ``torch.compile`` traces through
them without a graph break, and autograd joins them: the forward saves what the backward needs (q, k, v,
out, lse — no seqlen x seqlen matrix). On CUDA they run the rung-4 kernels (backward.py); where those do
not apply (fp32, GPUs before Ampere) and on CPU they run the chunked PyTorch path of reference.py.
Neither synchronises with the host or allocates outside torch's allocator, so both can be captured in a
CUDA graph. Arguments reach these ops already checked by api.py; causal is folded into window_right = 0.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import backward, dispatch, reference
from .forward import FwdProblem

__all__ = ["forward", "backward_op"]


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> tuple[int, ...]:
    """FlashAttention's LSE layouts: (batch, heads, seqlen_q) dense, (heads, total_q) varlen."""
    return (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])


def _chunked_options(softmax_scale: float, window_left: int, window_right: int, softcap: float) -> dict:
    return {"causal": False, "softmax_scale": softmax_scale, "window_size": (window_left, window_right),
            "softcap": softcap}


@torch.library.custom_op("flashtile::forward", mutates_args=())
def forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
            max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
            softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    """Attention forward: (out, lse). `deterministic` is for the backward this forward's autograd node runs."""
    if q.is_cuda:
        problem = FwdProblem(q, k, v, softmax_scale, (window_left, window_right), softcap, alibi_slopes,
                             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, want_lse=True)
        out, lse = dispatch.cuda_forward(problem, "auto")
    else:
        options = _chunked_options(softmax_scale, window_left, window_right, softcap)
        if cu_seqlens_q is None:
            out, lse = reference.attention_chunked(q, k, v, alibi_slopes=alibi_slopes, **options)
        else:
            out, lse = reference.varlen_apply(reference.attention_chunked, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                              alibi_slopes=alibi_slopes, **options)
    return out.contiguous(), lse.contiguous()


@forward.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                  window_right, softcap, alibi_slopes, deterministic):
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    return out, q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@torch.library.custom_op("flashtile::backward", mutates_args=())
def backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
                max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                alibi_slopes: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward: (dq, dk, dv), shaped like q, k, v (dk/dv summed over each GQA group)."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if q.is_cuda:
        problem = FwdProblem(dispatch.kernel_ready(q), dispatch.kernel_ready(k), dispatch.kernel_ready(v),
                             softmax_scale, (window_left, window_right), softcap, alibi_slopes,
                             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if backward.unsupported(problem) is None:
            dq, dk, dv = backward.cuda_backward(problem, dispatch.kernel_ready(out), lse.contiguous(),
                                                dispatch.kernel_ready(dout), deterministic)
            return (dq[..., :q.shape[-1]].contiguous(), dk[..., :k.shape[-1]].contiguous(),
                    dv[..., :v.shape[-1]].contiguous())
    options = _chunked_options(softmax_scale, window_left, window_right, softcap)
    if cu_seqlens_q is None:
        grads = reference.attention_chunked_backward(dout, q, k, v, out, lse, alibi_slopes=alibi_slopes, **options)
    else:
        grads = reference.varlen_apply_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                alibi_slopes=alibi_slopes, **options)
    return tuple(g.contiguous() for g in grads)


@backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   window_left, window_right, softcap, alibi_slopes, deterministic):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options, alibi_slopes, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.options = options  # max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = backward_op(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options, alibi_slopes,
                             ctx.deterministic)
    return (dq, dk, dv) + (None,) * 10


forward.register_autograd(_backward, setup_context=_setup_context)
