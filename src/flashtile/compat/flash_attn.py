"""FlashAttention-2 compatible functions over :func:`flashtile.attention` and :func:`flashtile.varlen_attention`.

The names, argument order, defaults and return conventions are those of ``flash_attn`` 2.x
(``flash_attn.flash_attn_interface``), so that replacing ``from flash_attn import flash_attn_func`` by
``from flashtile import flash_attn_func`` is enough. Layouts are FlashAttention's: dense tensors are
(batch, seqlen, heads, head_dim), varlen tensors are packed (total, heads, head_dim).

What differs from FlashAttention-2:

* ``dropout_p`` must be 0: dropout is not supported yet (ValueError otherwise).
* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: FlashAttention-2 returns ``S_dmask``, a
  debugging tensor that encodes the dropout pattern; with no dropout there is none to return, so it is None.
* ``block_table`` (paged K/V) of :func:`flash_attn_varlen_func` gathers each sequence's rows out of its pages into
  a packed batch before the call (a copy of the keys and values used; kernels that read pages in place are to come).

As in FlashAttention-2, packed varlen tensors may have rows past the last sequence (``cu_seqlens[-1]`` below their
length): padding, as batches padded to fixed sizes for CUDA graphs have (transformers' continuous batching pads so).
Those rows are not attended; their outputs are zero and their softmax_lse -inf, except while a CUDA graph is
captured or torch.compile traces, where the offsets cannot be read and the rows' outputs are left unspecified, as
FlashAttention-2 leaves them.
"""

from __future__ import annotations

from numbers import Real

import torch

from ..api import NO_SOFTCAP, NO_WINDOW, as_int, attention, host_readable, varlen_attention
from .kvcache import paged_rows

QKV_PACKED = 3   # q, k and v stacked along one dimension of a packed tensor
KV_PACKED = 2    # k and v stacked along one dimension of a packed tensor
PACK_DIM = -3    # the stacking dimension: (..., 3 or 2, heads, head_dim)


def _check_dropout(dropout_p) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise ValueError(f"dropout is not supported yet: dropout_p must be 0.0, got {dropout_p!r}")


def _as_int(value):
    """FlashAttention-2 accepts any integer-like max_seqlen (a 0-d int tensor, a numpy int): make it a Python int.

    Anything that is not integer-like is returned unchanged for the checks of flashtile's API to reject.
    """
    integer = as_int(value)
    return value if integer is None else integer


def _unpack(name: str, packed, count: int, rank: int, layout: str) -> tuple[torch.Tensor, ...]:
    """Split a packed tensor into `count` views along PACK_DIM; gradients flow back into `packed`."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != rank or packed.shape[PACK_DIM] != count:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(dim=PACK_DIM)


def _result(result, return_attn_probs: bool):
    """FlashAttention-2's return convention: out, or (out, softmax_lse, S_dmask) with S_dmask None."""
    if not return_attn_probs:
        return result
    out, softmax_lse = result
    return out, softmax_lse, None


def _used_rows(q, k, v, cu_seqlens_q, cu_seqlens_k) -> tuple[int, int] | None:
    """(rows of q, rows of k and v) that the sequences use, when the packed tensors have padding rows past them.

    None when there are none, when the offsets cannot be read now, or when the arguments are malformed (the checks
    of flashtile's API then say what is wrong).
    """
    offsets = (cu_seqlens_q, cu_seqlens_k)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v, *offsets)) or not host_readable(q.device):
        return None
    if q.dim() == 0 or k.dim() == 0 or v.dim() == 0 or k.shape[0] != v.shape[0]:
        return None
    if any(t.dim() != 1 or t.numel() < 2 or t.device != q.device for t in offsets):
        return None
    used = tuple(torch.stack([t[-1].long() for t in offsets]).tolist())
    rows = (q.shape[0], k.shape[0])
    if used == rows or not all(0 <= u <= r for u, r in zip(used, rows)):
        return None
    return used


def _padded(result, rows: int, return_lse: bool):
    """The varlen result over the used rows, extended to `rows` query rows: zero outputs, softmax_lse -inf."""
    out, softmax_lse = result if return_lse else (result, None)
    out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, rows - out.shape[0]))
    if softmax_lse is None:
        return out
    return out, torch.nn.functional.pad(softmax_lse, (0, rows - softmax_lse.shape[-1]), value=float("-inf"))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=NO_WINDOW, softcap=NO_SOFTCAP,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention over (batch, seqlen, heads, head_dim) tensors, as ``flash_attn.flash_attn_func``.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim);
           v: (batch, seqlen_k, heads_kv, head_dim_v). heads_q a multiple of heads_kv (MQA/GQA).
        dropout_p: must be 0.0 (dropout is not supported yet).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        causal: causal mask aligned to the bottom-right corner (as FlashAttention >= 2.1).
        window_size: (left, right) sliding window, any pair of integers (ints, a 2-element integer tensor); -1, or a
            bound at or past the longer sequence, is unbounded.
        softcap: if > 0, scores become softcap * tanh(scores / softcap).
        alibi_slopes: float32 (heads_q,) or (batch, heads_q).
        deterministic: a bitwise repeatable backward pass.
        return_attn_probs: also return softmax_lse and S_dmask (always None here, see the module docstring).
    Returns:
        out (batch, seqlen_q, heads_q, head_dim_v); with return_attn_probs, ``(out, softmax_lse, None)`` where
        softmax_lse is fp32 (batch, heads_q, seqlen_q).
    """
    _check_dropout(dropout_p)
    result = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                       softcap=softcap, alibi_slopes=alibi_slopes, return_lse=bool(return_attn_probs),
                       deterministic=deterministic)
    return _result(result, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=NO_WINDOW,
                              softcap=NO_SOFTCAP, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """As :func:`flash_attn_func` with q, k and v stacked: qkv is (batch, seqlen, 3, heads, head_dim)."""
    q, k, v = _unpack("qkv", qkv, QKV_PACKED, 5, "(batch, seqlen, 3, heads, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=NO_WINDOW,
                             softcap=NO_SOFTCAP, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """As :func:`flash_attn_func` with k and v stacked: kv is (batch, seqlen_k, 2, heads_kv, head_dim)."""
    k, v = _unpack("kv", kv, KV_PACKED, 5, "(batch, seqlen_k, 2, heads_kv, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=NO_WINDOW, softcap=NO_SOFTCAP,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over sequences packed without padding, as ``flash_attn.flash_attn_varlen_func``.

    Args:
        q: (total_q, heads_q, head_dim); k: (total_k, heads_kv, head_dim); v: (total_k, heads_kv, head_dim_v).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) offsets; sequence b is rows cu[b]:cu[b + 1].
        max_seqlen_q, max_seqlen_k: the longest sequence lengths.
        block_table: None, or (batch, max_blocks) int32 with k and v paged, (num_blocks, page_size, heads_kv, d):
            sequence b's keys are rows 0 .. cu_seqlens_k[b + 1] - cu_seqlens_k[b] of its blocks.
        Other arguments as in :func:`flash_attn_func`. Rows past the last sequence are padding (module docstring).
    Returns:
        out (total_q, heads_q, head_dim_v); with return_attn_probs, ``(out, softmax_lse, None)`` where
        softmax_lse is fp32 (heads_q, total_q).
    """
    _check_dropout(dropout_p)
    if block_table is not None:
        k, v = paged_rows(k, v, block_table, cu_seqlens_k)
    used = _used_rows(q, k, v, cu_seqlens_q, cu_seqlens_k)
    rows_q = q.shape[0] if used is not None else None
    if used is not None:
        q, k, v = q[:used[0]], k[:used[1]], v[:used[1]]
    result = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, _as_int(max_seqlen_q), _as_int(max_seqlen_k),
                              causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                              alibi_slopes=alibi_slopes, return_lse=bool(return_attn_probs),
                              deterministic=deterministic)
    if used is not None:
        result = _padded(result, rows_q, bool(return_attn_probs))
    return _result(result, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=NO_WINDOW, softcap=NO_SOFTCAP, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """As :func:`flash_attn_varlen_func` with q, k and v stacked: qkv is (total, 3, heads, head_dim)."""
    q, k, v = _unpack("qkv", qkv, QKV_PACKED, 4, "(total, 3, heads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=NO_WINDOW, softcap=NO_SOFTCAP,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """As :func:`flash_attn_varlen_func` with k and v stacked: kv is (total_k, 2, heads_kv, head_dim)."""
    k, v = _unpack("kv", kv, KV_PACKED, 4, "(total_k, 2, heads_kv, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
