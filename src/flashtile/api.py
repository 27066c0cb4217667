"""The public entry points: check every argument, normalise, and hand one problem to one path.

Bad input raises TypeError/ValueError naming the argument and what was expected — before anything
reaches a kernel, so a caller never sees a CUDA error, a crash or a silently wrong answer.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from . import dispatch, ladder, ops, reference
from .forward import FwdProblem, default_scale

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_ONLY_DTYPES = (torch.float64,)  # the chunked CPU path computes in them; no GPU kernel does
MAX_HEAD_DIM = 256


def _check_tensor(name: str, t, rank: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype in CPU_ONLY_DTYPES and t.device.type != "cpu":
        raise TypeError(f"{name} is {t.dtype} on {t.device}, but fp64 is CPU-only: use float16, bfloat16 or "
                        "float32 there")
    if t.dtype not in SUPPORTED_DTYPES + CPU_ONLY_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32 (or float64 on CPU), got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {what}, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {t.stride()}")


def _check_family(q, k, v) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != heads_kv:
        raise ValueError(f"k and v must have the same number of heads, got {heads_kv} and {v.shape[-2]}")
    if heads_q % heads_kv != 0:
        raise ValueError(f"heads of q ({heads_q}) must be a multiple of heads of k and v ({heads_kv}) (GQA/MQA)")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    for name, dim in (("q/k head_dim", q.shape[-1]), ("v head_dim", v.shape[-1])):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be between 1 and {MAX_HEAD_DIM}, got {dim}")


def _check_options(q, softmax_scale, window_size, softcap, alibi_slopes, batch: int | None) -> tuple[float, tuple]:
    if softmax_scale is None and alibi_slopes is None and softcap == 0.0 and window_size == (-1, -1):
        return default_scale(q.shape[-1]), (-1, -1)  # the common call: nothing else to check
    if softmax_scale is None:
        scale = default_scale(q.shape[-1])
    elif isinstance(softmax_scale, Real) and not isinstance(softmax_scale, bool) and math.isfinite(softmax_scale):
        scale = float(softmax_scale)
    else:
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1 = unbounded), got {window_size!r}")
    if not (isinstance(softcap, Real) and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    if alibi_slopes is not None:
        heads_q = q.shape[-2]
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes must be on {q.device} like q, got {alibi_slopes.device}")
        allowed = [(heads_q,)] + ([(batch, heads_q)] if batch is not None else [])
        if tuple(alibi_slopes.shape) not in allowed or alibi_slopes.stride(-1) != 1:
            raise ValueError(f"alibi_slopes must have shape (heads_q,) or (batch, heads_q) = {allowed}, "
                             f"contiguous in the last dim; got {tuple(alibi_slopes.shape)}")
    return scale, tuple(window_size)


def _check_flags(deterministic, rung) -> None:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if rung != "auto":
        ladder.get(rung)  # an unknown rung is an error on every device


def _differentiable(q, k, v, rung) -> bool:
    """True when the call must go through the autograd-aware op (gradients wanted, or torch.compile tracing)."""
    if torch.compiler.is_compiling():
        return True
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return False
    if rung != "auto":
        raise ValueError(f"rung={rung!r} is forward-only; inputs that require grad take rung='auto'")
    return True


# Input signature (shapes, strides, dtypes, devices, options) -> the LaunchPlan its first call produced. A
# repeated call checks nothing again: everything the checks looked at is in the signature.
_plans: dict[tuple, dispatch.LaunchPlan] = {}
MAX_PLANS = 4096  # inference over ever-new shapes (e.g. a growing KV length) must not grow the cache forever


def _signature(q, k, v, options: tuple) -> tuple | None:
    try:
        key = (q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype, k.get_device(),
               v.shape, v.stride(), v.dtype, v.get_device(), options)
        hash(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the full path says what is wrong
        return None
    return key


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, return_lse=False, deterministic=False, rung="auto"):
    """Exact attention, FlashAttention layout.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim);
           v: (batch, seqlen_k, heads_kv, head_dim_v). float16, bfloat16 or float32; heads_q a multiple
           of heads_kv (GQA/MQA); seqlen_q may differ from seqlen_k.
        causal: mask aligned to the bottom-right corner (FlashAttention >= 2.1).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        window_size: (left, right) sliding-window bounds, -1 = unbounded.
        softcap: if > 0, scores become softcap * tanh(scores / softcap).
        alibi_slopes: float32 (heads_q,) or (batch, heads_q); adds -slope * |i + seqlen_k - seqlen_q - j|.
        return_lse: also return the fp32 log-sum-exp (batch, heads_q, seqlen_q).
        deterministic: make the backward pass bitwise repeatable (no order-dependent atomics).
        rung: "auto" (the fastest kernel that serves the inputs), or a ladder rung by name or number.
    Returns:
        out (batch, seqlen_q, heads_q, head_dim_v) in the dtype of q, and lse if ``return_lse``.
    """
    key = None
    if alibi_slopes is None and not torch.compiler.is_compiling():
        key = _signature(q, k, v, (causal, softmax_scale, window_size, softcap, return_lse, deterministic, rung))
        plan = _plans.get(key) if key is not None else None
        if plan is not None and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                  or v.requires_grad)):
            result = plan.run(q, k, v)
            if result is not None:
                return result if return_lse else result[0]

    _check_tensor("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    _check_tensor("k", k, 4, "(batch, seqlen_k, heads_kv, head_dim)")
    _check_tensor("v", v, 4, "(batch, seqlen_k, heads_kv, head_dim_v)")
    _check_family(q, k, v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"k and v must have the same seqlen, got {k.shape[1]} and {v.shape[1]}")
    scale, window = _check_options(q, softmax_scale, window_size, softcap, alibi_slopes, q.shape[0])
    _check_flags(deterministic, rung)

    if _differentiable(q, k, v, rung):
        o, lse = ops.forward(q, k, v, None, None, 0, 0, scale, window[0], 0 if causal else window[1],
                             float(softcap), alibi_slopes, deterministic)
    elif q.is_cuda:
        problem = FwdProblem(q, k, v, scale, (window[0], 0 if causal else window[1]), float(softcap),
                             alibi_slopes, want_lse=return_lse)
        o, lse = dispatch.cuda_forward(problem, rung)
        if key is not None and problem.q is q and problem.k is k and problem.v is v:  # no operand was copied
            plan = dispatch.plan_for(problem, rung)
            if plan is not None:
                if len(_plans) >= MAX_PLANS:
                    _plans.clear()
                _plans[key] = plan
    elif q.device.type == "cpu":
        if rung != "auto":
            raise ValueError(f"rung={rung!r} runs CUDA kernels; CPU tensors take the chunked path (rung='auto')")
        o, lse = reference.attention_chunked(q, k, v, causal=causal, softmax_scale=scale, window_size=window,
                                             softcap=softcap, alibi_slopes=alibi_slopes)
    else:
        raise ValueError(f"q, k and v must be CPU or CUDA tensors, got device {q.device}")
    return (o, lse) if return_lse else o


def _check_cu_seqlens(name: str, cu, total: int, max_seqlen, max_name: str, device) -> int:
    """Validate one cu_seqlens tensor; returns the batch size."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got {cu.dtype} {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {cu.device}")
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 1:
        raise ValueError(f"{max_name} must be a positive int, got {max_seqlen!r}")
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return cu.numel() - 1  # values cannot be read while tracing or capturing; the caller vouches for them
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:])]
    if values[0] != 0 or values[-1] != total or min(lengths) < 0:
        raise ValueError(f"{name} must rise from 0 to the packed length {total}, got {values[:8]}...")
    if max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} ({max_seqlen}) is smaller than the longest sequence ({max(lengths)})")
    return cu.numel() - 1


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     return_lse=False, deterministic=False, rung="auto"):
    """Exact attention over a batch of sequences of different lengths, packed without padding.

    Args:
        q: (total_q, heads_q, head_dim); k: (total_k, heads_kv, head_dim); v: (total_k, heads_kv, head_dim_v).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) offsets: sequence b is rows cu[b]:cu[b+1].
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (ints).
        Other options as in :func:`attention`; alibi_slopes may be (heads_q,) or (batch, heads_q).
    Returns:
        out (total_q, heads_q, head_dim_v), and lse (heads_q, total_q) fp32 if ``return_lse``.
    """
    _check_tensor("q", q, 3, "(total_q, heads_q, head_dim)")
    _check_tensor("k", k, 3, "(total_k, heads_kv, head_dim)")
    _check_tensor("v", v, 3, "(total_k, heads_kv, head_dim_v)")
    _check_family(q, k, v)
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must have the same number of packed rows, got {k.shape[0]} and {v.shape[0]}")
    batch = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q", q.device)
    if _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k", q.device) != batch:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got {cu_seqlens_q.numel()} "
                         f"and {cu_seqlens_k.numel()} offsets")
    scale, window = _check_options(q, softmax_scale, window_size, softcap, alibi_slopes, batch)
    _check_flags(deterministic, rung)
    options = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    if _differentiable(q, k, v, rung):
        left, right = reference.effective_window(causal, window)
        o, lse = ops.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right,
                             float(softcap), alibi_slopes, deterministic)
    elif q.device.type == "cpu":
        if rung != "auto":
            raise ValueError(f"rung={rung!r} runs CUDA kernels; CPU tensors take the chunked path (rung='auto')")
        o, lse = reference.varlen_apply(reference.attention_chunked, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                        alibi_slopes=alibi_slopes, **options)
    elif q.device.type == "cuda":
        problem = FwdProblem(q, k, v, scale, reference.effective_window(causal, window), float(softcap),
                             alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             want_lse=return_lse)
        o, lse = dispatch.cuda_forward(problem, rung)
    else:
        raise ValueError(f"q, k and v must be CPU or CUDA tensors, got device {q.device}")
    return (o, lse) if return_lse else o
