"""Decoding: one query token per sequence against a long key/value cache, on rung 4's kernel built for it.

A decode step is bound by reading K and V once. Rung 4 run as it is reads them once per query head and fills one
block per (batch, head): with GQA that is `group` times the bytes, and a small batch leaves most SMs idle. The
decode build of the same kernel (specs.decode_spec, FT_DECODE) runs a reshaped problem, with no copy of the cache:

* the `group` query heads that share a kv head become `group` query rows of one head (a view of q, and of the
  output), so each block reads its kv head's keys once for all of them;
* each sequence's keys are split into `splits` parts, one block each, so that batch x kv heads x splits blocks
  fill the GPU; the parts write normalised outputs and log-sum-exps in fp32, and a second kernel
  (attn_combine) merges them: o = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s;
* a cache may hold more rows than a sequence uses (`seqused_k`, per sequence, read on the device) and may be
  paged (`block_table`, on Hopper: the tensor maps read each page in place; pages of 16 or 32 rows take a build
  whose K/V tiles are stored in groups of a page's rows, one copy per page: `group_rows`).

The plan fixes the number of parts from shapes alone and never reads a tensor on the host, so a decode step can
be captured in a CUDA graph. One token sees every key of its cache (causal, bottom-right aligned, masks nothing),
so the family serves causal and plain calls; windows, softcap, ALiBi and varlen stay with rung 4.
"""

from __future__ import annotations

import dataclasses

import torch

from . import launch, plans, specs, tma
from .family import Family, Serves, Variant
from .forward import FwdProblem, NO_DECODE_FIELDS

MIN_SPLIT_KEYS = 1024      # a part shorter than this spends more on its block's setup and merge than it saves
SMEM_PER_BLOCK_RESERVED = 1024  # shared memory the driver keeps per resident block (sm_80 and later)
FP32 = torch.float32
_DECODE_FIELDS = len(NO_DECODE_FIELDS)  # AttnParams ends with these: 4 addresses, then 3 sizes


def _why_not(variant: Variant) -> str | None:
    if variant.head_dim != variant.head_dim_v:
        return "kernel 'decode' takes one head dim for q/k and v"
    return None


def _slots(device: int, smem_bytes: int) -> int:
    """Blocks of `smem_bytes` shared memory the whole GPU holds at once."""
    props = torch.cuda.get_device_properties(device)
    per_sm = max(1, getattr(props, "shared_memory_per_multiprocessor", 0) // (smem_bytes + SMEM_PER_BLOCK_RESERVED))
    return per_sm * props.multi_processor_count


def choose_splits(blocks: int, seqlen_k: int, slots: int) -> int:
    """Parts of each sequence's keys, for `blocks` blocks of work before splitting on a GPU that holds `slots`
    blocks at once: the largest power of two that keeps the grid within one wave and each part at least
    MIN_SPLIT_KEYS keys (fewer, longer parts spend less on setup and merging than a second wave would save)."""
    splits = 1
    while blocks * 2 * splits <= slots and seqlen_k // (2 * splits) >= MIN_SPLIT_KEYS:
        splits *= 2
    return splits


def rows_view(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """q or the output (batch, 1, heads_kv * group, d) as (batch, group, heads_kv, d): a kv head's query heads as
    its query rows (a view)."""
    b, _, h, d = t.shape
    g = h // heads_kv
    return t.as_strided((b, g, heads_kv, d), (t.stride(0), t.stride(2), g * t.stride(2), t.stride(3)))


def _out_shape(q: torch.Tensor, head_dim_v: int) -> tuple[int, ...] | None:
    """The output's shape where it differs from q's (plans.empty_outputs' convention)."""
    return None if q.shape[-1] == head_dim_v else (*q.shape[:-1], head_dim_v)


def _lse_view(lse: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """The LSE (batch, heads_q, 1) as (batch, heads_kv, group): the rows view's layout (a view)."""
    b, h, _ = lse.shape
    g = h // heads_kv
    return lse.as_strided((b, heads_kv, g), (lse.stride(0), g * lse.stride(1), lse.stride(1)))


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    launches: tuple[launch.Launch, ...]  # the parts' kernel, then the combine when the keys are split
    batch: int
    heads_q: int
    splits: int
    head_dim_v: int
    want_lse: bool
    tail: tuple                          # AttnParams between the tensors' addresses and the decoding fields
    decode_sizes: tuple                  # block_table_batch_stride, page_size, num_splits
    kv_box: specs.KvBox

    def run(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None, out=None, seqused_k=None,
            block_table=None):
        """(out, lse): out (batch, 1, heads_q, dv), lse (batch, heads_q, 1) if wanted; fresh, or written into `out`
        = (o, lse). k and v are the cache (batch, rows, heads_kv, d), or its pages (blocks, page_size, heads_kv, d)
        with `block_table`; `seqused_k` (batch,) int32 counts each sequence's keys (None: every row)."""
        b = self.batch
        lse_shape = (b, self.heads_q, 1) if self.want_lse else None
        o, lse = out or plans.empty_outputs(q, _out_shape(q, self.head_dim_v), lse_shape)
        accum = lse_accum = 0
        if self.splits > 1:
            rows = b * self.heads_q
            scratch = torch.empty(rows * self.splits * (self.head_dim_v + 1), dtype=FP32, device=q.device)
            accum = scratch.data_ptr()
            lse_accum = accum + rows * self.splits * self.head_dim_v * scratch.element_size()
        params = ((q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0 if lse is None else lse.data_ptr(),
                   0, 0, 0, 0) + self.tail
                  + (0 if seqused_k is None else seqused_k.data_ptr(), 0 if block_table is None else block_table.data_ptr(),
                     accum, lse_accum) + self.decode_sizes)
        launch.run(self.launches, params, launch.PARAMS_STRUCT, tma.kernel_argument(k, v, self.kv_box))
        return o, lse


def _maps_feed(spec: specs.KernelSpec) -> bool:
    """Whether tensor maps feed this build's K/V (Hopper), not cp.async."""
    return bool(spec.kv_maps and spec.kv_maps.rows)


def group_rows(spec: specs.KernelSpec, page_size: int, head_dim: int) -> int:
    """The row groups of the build that reads pages of `page_size` rows (specs.DECODE_GROUPED_PAGE_ROWS), or 0 when
    `spec`, the family's build, reads them itself: it loads K/V with cp.async, the pages are large enough, or the
    head dim is not a whole number of 64-byte column blocks (a group's box spans the head dim exactly)."""
    rows = page_size & -page_size
    if not _maps_feed(spec) or rows not in specs.DECODE_GROUPED_PAGE_ROWS:
        return 0
    return rows if head_dim % specs.NARROW_BOX_COLS == 0 else 0


def more_specs(variant: Variant) -> tuple[specs.KernelSpec, ...]:
    """The builds a plan may load besides the family's: one per row-group size, where pages take them."""
    spec = specs.decode_spec(variant.dtype_name, variant.head_dim, variant.head_dim_v, variant.arch)
    if not _maps_feed(spec) or variant.head_dim != variant.head_dim_v:
        return ()
    return tuple(specs.decode_spec(variant.dtype_name, variant.head_dim, variant.head_dim_v, variant.arch, rows)
                 for rows in specs.DECODE_GROUPED_PAGE_ROWS)


def _box(spec: specs.KernelSpec, page_size: int | None) -> specs.KvBox:
    """The K/V maps' box: the spec's, or for pages the largest power of two dividing the page size, at most a
    tile (a box never straddles two pages)."""
    box = spec.kv_maps
    if page_size is None or not box.rows:
        return box
    return dataclasses.replace(box, rows=min(page_size & -page_size, box.rows))


def build(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, module: launch.LoadedModule, *,
          want_lse: bool, seqlen_k: int, page_size: int | None = None, block_table_stride: int = 0,
          splits: int = 0, outputs: tuple | None = None) -> DecodePlan:
    """The plan of one token per sequence over a cache of `seqlen_k` rows (pages of `page_size` rows when paged);
    `splits` 0 picks the parts by shapes alone."""
    rows = group_rows(module.spec, page_size, q.shape[-1]) if page_size else 0
    if rows:
        module = launch.load(specs.decode_spec(module.spec.dtype, q.shape[-1], v.shape[-1], module.spec.arch, rows),
                             q.device.index)
    spec = module.spec
    defines = dict(spec.defines)
    b, _, hq, _ = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    g = hq // hkv
    m_blocks = -(-g // defines["FT_BLOCK_M"])
    key_tiles = max(1, -(-seqlen_k // defines["FT_BLOCK_N"]))
    if splits <= 0:
        splits = choose_splits(b * hkv * m_blocks, seqlen_k, _slots(q.device.index, spec.smem_bytes))
    splits = max(1, min(splits, key_tiles))
    o, lse = outputs or plans.empty_outputs(q, _out_shape(q, dv), (b, hq, 1) if want_lse else None)
    view = FwdProblem(rows_view(q, hkv), k, v, scale, (-1, -1), want_lse=want_lse)
    fields = launch.PARAM_FIELDS
    values = dict(zip((name for name, _ in fields),
                      view.params(rows_view(o, hkv), None if lse is None else _lse_view(lse, hkv))))
    values["seqlen_k"] = seqlen_k
    tail = tuple(values[name] for name, _ in fields[plans.ADDRESS_FIELDS:-_DECODE_FIELDS])
    threads = defines["FT_WARPS"] * 32
    steps = [launch.Launch(module.kernels["attn_fwd"], (m_blocks * splits, hkv, b), threads, spec.smem_bytes)]
    if splits > 1:
        per_block = defines["FT_COMBINE_WARPS"]
        steps.append(launch.Launch(module.kernels["attn_combine"], (-(-b * hq // per_block), 1, 1), per_block * 32, 0))
    return DecodePlan(tuple(steps), b, hq, splits, dv, want_lse, tail,
                      (block_table_stride, page_size or 0, splits), _box(spec, page_size))


def plan(problem: FwdProblem, module: launch.LoadedModule, outputs: tuple | None = None) -> DecodePlan:
    """The family's plan of a dense decode problem (flashtile.attention with one query token)."""
    return build(problem.q, problem.k, problem.v, problem.scale, module, want_lse=problem.want_lse,
                 seqlen_k=problem.seqlen_k, outputs=outputs)


def decode_tile(variant: Variant) -> specs.Tile:
    padded = max(specs.pick_padded(n, specs.FWD_HEAD_DIMS) for n in (variant.head_dim, variant.head_dim_v))
    return specs.decode_tile(padded, padded, variant.arch)


FAMILY = Family(
    "decode", "fwd", "one query token against a long cache: a kv head's query heads as rows, the keys split in "
    "parts merged by their log-sum-exps, pages read in place (rung 4's kernel, built for decoding)",
    Serves((torch.float16, torch.bfloat16), max(specs.FWD_HEAD_DIMS), frozenset(), (8, 0), frozenset({"decode"}),
           extra=_why_not),
    lambda v: specs.decode_spec(v.dtype_name, v.head_dim, v.head_dim_v, v.arch), plan, tile=decode_tile,
    more_specs=more_specs)
