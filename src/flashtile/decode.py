"""Decoding: one query token per sequence against a long key/value cache, on rung 4's kernel.

A decode step is bound by reading K and V once. Rung 4 run as it is reads them once per query head and fills one
block per (batch, head): with GQA that is `group` times the bytes, and a small batch leaves most SMs idle. This
family runs the same kernel on a reshaped problem, with no copy of the cache:

* the `group` query heads that share a kv head become `group` query rows of one head (a view of q), so each
  block reads its kv head's keys once for all of them;
* the cache is split along its length into `splits` parts that become batch entries (a view of k and v when the
  cache is contiguous along batch and length), so that batch x kv heads x splits blocks fill the GPU;
* the parts' outputs merge by their log-sum-exp: o = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s.

One token sees every key of its cache (causal, bottom-right aligned, masks nothing), so the family serves causal
and plain calls; windows, softcap, ALiBi and varlen stay with rung 4.
"""

from __future__ import annotations

import dataclasses

import torch

from . import launch, specs
from .ladder import BY_NAME, pipelined_tile
from .family import Family, Serves, Variant
from .forward import MAX_GRID_BATCH, FwdProblem

BLOCKS_PER_SM = 2          # enough blocks in flight per SM to keep its loads busy
MIN_SPLIT_KEYS = 1024      # a part shorter than this spends more on its block's setup and merge than it saves


def _why_not(variant: Variant) -> str | None:
    if variant.head_dim != variant.head_dim_v:
        return "kernel 'decode' takes one head dim for q/k and v"
    return None


def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(batch: int, heads_kv: int, seqlen_k: int, sms: int) -> int:
    """Parts of the cache per (batch, kv head): enough blocks for BLOCKS_PER_SM per SM, parts of at least
    MIN_SPLIT_KEYS keys, a power of two that divides the cache length (so the parts are a view), and a batch
    of parts a grid can hold."""
    splits = 1
    while (batch * heads_kv * splits < BLOCKS_PER_SM * sms and seqlen_k % (2 * splits) == 0
           and seqlen_k // (2 * splits) >= MIN_SPLIT_KEYS and batch * 2 * splits <= MAX_GRID_BATCH):
        splits *= 2
    return splits


def _parts(t: torch.Tensor, splits: int) -> torch.Tensor | None:
    """(batch, n, heads, d) as (batch * splits, n / splits, heads, d) without a copy, or None if the layout
    does not allow it (batch entries not one cache length apart)."""
    b, n, h, d = t.shape
    if splits == 1:
        return t
    if t.stride(0) != n * t.stride(1):
        return None
    return t.as_strided((b * splits, n // splits, h, d), (t.stride(0) // splits, *t.stride()[1:]))


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    inner: object                 # the rung-4 plan of the reshaped problem (plans.FwdPlan)
    batch: int
    heads_kv: int
    group: int
    splits: int
    want_lse: bool

    def run(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None, out=None):
        """(out, lse) like rung 4's: out (batch, 1, heads_q, dv), lse (batch, heads_q, 1) if wanted."""
        b, hkv, g, s = self.batch, self.heads_kv, self.group, self.splits
        o_parts, lse_parts = self.inner.run(_rows(q, hkv, s), _parts(k, s), _parts(v, s))
        dv = o_parts.shape[-1]
        if s == 1:
            o_rows, lse_rows = o_parts, lse_parts
        else:  # merge the parts by their log-sum-exp (fp32)
            lse_split = lse_parts.view(b, s, hkv, g)
            lse_rows = torch.logsumexp(lse_split, dim=1)
            weight = torch.exp(lse_split - lse_rows[:, None])  # every part has keys; a NaN stays NaN
            o_rows = torch.einsum("bshg,bsghd->bghd", weight, o_parts.view(b, s, g, hkv, dv).float())
        o = o_rows.view(b, g, hkv, dv).transpose(1, 2).reshape(b, 1, hkv * g, dv)
        lse = lse_rows.reshape(b, hkv * g, 1) if self.want_lse else None
        if out is not None:
            out[0].copy_(o)
            if lse is not None:
                out[1].copy_(lse)
            return out
        return o.to(q.dtype), lse


def _rows(q: torch.Tensor, heads_kv: int, splits: int) -> torch.Tensor:
    """q (batch, 1, heads_q, d) as (batch * splits, group, heads_kv, d): a kv head's query heads as its query rows
    (a view), repeated for each part of the cache (a small copy, only when the cache is split)."""
    b, _, hq, d = q.shape
    g = hq // heads_kv
    rows = q.as_strided((b, g, heads_kv, d), (q.stride(0), q.stride(2), g * q.stride(2), q.stride(3)))
    if splits == 1:
        return rows
    return rows.unsqueeze(1).expand(b, splits, g, heads_kv, d).reshape(b * splits, g, heads_kv, d)


def plan(problem: FwdProblem, module: launch.LoadedModule, outputs: tuple | None = None) -> DecodePlan:
    q, k, v = problem.q, problem.k, problem.v
    b, hkv, n = q.shape[0], problem.heads_kv, problem.seqlen_k
    g = problem.heads_q // hkv
    splits = choose_splits(b, hkv, n, _sms(q.device.index))
    if _parts(k, splits) is None or _parts(v, splits) is None:
        splits = 1
    reshaped = dataclasses.replace(problem, q=_rows(q, hkv, splits), k=_parts(k, splits), v=_parts(v, splits), window=(-1, -1),
                                   want_lse=problem.want_lse or splits > 1)
    return DecodePlan(BY_NAME["pipelined"].plan(reshaped, module), b, hkv, g, splits, problem.want_lse)


def decode_tile(variant: Variant) -> specs.Tile:
    padded = max(specs.pick_padded(n, specs.FWD_HEAD_DIMS) for n in (variant.head_dim, variant.head_dim_v))
    tile = specs.DECODE_TILES_SM90.get(padded) if variant.arch == "sm_90a" else None
    return tile or pipelined_tile(variant)


FAMILY = Family(
    "decode", "fwd", "one query token against a long cache: a kv head's query heads as rows, the cache split "
    "along its length, the parts merged by their log-sum-exp (rung 4's kernel)",
    Serves((torch.float16, torch.bfloat16), max(specs.FWD_HEAD_DIMS), frozenset(), (8, 0), frozenset({"decode"}),
           extra=_why_not),
    lambda v: specs.decode_spec(v.dtype_name, v.head_dim, v.head_dim_v, v.arch), plan, tile=decode_tile)
