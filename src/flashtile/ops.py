"""flashtile's autograd: one eager-mode autograd.Function, and torch.library ops for torch.compile.

A call with a host path (host.py) records the same node in C++ instead; this module's Function serves the rest
and every call under torch.func transforms.

Eager calls that need gradients go through :class:`Attention`, a ``torch.autograd.Function`` over a call
(dispatch.PlannedCall or dispatch.GeneralCall): its forward runs the call's forward and saves q, k, v, out and
lse (no seqlen x seqlen matrix), its backward runs the call's backward. That costs what autograd's node costs and
no more: :func:`attention` enters it through the C++ apply, and the backward wraps itself in
``once_differentiable`` only when a graph of the backward is being recorded (``create_graph=True``), the one case
where that wrapper does anything. torch.library's Python dispatch would add about a hundred microseconds a call.

Under torch.compile the same work goes through ``torch.ops.flashtile.forward`` and ``torch.ops.flashtile.backward``:
custom ops with fake (meta) implementations, so torch.compile traces through them without a graph break, joined
by ``register_autograd``. Neither path synchronises with the host or allocates outside torch's allocator, so both
can be captured in a CUDA graph. Arguments reach this module already checked by api.py; causal is folded into
window_right = 0.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import dispatch
from .forward import FwdProblem

__all__ = ["Attention", "attention", "forward", "backward_op"]


class Attention(torch.autograd.Function):
    """(out, lse) of `call` on q, k, v, differentiable in q, k and v. Call it through :func:`attention`."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, call) -> tuple[Tensor, Tensor]:
        out, lse = call.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zero tensor per call
        return out, lse

    @staticmethod
    def backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
        if torch.is_grad_enabled():  # backward(create_graph=True): gradients that refuse a second backward
            return _once_differentiable_backward(ctx, dout, dlse)
        return _backward_grads(ctx, dout, dlse)


def _backward_grads(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None and dlse is None:
        return None, None, None, None
    if dout is None:  # only the log-sum-exp reached the loss
        dout = torch.zeros_like(out)
    dq, dk, dv = ctx.call.backward(dout, q, k, v, out, lse, dlse)
    return dq, dk, dv, None


_once_differentiable_backward = once_differentiable(_backward_grads)
# autograd.Function.apply's Python layer (argument binding, functorch's checks) costs about as much as the node it
# builds; outside functorch transforms (vmap, grad) the C++ apply it ends in serves alone.
_apply = super(torch.autograd.Function, Attention).apply


def attention(q: Tensor, k: Tensor, v: Tensor, call) -> tuple[Tensor, Tensor]:
    """Attention.apply(q, k, v, call), or the same node built in C++ where the call has a host path (host.py: a
    planned CUDA call, or torch's CPU kernel)."""
    if torch._C._are_functorch_transforms_active():
        return Attention.apply(q, k, v, call)
    if call.host is not None:
        result = call.host.train(q, k, v)
        if result is not None:  # None: a CPU input is not finite, and ops.Attention applies the general rules
            return result
    return _apply(q, k, v, call)


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> tuple[int, ...]:
    """FlashAttention's LSE layouts: (batch, heads, seqlen_q) dense, (heads, total_q) varlen."""
    return (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])


def _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
             window_right, softcap, alibi_slopes) -> FwdProblem:
    return FwdProblem(q, k, v, softmax_scale, (window_left, window_right), softcap, alibi_slopes, cu_seqlens_q,
                      cu_seqlens_k, max_seqlen_q, max_seqlen_k, want_lse=True)


@torch.library.custom_op("flashtile::forward", mutates_args=())
def forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
            max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
            softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    """Attention forward: (out, lse). `deterministic` is for the backward this forward's autograd node runs."""
    out, lse = dispatch.forward(_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, window_left, window_right, softcap, alibi_slopes))
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
                alibi_slopes: Optional[Tensor], deterministic: bool,
                dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward: (dq, dk, dv), shaped like q, k, v (dk/dv summed over each GQA group). `dlse`: the
    gradient of the forward's log-sum-exp, None when the loss does not use it."""
    problem = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                       window_right, softcap, alibi_slopes)
    return tuple(g.contiguous() for g in dispatch.backward(problem, out, lse, dout, deterministic, dlse))


@backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   window_left, window_right, softcap, alibi_slopes, deterministic, dlse=None):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options, alibi_slopes, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.options = options  # max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap
    ctx.deterministic = deterministic


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = backward_op(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options, alibi_slopes,
                             ctx.deterministic, dlse)
    return (dq, dk, dv) + (None,) * 10


forward.register_autograd(_backward, setup_context=_setup_context)
