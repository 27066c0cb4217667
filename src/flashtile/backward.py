"""The backward kernel families and their plans.

Three families, asked in this order: the Hopper kernel on wgmma (kernels/wgmma/bwd.cu), the per-phase warp-grid
kernel for head dim 192 (kernels/mma/bwd_grid.cu) and rung 4's 16-keys-per-warp kernel (kernels/mma/bwd.cu),
which serves everything the other two leave. Each plan is three launches over one BwdParams struct: a
preprocess over query rows (D = rowsum(dO * O), the LSE in base 2, the fp32 dQ accumulator zeroed), the main
kernel over key blocks (one launch, or two for mma/bwd.cu past head dim 128: dV, then dK and dQ), and the
conversion of the dQ accumulator to the dtype of q. Where the Hopper kernel leaves dQ to a pass of its own
(specs.BwdWgmmaTile.dq_pass), that pass over query blocks is the last launch instead, and there is no
accumulator.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import launch, plans, specs
from .family import Family, Serves, Variant
from .forward import FwdProblem
from .launch import Launch

TENSOR_MAP_FLOATS = specs.TENSOR_MAP_BYTES // 4  # a block's slot for its copy of a map, in the fp32 scratch
SCRATCH_TILE = 128  # the backward's scratch rows come in whole tiles of this many (params.cuh, kScratchTile)
EPILOGUE_MAPS = 2  # dK's and dV's
ROWS_MAPS = 1      # the scratch rows of D and the base-2 LSE
VARLEN_MAPS = 4    # K's, V's, Q's and dO's, bounded by a varlen block's sequence

WARP = 32
DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)  # mma.sync and cp.async
SCRATCH_LIMIT_BYTES = 64 * 2**20  # the fp32 dQ accumulator's budget: beyond it, heads go in groups
FP32_BYTES = 4
ALL_FEATURES = frozenset({"window", "varlen", "softcap", "alibi"})
PLAIN_FEATURES = frozenset({"window", "varlen"})


def _padded(variant: Variant) -> tuple[int, int]:
    return specs.pick_padded(variant.head_dim, specs.FWD_HEAD_DIMS), specs.pick_padded(variant.head_dim_v,
                                                                                      specs.FWD_HEAD_DIMS)


def _wgmma_tile(variant: Variant):
    return specs.bwd_wgmma_tile(*_padded(variant), variant.arch, variant.score_mods, variant.deterministic)


def _grid_tile(variant: Variant):
    return specs.bwd_grid_tile(max(_padded(variant)), variant.arch, variant.score_mods)


def _wgmma_why_not(variant: Variant) -> str | None:
    if variant.arch != "sm_90a":
        return "kernel 'bwd-wgmma' runs on Hopper (sm_90a) only"
    if _wgmma_tile(variant) is None:
        return (f"kernel 'bwd-wgmma' serves q/k and v head dims that pad alike to one of "
                f"{sorted(specs.BWD_WGMMA_TILES)}, not {_padded(variant)}")
    return None


def _grid_why_not(variant: Variant) -> str | None:
    if _grid_tile(variant) is None:
        return (f"kernel 'bwd-grid' serves head dims padding to {sorted(specs.BWD_GRID_TILES)} where its tile fits "
                f"the shared memory of {variant.arch}")
    return None


def _strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements; packed varlen tensors have no batch stride."""
    return (0, *t.stride()[:2]) if varlen else t.stride()[:3]


def plan(problem: FwdProblem, module: launch.LoadedModule, out: torch.Tensor, lse: torch.Tensor,
         dout: torch.Tensor, grads: tuple[torch.Tensor, ...], deterministic: bool) -> plans.BwdPlan:
    """The backward plan of `problem` (q/k/v kernel-ready) given the forward's `out` and `lse`, and dO and the
    gradient buffers laid out as the plan's runs will find them. Where the fp32 dQ accumulator of every head
    would pass SCRATCH_LIMIT_BYTES, the plan runs its launches once per group of heads (kv_heads_per_launch)."""
    spec = module.spec
    defines = dict(spec.defines)
    block_m, block_n, warps = defines["FT_BLOCK_M"], defines["FT_BLOCK_N"], defines["FT_WARPS"]
    row_warps, rows_per_block = defines["FT_ROW_WARPS"], defines["FT_PREPROCESS_ROWS"]
    varlen = problem.varlen
    lse_head_dim = 0 if varlen else 1  # the LSE is (heads, total) packed, (batch, heads, seqlen) otherwise
    kv_heads = kv_heads_per_launch(problem, module, lse.numel() // problem.heads_q)
    groups, q_heads = problem.heads_kv // kv_heads, kv_heads * (problem.heads_q // problem.heads_kv)
    if groups > 1:  # the first group stands for every one: the others differ only by their heads' addresses
        problem, out, lse, dout, grads = _first_heads(problem, out, lse, dout, grads, q_heads, kv_heads, lse_head_dim)
    dq, dk, dv = grads
    m_blocks = math.ceil(problem.seqlen_q / block_m)
    kernels = module.kernels
    row_grid = (math.ceil(problem.seqlen_q / rows_per_block), problem.heads_q, problem.batch)
    padded_grid = (math.ceil(_round_up(problem.seqlen_q, SCRATCH_TILE) / rows_per_block), *row_grid[1:])
    key_grid = (math.ceil(problem.seqlen_k / block_n), problem.heads_kv, problem.batch)
    rows = Launch(kernels["attn_bwd_preprocess"], padded_grid, row_warps * WARP, 0)
    main = tuple(Launch(kernels[entry], key_grid, warps * WARP, spec.smem_bytes) for entry in spec.entries[1:-1])
    dq_pass = spec.dq_smem_bytes > 0
    if dq_pass:
        query_grid = (math.ceil(problem.seqlen_q / specs.bwd_dq_pass_rows(warps)), problem.heads_q, problem.batch)
        last = Launch(kernels["attn_bwd_dq"], query_grid, warps * WARP, spec.dq_smem_bytes)
    else:
        last = Launch(kernels["attn_bwd_dq_convert"], row_grid, row_warps * WARP, 0)
    map_slots = math.prod(key_grid) * TENSOR_MAP_FLOATS * block_maps(spec, varlen)
    scratch_batch, scratch_head = scratch_strides(problem, lse)
    scratch = problem.heads_q * scratch_head  # rows
    accum_floats = (0 if dq_pass else scratch * defines["FT_HEAD_DIM"]) + map_slots
    boxes = None if spec.do_map is None else (spec.kv_maps, spec.q_map, spec.do_map) + (
        () if spec.dq_map is None else (spec.dq_map,))
    return plans.BwdPlan(
        (rows, *main, last), problem.params(out, lse)[plans.ADDRESS_FIELDS:],
        (*_strides(dout, varlen), *_strides(dq, varlen), *_strides(dk, varlen), *_strides(dv, varlen),
         scratch_batch, scratch_head, m_blocks),
        dout.stride(), scratch, accum_floats,
        problem.batch * problem.heads_q * m_blocks if deterministic and not dq_pass else 0,
        plans.HeadGroups(groups, q_heads, kv_heads, lse_head_dim), boxes)


def _first_heads(problem: FwdProblem, out, lse, dout, grads, q_heads: int, kv_heads: int, lse_head_dim: int):
    """The problem and buffers of the first group of heads, laid out as BwdPlan.run hands each group over."""
    qh, kv = slice(0, q_heads), slice(0, kv_heads)
    slopes = problem.alibi_slopes[..., qh] if problem.alibi_slopes is not None else None
    part = dataclasses.replace(problem, q=problem.q[..., qh, :], k=problem.k[..., kv, :], v=problem.v[..., kv, :],
                               alibi_slopes=slopes)
    return (part, out[..., qh, :], lse.narrow(lse_head_dim, 0, q_heads).contiguous(), dout[..., qh, :],
            (grads[0][..., qh, :], grads[1][..., kv, :], grads[2][..., kv, :]))


FAMILIES: tuple[Family, ...] = (
    Family("bwd-wgmma", "bwd", "Hopper: every product on wgmma, two warpgroups per block",
           Serves(DTYPES, max(specs.FWD_HEAD_DIMS), PLAIN_FEATURES, (9, 0), extra=_wgmma_why_not),
           lambda v: specs.bwd_wgmma_spec(v.dtype_name, _padded(v)[0], _wgmma_tile(v)), plan, tile=_wgmma_tile),
    Family("bwd-grid", "bwd", "mma.sync with per-phase warp grids: dK and dV of head dim 192 in one pass",
           Serves(DTYPES, max(specs.FWD_HEAD_DIMS), PLAIN_FEATURES, MIN_CAPABILITY, extra=_grid_why_not),
           lambda v: specs.bwd_grid_spec(v.dtype_name, *_padded(v), v.arch, _grid_tile(v)), plan, tile=_grid_tile),
    Family("bwd-mma", "bwd", "rung 4's backward: mma.sync, 16 keys per warp, every feature",
           Serves(DTYPES, max(specs.FWD_HEAD_DIMS), ALL_FEATURES, MIN_CAPABILITY),
           lambda v: specs.bwd_mma_spec(v.dtype_name, v.head_dim, v.head_dim_v, v.arch,
                                        softcap="softcap" in v.features, alibi="alibi" in v.features), plan,
           tile=lambda v: specs.bwd_tile(max(_padded(v)), v.arch, v.score_mods)),
)


def _round_up(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def scratch_strides(problem: FwdProblem, lse: torch.Tensor) -> tuple[int, int]:
    """(batch, head) strides of the backward's scratch rows (kernels/common/params.cuh, scratch_row0), in rows:
    each (batch, head)'s query rows padded to whole tiles of SCRATCH_TILE; a varlen head's sequences packed, with
    a tile of slack each (its rows: the LSE's head stride, as the kernels read it, plus batch tiles, rounded up)."""
    if problem.varlen:  # the LSE: (heads, packed rows); a sequence starts a tile further on per sequence before it
        return SCRATCH_TILE, _round_up(lse.stride(0) + problem.batch * SCRATCH_TILE, SCRATCH_TILE)
    rows = _round_up(problem.seqlen_q, SCRATCH_TILE)
    return rows, problem.batch * rows


def block_maps(spec, varlen: bool) -> int:
    """The tensor maps each block of the Hopper backward completes on the device, in slots of the scratch after
    the dQ accumulator (kernels/wgmma/bwd.cu, block_maps_of): the dQ writer's where it adds boxes, dK's and dV's
    (their stores), the rows map (the loads of D and the LSE), and for a varlen problem K's, V's, Q's and dO's
    bounded by the block's sequence."""
    if spec.do_map is None:  # the kernels that take no maps
        return 0
    return (spec.dq_map is not None) + EPILOGUE_MAPS + ROWS_MAPS + (VARLEN_MAPS if varlen else 0)


def kv_heads_per_launch(problem: FwdProblem, module: launch.LoadedModule, query_rows: int) -> int:
    """How many kv heads one launch takes: all of them, unless the fp32 dQ accumulator of `query_rows` rows (all
    batches) would pass SCRATCH_LIMIT_BYTES (training at long sequence lengths then needs little more than its
    own tensors); then the largest divisor of heads_kv that stays under it, so that every group is alike."""
    if module.spec.dq_smem_bytes:  # the dQ pass keeps no accumulator
        return problem.heads_kv
    group = problem.heads_q // problem.heads_kv
    accum_bytes_per_kv_head = query_rows * group * dict(module.spec.defines)["FT_HEAD_DIM"] * FP32_BYTES
    fits = max(1, SCRATCH_LIMIT_BYTES // accum_bytes_per_kv_head)
    return max(h for h in range(1, problem.heads_kv + 1) if problem.heads_kv % h == 0 and h <= fits)


def run(problem: FwdProblem, module: launch.LoadedModule, out: torch.Tensor, lse: torch.Tensor,
        dout: torch.Tensor, deterministic: bool,
        dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of `problem` (q/k/v, out and dout kernel-ready), in batch parts a grid can hold (each plan then
    runs its head groups). `dlse`: the gradient of the log-sum-exp, or None."""
    grads = plans.empty_grads(problem.q, problem.k, problem.v)
    for b0, b1, part in problem.batch_parts():
        if problem.varlen:  # the packed tensors stay whole: each part's offsets say which rows are its own
            buffers = out, lse, dout, dlse, grads
        else:
            buffers = (out[b0:b1], lse[b0:b1], dout[b0:b1], None if dlse is None else dlse[b0:b1],
                       tuple(g[b0:b1] for g in grads))
        part_out, part_lse, part_dout, part_dlse, part_grads = buffers
        plan(part, module, part_out, part_lse, part_dout, part_grads, deterministic).run(
            part_dout, part.q, part.k, part.v, part_out, part_lse, part.cu_seqlens_q, part.cu_seqlens_k,
            part.alibi_slopes, grads=part_grads, dlse=part_dlse)
    return grads
