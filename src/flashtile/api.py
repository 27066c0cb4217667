"""The public entry points: check every argument, normalise, and hand one problem to one path.

Bad input raises TypeError/ValueError naming the argument and what was expected — before anything
reaches a kernel, so a caller never sees a CUDA error, a crash or a silently wrong answer.
"""

from __future__ import annotations

import math
import operator
from numbers import Real

import numpy as np
import torch

from . import dispatch, host, ladder, ops, reference
from .forward import LOG2E, FwdProblem, default_scale

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_ONLY_DTYPES = (torch.float64,)  # the chunked CPU path computes in them; no GPU kernel does
MAX_HEAD_DIM = 256
UNBOUNDED = -1                        # a window bound that lets every key in
NO_WINDOW = (UNBOUNDED, UNBOUNDED)    # the default window_size (the fast paths test it by identity)
NO_SOFTCAP = 0.0                      # the default softcap, off (likewise)
# The kernels' params hold softmax_scale and softcap as float32: the largest float32 is 2**128 - 2**104, and a
# value half a unit past it (2**103) rounds to infinity.
FP32_OVERFLOW = 2.0**128 - 2.0**103
KEYED_NUMBERS = (float, int)          # the number types the call cache keys on as given (see _key_forms)


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


def as_int(value) -> int | None:
    """value as a Python int when it is an integer (Python or NumPy, or a 0-d integer tensor) and not a bool;
    otherwise None. FlashAttention-2 takes integers in all these forms."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor)
                                               and (value.dim() != 0 or value.dtype == torch.bool)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _window_pair(window_size) -> tuple[int, int]:
    """window_size as two Python ints >= -1. Any pair of integers will do, as for FlashAttention-2: a tuple or
    list of Python or NumPy ints or 0-d integer tensors, or a 1-d integer tensor or array of two."""
    pair = window_size.tolist() if isinstance(window_size, (torch.Tensor, np.ndarray)) else window_size
    if isinstance(pair, (tuple, list)) and len(pair) == 2:
        left, right = as_int(pair[0]), as_int(pair[1])
        if left is not None and right is not None and left >= UNBOUNDED and right >= UNBOUNDED:
            return left, right
    raise ValueError(f"window_size must be a pair of integers >= -1 (-1 = unbounded), got {window_size!r}")


def _window(window_size, reach: int) -> tuple[int, int]:
    """The checked window with every bound at or past `reach`, the longer sequence length, made -1: such a bound
    lets every key in, and only -1 says so in the kernels' int32 params whatever its size."""
    return tuple(UNBOUNDED if bound >= reach else bound for bound in _window_pair(window_size))


def _real(name: str, value, expected: str) -> float:
    """A real option as a Python float: FlashAttention-2 takes Python and NumPy numbers and 0-d tensors."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool and not value.is_complex():
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int past float64's range
        raise ValueError(f"{name} must be {expected}, got {value!r}") from None


def _finite_in_fp32(x: float) -> bool:
    """Whether x stays finite as the float32 the kernels' params hold (arithmetic only, so torch.compile traces
    it): rounding to nearest reaches infinity from FP32_OVERFLOW on."""
    return abs(x) < FP32_OVERFLOW


def _check_scale(softmax_scale) -> float:
    """softmax_scale as a float; the kernels also use softmax_scale * log2(e), which must stay finite too."""
    expected = "None or a number that, like its product with log2(e), is finite in float32"
    scale = _real("softmax_scale", softmax_scale, expected)
    if not (_finite_in_fp32(scale) and _finite_in_fp32(scale * LOG2E)):
        raise ValueError(f"softmax_scale must be {expected}, got {softmax_scale!r}")
    return scale


def _check_softcap(softcap) -> float:
    """softcap as a float, 0 (off) or positive; the kernels also use 1 / softcap, which must stay finite too."""
    expected = "0 (off) or a positive number that, like its reciprocal, is finite in float32"
    cap = _real("softcap", softcap, expected)
    if cap != 0 and not (cap > 0 and _finite_in_fp32(cap) and _finite_in_fp32(1 / cap)):
        raise ValueError(f"softcap must be {expected}, got {softcap!r}")
    return cap


def _check_options(q, softmax_scale, window_size, softcap, alibi_slopes, batch: int | None,
                   reach: int) -> tuple[float, tuple[int, int], float]:
    """(scale, window, softcap) checked and normalised; `reach` is the longer of seqlen_q and seqlen_k."""
    if softmax_scale is None and alibi_slopes is None and window_size is NO_WINDOW and softcap is NO_SOFTCAP:
        return default_scale(q.shape[-1]), NO_WINDOW, NO_SOFTCAP  # the common call: nothing else to check
    scale = default_scale(q.shape[-1]) if softmax_scale is None else _check_scale(softmax_scale)
    window = _window(window_size, reach)
    cap = _check_softcap(softcap)
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
    return scale, window, cap


def _check_flags(deterministic, rung) -> None:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if rung != "auto":
        ladder.get(rung)  # an unknown rung is an error on every device


def _differentiable(q, k, v, rung) -> bool:
    """True when gradients are wanted from this call."""
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return False
    if rung != "auto":
        raise ValueError(f"rung={rung!r} is forward-only; inputs that require grad take rung='auto'")
    return True


def _run(call, q, k, v, grad: bool, return_lse: bool):
    out, lse = ops.attention(q, k, v, call) if grad else call.forward(q, k, v)
    return (out, lse) if return_lse else out


# Input signature (shapes, strides, dtypes, devices, options, whether gradients are wanted) -> the
# dispatch.PlannedCall (or, on the CPU, dispatch.GeneralCall) its first call produced. A repeated call checks
# nothing again: everything the checks looked at is in the signature. Kept calls hold no tensors. Calls whose
# whole run is C++ are kept in the extension's table too (host.keep), where a repeated call is found and run in
# one crossing.
_calls: dict[tuple, dispatch.PlannedCall | dispatch.GeneralCall] = {}
MAX_CALLS = host.MAX_KEPT_CALLS
host.on_change(_calls.clear)  # when the host path changes (its build is ready), calls are planned again


def clear_calls() -> None:
    """Forget every kept call (this module's and the extension's): the next call of each signature plans anew."""
    _calls.clear()
    table = host.kept_calls()
    if table is not None:
        table.clear()


_KEY_GRAD = 12  # the signature's field that says whether gradients are wanted


def _signature(q, k, v, options: tuple) -> tuple | None:
    try:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        key = (q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype, k.get_device(),
               v.shape, v.stride(), v.dtype, v.get_device(), grad, options)
        hash(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the full path says what is wrong
        return None
    return key


def _key_forms(softmax_scale, window_size, softcap) -> tuple:
    """The options in forms the call cache can key on: as given when they are Python numbers and a tuple of two
    Python ints, otherwise checked and converted to those. A tensor can change in place under its key, and a
    float or bool equals an int (3.0 == 3, True == 1) whose accepted key it would share though the checks
    refuse it."""
    if ((softmax_scale is None or softmax_scale.__class__ in KEYED_NUMBERS) and softcap.__class__ in KEYED_NUMBERS
            and window_size.__class__ is tuple and len(window_size) == 2
            and window_size[0].__class__ is int and window_size[1].__class__ is int):
        return softmax_scale, window_size, softcap
    scale = None if softmax_scale is None else _check_scale(softmax_scale)
    return scale, _window_pair(window_size), _check_softcap(softcap)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=NO_WINDOW, softcap=NO_SOFTCAP,
              alibi_slopes=None, return_lse=False, deterministic=False, rung="auto"):
    """Exact attention, FlashAttention layout.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim);
           v: (batch, seqlen_k, heads_kv, head_dim_v). float16, bfloat16 or float32; heads_q a multiple
           of heads_kv (GQA/MQA); seqlen_q may differ from seqlen_k.
        causal: mask aligned to the bottom-right corner (FlashAttention >= 2.1).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        window_size: (left, right) sliding-window bounds, any pair of integers; -1, or a bound at or past the
            longer sequence, is unbounded.
        softcap: if > 0, scores become softcap * tanh(scores / softcap).
        alibi_slopes: float32 (heads_q,) or (batch, heads_q); adds -slope * |i + seqlen_k - seqlen_q - j|.
        return_lse: also return the fp32 log-sum-exp (batch, heads_q, seqlen_q).
        deterministic: make the backward pass bitwise repeatable (no order-dependent atomics).
        rung: "auto" (the fastest kernel that serves the inputs), or a ladder rung by name or number.
    Returns:
        out (batch, seqlen_q, heads_q, head_dim_v) in the dtype of q, and lse if ``return_lse``.
    """
    compiling = torch.compiler.is_compiling()
    key = None
    if alibi_slopes is None and not compiling:
        if softmax_scale is not None or window_size is not NO_WINDOW or softcap is not NO_SOFTCAP:
            softmax_scale, window_size, softcap = _key_forms(softmax_scale, window_size, softcap)
        options = (causal, softmax_scale, window_size, softcap, return_lse, deterministic, rung)
        table = host.kept_calls()
        if table is not None:
            result = table.run(q, k, v, options)
            if result is not None:
                return result
        key = _signature(q, k, v, options)
        call = _calls.get(key) if key is not None else None
        if call is not None and call.serves(q, k, v):
            return _run(call, q, k, v, key[_KEY_GRAD], return_lse)

    _check_tensor("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    _check_tensor("k", k, 4, "(batch, seqlen_k, heads_kv, head_dim)")
    _check_tensor("v", v, 4, "(batch, seqlen_k, heads_kv, head_dim_v)")
    _check_family(q, k, v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"k and v must have the same seqlen, got {k.shape[1]} and {v.shape[1]}")
    scale, window, softcap = _check_options(q, softmax_scale, window_size, softcap, alibi_slopes, q.shape[0],
                                            max(q.shape[1], k.shape[1]))
    _check_flags(deterministic, rung)
    grad = _differentiable(q, k, v, rung)
    _check_device(q, rung)
    window = reference.effective_window(causal, window)

    if compiling:
        if rung != "auto":
            raise ValueError(f"rung={rung!r} is not traced by torch.compile; take rung='auto'")
        o, lse = ops.forward(q, k, v, None, None, 0, 0, scale, *window, softcap, alibi_slopes, deterministic)
        return (o, lse) if return_lse else o
    problem = FwdProblem(q, k, v, scale, window, softcap, alibi_slopes, want_lse=return_lse or grad)
    call = dispatch.planned_call(problem, rung, deterministic, grad)
    kept = call
    if call is None:
        cpu_kernel = host.cpu_kernel_of(problem, deterministic) if q.is_cpu and rung == "auto" else None
        call = dispatch.GeneralCall(problem, deterministic, rung, cpu_kernel, return_lse)
        # The CPU's general call is kept too, without this call's operands; on CUDA a general call may only mean
        # that these operands were misaligned, and the next call's may not be.
        kept = None if q.is_cuda else dispatch.GeneralCall(problem.on(None, None, None), deterministic, rung,
                                                           cpu_kernel, return_lse)
    if key is not None and kept is not None:
        if len(_calls) >= MAX_CALLS:
            _calls.clear()
        _calls[key] = kept
        host.keep(q, k, v, options, kept, return_lse)
    return _run(call, q, k, v, grad, return_lse)


def _check_device(q, rung) -> None:
    if q.device.type == "cpu":
        if rung != "auto":
            raise ValueError(f"rung={rung!r} runs CUDA kernels; CPU tensors take the chunked path (rung='auto')")
    elif q.device.type != "cuda":
        raise ValueError(f"q, k and v must be CPU or CUDA tensors, got device {q.device}")


def host_readable(device) -> bool:
    """Whether the values of tensors on `device` can be read on the host now: not while torch.compile traces, nor
    while a CUDA graph is being captured on the current stream."""
    return not (torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()))


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
    if not host_readable(device):
        return cu.numel() - 1  # values cannot be read while tracing or capturing; the caller vouches for them
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:])]
    if values[0] != 0 or values[-1] != total or min(lengths) < 0:
        raise ValueError(f"{name} must rise from 0 to the packed length {total}, got {values[:8]}...")
    if max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} ({max_seqlen}) is smaller than the longest sequence ({max(lengths)})")
    return cu.numel() - 1


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=NO_WINDOW, softcap=NO_SOFTCAP, alibi_slopes=None,
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
    scale, window, softcap = _check_options(q, softmax_scale, window_size, softcap, alibi_slopes, batch,
                                            max(max_seqlen_q, max_seqlen_k))
    _check_flags(deterministic, rung)
    grad = _differentiable(q, k, v, rung)
    _check_device(q, rung)
    window = reference.effective_window(causal, window)
    if torch.compiler.is_compiling():
        if rung != "auto":
            raise ValueError(f"rung={rung!r} is not traced by torch.compile; take rung='auto'")
        o, lse = ops.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, *window,
                             softcap, alibi_slopes, deterministic)
        return (o, lse) if return_lse else o
    problem = FwdProblem(q, k, v, scale, window, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, want_lse=return_lse or grad)
    return _run(dispatch.GeneralCall(problem, deterministic, rung), q, k, v, grad, return_lse)
