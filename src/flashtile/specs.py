"""Kernel specs: what to compile, named so a person can read the cache directory.

A :class:`KernelSpec` is a frozen description of one NVRTC compilation — a kernel source file, its
entry points, the element type, the compile-time constants and the target architecture. The same spec
feeds run-time compilation (:mod:`flashtile.jit`), the ahead-of-time ``flashtile compile`` command and
the CPU test that compiles every kernel for several architectures (registry.all_specs).

Tile sizes live in the tables below, one row per choice, each with the reason for it. The measurements
behind the reasons (scripts/tune_fwd.py and scripts/tune_bwd.py on the H200) are in docs/notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_DTYPE_DEFINES = {"f32": "FT_DTYPE_F32", "f16": "FT_DTYPE_F16", "bf16": "FT_DTYPE_BF16"}

# Architectures every spec must compile for on a machine without a GPU (tests/test_compile_all.py).
TEST_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120")


TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)


@dataclass(frozen=True)
class KvBox:
    """The box of the K and V tensor maps a kernel takes as its second argument (flashtile/tma.py encodes them,
    common/tma.cuh's KvMaps receives them)."""

    rows: int   # keys per box; 0: this build loads K and V with cp.async and the maps are zeros
    cols: int   # elements per box row, one swizzle block: 32 (64-byte swizzle) or 64 (128-byte swizzle)
    blocks: int = 1  # column blocks per box; more than one: 5-D maps, (cols, rows, block, heads, batch or pages)


@dataclass(frozen=True)
class DqBox:
    """The box of the fp32 dQ accumulator's map, where the Hopper backward's writer adds dQ in boxes."""

    rows: int   # query rows per box (the kernel's block)
    cols: int   # fp32 columns per box
    width: int  # floats per accumulator row: the kernel's head dim, which a narrower q's is padded to


@dataclass(frozen=True)
class KernelSpec:
    source: str                          # path under flashtile/kernels/, e.g. "ladder/r2_tiled.cu"
    entries: tuple[str, ...]             # extern "C" kernel names in that file
    dtype: str                           # "f32" | "f16" | "bf16"
    arch: str                            # "sm_80", "sm_90a", ...
    defines: tuple[tuple[str, int], ...] = ()
    smem_bytes: int = 0                  # dynamic shared memory per block (= sizeof(SharedStorage), tested)
    kv_maps: KvBox | None = None         # the kernels' second argument: K's and V's tensor maps; None: none
    q_map: KvBox | None = None           # Q's map after them (rung 5's producer loads Q); None: none
    do_map: KvBox | None = None          # dO's map after Q's (the Hopper backward's producer); None: none
    o_map: KvBox | None = None           # O's map after Q's (rung 5's consumers store O through it); None: none
    dq_map: DqBox | None = None          # the fp32 dQ accumulator's template after dO's (its writer adds boxes)
    dq_smem_bytes: int = 0               # the Hopper backward's dQ pass (entry attn_bwd_dq): = sizeof(DqStorage)

    @property
    def maps_bytes(self) -> int:
        """Bytes of the second argument (0: the kernels take one)."""
        if self.kv_maps is None:
            return 0
        return TENSOR_MAP_BYTES * (2 + sum(box is not None for box in (self.q_map, self.do_map, self.o_map,
                                                                     self.dq_map)))

    @property
    def name(self) -> str:
        """Readable, file-name-safe identity, e.g. ``r2_tiled-bf16-head_dim64-block_n64-sm_90a``."""
        stem = self.source.rsplit("/", 1)[-1].removesuffix(".cu")
        consts = [f"{key.removeprefix('FT_').lower()}{value}" for key, value in self.defines]
        return "-".join([stem, self.dtype, *consts, self.arch])

    def macro_definitions(self) -> list[str]:
        return [f"FT_DTYPE={_DTYPE_DEFINES[self.dtype]}"] + [f"{k}={v}" for k, v in self.defines]


def arch_of(capability: tuple[int, int]) -> str:
    """NVRTC target for a device's compute capability; Hopper gets sm_90a so wgmma/setmaxnreg are legal."""
    major, minor = capability
    suffix = "a" if (major, minor) == (9, 0) else ""
    return f"sm_{major}{minor}{suffix}"


def capability_of(arch: str) -> tuple[int, int]:
    """The compute capability an NVRTC target runs on: "sm_90a" -> (9, 0), "sm_120" -> (12, 0), "sm_120f" -> (12, 0)
    (the suffixes: "a" architecture-specific, "f" family-specific features)."""
    digits = arch.removeprefix("sm_").rstrip("af")
    return int(digits[:-1]), int(digits[-1])


# Shared memory a block may use, by compute capability (so that sm_90a, sm_100a and sm_120f find theirs): sm_75
# 64 KB, sm_80 163 KB, sm_86/sm_89 99 KB, sm_90 227 KB, sm_100 (B200) 227 KB, sm_120 (RTX 50xx) 99 KB. Source: the
# CUDA C++ Programming Guide's "Technical Specifications per Compute Capability" table (table 24 of the 12.x guide),
# "maximum amount of shared memory per thread block"; the same numbers as CCCL's cuda/__device/arch_traits.h.
SMEM_LIMIT = {(7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
              (10, 0): 232448, (12, 0): 101376}
# What the tile tables assume of a GPU not listed: 99 KB, the least of the listed GPUs with mma.sync (sm_80+).
SMEM_LIMIT_UNLISTED = 101376


def smem_limit(arch: str) -> int:
    return SMEM_LIMIT.get(capability_of(arch), SMEM_LIMIT_UNLISTED)


# Blackwell: compute capability 10.0 (B200) and newer, 12.0 (RTX 50xx) included. mma.sync and cp.async run there as
# on Ampere (rung 4's path; wgmma and the TMA-fed ring are Hopper's), but ptxas allocates registers its own way:
# a few rows of the tables below spill there, and the *_BLACKWELL rows are what fits instead.
BLACKWELL = (10, 0)


def blackwell(arch: str) -> bool:
    return capability_of(arch) >= BLACKWELL


# ---------------------------------------------------------------------------------------------------
# Ladder rungs 0-2 (CUDA cores). Head dims are padded up to the nearest compiled variant.
# ---------------------------------------------------------------------------------------------------

LADDER_DTYPES = ("f32", "f16", "bf16")

# Rung 0: one thread per score / output element; a block of 256 threads is the usual occupancy sweet spot.
NAIVE_THREADS = 256

# Rung 1: each lane of a warp holds head_dim / 32 dims of q and of the output in registers; one warp per
# query row, four rows per block so that a block is 128 threads.
FUSED_HEAD_DIMS = (64, 128, 256)
FUSED_WARPS = 4

# Rung 2: block M = 64 rows is fixed by the 16 x 16 thread grid with 4 rows per thread.
TILED_BLOCK_M = 64
TILED_THREADS = 256
TILED_PAD = 4      # floats of padding per shared-memory row (kernels/ladder/r2_tiled.cu kPad)
FP32_BYTES = 4
#   head_dim -> keys per tile (BLOCK_N)
TILED_BLOCK_N = {
    64: 64,    # Q, K, V, P tiles in fp32 = 70 KB of shared memory: three blocks per SM on Ampere and Hopper
    128: 32,   # at 64 keys the tiles need 119 KB, more than the 99 KB an sm_86/sm_89 block may use; 32 keys: 77 KB
}
# Turing (sm_75) gives a block 64 KB, less than either row above needs: the largest key tiles that fit.
TILED_BLOCK_N_64KB = {
    64: 32,    # 43 KB
    128: 16,   # 55 KB
}
TILED_MAX_HEAD_DIM = max(TILED_BLOCK_N)


def pick_padded(head_dim: int, choices) -> int:
    for c in sorted(choices):
        if head_dim <= c:
            return c
    raise ValueError(f"head_dim {head_dim} exceeds the largest compiled variant {max(choices)}")


def naive_spec(dtype: str, arch: str) -> KernelSpec:
    return KernelSpec("ladder/r0_naive.cu", ("naive_scores", "naive_softmax", "naive_pv"), dtype, arch,
                      (("FT_THREADS", NAIVE_THREADS),))


def fused_spec(dtype: str, head_dim: int, arch: str) -> KernelSpec:
    padded = pick_padded(head_dim, FUSED_HEAD_DIMS)
    return KernelSpec("ladder/r1_fused.cu", ("fused_fwd",), dtype, arch,
                      (("FT_HEAD_DIM", padded), ("FT_WARPS", FUSED_WARPS)))


def tiled_smem(head_dim: int, block_n: int) -> int:
    """Q, K and V tiles of padded fp32 rows and the probabilities' tile (r2_tiled.cu's SharedStorage)."""
    rows = (TILED_BLOCK_M + 2 * block_n) * (head_dim + TILED_PAD) + TILED_BLOCK_M * (block_n + TILED_PAD)
    return rows * FP32_BYTES


def tiled_block_n(head_dim: int, arch: str) -> int:
    block_n = TILED_BLOCK_N[head_dim]
    return block_n if tiled_smem(head_dim, block_n) <= smem_limit(arch) else TILED_BLOCK_N_64KB[head_dim]


def tiled_spec(dtype: str, head_dim: int, arch: str) -> KernelSpec:
    padded = pick_padded(head_dim, TILED_BLOCK_N)
    block_n = tiled_block_n(padded, arch)
    return KernelSpec("ladder/r2_tiled.cu", ("tiled_fwd",), dtype, arch,
                      (("FT_HEAD_DIM", padded), ("FT_BLOCK_N", block_n), ("FT_BLOCK_M", TILED_BLOCK_M),
                       ("FT_THREADS", TILED_THREADS)), tiled_smem(padded, block_n))


# ---------------------------------------------------------------------------------------------------
# Rungs 3-4 (tensor cores, mma.sync: sm_80 and newer). fp16 and bf16 only.
# ---------------------------------------------------------------------------------------------------

MMA_DTYPES = ("f16", "bf16")
ELEM_BYTES = 2

# Rung 3: 64 x 64 tiles, 4 warps of 16 rows; rows padded by 8 elements (16 bytes).
MMA_HEAD_DIMS = (64, 128)
MMA_BLOCK_M = 64
MMA_WARPS = 4
MMA_BLOCK_N = 64
# ptxas for sm_100 (d128) and sm_120 (d64, d128) spills 64 keys' scores; 32 keys halve them and fit.
MMA_BLOCK_N_BLACKWELL = 32


def mma_spec(dtype: str, head_dim: int, arch: str) -> KernelSpec:
    padded = pick_padded(head_dim, MMA_HEAD_DIMS)
    block_n = MMA_BLOCK_N_BLACKWELL if blackwell(arch) else MMA_BLOCK_N
    smem = (MMA_BLOCK_M + 2 * block_n) * (padded + 8) * ELEM_BYTES
    return KernelSpec("ladder/r3_mma.cu", ("mma_fwd",), dtype, arch,
                      (("FT_HEAD_DIM", padded), ("FT_BLOCK_M", MMA_BLOCK_M), ("FT_BLOCK_N", block_n),
                       ("FT_WARPS", MMA_WARPS)), smem)


# Rung 4: compiled head dims (q/k and v are padded separately to one of these).
FWD_HEAD_DIMS = (64, 96, 128, 192, 256)


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    warps: int
    stages: int
    min_blocks: int   # __launch_bounds__ minimum blocks per SM: caps registers at 64K / (threads * this)
    why: str
    wide: bool = False  # 128-byte swizzle blocks (common/tile.cuh): one wavefront per cp.async phase, +6 registers
    tma: bool = False   # sm_90: the tensor memory accelerator feeds the K/V ring (common/tma.cuh, flashtile/tma.py)


# The forward tile table: padded head dim -> Tile, for GPUs with >= 160 KB of shared memory per block
# (A100, H100/H200, B200) and for those with 99 KB (RTX 30xx/40xx/50xx). Each row says why.
FWD_TILES_LARGE_SMEM = {
    64: Tile(128, 64, 4, 2, 1, "2 slabs/warp: each K/V fragment feeds two mmas; a third stage gains nothing; "
                               "128 keys is faster but spills"),
    96: Tile(128, 32, 4, 2, 1, "as d128 on sm_80; at 64 keys ptxas spills"),
    128: Tile(128, 32, 4, 2, 1, "64 keys is faster on Hopper (see FWD_TILES_SM90) but spills with sm_80's register "
                                "allocation"),
    192: Tile(128, 64, 8, 2, 1, "1 slab/warp keeps O at 96 regs; 144 KB"),
    256: Tile(64, 64, 4, 2, 1, "160 KB: block_m 128 with a 2-stage ring would need 192 KB, over sm_80's 163 KB"),
}
# Hopper-only rows: ptxas for sm_90a fits these without spills.
FWD_TILES_SM90 = {
    64: Tile(128, 64, 4, 2, 1, "as FWD_TILES_LARGE_SMEM, K/V by TMA: faster than cp.async at every length",
             tma=True),
    128: Tile(128, 64, 4, 2, 1, "FA2's tile (255 regs, no spills on sm_90a), faster than 128 x 32 on Hopper; K/V by "
                                "TMA, faster than cp.async at every length: issuing 16 copies per thread and tile was "
                                "the loop's largest overhead, one thread issues 8 instead", tma=True),
    256: Tile(64, 64, 4, 1, 2, "K and V take turns in one buffer each (FA2's d256 schedule): 96 KB, two blocks "
                               "per SM, faster than a 2-stage ring of 128 x 64 x 8 warps at short sequences and level "
                               "at long ones; 128-byte swizzle blocks, faster at every length than 64-byte ones, whose "
                               "cp.async phases take two wavefronts", wide=True),
}
# B200 rows (sm_100: Hopper's shared memory, no TMA-fed ring) where ptxas for sm_100 spills FWD_TILES_LARGE_SMEM's.
FWD_TILES_LARGE_SMEM_BLACKWELL = {
    128: Tile(128, 64, 8, 2, 1, "1 slab/warp, FWD_TILE_SCORE_MODS's shape: ptxas for sm_100 spills 128 x 32 x 4 "
                                "warps and fits this; 96 KB; not timed on a B200"),
}
FWD_TILES_SMALL_SMEM = {
    64: Tile(128, 64, 4, 2, 1, "48 KB"),
    96: Tile(128, 32, 4, 2, 1, "48 KB"),
    128: Tile(128, 32, 4, 2, 1, "64 KB"),
    192: Tile(64, 32, 4, 2, 1, "72 KB: 128 x 64 tiles would need 144 KB, over the 99 KB limit"),
    256: Tile(64, 32, 4, 2, 1, "96 KB"),
}
# Softcap / ALiBi add per-score work and registers: the 2-slab shapes spill, one slab per warp does not.
FWD_TILE_SCORE_MODS = Tile(128, 64, 8, 2, 1, "1 slab/warp leaves room for the score modifications")


def fwd_tile(head_dim: int, arch: str, score_mods: bool = False) -> Tile:
    if score_mods and head_dim <= 128:
        return FWD_TILE_SCORE_MODS
    if arch == "sm_90a" and head_dim in FWD_TILES_SM90:
        return FWD_TILES_SM90[head_dim]
    if smem_limit(arch) < 160 * 1024:
        return FWD_TILES_SMALL_SMEM[head_dim]
    if blackwell(arch) and head_dim in FWD_TILES_LARGE_SMEM_BLACKWELL:
        return FWD_TILES_LARGE_SMEM_BLACKWELL[head_dim]
    return FWD_TILES_LARGE_SMEM[head_dim]


PIPELINED_SOURCE = "mma/fwd.cu"
MBARRIER_BYTES = 8
INT_BYTES = 4
SWIZZLE_ATOM_BYTES = 1024  # the 128-byte swizzle's period: 8 rows of 128 bytes
WGMMA_M = 64               # rows of a warpgroup product


def fwd_smem(d: int, dv: int, tile: Tile) -> int:
    """Q (later O), the K/V stages, and one mbarrier per stage (used when TMA feeds the ring)."""
    tiles = tile.block_m * max(d, dv) + tile.stages * tile.block_n * (d + dv)
    return tiles * ELEM_BYTES + tile.stages * MBARRIER_BYTES


def fwd_defines(d: int, dv: int, tile: Tile, softcap: bool = False, alibi: bool = False) -> tuple:
    return (("FT_HEAD_DIM", d), ("FT_HEAD_DIM_V", dv), ("FT_BLOCK_M", tile.block_m), ("FT_BLOCK_N", tile.block_n),
            ("FT_WARPS", tile.warps), ("FT_STAGES", tile.stages), ("FT_MIN_BLOCKS", tile.min_blocks),
            ("FT_SOFTCAP", int(softcap)), ("FT_ALIBI", int(alibi)), ("FT_WIDE_BLOCKS", int(tile.wide)),
            ("FT_TMA_KV", int(tile.tma)))


NARROW_BOX_COLS = 32  # rung 4's K/V boxes: one 64-byte swizzle block of common/tile.cuh's narrow layout


def fwd_kv_box(tile: Tile) -> KvBox:
    """Rung 4's K/V maps: boxes of the ring's tiles where TMA feeds it, zeros where cp.async does."""
    return KvBox(tile.block_n if tile.tma else 0, NARROW_BOX_COLS)


def fwd_spec(dtype: str, head_dim: int, head_dim_v: int, arch: str, softcap: bool = False,
             alibi: bool = False) -> KernelSpec:
    d, dv = pick_padded(head_dim, FWD_HEAD_DIMS), pick_padded(head_dim_v, FWD_HEAD_DIMS)
    tile = fwd_tile(max(d, dv), arch, softcap or alibi)
    return KernelSpec(PIPELINED_SOURCE, ("attn_fwd",), dtype, arch, fwd_defines(d, dv, tile, softcap, alibi),
                      fwd_smem(d, dv, tile), kv_maps=fwd_kv_box(tile))


# Decoding (flashtile/decode.py): a block's query rows are a kv head's query heads (a GQA group, usually 1-16 rows)
# in one 16-row slab, and the decode build shares each tile's keys among its 4 warps (kernels/mma/fwd.cu): K and V
# leave shared memory once per block, and no warp multiplies rows that are not there. With 64 rows shared by the
# warps instead, every warp read all of K and V and the tensor cores worked on 4-8x the real rows: the loop was
# bound by that work, not by memory (docs/notes.md).
DECODE_BLOCK_M = 16
DECODE_TILES_SM90 = {
    64: Tile(DECODE_BLOCK_M, 128, 4, 3, 1, "TMA ring of 128-key tiles, 3 stages (two in flight while one is "
                                           "computed); 98 KB, two blocks per SM", tma=True),
    128: Tile(DECODE_BLOCK_M, 128, 4, 3, 1, "TMA ring of 128-key tiles, 3 stages (two in flight while one is "
                                            "computed; a fourth does not fit); 196 KB", tma=True),
}
DECODE_KEYS_CP_ASYNC = 64  # elsewhere: 16 keys per warp, and the most stages of a cp.async ring that fit
DECODE_MAX_STAGES = 4
DECODE_ENTRIES = ("attn_fwd", "attn_combine")  # the parts' kernel, then the kernel that merges them
COMBINE_WARPS = 4  # attn_combine merges one query row per warp; 4 rows per block


def decode_tile(d: int, dv: int, arch: str) -> Tile:
    """The decode build's tile: DECODE_TILES_SM90 on Hopper; elsewhere a cp.async ring of DECODE_KEYS_CP_ASYNC-key
    tiles with as many stages as the GPU's shared memory holds (at most DECODE_MAX_STAGES)."""
    if arch == "sm_90a" and max(d, dv) in DECODE_TILES_SM90:
        return DECODE_TILES_SM90[max(d, dv)]
    for stages in range(DECODE_MAX_STAGES, 0, -1):
        tile = Tile(DECODE_BLOCK_M, DECODE_KEYS_CP_ASYNC, 4, stages, 1,
                    f"cp.async ring of {DECODE_KEYS_CP_ASYNC}-key tiles, the most stages (up to {DECODE_MAX_STAGES}) "
                    "that fit this GPU's shared memory")
        if fwd_smem(d, dv, tile) <= smem_limit(arch):
            return tile
    return tile


# Pages whose rows' largest power-of-two divisor is one of these read through row groups (kernels/mma/fwd.cu,
# FT_KV_GROUP_ROWS): one copy per page and tile instead of one per 64-byte column block. At 16 rows the copies'
# count, not the bytes, bounded the loop (64 copies of 1 KB per tile); from 64 rows on a column block's box is
# large enough (docs/notes.md).
DECODE_GROUPED_PAGE_ROWS = (16, 32)


def decode_spec(dtype: str, head_dim: int, head_dim_v: int, arch: str, group_rows: int = 0) -> KernelSpec:
    """Rung 4's kernel built for decoding (FT_DECODE: split parts, per-sequence key counts, pages on Hopper),
    with the kernel that merges the parts; `group_rows` (one of DECODE_GROUPED_PAGE_ROWS, Hopper): the build
    for pages of that many rows (or multiples whose largest power-of-two divisor it is)."""
    d, dv = pick_padded(head_dim, FWD_HEAD_DIMS), pick_padded(head_dim_v, FWD_HEAD_DIMS)
    tile = decode_tile(d, dv, arch)
    defines = fwd_defines(d, dv, tile) + (("FT_DECODE", 1), ("FT_COMBINE_WARPS", COMBINE_WARPS))
    box = fwd_kv_box(tile)
    if group_rows:
        if group_rows not in DECODE_GROUPED_PAGE_ROWS or not tile.tma or d != dv:
            raise ValueError(f"row groups of {group_rows} rows: the decode build takes groups of "
                             f"{DECODE_GROUPED_PAGE_ROWS} rows where tensor maps feed it (Hopper, head dims up to "
                             f"{max(DECODE_TILES_SM90)}) and q/k and v share one head dim")
        defines += (("FT_KV_GROUP_ROWS", group_rows),)
        box = KvBox(group_rows, NARROW_BOX_COLS, d // NARROW_BOX_COLS)
    return KernelSpec(PIPELINED_SOURCE, DECODE_ENTRIES, dtype, arch, defines, fwd_smem(d, dv, tile), kv_maps=box)


# ---------------------------------------------------------------------------------------------------
# Rung 5, the Hopper forward (kernels/wgmma/fwd.cu): a producer warpgroup whose one thread feeds K and V through
# the tensor memory accelerator, and consumer warpgroups of 64 query rows each computing on wgmma. Tiles in
# 128-byte swizzle blocks (the layout wgmma's descriptors read, and the one a TMA box of 64 columns writes); the
# shared storage is aligned to the swizzle's 1024-byte period. Registers: 64K per SM at one block, moved by
# setmaxnreg from the producer warpgroup (PRODUCER_REGISTERS per thread) to the consumers.
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HopperFwdTile:
    block_m: int   # 64 query rows per consumer warpgroup
    block_n: int
    stages: int
    why: str
    pingpong: bool = True  # the consumers take turns issuing their products
    persistent: bool = True  # blocks loop over work tiles (kernels/wgmma/fwd.cu; flashtile/ladder.py's plan)
    tail_split: bool = True  # persistent blocks share the last round's units by key tiles (hopper_tail_split)

    @property
    def consumers(self) -> int:
        return self.block_m // WGMMA_M


def hopper_fwd_threads(block_m: int) -> int:
    """A rung-5 block's threads: the producer warpgroup and one consumer warpgroup per 64 query rows."""
    return (1 + block_m // WGMMA_M) * WARPGROUP_THREADS


WARPGROUP_THREADS = 128
WARPGROUP_WARPS = 4
WIDE_BOX_COLS = 64             # one 128-byte swizzle block of 16-bit elements
O_STORE_ROWS = 16              # rung 5's O map: a warp stores its own rows of a consumer's 64
PRODUCER_REGISTERS = 24        # the producer holds a few addresses and counters
REGISTER_FILE = 65536          # 32-bit registers per SM
REGISTER_STEP = 8              # setmaxnreg and the compiler's per-thread allocation move in steps of 8


def launch_registers(threads: int) -> int:
    """Registers per thread the compiler gives a kernel of `threads` threads at one block per SM."""
    return min(255, REGISTER_FILE // threads) // REGISTER_STEP * REGISTER_STEP


def consumer_registers(consumers: int, producer_registers: int = PRODUCER_REGISTERS) -> int:
    """A consumer's registers after setmaxnreg: the block starts with launch_registers each, and the consumers can
    take only what the producer warpgroup gives back (setmaxnreg.inc waits until the block's own registers
    free up, so asking for more hangs the block)."""
    start = launch_registers((1 + consumers) * WARPGROUP_THREADS)
    freed = (start - producer_registers) * WARPGROUP_THREADS
    return (start + freed // (consumers * WARPGROUP_THREADS)) // REGISTER_STEP * REGISTER_STEP


HOPPER_FWD_TILES = {
    64: HopperFwdTile(192, 128, 3, "three consumers (S 64 + O 32 + P 32 registers fit 160): more rows per K/V "
                                   "tile read; three stages beat two and four; 169 KB with O's buffer; no tail "
                                   "split: its merge does not fit the 160 registers (ptxas spills)", tail_split=False),
    128: HopperFwdTile(128, 128, 2, "two consumers of 240 registers: S 64 + O 64 + P 32; two stages level with "
                                    "three once K and V free their slots apart; 225 KB with O's buffer, so no third"),
    256: HopperFwdTile(128, 64, 2, "two consumers: O 128 + S 32 + P 16 registers; a 128-key tile would need "
                                   "S 64 more; 193 KB, so two stages; one work tile per block (O staged over Q): the "
                                   "persistent loop's bookkeeping spills 8 bytes under NVRTC 13.0", persistent=False,
                       tail_split=False),
}


# Rung 5's tiles for causal forwards of at most HOPPER_SHORT_CAUSAL_KEYS keys (Variant.short_causal), instead of
# HOPPER_FWD_TILES' row. A short causal row is mostly diagonal tiles and the turns around them. The bound is where
# the narrow tile stopped leading: it led at 512 to 1024 keys and lost at 2048 (notes.md, session forty-one).
HOPPER_SHORT_CAUSAL_KEYS = 1024
HOPPER_FWD_SHORT_CAUSAL_TILES = {
    64: HopperFwdTile(192, 64, 4, "64-key tiles: less of each diagonal tile masked away and a consumer whose rows "
                                  "stop early passes shorter turns, which leads at short causal rows; at longer or "
                                  "unmasked rows twice the turns per key, each half as long, lose; six stages are "
                                  "level with four", tail_split=False),
}


def hopper_fwd_tile(d: int, dv: int, arch: str, short_causal: bool = False) -> HopperFwdTile | None:
    """Rung 5's tile for padded head dims, or None where it does not serve (off Hopper, dims unlike); with
    `short_causal`, the tile for a causal problem of at most HOPPER_SHORT_CAUSAL_KEYS keys."""
    if arch != "sm_90a" or d != dv:
        return None
    if short_causal and d in HOPPER_FWD_SHORT_CAUSAL_TILES:
        return HOPPER_FWD_SHORT_CAUSAL_TILES[d]
    return HOPPER_FWD_TILES.get(d)


# The tail split (kernels/wgmma/fwd.cu TailSplit): without a mask, the units past the blocks' last full round are
# dealt out by key tiles in runs of `run`, one run a block; each shared unit's pieces leave partial rows in slots of
# the plan's scratch, and a counter per tail unit and consumer (zeroed by the plan before each call) finds the last.
TAIL_SPLIT_MIN_SAVED_TILES = 8  # taken where the last round's longest block saves this many key tiles (notes.md:
                                # at d64 n1k, runs of 3 of a unit's 8 tiles lost 1-3%: a piece pays a tile's fixed
                                # costs again)
TAIL_SPLIT_GROUP_FLOATS = 4     # the slots hold a thread's values in fours (float4)


@dataclass(frozen=True)
class TailSplit:
    run: int             # key tiles per block (AttnParams.tail_tiles)
    scratch_floats: int  # the slots, then the counters
    counter_floats: int  # the counters: the scratch's last floats, zeroed before each call


def hopper_tail_split(units: int, blocks: int, unit_tiles: int, consumers: int, dv: int) -> TailSplit | None:
    """The tail split of `units` work units of `unit_tiles` key tiles each over `blocks` persistent blocks, or
    None where it does not pay. Slots: one per block and one per tail unit, each holding every consumer thread's
    partial O (dv / 2 floats: 64 rows x dv over 128 threads) and its rows' two maxima and two sums."""
    tail = units % blocks if units > blocks else 0
    if tail == 0:
        return None
    run = -(-tail * unit_tiles // blocks)
    if unit_tiles - run < TAIL_SPLIT_MIN_SAVED_TILES:
        return None
    thread_floats = dv // 2 + TAIL_SPLIT_GROUP_FLOATS
    slots = (blocks + tail) * consumers * thread_floats * WARPGROUP_THREADS
    return TailSplit(run, slots + tail * consumers, tail * consumers)


def hopper_fwd_q_buffers(tile: HopperFwdTile) -> int:
    """Q buffers of a rung-5 block: persistent blocks load the next tile's Q while the current one runs."""
    return 2 if tile.persistent else 1


def hopper_fwd_smem(d: int, dv: int, tile: HopperFwdTile) -> int:
    """O's buffer (persistent blocks; one tile's O is staged over its Q), the Q buffers, the K/V stages, two
    mbarriers per Q buffer and four per stage, two ints per Q buffer (the place in the schedule of the tile whose Q
    it holds, and that tile's ring position); a multiple of the swizzle atom."""
    buffers = hopper_fwd_q_buffers(tile)
    o_buffer = tile.block_m * dv if tile.persistent else 0
    tiles = o_buffer + buffers * tile.block_m * d + tile.stages * tile.block_n * (d + dv)
    storage = tiles * ELEM_BYTES + (2 * buffers + 4 * tile.stages) * MBARRIER_BYTES + 2 * buffers * INT_BYTES
    return -(-storage // SWIZZLE_ATOM_BYTES) * SWIZZLE_ATOM_BYTES


def hopper_fwd_spec(dtype: str, d: int, dv: int, tile: HopperFwdTile) -> KernelSpec:
    defines = (("FT_HEAD_DIM", d), ("FT_HEAD_DIM_V", dv), ("FT_BLOCK_M", tile.block_m), ("FT_BLOCK_N", tile.block_n),
               ("FT_STAGES", tile.stages), ("FT_PINGPONG", int(tile.pingpong)), ("FT_PRODUCER_REGISTERS", PRODUCER_REGISTERS),
               ("FT_CONSUMER_REGISTERS", consumer_registers(tile.consumers)), ("FT_PERSISTENT", int(tile.persistent)),
               ("FT_Q_BUFFERS", hopper_fwd_q_buffers(tile)), ("FT_TAIL_SPLIT", int(tile.tail_split)))
    return KernelSpec("wgmma/fwd.cu", ("attn_fwd",), dtype, "sm_90a", defines, hopper_fwd_smem(d, dv, tile),
                      kv_maps=KvBox(tile.block_n, WIDE_BOX_COLS), q_map=KvBox(WGMMA_M, WIDE_BOX_COLS),
                      o_map=KvBox(O_STORE_ROWS, WIDE_BOX_COLS))


# The backward's two row kernels (preprocess: D = rowsum(dO * O) and the base-2 LSE; the dQ conversion): one
# warp per row, 16 rows per block of 4 warps — short rows of work, so a block of 128 threads keeps enough
# blocks in flight on every GPU.
ROW_WARPS = 4
PREPROCESS_ROWS = 16
ROW_DEFINES = (("FT_ROW_WARPS", ROW_WARPS), ("FT_PREPROCESS_ROWS", PREPROCESS_ROWS))


# ---------------------------------------------------------------------------------------------------
# Rung 4 backward, the 16-keys-per-warp kernel (kernels/mma/bwd.cu): every case off Hopper; on Hopper
# softcap/ALiBi, d96 and q/k and v head dims that differ (the wgmma kernel and the grid kernel below serve the
# rest). A block owns block_n keys (16 per warp) and keeps their dK and dV in registers: (d + dv) / 2 fp32 registers
# per thread, plus block_m / 2 for dP and block_m / 4 for P (kept as 16-bit pairs in one-pass 64+-query steps). Past
# head dim 128 that does not fit in 255 registers, so those dims run two passes (split: dV, then dK and dQ).
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BwdTile:
    block_m: int
    block_n: int
    stages: int
    split: bool
    why: str

    @property
    def warps(self) -> int:
        return self.block_n // 16


BWD_TILES_LARGE_SMEM = {
    64: BwdTile(128, 128, 2, False, "8 warps x 16 keys, 128-query steps: faster than block_m 64, and half the "
                                    "deterministic hand-offs; 130 KB"),
    96: BwdTile(64, 128, 2, False, "as d128"),
    128: BwdTile(64, 128, 2, False, "FA2's tile; P kept as 16-bit pairs leaves room for 64-query steps beside dK + dV "
                                    "(128 regs/thread): faster than block_m 32, and half the deterministic hand-offs; "
                                    "145 KB"),
    192: BwdTile(64, 64, 2, True, "two passes; 153 KB"),
    256: BwdTile(64, 64, 2, True, "two passes; 200 KB, Hopper's and B200's 227 KB only"),
}
# B200 rows (sm_100) where ptxas for sm_100 spills BWD_TILES_LARGE_SMEM's.
BWD_TILES_LARGE_SMEM_BLACKWELL = {
    64: BwdTile(64, 128, 2, False, "as d96 and d128: ptxas for sm_100 spills 128-query steps in bf16; not timed on a "
                                   "B200"),
}
BWD_TILE_SM80_D256 = BwdTile(64, 64, 1, True, "one query buffer: 137 KB fits sm_80's 163 KB")
BWD_TILES_SMALL_SMEM = {
    64: BwdTile(32, 64, 2, False, "37 KB"),
    96: BwdTile(32, 64, 2, False, "51 KB"),
    128: BwdTile(32, 64, 2, False, "66 KB: at block_m 64, 2 stages need 104 KB, over the 99 KB limit"),
    192: BwdTile(32, 32, 2, True, "74 KB"),
    256: BwdTile(32, 32, 2, True, "98 KB"),
}
# Softcap keeps 1 - tanh^2 per score and ALiBi its distances: halve block_m to keep the registers.
BWD_BLOCK_M_SCORE_MODS = 32
# On Blackwell that is not enough: ptxas for sm_100 and sm_120 spills at d128, the head dim CI compiles score
# modifications at. One query buffer instead of a 2-stage ring frees the rest, at every head dim. Not timed there.
BWD_STAGES_SCORE_MODS_BLACKWELL = 1


def bwd_tile(head_dim: int, arch: str, score_mods: bool = False) -> BwdTile:
    if smem_limit(arch) < 160 * 1024:
        tile = BWD_TILES_SMALL_SMEM[head_dim]
    elif head_dim == 256 and smem_limit(arch) < 200 * 1024 + 2048:
        tile = BWD_TILE_SM80_D256
    elif blackwell(arch) and head_dim in BWD_TILES_LARGE_SMEM_BLACKWELL:
        tile = BWD_TILES_LARGE_SMEM_BLACKWELL[head_dim]
    else:
        tile = BWD_TILES_LARGE_SMEM[head_dim]
    if score_mods:
        if blackwell(arch):
            tile = BwdTile(tile.block_m, tile.block_n, BWD_STAGES_SCORE_MODS_BLACKWELL, tile.split,
                           tile.why + "; one query buffer on Blackwell")
        tile = BwdTile(BWD_BLOCK_M_SCORE_MODS, tile.block_n, tile.stages, tile.split, tile.why + "; score mods")
    return tile


# The per-phase warp-grid kernel (kernels/mma/bwd_grid.cu), for head dim 192 where its tile fits the GPU's
# shared memory (Hopper). Per step (block_m queries) each phase splits the 8 warps its own way: S/dP over
# keys x queries, dK/dV over keys x head dim, dQ over queries x head dim, so dK and dV of a 64-key block fit the
# registers in one pass (bwd.cu needs two past d128, recomputing S in each). At d <= 128 bwd.cu is faster (fewer
# instructions, no round trip of P and dS through shared memory), and on Hopper d64, d128 and d256 run the wgmma
# kernel below, faster still, so only d192 is listed; scripts/tune_bwd.py sweeps both kernels' tiles at any head dim.


@dataclass(frozen=True)
class BwdGridTile:
    block_m: int
    block_n: int
    warps: int
    stages: int
    warps_keys_sdp: int    # phase 1: warps along keys (the rest along queries)
    warps_keys_dkv: int    # phase 2: warps along keys (the rest along the head dim)
    warps_queries_dq: int  # phase 3: warps along queries (the rest along the head dim)
    why: str


BWD_GRID_TILES = {
    192: BwdGridTile(64, 64, 8, 2, 4, 2, 4, "one pass where bwd.cu needs two, and faster: each warp 32 keys x 48 "
                                            "columns of dK and dV; 161 KB"),
}


def bwd_grid_tile(head_dim: int, arch: str, score_mods: bool = False) -> BwdGridTile | None:
    """The grid kernel's tile, or None where the 16-keys-per-warp kernel serves."""
    tile = BWD_GRID_TILES.get(head_dim)
    if tile is None or score_mods or smem_limit(arch) < bwd_grid_smem(head_dim, head_dim, tile):
        return None
    return tile


def bwd_grid_smem(d: int, dv: int, tile: BwdGridTile) -> int:
    """K, V, the query ring (Q and dO), P^T and dS^T, and the ring's two numbers per query row."""
    m, n, stages = tile.block_m, tile.block_n, tile.stages
    return (n * (d + dv) + stages * m * (d + dv) + 2 * n * m) * ELEM_BYTES + 2 * stages * m * 4


def bwd_grid_spec(dtype: str, d: int, dv: int, arch: str, tile: BwdGridTile) -> KernelSpec:
    m, n, stages = tile.block_m, tile.block_n, tile.stages
    smem = bwd_grid_smem(d, dv, tile)
    defines = (("FT_HEAD_DIM", d), ("FT_HEAD_DIM_V", dv), ("FT_BLOCK_M", m), ("FT_BLOCK_N", n),
               ("FT_WARPS", tile.warps), ("FT_STAGES", stages), ("FT_WARPS_KEYS_SDP", tile.warps_keys_sdp),
               ("FT_WARPS_KEYS_DKV", tile.warps_keys_dkv), ("FT_WARPS_QUERIES_DQ", tile.warps_queries_dq),
               ("FT_SOFTCAP", 0), ("FT_ALIBI", 0), *ROW_DEFINES)
    return KernelSpec("mma/bwd_grid.cu", ("attn_bwd_preprocess", "attn_bwd", "attn_bwd_dq_convert"), dtype, arch,
                      defines, smem)


# The Hopper backward (kernels/wgmma/bwd.cu): every product on wgmma, two warpgroups per block, for head dims 64,
# 128 and 256 (q/k and v alike) without score modifications on sm_90a. Tiles in 128-byte swizzle blocks,
# the layout wgmma's descriptors read; the block's shared storage is aligned to the swizzle's 1024-byte period.


@dataclass(frozen=True)
class BwdWgmmaTile:
    block_m: int
    block_n: int
    stages: int
    why: str
    warps: int = 12  # a producer warpgroup and two consumer warpgroups
    dq_writer: bool = False  # dQ staged in shared memory and added by writer warps of the producer warpgroup
    scores_ahead: bool = False  # a step's S^T issued by the step before, behind its dQ product (keys split)
    turn_keeper: bool = False  # deterministic mode: the producer warpgroup's second warp keeps dQ's turns
    dq_turns: bool = False  # with the writer: dQ by one warpgroup a step, the two in turns
    dq_buffers: int = 1  # staged dQ tiles of boxes, a writer warp each (2: one adds a tile, the other the next)
    dq_boxes: bool = False  # with the writer: dQ staged as boxes of 8 columns, added by tensor-map reductions
    dq_pass: bool = False  # dQ by a kernel of its own (wgmma/bwd_dq.cuh), not by the main kernel's reductions


BWD_WGMMA_TILES = {
    64: BwdWgmmaTile(128, 128, 2, "keys split, dQ split by rows (64 queries per warpgroup); dQ staged as boxes that "
                                  "the writer warp adds by tensor-map reductions; 195 KB. Faster than the "
                                  "consumers' atomics, which made the writer's row reductions slower here",
                     dq_writer=True, dq_boxes=True),
    128: BwdWgmmaTile(64, 128, 2, "keys split; dQ by one warpgroup a step, the two in turns, over two staged tiles "
                                  "of boxes two writer warps add by tensor-map reductions; S^T, dP^T 32 and dK, dV "
                                  "64 registers each; 226 KB. Faster than dQ split by columns or rows reduced",
                      dq_writer=True, dq_turns=True, dq_buffers=2, dq_boxes=True),
    256: BwdWgmmaTile(64, 64, 2, "columns split: 64 keys shared by both warpgroups, each with half of dK, dV and dQ "
                                 "(64 registers each); warpgroup 0 S^T and P^T, warpgroup 1 dP^T and dS^T, both "
                                 "through shared memory; 226 KB. Faster than sdpa-flash and bwd_grid.cu; S^T/dP^T "
                                 "split by queries instead is slower (both warpgroups read all of K and V). dQ by a "
                                 "pass of its own (128 queries a block): 1.5x the main kernel's own dQ, whose fp32 "
                                 "reductions into L2 bound it",
                      dq_pass=True),
}
# Builds of BWD_WGMMA_TILES' rows measured beside them and not taken (docs/notes.md, sessions twenty-five and
# twenty-six): CI compiles them, scripts/tune_bwd.py times them.
BWD_WGMMA_ALTERNATIVES = {
    128: (replace(BWD_WGMMA_TILES[128], dq_turns=False, dq_buffers=1, dq_boxes=False,
                  why="dQ split by columns, one padded staged tile that the writer adds by row reductions (slower)"),),
    256: (replace(BWD_WGMMA_TILES[256], dq_pass=False,
                  why="dQ by the main kernel's consumers, fp32 atomics into an accumulator (a third slower)"),),
}
# dS^T (and P^T) in two buffers that alternate by step: with no block barrier between steps, one warpgroup may
# write the next step's while the other still reads this step's.
BWD_SCORE_BUFFERS = 2
DQ_BOX_COLS = 8  # fp32 columns of a dQ box where the writer adds boxes (wgmma/bwd.cu kDqBoxCols)
BWD_DQ_STAGE_PAD = 4  # floats after each staged dQ row where the writer adds rows (wgmma/bwd.cu kDqStageStride)
# With the dQ writer the producer warpgroup also issues dQ's reductions: at 24 registers it spilled; at 32 the
# consumers keep 232, which the d128 build fits. Without it the producer keeps PRODUCER_REGISTERS.
DQ_WRITER_PRODUCER_REGISTERS = 32


def bwd_wgmma_tile(d: int, dv: int, arch: str, score_mods: bool = False,
                   deterministic: bool = False) -> BwdWgmmaTile | None:
    """The Hopper kernel's tile, or None where rung 4's kernels serve. In the deterministic mode the writer warps
    keep the dQ tiles' turns where there are two staged tiles (d128), one writer per tile: one tile's reductions
    complete and its turn passes while the other writer adds the next tile (docs/notes.md, sessions twenty-seven
    and twenty-eight). With one staged tile (d64) the consumers would wait for the writer every step, and the
    atomics, with a turn keeper warp where the keys are split, are faster. Where a step's queries are one block
    of 64, the next step's S^T runs under those atomics (session twenty)."""
    if arch != "sm_90a" or score_mods or d != dv:
        return None
    tile = BWD_WGMMA_TILES.get(d)
    if tile is None or not deterministic or tile.dq_pass or (tile.dq_writer and tile.dq_buffers > 1):
        return tile
    split_keys = tile.block_n == 2 * WGMMA_M
    return replace(tile, dq_writer=False, dq_turns=False, dq_buffers=1, dq_boxes=False,
                   scores_ahead=split_keys and tile.block_m == WGMMA_M, turn_keeper=split_keys)


def bwd_wgmma_spec(dtype: str, d: int, tile: BwdWgmmaTile) -> KernelSpec:
    m, n, stages = tile.block_m, tile.block_n, tile.stages
    split_columns = n == WGMMA_M  # one key block for both warpgroups: P^T goes through shared memory as well
    score_tiles = BWD_SCORE_BUFFERS * (1 + split_columns) * n * m  # dS^T (and P^T), two steps' worth
    producer = DQ_WRITER_PRODUCER_REGISTERS if tile.dq_writer else PRODUCER_REGISTERS
    stage_row = d + (0 if tile.dq_boxes else BWD_DQ_STAGE_PAD)  # fp32
    dq_stage = tile.dq_buffers * m * stage_row * 4 if tile.dq_writer else 0
    storage = ((2 * n * d + 2 * stages * m * d + score_tiles) * ELEM_BYTES + 2 * stages * m * 4 + dq_stage
               + (1 + 2 * stages) * MBARRIER_BYTES)
    smem = -(-storage // SWIZZLE_ATOM_BYTES) * SWIZZLE_ATOM_BYTES
    defines = (("FT_HEAD_DIM", d), ("FT_HEAD_DIM_V", d), ("FT_BLOCK_M", m), ("FT_BLOCK_N", n),
               ("FT_WARPS", tile.warps), ("FT_STAGES", stages), ("FT_SOFTCAP", 0), ("FT_ALIBI", 0),
               ("FT_WIDE_BLOCKS", 1), ("FT_DQ_WRITER", int(tile.dq_writer)),
               ("FT_SCORES_AHEAD", int(tile.scores_ahead)), ("FT_TURN_KEEPER", int(tile.turn_keeper)),
               ("FT_DQ_TURNS", int(tile.dq_turns)), ("FT_DQ_BUFFERS", tile.dq_buffers),
               ("FT_DQ_BOXES", int(tile.dq_boxes)),
               ("FT_PRODUCER_REGISTERS", producer),
               ("FT_CONSUMER_REGISTERS", consumer_registers(tile.warps // WARPGROUP_WARPS - 1, producer)),
               *ROW_DEFINES)
    if tile.dq_pass:
        defines += (("FT_DQ_PASS", 1), ("FT_DQ_K_STAGES", BWD_DQ_PASS_K_STAGES),
                    ("FT_DQ_V_STAGES", BWD_DQ_PASS_V_STAGES))
    last = "attn_bwd_dq" if tile.dq_pass else "attn_bwd_dq_convert"
    return KernelSpec("wgmma/bwd.cu", ("attn_bwd_preprocess", "attn_bwd", last), dtype, "sm_90a",
                      defines, smem, kv_maps=KvBox(n, WIDE_BOX_COLS), q_map=KvBox(m, WIDE_BOX_COLS),
                      do_map=KvBox(m, WIDE_BOX_COLS), dq_map=DqBox(m, DQ_BOX_COLS, d) if tile.dq_boxes else None,
                      dq_smem_bytes=bwd_dq_pass_smem(d, n, tile.warps) if tile.dq_pass else 0)


# The dQ pass (kernels/wgmma/bwd_dq.cuh): a block holds the Q and dO of 64 queries per consumer warpgroup, K in a ring
# of two stages and V in one (no more fits beside Q and dO at d256: V is read first and refilled behind dQ's product).
BWD_DQ_PASS_K_STAGES = 2
BWD_DQ_PASS_V_STAGES = 1


def bwd_dq_pass_rows(warps: int) -> int:
    """Queries per block of the dQ pass: 64 per consumer warpgroup (the block's warps less the producer's)."""
    return (warps // WARPGROUP_WARPS - 1) * WGMMA_M


def bwd_dq_pass_smem(d: int, block_n: int, warps: int = 12) -> int:
    storage = ((2 * bwd_dq_pass_rows(warps) + (BWD_DQ_PASS_K_STAGES + BWD_DQ_PASS_V_STAGES) * block_n) * d * ELEM_BYTES
               + (1 + 2 * BWD_DQ_PASS_K_STAGES + 2 * BWD_DQ_PASS_V_STAGES) * MBARRIER_BYTES)
    return -(-storage // SWIZZLE_ATOM_BYTES) * SWIZZLE_ATOM_BYTES


def bwd_mma_spec(dtype: str, head_dim: int, head_dim_v: int, arch: str, softcap: bool = False,
                 alibi: bool = False) -> KernelSpec:
    """Rung 4's backward (kernels/mma/bwd.cu): 16 keys per warp, every case the other kernels leave."""
    d, dv = pick_padded(head_dim, FWD_HEAD_DIMS), pick_padded(head_dim_v, FWD_HEAD_DIMS)
    tile = bwd_tile(max(d, dv), arch, softcap or alibi)
    m, n, stages = tile.block_m, tile.block_n, tile.stages
    smem = (n * (d + dv) + stages * m * (d + dv) + n * m) * ELEM_BYTES + 2 * stages * m * 4
    main = ("attn_bwd_dv", "attn_bwd_dkdq") if tile.split else ("attn_bwd",)
    defines = (("FT_HEAD_DIM", d), ("FT_HEAD_DIM_V", dv), ("FT_BLOCK_M", m), ("FT_BLOCK_N", n),
               ("FT_WARPS", tile.warps), ("FT_STAGES", stages), ("FT_SPLIT", int(tile.split)),
               ("FT_SOFTCAP", int(softcap)), ("FT_ALIBI", int(alibi)), *ROW_DEFINES)
    return KernelSpec("mma/bwd.cu", ("attn_bwd_preprocess", *main, "attn_bwd_dq_convert"), dtype, arch, defines,
                      smem)
