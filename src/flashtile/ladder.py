"""The ladder: attention kernels from naive to state of the art, in order, each runnable and tested.

Every rung is a forward kernel family (family.py) with its place on the ladder: what it serves, the spec it
compiles and the plan that launches it. The registry (registry.py) asks them, fastest first, for each call;
``flashtile check`` tests each rung against the reference, ``flashtile bench ladder`` times them side by side,
docs/ladder.md tells their story.
"""

from __future__ import annotations

import functools

import torch

from . import launch, plans, specs
from .family import Family, Serves, Variant
from .forward import NO_TAIL_SPLIT, FwdProblem
from .launch import Launch

MAX_GRID_X = 2**31 - 1   # grid-stride loops cover whatever a grid of this many blocks does not
WARP = 32


@functools.cache
def device_capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _padded_dims(variant: Variant) -> int:
    return max(variant.head_dim, variant.head_dim_v)


def fwd_plan(problem: FwdProblem, launches: tuple[Launch, ...], scratch_floats: int = 0,
             kv_box: specs.KvBox | None = None, outputs: tuple | None = None,
             q_box: specs.KvBox | None = None, o_box: specs.KvBox | None = None,
             tail_split: specs.TailSplit | None = None) -> plans.FwdPlan:
    """The plan of `launches` over `problem`: the params after the addresses are computed here, once, for
    outputs laid out as `outputs` (default: as plans.empty_outputs allocates them)."""
    o, lse = outputs or plans.empty_outputs(problem.q, problem.out_shape(), problem.lse_shape())
    run, zeroed = NO_TAIL_SPLIT, 0
    if tail_split is not None:
        run, scratch_floats, zeroed = tail_split.run, tail_split.scratch_floats, tail_split.counter_floats
    tail = problem.params(o, lse, tail_tiles=run)[plans.ADDRESS_FIELDS:]
    return plans.FwdPlan(launches, problem.out_shape(), problem.lse_shape(), scratch_floats, tail, kv_box, q_box,
                         o_box, zeroed)


def _naive_plan(problem: FwdProblem, module: launch.LoadedModule, outputs: tuple | None = None) -> plans.FwdPlan:
    threads = dict(module.spec.defines)["FT_THREADS"]
    n_rows = problem.batch * problem.heads_q * problem.seqlen_q
    n_scores = n_rows * problem.seqlen_k

    def over(entry: str, n: int) -> Launch:
        return Launch(module.kernels[entry], (min(-(-n // threads), MAX_GRID_X), 1, 1), threads, 0)

    return fwd_plan(problem, (over("naive_scores", n_scores), over("naive_softmax", n_rows),
                              over("naive_pv", n_rows * problem.head_dim_v)), scratch_floats=n_scores,
                    outputs=outputs)


def _grid_plan(entry: str, block_m_define: str, threads_of):
    """The plan of a rung that is one kernel over a (query blocks, heads, batch) grid."""
    def plan(problem: FwdProblem, module: launch.LoadedModule, outputs: tuple | None = None) -> plans.FwdPlan:
        spec = module.spec
        defines = dict(spec.defines)
        grid = (-(-problem.seqlen_q // defines[block_m_define]), problem.heads_q, problem.batch)
        step = Launch(module.kernels[entry], grid, threads_of(defines), spec.smem_bytes)
        return fwd_plan(problem, (step,), kv_box=spec.kv_maps, outputs=outputs)
    return plan


@functools.cache
def sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _persistent_plan(entry: str, threads_of):
    """The plan of a rung whose blocks loop over work units (kernels/wgmma/fwd.cu): one block per SM, at most one
    per unit, where the units cost the same: without a mask (a unit is a work tile) and under a causal mask (a
    unit pairs a head's heaviest and lightest query blocks). Under other masks the tiles' costs differ, and one
    block per tile, heaviest first, lets the hardware hand the next tile to whichever SM frees first. A build
    without persistent blocks (FT_PERSISTENT 0) takes one tile per block of a (query blocks, heads, batch) grid.
    Without a mask, a build with FT_TAIL_SPLIT shares the last round's units out by key tiles where that pays
    (specs.hopper_tail_split)."""
    def plan(problem: FwdProblem, module: launch.LoadedModule, outputs: tuple | None = None) -> plans.FwdPlan:
        spec = module.spec
        defines = dict(spec.defines)
        m_blocks = -(-problem.seqlen_q // defines["FT_BLOCK_M"])
        tiles = m_blocks * problem.heads_q * problem.batch
        left, right = problem.window
        paired = left < 0 and right == 0
        if not defines["FT_PERSISTENT"]:  # one block per tile on the (query blocks, heads, batch) grid
            grid = (m_blocks, problem.heads_q, problem.batch)
        elif not (paired or (left, right) == (-1, -1)):
            grid = (tiles, 1, 1)
        else:
            units = (-(-m_blocks // 2) if paired else m_blocks) * problem.heads_q * problem.batch
            grid = (max(1, min(units, sm_count(problem.q.device.index))), 1, 1)
        split = None
        if defines.get("FT_TAIL_SPLIT") and defines["FT_PERSISTENT"] and (left, right) == (-1, -1):
            split = specs.hopper_tail_split(units, grid[0], -(-problem.seqlen_k // defines["FT_BLOCK_N"]),
                                            defines["FT_BLOCK_M"] // specs.WGMMA_M, defines["FT_HEAD_DIM_V"])
        step = Launch(module.kernels[entry], grid, threads_of(defines), spec.smem_bytes)
        return fwd_plan(problem, (step,), kv_box=spec.kv_maps, outputs=outputs, q_box=spec.q_map,
                        o_box=spec.o_map, tail_split=split)
    return plan


def pipelined_tile(variant: Variant) -> specs.Tile:
    padded = max(specs.pick_padded(n, specs.FWD_HEAD_DIMS) for n in (variant.head_dim, variant.head_dim_v))
    return specs.fwd_tile(padded, variant.arch, variant.score_mods)


def _hopper_dims(variant: Variant) -> tuple[int, int]:
    return (specs.pick_padded(variant.head_dim, specs.FWD_HEAD_DIMS),
            specs.pick_padded(variant.head_dim_v, specs.FWD_HEAD_DIMS))


def hopper_tile(variant: Variant) -> specs.HopperFwdTile | None:
    return specs.hopper_fwd_tile(*_hopper_dims(variant), variant.arch, variant.short_causal)


def _hopper_why_not(variant: Variant) -> str | None:
    if variant.arch != "sm_90a":
        return (f"rung 'hopper' runs on Hopper (sm_90a) only, not {variant.arch}: wgmma, setmaxnreg and the tensor "
                "memory accelerator")
    if hopper_tile(variant) is None:
        return (f"rung 'hopper' serves q/k and v head dims that pad alike to one of {sorted(specs.HOPPER_FWD_TILES)}, "
                f"not {_hopper_dims(variant)}")
    return None


_CUDA_CORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
_BASIC = frozenset({"window"})
_ALL = frozenset({"window", "varlen", "softcap", "alibi"})
_AMPERE = (8, 0)

RUNGS: tuple[Family, ...] = (
    Family("naive", "fwd", "S = QK^T in global memory, softmax in place, O = PV: three kernels",
           Serves(_CUDA_CORE_DTYPES, 256, _BASIC),
           lambda v: specs.naive_spec(v.dtype_name, v.arch), _naive_plan, rung=0),
    Family("fused", "fwd", "one kernel, online softmax, one warp per query row",
           Serves(_CUDA_CORE_DTYPES, max(specs.FUSED_HEAD_DIMS), _BASIC | {"varlen"}),
           lambda v: specs.fused_spec(v.dtype_name, _padded_dims(v), v.arch),
           _grid_plan("fused_fwd", "FT_WARPS", lambda d: d["FT_WARPS"] * WARP), rung=1),
    Family("tiled", "fwd", "Q/K/V tiles in shared memory, fp32 on CUDA cores",
           Serves(_CUDA_CORE_DTYPES, specs.TILED_MAX_HEAD_DIM, _BASIC | {"varlen"}),
           lambda v: specs.tiled_spec(v.dtype_name, _padded_dims(v), v.arch),
           _grid_plan("tiled_fwd", "FT_BLOCK_M", lambda d: d["FT_THREADS"]), rung=2),
    Family("mma", "fwd", "tensor cores (mma.sync), FlashAttention-2 work split, synchronous loads",
           Serves(_TENSOR_CORE_DTYPES, max(specs.MMA_HEAD_DIMS), _BASIC | {"varlen"}, _AMPERE),
           lambda v: specs.mma_spec(v.dtype_name, _padded_dims(v), v.arch),
           _grid_plan("mma_fwd", "FT_BLOCK_M", lambda d: d["FT_WARPS"] * WARP), rung=3),
    Family("pipelined", "fwd", "cp.async pipeline (a TMA ring on Hopper), swizzled smem, exp2 softmax, every "
           "forward feature",
           Serves(_TENSOR_CORE_DTYPES, max(specs.FWD_HEAD_DIMS), _ALL, _AMPERE),
           lambda v: specs.fwd_spec(v.dtype_name, v.head_dim, v.head_dim_v, v.arch,
                                    softcap="softcap" in v.features, alibi="alibi" in v.features),
           _grid_plan("attn_fwd", "FT_BLOCK_M", lambda d: d["FT_WARPS"] * WARP), rung=4, tile=pipelined_tile),
    Family("hopper", "fwd", "warp specialisation: a TMA producer warp feeds wgmma consumer warpgroups, registers moved "
           "to them by setmaxnreg",
           Serves(_TENSOR_CORE_DTYPES, max(specs.HOPPER_FWD_TILES), _BASIC, (9, 0), extra=_hopper_why_not),
           lambda v: specs.hopper_fwd_spec(v.dtype_name, *_hopper_dims(v), hopper_tile(v)),
           _persistent_plan("attn_fwd", lambda d: specs.hopper_fwd_threads(d["FT_BLOCK_M"])),
           rung=5, tile=hopper_tile),
)
BY_NAME = {r.name: r for r in RUNGS}


def get(rung: str | int) -> Family:
    """A rung by name or number; ValueError listing the choices otherwise."""
    for r in RUNGS:
        if rung == r.name or (isinstance(rung, int) and not isinstance(rung, bool) and rung == r.rung):
            return r
    choices = ", ".join(f"{r.rung}/{r.name!r}" for r in RUNGS)
    raise ValueError(f"rung must be 'auto' or one of {choices}; got {rung!r}")
