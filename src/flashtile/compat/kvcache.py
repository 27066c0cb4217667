"""``flash_attn_with_kvcache``: FlashAttention-2's decoding call (2.8), over flashtile's attention.

One step of generation: new keys and values are written into the cache in place, rotary embeddings are applied to
the queries and the new keys on the way, and the queries attend to each sequence's valid part of the cache.

Semantics (FlashAttention-2's):
* ``k_cache``/``v_cache`` are dense ``(batch_cache, seqlen_cache, heads_kv, d)``, or paged ``(num_blocks,
  page_size, heads_kv, d)`` with ``block_table`` ``(batch, max_blocks)``: row ``p`` of sequence ``b`` lives in
  block ``block_table[b, p // page_size]`` at offset ``p % page_size``.
* ``cache_seqlens`` (an int, or ``(batch,)`` int32) counts each sequence's rows before this call, from row 0;
  ``cache_leftpad`` (``(batch,)`` int32) is the row where its cache starts (rows before it are padding).
  ``cache_batch_idx`` (``(batch,)`` int32) picks the dense cache's row of each query batch entry.
* New ``k``/``v`` ``(batch, seqlen_new, heads_kv, d)`` go to rows ``cache_seqlens .. cache_seqlens + seqlen_new``.
  The keys attended are rows ``cache_leftpad .. cache_seqlens + seqlen_new`` (bottom-right aligned for ``causal``
  and windows, as everywhere in flashtile).
* Rotary (``rotary_cos``/``rotary_sin`` ``(seqlen_ro, rotary_dim / 2)``, only with new keys) rotates the first
  ``rotary_dim`` dims of each new key at its row index, and of the queries at ``cache_seqlens + i`` under a causal
  mask or a window, else all at ``cache_seqlens``; pairs are (0, 1), (2, 3), ... when ``rotary_interleaved``,
  else (i, i + rotary_dim / 2).

How it runs: one query token per sequence (a decode step) is read where the cache lies by the decode kernel
(decode.py): dense caches with ragged lengths, batch indices (one page per entry) and, on Hopper, pages of any
multiple of 16 rows; ``num_splits`` (0: by shapes) sets the parts of each sequence's keys. A step that only reads
(no new keys) never waits for the GPU, so it can be captured in a CUDA graph: the kernel clamps each length to
the cache and reads zeros for a page or batch index outside it. Every other case (several query tokens, left
padding, windows, softcap, ALiBi, pages the kernel cannot read) gathers each sequence's valid rows into a packed
varlen batch first, which copies them; appending new keys checks every index on the host first (one wait).
"""

from __future__ import annotations

import torch

from .. import decode, dispatch
from ..forward import MAX_GRID_BATCH, FwdProblem
from ..plans import ALIGN_BYTES
from ..api import NO_SOFTCAP, NO_WINDOW, _check_options, as_int, attention, varlen_attention

INT32 = torch.int32
MIN_PAGE_ROWS = 16    # pages of a multiple of this many rows are read in place (a tensor-map box is >= 8 rows)
MAX_KEPT_PLANS = 256  # decode plans kept by signature (shapes, strides, options)
_plans: dict[tuple, decode.DecodePlan] = {}


def _lengths(name: str, value, batch: int, device, default: int | None = None) -> torch.Tensor:
    """A per-sequence integer argument as an int64 (batch,) tensor on `device`: an int, or a (batch,) int32 tensor."""
    if value is None:
        value = default
    integer = as_int(value)
    if integer is not None:
        if integer < 0:
            raise ValueError(f"{name} must be >= 0, got {integer}")
        return torch.full((batch,), integer, dtype=torch.int64, device=device)
    _check_int32(name, value, batch, device)
    return value.long()


def _check_int32(name: str, value, batch: int, device) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != INT32 or tuple(value.shape) != (batch,):
        raise ValueError(f"{name} must be an int or a ({batch},) int32 tensor, got {value!r}")
    if value.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {value.device}")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    """x (batch, s, heads, d) with its first rotary_dim dims rotated at `positions` (batch, s), in fp32."""
    half = cos.shape[1]
    c = cos[positions].float().unsqueeze(2)  # (batch, s, 1, half)
    s = sin[positions].float().unsqueeze(2)
    rotary = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rotary[..., 0::2], rotary[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rotary[..., :half], rotary[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _check_cache(q, k_cache, v_cache, block_table) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', t)!r}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree but in head_dim, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if block_table is not None:
        if (not isinstance(block_table, torch.Tensor) or block_table.dtype != INT32 or block_table.dim() != 2
                or block_table.shape[0] != q.shape[0]):
            raise ValueError(f"block_table must be a ({q.shape[0]}, max_blocks) int32 tensor, got {block_table!r}")
        if block_table.device != q.device:
            raise ValueError(f"block_table must be on {q.device} like q, got {block_table.device}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=NO_WINDOW, softcap=NO_SOFTCAP, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q over a KV cache, appending k and v to it in place first (see the module docstring).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim).
        k_cache, v_cache: (batch_cache, seqlen_cache, heads_kv, head_dim[_v]), or (num_blocks, page_size, heads_kv,
            head_dim[_v]) with block_table.
        k, v: None, or the new keys and values (batch, seqlen_new, heads_kv, head_dim[_v]).
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2) tables (with k and v only).
        cache_seqlens: int or (batch,) int32; default: the whole cache (seqlen_cache, dense caches only).
        cache_batch_idx, cache_leftpad: None, or (batch,) int32.
        block_table: None, or (batch, max_blocks) int32 for a paged cache.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in :func:`flashtile.attention`.
        num_splits: an int >= 0: the parts each sequence's keys are split into on the decode path; 0 picks by shapes.
        return_softmax_lse: also return the fp32 LSE (batch, heads_q, seqlen_q).
    Returns:
        out (batch, seqlen_q, heads_q, head_dim_v), and the LSE if ``return_softmax_lse``.
    """
    _check_cache(q, k_cache, v_cache, block_table)
    if as_int(num_splits) is None or as_int(num_splits) < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or neither)")
    if rotary_cos is not None and k is None:
        raise ValueError("rotary_cos/rotary_sin apply to new keys: pass k and v with them")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    batch, seqlen_q = q.shape[:2]
    paged = block_table is not None
    page = k_cache.shape[1]
    capacity = block_table.shape[1] * page if paged else k_cache.shape[1]
    if paged and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx indexes a dense cache: pass None with block_table")
    if cache_seqlens is None and paged:
        raise ValueError("cache_seqlens is required with a paged cache (block_table)")
    if k is None and cache_leftpad is None and alibi_slopes is None:
        read = _read_in_place(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, capacity,
                              softmax_scale, window_size, softcap, int(num_splits))
        if read is not None:
            return read if return_softmax_lse else read[0]
    seqlens = _lengths("cache_seqlens", cache_seqlens, batch, q.device, default=capacity)
    leftpad = _lengths("cache_leftpad", cache_leftpad, batch, q.device, default=0)
    rows = (torch.arange(batch, device=q.device) if cache_batch_idx is None
            else _lengths("cache_batch_idx", cache_batch_idx, batch, q.device))
    new = 0 if k is None else k.shape[1]
    if k is not None:
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != batch or t.shape[2:] != cache.shape[2:]:
                raise ValueError(f"{name} must be (batch {batch}, seqlen_new, heads_kv, head_dim) like {name}_cache, "
                                 f"got {getattr(t, 'shape', t)!r}")
        if v.shape[1] != new:
            raise ValueError(f"k and v must add the same number of rows, got {new} and {v.shape[1]}")
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k.device != q.device or v.device != q.device:
            raise ValueError(f"k and v must have their caches' dtype ({k_cache.dtype}) and q's device ({q.device}), "
                             f"got {k.dtype}/{v.dtype} on {k.device}")
    # The host checks every index the cache will be read or written at (a bad one would be a device-side assert),
    # all in one read of the device: a decode step waits for the GPU once.
    ends = seqlens + new
    lengths_bad = (ends > capacity).any() | (leftpad > seqlens).any() | (ends == leftpad).all()
    indices = block_table if paged else rows
    indices_bad = ((indices < 0) | (indices >= k_cache.shape[0])).any()
    if bool(lengths_bad | indices_bad):
        if bool(lengths_bad):
            raise ValueError(f"cache_seqlens + seqlen_new must fit the cache ({capacity} rows), cache_leftpad must "
                             f"not pass cache_seqlens, and some sequence must hold a key; got cache_seqlens "
                             f"{seqlens.tolist()[:8]}, seqlen_new {new}, cache_leftpad {leftpad.tolist()[:8]}")
        if paged:
            raise ValueError(f"block_table must index the cache's {k_cache.shape[0]} blocks")
        raise ValueError(f"cache_batch_idx must index the cache's {k_cache.shape[0]} rows, got {rows.tolist()[:8]}")

    if rotary_cos is not None:
        key_positions = seqlens[:, None] + torch.arange(new, device=q.device)[None]
        moving = causal or tuple(window_size) != tuple(NO_WINDOW)
        query_positions = seqlens[:, None] + (torch.arange(seqlen_q, device=q.device)[None] if moving else 0)
        query_positions = query_positions.expand(batch, seqlen_q)
        highest = max(int(query_positions.max()), int(key_positions.max()) if new else 0)
        if highest >= rotary_cos.shape[0] or rotary_sin.shape != rotary_cos.shape or 2 * rotary_cos.shape[1] > q.shape[-1]:
            raise ValueError(f"rotary_cos and rotary_sin must be (seqlen_ro, rotary_dim / 2) alike, with a row for every "
                             f"position rotated (up to {highest}) and rotary_dim <= head_dim; got "
                             f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        q = _rotate(q, rotary_cos, rotary_sin, query_positions, rotary_interleaved)
        k = _rotate(k, rotary_cos, rotary_sin, key_positions, rotary_interleaved)
    if k is not None:
        positions = seqlens[:, None] + torch.arange(new, device=q.device)[None]   # (batch, new) cache rows
        where = _cache_index(positions, rows, block_table, page)
        k_cache[where] = k
        v_cache[where] = v

    if alibi_slopes is None and cache_leftpad is None:
        read = _read_in_place(q, k_cache, v_cache, ends.to(INT32), cache_batch_idx, block_table, capacity,
                              softmax_scale, window_size, softcap, int(num_splits))
        if read is not None:
            return read if return_softmax_lse else read[0]

    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, return_lse=True)
    uniform = (not paged and cache_batch_idx is None and cache_leftpad is None
               and (as_int(cache_seqlens) is not None or cache_seqlens is None or bool((seqlens == seqlens[0]).all())))
    if uniform:
        length = int(ends[0])
        out, lse = attention(q, k_cache[:batch, :length], v_cache[:batch, :length], **options)
    else:
        out, lse = _ragged(q, k_cache, v_cache, leftpad, ends, rows, block_table, page, options)
    return (out, lse) if return_softmax_lse else out


def _why_not_in_place(q, k_cache, v_cache, page_size: int | None) -> str | None:
    """Why the decode kernel cannot read this cache where it lies (None: it can); `page_size` is the rows of a page
    (a block table, or cache_batch_idx as one page per entry), None for a dense cache."""
    if not q.is_cuda or q.shape[1] != 1:
        return "one query token per sequence on a CUDA device"
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k_cache.dtype == v_cache.dtype:
        return "fp16 or bf16 alike"
    if not q.shape[-1] == k_cache.shape[-1] == v_cache.shape[-1] or q.shape[2] % k_cache.shape[2]:
        return "one head dim, and heads_q a multiple of heads_kv"
    if q.shape[0] > MAX_GRID_BATCH or any(dispatch.kernel_ready(t) is not t for t in (q, k_cache, v_cache)):
        return "a batch a grid holds; 16-byte aligned rows and strides, a head dim that is a multiple of 8"
    module = _module(q, k_cache, v_cache)
    if module is None:
        return "the decode kernel serves this GPU"
    if page_size is not None:
        if page_size % MIN_PAGE_ROWS:
            return f"pages of a multiple of {MIN_PAGE_ROWS} rows"
        if not module.spec.kv_maps.rows:
            return "pages are read through tensor maps (Hopper)"
    return None


def _module(q, k_cache, v_cache):
    """The decode family's loaded kernels for these operands, or None when the registry picks another family."""
    family, module = dispatch.load(FwdProblem(q, k_cache, v_cache, 1.0, NO_WINDOW), "fwd")
    return module if family is decode.FAMILY else None


def _read_in_place(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, capacity: int, softmax_scale,
                   window_size, softcap, num_splits: int):
    """(out, lse) of one token per sequence read by the decode kernel where the cache lies, or None when it cannot
    be (then the caller gathers). Nothing here reads a device tensor: the kernel clamps each length to the cache,
    and a page or batch index outside the cache reads zeros (tensor maps are bounded), so a decode step never waits
    for the GPU and can be captured in a CUDA graph."""
    if not q.is_cuda or q.shape[1] != 1:
        return None
    batch = q.shape[0]
    scale, window, cap = _check_options(q, softmax_scale, window_size, softcap, None, batch, capacity + 1)
    if window[0] != -1 or cap != 0:  # one token's window cuts keys on the left; softcap is rung 4's
        return None
    seqused = None
    if cache_seqlens is None:
        seqlen_k = capacity
    elif as_int(cache_seqlens) is not None:
        seqlen_k = as_int(cache_seqlens)
        if not 0 < seqlen_k <= capacity:
            raise ValueError(f"cache_seqlens must be in [1, {capacity}] (the cache's rows), got {seqlen_k}")
    else:
        _check_int32("cache_seqlens", cache_seqlens, batch, q.device)
        seqused, seqlen_k = cache_seqlens, capacity
    if cache_batch_idx is not None:  # a dense cache indexed by batch entry: one page per entry
        _check_int32("cache_batch_idx", cache_batch_idx, batch, q.device)
        block_table = cache_batch_idx[:, None]
    if block_table is None:
        k_cache, v_cache = k_cache[:batch, :seqlen_k], v_cache[:batch, :seqlen_k]
    if (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % ALIGN_BYTES:
        return None
    paged = block_table is not None
    key = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(), q.dtype, q.device,
           scale, num_splits, seqlen_k, block_table.stride(0) if paged else None)
    if key not in _plans:
        if len(_plans) >= MAX_KEPT_PLANS:
            _plans.clear()
        page_size = k_cache.shape[1] if paged else None
        _plans[key] = None if _why_not_in_place(q, k_cache, v_cache, page_size) else decode.build(
            q, k_cache, v_cache, scale, _module(q, k_cache, v_cache), want_lse=True, seqlen_k=seqlen_k,
            page_size=page_size, block_table_stride=block_table.stride(0) if paged else 0, splits=num_splits)
    plan = _plans[key]
    if plan is None:
        return None
    return plan.run(q, k_cache, v_cache, seqused_k=seqused, block_table=block_table)


def _cache_index(positions: torch.Tensor, rows: torch.Tensor, block_table, page: int):
    """Advanced indices into the cache's first two dims for row `positions` (batch, n) of each sequence."""
    if block_table is None:
        return rows[:, None].expand_as(positions), positions
    blocks = block_table.long().gather(1, positions // page)
    return blocks, positions % page


def _packed_rows(starts: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor | None, block_table,
                 page: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Advanced indices of the cache rows [start, start + length) of every sequence, packed one sequence after the
    other (dense rows `rows`, or the blocks of `block_table`), and the packed offsets (batch + 1,) int64."""
    batch = lengths.shape[0]
    offsets = torch.zeros(batch + 1, dtype=torch.int64, device=lengths.device)
    offsets[1:] = torch.cumsum(lengths, 0)
    total = int(offsets[-1])
    owner = torch.repeat_interleave(torch.arange(batch, device=lengths.device), lengths, output_size=total)
    positions = starts[owner] + torch.arange(total, device=lengths.device) - offsets[owner]
    if block_table is None:
        return (rows[owner], positions), offsets
    return (block_table.long()[owner, positions // page], positions % page), offsets


def paged_rows(k, v, block_table, cu_seqlens_k) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed (total_k, heads_kv, d) keys and values of paged caches k, v (num_blocks, page_size, heads_kv, d):
    sequence b's rows 0 .. len_b of its blocks, len_b from cu_seqlens_k (FlashAttention-2's varlen block_table).
    Differentiable in k and v."""
    _check_cache(k, k, v, None)
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1 or cu_seqlens_k.numel() < 2:
        raise ValueError(f"cu_seqlens_k must be a 1-D tensor of batch + 1 offsets, got {cu_seqlens_k!r}")
    batch = cu_seqlens_k.numel() - 1
    if (not isinstance(block_table, torch.Tensor) or block_table.dtype != INT32 or block_table.dim() != 2
            or block_table.shape[0] != batch or block_table.device != k.device):
        raise ValueError(f"block_table must be a ({batch}, max_blocks) int32 tensor on {k.device}, got {block_table!r}")
    page = k.shape[1]
    lengths = cu_seqlens_k.long().diff()
    if bool((lengths < 0).any()) or bool((lengths > block_table.shape[1] * page).any()):
        raise ValueError(f"cu_seqlens_k's lengths must fit the block table ({block_table.shape[1]} blocks of {page} "
                         f"rows), got {lengths.tolist()[:8]}")
    if bool(((block_table < 0) | (block_table >= k.shape[0])).any()):
        raise ValueError(f"block_table must index the cache's {k.shape[0]} blocks")
    where, _ = _packed_rows(torch.zeros_like(lengths), lengths, None, block_table, page)
    return k[where], v[where]


def _ragged(q, k_cache, v_cache, starts, ends, rows, block_table, page, options):
    """Each sequence's cache rows [start, end) gathered into one packed varlen batch, and its queries beside them."""
    batch, seqlen_q = q.shape[:2]
    lengths = ends - starts
    where, offsets = _packed_rows(starts, lengths, rows, block_table, page)
    keys, values = k_cache[where], v_cache[where]
    cu_q = torch.arange(batch + 1, dtype=INT32, device=q.device) * seqlen_q
    out, lse = varlen_attention(q.reshape(batch * seqlen_q, *q.shape[2:]), keys, values, cu_q, offsets.to(INT32),
                                seqlen_q, max(1, int(lengths.max())), **options)
    heads = q.shape[2]
    return out.view(batch, seqlen_q, heads, -1), lse.view(heads, batch, seqlen_q).permute(1, 0, 2).contiguous()
