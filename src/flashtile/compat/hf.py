"""Hugging Face transformers integration: ``attn_implementation="tile_attention"``.

Usage::

    import flashtile
    flashtile.register_hf()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="tile_attention")

The name is not "flashtile": transformers takes every implementation name containing "flash" for a
FlashAttention kernel (``is_flash_attention_requested``) and tries to load one from the Hugging Face Hub, and
it treats names containing "sdpa" as torch SDPA. ``register_hf()`` returns the name.

Registration is explicit: ``import flashtile`` never imports transformers (it is an optional dependency,
``pip install flashtile[hf]``, and slow to import). :func:`register_hf` may be called any number of times.

Needs transformers >= 4.53 (tested with 4.53.3 and 5.24.0).

Masks: the name is also registered with transformers' mask interface, with the mask builder transformers
uses for ``sdpa``, so a model hands the attention function exactly the mask it would hand torch SDPA: None
when the pattern is plain causal (or full attention), otherwise a boolean 4-D mask (an additive float 4-D
mask, as a caller may pass, is read the same way). Served by flashtile:

* no mask: causal per ``is_causal`` (or ``module.is_causal``), exactly as transformers' sdpa reads it;
* a 4-D mask that is exactly a full, bottom-right causal or causal sliding-window pattern, shared by the whole
  batch (e.g. decoding or chunked prefill with a KV cache, sliding-window layers).

Any other mask (padding with real zeros in ``attention_mask``, packed sequences, custom patterns) is not
ignored: the call goes to transformers' sdpa with a one-time :class:`~flashtile.compat._warn.FallbackWarning`,
as do attention dropout, ``position_bias``, dtypes, devices and head dims flashtile does not serve. Where sdpa
cannot serve the fallback either (``softcap``, attention sinks ``s_aux``), the model's own eager function does.
GQA needs no copies: flashtile reads key/value heads shared by groups of query heads directly.
"""

from __future__ import annotations

import sys
import weakref

import torch

from ..api import MAX_HEAD_DIM, SUPPORTED_DTYPES, attention
from ._warn import warn_once
from .sdpa import SERVED_DEVICES, _flash_layout

ATTN_IMPLEMENTATION = "tile_attention"  # the attn_implementation name: no "flash" or "sdpa" in it, see above
FRONT_DOOR = "hf"
SDPA_FALLBACK = "transformers' sdpa attention"
EAGER_FALLBACK = "the model's eager attention"
PADDING_REASON = "an attention mask with padding, packed sequences or a custom pattern"
MIN_TRANSFORMERS = "4.53"          # the first with AttentionMaskInterface (and the oldest tested)
MASK_MEMO_SIZE = 8                  # masks remembered: a model passes the same one or two masks to every layer


def register_hf() -> str:
    """Register ``attn_implementation="tile_attention"`` (and its mask builder) with transformers; idempotent.

    Returns the implementation name, so ``attn_implementation=flashtile.register_hf()`` works too.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError(f"flashtile.register_hf() needs transformers >= {MIN_TRANSFORMERS}: "
                          "pip install 'flashtile[hf]'") from error
    AttentionInterface.register(ATTN_IMPLEMENTATION, flashtile_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, AttentionMaskInterface()["sdpa"])
    return ATTN_IMPLEMENTATION


def _causal_pattern(seqlen_q: int, seqlen_k: int, left: int, device) -> torch.Tensor:
    """(seqlen_q, seqlen_k) booleans: bottom-right aligned causal, with `left` keys of window (-1 = unbounded)."""
    diag = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = cols <= diag
    if left >= 0:
        visible &= cols >= diag - left
    return visible


def _visible(mask: torch.Tensor) -> torch.Tensor | None:
    """Booleans of which keys each query sees, from a boolean or an additive float 4-D mask; None if neither."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    visible = mask == 0
    blocked = mask.masked_fill(visible, float("-inf"))
    if not bool((blocked <= torch.finfo(mask.dtype).min / 2).all()):
        return None  # a bias, not a mask
    return visible


def _match_pattern(mask) -> tuple[bool, int] | None:
    """(causal, window left) when `mask` is exactly a pattern flashtile computes itself, else None."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or 0 in mask.shape:
        return None
    visible = _visible(mask)
    if visible is None:
        return None
    seqlen_q, seqlen_k = visible.shape[-2:]
    seen_by_last = int(visible[0, 0, -1].sum())  # the last query sees the widest causal window
    if seen_by_last == 0:
        return None
    if seen_by_last == seqlen_k and bool(visible.all()):
        return False, -1
    left = -1 if seen_by_last == seqlen_k else seen_by_last - 1
    if torch.equal(visible, _causal_pattern(seqlen_q, seqlen_k, left, mask.device).expand_as(visible)):
        return True, left
    return None


_mask_memo: dict[int, tuple] = {}


def _mask_plan(mask: torch.Tensor) -> tuple[bool, int] | None:
    """:func:`_match_pattern`, remembered per mask tensor (every layer of a model gets the same one)."""
    if mask.is_inference():
        return _match_pattern(mask)  # inference tensors keep no version counter to check a memo against
    hit = _mask_memo.get(id(mask))
    if hit is not None and hit[0]() is mask and hit[1] == mask._version:
        return hit[2]
    plan = _match_pattern(mask)
    if len(_mask_memo) >= MASK_MEMO_SIZE:
        _mask_memo.clear()
    _mask_memo[id(mask)] = (weakref.ref(mask), mask._version, plan)
    return plan


def _resolve_causal(module, is_causal) -> bool:
    """The causal flag as transformers' sdpa reads it: the argument if given, else the module's, else True."""
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))


def _unserved(query, key, value, dropout, kwargs) -> str | None:
    """Why flashtile cannot serve this call, whatever the mask; None if it can."""
    if dropout:
        return "attention dropout"
    if kwargs.get("position_bias") is not None:
        return "a position_bias"
    if kwargs.get("s_aux") is not None:
        return "attention sinks (s_aux)"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in SUPPORTED_DTYPES:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}"
    if query.device.type not in SERVED_DEVICES or not (query.device == key.device == value.device):
        return f"device {query.device}"
    if any(t.numel() == 0 for t in (query, key, value)):
        return "empty tensors"
    if key.shape[-1] != query.shape[-1] or max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims {query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}"
    heads_q, heads_k, heads_v = query.shape[1], key.shape[1], value.shape[1]
    if heads_k != heads_v or heads_q % heads_k or not (query.shape[0] == key.shape[0] == value.shape[0]):
        return f"query/key/value shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
    return None


def _eager_mask(module, query, key, attention_mask, is_causal):
    """The additive float mask an eager attention function expects, for the mask handed to sdpa."""
    if attention_mask is None:
        seqlen_q, seqlen_k = query.shape[2], key.shape[2]
        if not (_resolve_causal(module, is_causal) and seqlen_q > 1):
            return None
        attention_mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=query.device).tril()[None, None]
    if attention_mask.dtype != torch.bool:
        return attention_mask
    return torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
        ~attention_mask, torch.finfo(query.dtype).min)


def _fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, is_causal,
              kwargs):
    """Serve the call as transformers would with ``sdpa`` (or eager where sdpa cannot)."""
    if is_causal is not None:
        kwargs["is_causal"] = is_causal
    if softcap is None and kwargs.get("s_aux") is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"flashtile cannot serve this call of {type(module).__name__} and neither can sdpa "
                         f"(softcap or attention sinks); use attn_implementation='eager'")
    mask = _eager_mask(module, query, key, attention_mask, kwargs.pop("is_causal", None))
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
                 softcap=softcap, **kwargs)


def flashtile_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """The attention function transformers calls for ``attn_implementation="tile_attention"``.

    Args:
        module: the model's attention module (``is_causal`` is read from it unless passed).
        query: (batch, heads_q, seqlen_q, head_dim); key, value: (batch, heads_kv, seqlen_k, head_dim[_v]).
        attention_mask: None or a 4-D mask, see the module docstring.
        dropout, scaling, softcap, is_causal: as transformers passes them. ``sliding_window`` needs no handling
            here: the mask carries the window, which is read off it.
    Returns:
        ``(attn_output, None)``, attn_output (batch, seqlen_q, heads_q, head_dim_v).
    """
    reason = _unserved(query, key, value, dropout, kwargs)
    plan = None
    if reason is None:
        if attention_mask is None:
            plan = _resolve_causal(module, is_causal) and query.shape[2] > 1, -1
        else:
            plan = _mask_plan(attention_mask)
            reason = None if plan is not None else PADDING_REASON
    if reason is not None:
        needs_eager = softcap is not None or kwargs.get("s_aux") is not None
        warn_once(FRONT_DOOR, reason, EAGER_FALLBACK if needs_eager else SDPA_FALLBACK)
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                         is_causal, kwargs)

    causal, left = plan
    seqlen_q = query.shape[2]
    if attention_mask is None and causal and key.shape[2] > seqlen_q:
        # No mask with more keys than queries: transformers' sdpa means top-left causal (a prefill into a static
        # cache whose later slots are empty), i.e. only the first seqlen_q keys are visible.
        key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]
    out = attention(_flash_layout(query), _flash_layout(key), _flash_layout(value), causal=causal,
                    softmax_scale=scaling, window_size=(left, -1), softcap=float(softcap or 0.0),
                    deterministic=bool(kwargs.get("deterministic") or False))
    return out, None
