"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` served by :func:`flashtile.attention`.

Same arguments, defaults, layout (batch, heads, seqlen, head_dim) and semantics as torch's function. What
flashtile cannot serve goes to torch's own function, with a :class:`~flashtile.compat._warn.FallbackWarning`
once per reason: an ``attn_mask``, ``dropout_p > 0``, dtypes other than float16/bfloat16/float32, devices other
than CPU and CUDA, tensors that are not 4-D, empty tensors, head dims above 256, broadcast batch dims, and
query heads fewer than key/value heads. Calls that torch rejects (mismatched dtypes or devices, key/value
heads that are neither equal to nor a divisor of the query heads as torch requires) go to torch without a
warning, so they fail exactly as they do in torch.

Causal alignment: torch's ``is_causal`` is aligned to the top-left corner (query i sees keys j <= i), flashtile's
to the bottom-right. They agree when seqlen_q == seqlen_k. When seqlen_q < seqlen_k, keys at or past seqlen_q
are never visible, so the keys are cut to the first seqlen_q and flashtile's causal mask is used. When
seqlen_q > seqlen_k, query i seeing keys j <= i is flashtile's window (left -1, right seqlen_q - seqlen_k)
without the causal flag.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import torch.nn.functional as F

from ..api import MAX_HEAD_DIM, SUPPORTED_DTYPES, attention
from ._warn import warn_once

FRONT_DOOR = "sdpa"
TORCH_SDPA = "torch.nn.functional.scaled_dot_product_attention"
RANK = 4                              # (batch, heads, seqlen, head_dim)
SERVED_DEVICES = ("cpu", "cuda")
TORCH_REJECTS = "torch rejects it"    # a reason that is not warned about: torch raises its own error


def _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, **kwargs)


def _heads_reason(heads_q: int, heads_k: int, heads_v: int, enable_gqa: bool) -> str | None:
    """Why flashtile cannot serve these head counts, or None if it can (equal heads, GQA or MQA)."""
    if heads_k != heads_v:
        return "key and value with different numbers of heads"
    if heads_q == heads_k:
        return None
    if heads_q < heads_k:
        return "fewer query heads than key/value heads"
    if enable_gqa:
        return None if heads_q % heads_k == 0 else TORCH_REJECTS
    return None if heads_k == 1 else TORCH_REJECTS  # torch broadcasts a single key/value head (MQA)


def _unserved(query, key, value, attn_mask, dropout_p, scale, enable_gqa) -> str | None:
    """The reason flashtile cannot serve this call (TORCH_REJECTS for calls torch refuses), or None."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or any(t.is_nested for t in tensors):
        return TORCH_REJECTS
    if not (query.dtype == key.dtype == value.dtype) or not (query.device == key.device == value.device):
        return TORCH_REJECTS
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(scale)):
        return TORCH_REJECTS
    if attn_mask is not None:
        return "an attn_mask is given"
    if not isinstance(dropout_p, Real) or dropout_p != 0:
        return "dropout_p > 0"
    if any(t.dim() != RANK for t in tensors):
        return "tensors that are not 4-D (batch, heads, seqlen, head_dim)"
    if query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype}"
    if query.device.type not in SERVED_DEVICES:
        return f"device type {query.device.type}"
    if any(t.numel() == 0 for t in tensors):
        return "empty tensors"
    if key.shape[2] != value.shape[2] or key.shape[3] != query.shape[3]:
        return TORCH_REJECTS
    if max(query.shape[3], value.shape[3]) > MAX_HEAD_DIM:
        return f"head_dim above {MAX_HEAD_DIM}"
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        return "batch sizes that broadcast"
    return _heads_reason(query.shape[1], key.shape[1], value.shape[1], enable_gqa)


def _flash_layout(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seqlen, dim) -> the (batch, seqlen, heads, dim) view flashtile reads, unit stride last."""
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """Scaled dot-product attention with torch's signature and semantics, computed by flashtile.

    Args:
        query: (batch, heads_q, seqlen_q, head_dim); key: (batch, heads_kv, seqlen_k, head_dim);
            value: (batch, heads_kv, seqlen_k, head_dim_v).
        attn_mask: only None is served by flashtile; any mask goes to torch (with a one-time warning).
        dropout_p: only 0.0 is served by flashtile; anything else goes to torch (with a one-time warning).
        is_causal: causal mask aligned to the top-left corner, as in torch.
        scale: defaults to 1 / sqrt(head_dim).
        enable_gqa: allow heads_q to be a multiple of heads_kv (grouped-query attention), as in torch.
        scale and enable_gqa are keyword-only, as in torch.
    Returns:
        (batch, heads_q, seqlen_q, head_dim_v) in the dtype of query (a transposed view of flashtile's output).
    """
    reason = _unserved(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    if reason is not None:
        if reason != TORCH_REJECTS:
            warn_once(FRONT_DOOR, reason, TORCH_SDPA)
        return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    causal, window = bool(is_causal), (-1, -1)
    if causal and seqlen_q < seqlen_k:
        key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]  # keys past the last query are never visible
    elif causal and seqlen_q > seqlen_k:
        causal, window = False, (-1, seqlen_q - seqlen_k)   # j <= i as a bottom-right window
    out = attention(_flash_layout(query), _flash_layout(key), _flash_layout(value), causal=causal,
                    softmax_scale=scale, window_size=window)
    return out.transpose(1, 2)
