"""Hugging Face transformers integration: ``attn_implementation="flashtile"`` (and the older ``"tile_attention"``).

:func:`register_hf` registers both names with transformers and returns the one to use. ``"flashtile"``
(transformers >= 5) is a FlashAttention implementation served by flashtile's FlashAttention-2 functions;
``"tile_attention"`` (>= 4.53) takes sdpa's masks and falls back to sdpa for those it cannot read. docs/hf.md
describes both: supported versions, padding, packed sequences, the KV cache, continuous batching and what is not
served.
"""

from __future__ import annotations

import sys
import warnings
import weakref

import torch

from ..api import MAX_HEAD_DIM, SUPPORTED_DTYPES, attention
from ._warn import warn_once
from .flash_attn import flash_attn_func, flash_attn_varlen_func
from .sdpa import SERVED_DEVICES, _flash_layout

ATTN_IMPLEMENTATION = "flashtile"      # the name: a FlashAttention implementation to transformers 5 (docs/hf.md)
TILE_IMPLEMENTATION = "tile_attention"  # the older name: no "flash" or "sdpa" in it, sdpa's masks
FRONT_DOOR = "hf"
SDPA_FALLBACK = "transformers' sdpa attention"
EAGER_FALLBACK = "the model's eager attention"
PADDING_REASON = "an attention mask with padding, packed sequences or a custom pattern"
MIN_TRANSFORMERS = "4.53"          # the first with AttentionMaskInterface (and the oldest tested)
MIN_TRANSFORMERS_FLASH = 5         # the first major version whose flash loader is keyed by name
MASK_MEMO_SIZE = 8                  # masks remembered: a model passes the same one or two masks to every layer
FLASH_TWIN = "flash_attention_2"    # whose mask builder "flashtile" shares (and whose paged function, below)
# Continuous batching (generate_batch) in transformers 5.0 and 5.17 switches a model to "paged|<its implementation>"
# and calls that name's function with the paged cache; 5.24 keeps "flashtile" and has no "paged|flash_attention_2".
# Where that name exists, "paged|flashtile" is registered with its function, which writes the new keys and values
# into the cache, reads each sequence's back and calls the loader's varlen function (flashtile's, for both names).
PAGED_PREFIX = "paged|"
PAGED_IMPLEMENTATION = PAGED_PREFIX + ATTN_IMPLEMENTATION
PAGED_TWIN = PAGED_PREFIX + FLASH_TWIN
LOADED_NAMES = (ATTN_IMPLEMENTATION, PAGED_IMPLEMENTATION)  # the names the loader serves flashtile's functions for
# transformers.modeling_flash_attention_utils: the loader and the state it keeps, all of which must exist
LOADER_NAMES = ("lazy_import_flash_attention", "_lazy_imports", "_loaded_implementation", "_flash_fn",
                "_flash_varlen_fn", "_pad_fn", "_unpad_fn", "_pad_input", "_unpad_input")
# Present (5.17, 5.24): the loader returns 5 functions; absent (5.0): 4. Left None: transformers calls
# flash_attn_with_kvcache only on continuous batching's decode fast path, which it takes only for names matching
# "flash...2" or "flash...3" on CUDA (ensure_decode_fast_path_is_available), never for "flashtile".
KVCACHE_SLOT = "_flash_with_kvcache_fn"
LOADER_STATE = ("_lazy_imports", "_loaded_implementation", "_flash_fn", "_flash_varlen_fn", KVCACHE_SLOT,
                "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn")


def register_hf() -> str:
    """Register ``attn_implementation="flashtile"`` and ``"tile_attention"`` with transformers; idempotent.

    Returns:
        "flashtile", the name to use (``attn_implementation=flashtile.register_hf()`` works too). With
        transformers 4.x, which cannot take "flashtile" (docs/hf.md says why), "tile_attention", with a
        warning.
    Raises:
        ImportError: transformers is missing, or its FlashAttention loader is not as expected (the message names
            the version); "tile_attention" is registered before that check and stays usable.
    """
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError(f"flashtile.register_hf() needs transformers >= {MIN_TRANSFORMERS}: "
                          "pip install 'flashtile[hf]'") from error
    AttentionInterface.register(TILE_IMPLEMENTATION, flashtile_attention_forward)
    AttentionMaskInterface.register(TILE_IMPLEMENTATION, AttentionMaskInterface()["sdpa"])
    if not _flash_capable(transformers.__version__):
        warnings.warn(f"flashtile.register_hf(): attn_implementation={ATTN_IMPLEMENTATION!r} needs transformers >= "
                      f"{MIN_TRANSFORMERS_FLASH} (this is {transformers.__version__}, whose FlashAttention loader is "
                      f"not keyed by name); registered attn_implementation={TILE_IMPLEMENTATION!r} only, use that",
                      UserWarning, stacklevel=2)
        return TILE_IMPLEMENTATION
    flash_mask = _install_flash_loader(transformers.__version__)
    AttentionInterface.register(ATTN_IMPLEMENTATION, flashtile_flash_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_mask)
    paged = AttentionInterface().get(PAGED_TWIN)
    if paged is not None:
        AttentionInterface.register(PAGED_IMPLEMENTATION, paged)
    return ATTN_IMPLEMENTATION


def _flash_capable(version: str) -> bool:
    """Whether this transformers version has the FlashAttention loader keyed by name ("5.0.0", "5.1.0.dev0")."""
    major = version.split(".", 1)[0]
    return major.isdigit() and int(major) >= MIN_TRANSFORMERS_FLASH


def _loader_functions(fau) -> tuple:
    """What ``_lazy_imports`` returns for LOADED_NAMES: flashtile's FA2 functions, in the version's order."""
    kvcache = (None,) if hasattr(fau, KVCACHE_SLOT) else ()
    return (flash_attn_func, flash_attn_varlen_func, *kvcache, fau._pad_input, fau._unpad_input)


def _wrap_loader(original):
    """transformers' ``_lazy_imports`` with "flashtile" and "paged|flashtile" added; other names pass unchanged."""
    def _lazy_imports(implementation, *args, **kwargs):
        if implementation in LOADED_NAMES:
            return _loader_functions(sys.modules["transformers.modeling_flash_attention_utils"])
        return original(implementation, *args, **kwargs)

    _lazy_imports.__wrapped__ = original
    _lazy_imports.flashtile_loader = True
    _lazy_imports.__doc__ = original.__doc__
    return _lazy_imports


def _holds_flashtile(fau) -> bool:
    """Whether transformers' loader holds flashtile's functions."""
    return (fau._flash_fn is flash_attn_func and fau._flash_varlen_fn is flash_attn_varlen_func
            and fau._pad_fn is fau._pad_input and fau._unpad_fn is fau._unpad_input
            and getattr(fau, KVCACHE_SLOT, None) is None)


def _primed(fau) -> bool:
    """Whether transformers' loader holds flashtile's functions under the name "flashtile"."""
    return fau._loaded_implementation == ATTN_IMPLEMENTATION and _holds_flashtile(fau)


def _install_flash_loader(version: str):
    """Teach transformers' FlashAttention loader the name "flashtile" and prime it; returns the mask builder.

    Raises ImportError (leaving transformers as it was) when an internal this relies on is missing or does not
    behave as expected.
    """
    advice = (f"transformers {version} is not supported by flashtile.register_hf() for "
              f"attn_implementation={ATTN_IMPLEMENTATION!r} (tested with 5.0.0, 5.17.0 and 5.24.0): ")
    fallback = f"; use attn_implementation={TILE_IMPLEMENTATION!r} (registered) instead"
    try:
        from transformers import modeling_flash_attention_utils as fau
        from transformers.integrations.flash_attention import flash_attention_forward  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError(advice + f"{error}" + fallback) from error
    missing = [name for name in LOADER_NAMES if not hasattr(fau, name)]
    flash_mask = AttentionMaskInterface().get(FLASH_TWIN)
    if flash_mask is None:
        missing.append(f"masking_utils.AttentionMaskInterface[{FLASH_TWIN!r}]")
    if missing:
        raise ImportError(advice + "missing " + ", ".join(missing) + fallback)

    saved = {name: getattr(fau, name) for name in LOADER_STATE if hasattr(fau, name)}
    current = fau._lazy_imports
    original = current.__wrapped__ if getattr(current, "flashtile_loader", False) else current
    try:
        fau._lazy_imports = _wrap_loader(original)
        if fau._loaded_implementation in LOADED_NAMES and not _holds_flashtile(fau):
            fau._loaded_implementation = None  # stale (e.g. this module reloaded): load again
        fau.lazy_import_flash_attention(ATTN_IMPLEMENTATION)
        if not _primed(fau):
            raise ImportError("lazy_import_flash_attention('flashtile') did not keep flashtile's functions")
    except Exception as error:
        for name, value in saved.items():
            setattr(fau, name, value)
        raise ImportError(advice + f"{type(error).__name__}: {error}" + fallback) from error
    return flash_mask


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
    """The attention function transformers calls for ``attn_implementation="tile_attention"`` (and 4-D masks).

    Args:
        module: the model's attention module (``is_causal`` is read from it unless passed).
        query: (batch, heads_q, seqlen_q, head_dim); key, value: (batch, heads_kv, seqlen_k, head_dim[_v]).
        attention_mask: None or a 4-D mask; docs/hf.md says which masks flashtile serves.
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


def flashtile_flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """The attention function transformers calls for ``attn_implementation="flashtile"``.

    transformers' ``flash_attention_forward``, which reaches flashtile's FlashAttention-2 functions through the
    loader :func:`register_hf` primed, except for what docs/hf.md lists: a 4-D mask goes to
    :func:`flashtile_attention_forward`; dropout and attention sinks raise ValueError.

    Args:
        module: the model's attention module.
        query: (batch, heads_q, seqlen_q, head_dim); key, value: (batch, heads_kv, seqlen_k, head_dim[_v]).
        attention_mask: None, a 2-D padding mask (transformers' ``flash_attention_mask``) or a 4-D mask.
        dropout, scaling, sliding_window, softcap, is_causal, kwargs: as transformers passes them (``position_ids``
            and ``cu_seq_lens_*``/``max_length_*`` for packed sequences among the kwargs).
    Returns:
        ``(attn_output, None)``, attn_output (batch, seqlen_q, heads_q, head_dim_v).
    """
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        return flashtile_attention_forward(module, query, key, value, attention_mask, dropout, scaling,
                                           sliding_window, softcap, is_causal, **kwargs)
    unserved = ("attention dropout" if dropout else
                "attention sinks (s_aux)" if kwargs.get("s_aux") is not None else None)
    if unserved is not None:
        raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} does not support {unserved} "
                         f"({type(module).__name__}); use attn_implementation={TILE_IMPLEMENTATION!r}, which hands "
                         f"such calls to transformers' sdpa or eager attention")
    from transformers.integrations.flash_attention import flash_attention_forward

    return flash_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   sliding_window=sliding_window, softcap=softcap, is_causal=is_causal, **kwargs)
