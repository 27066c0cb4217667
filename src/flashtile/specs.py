"""Kernel specs: what to compile, named so a person can read the cache directory.

A :class:`KernelSpec` is a frozen description of one NVRTC compilation — a kernel source file, its
entry points, the element type, the compile-time constants and the target architecture. The same spec
feeds run-time compilation (:mod:`flashtile.jit`), the ahead-of-time ``flashtile compile`` command and
the CPU test that compiles every kernel for several architectures (:func:`all_specs`).

Tile sizes live in the tables below, one row per choice, each with the reason for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_DTYPE_DEFINES = {"f32": "FT_DTYPE_F32", "f16": "FT_DTYPE_F16", "bf16": "FT_DTYPE_BF16"}

# Architectures every spec must compile for on a machine without a GPU (tests/test_compile_all.py).
TEST_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")


@dataclass(frozen=True)
class KernelSpec:
    source: str                          # path under flashtile/kernels/, e.g. "ladder/r2_tiled.cu"
    entries: tuple[str, ...]             # extern "C" kernel names in that file
    dtype: str                           # "f32" | "f16" | "bf16"
    arch: str                            # "sm_80", "sm_90a", ...
    defines: tuple[tuple[str, int], ...] = ()

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


# ---------------------------------------------------------------------------------------------------
# Ladder rungs 0-2 (CUDA cores). Head dims are padded up to the nearest compiled variant.
# ---------------------------------------------------------------------------------------------------

LADDER_DTYPES = ("f32", "f16", "bf16")

# Rung 1: each lane of a warp holds head_dim / 32 dims of q and of the output in registers.
FUSED_HEAD_DIMS = (64, 128, 256)

# Rung 2: block M = 64 rows is fixed by the 16 x 16 thread grid with 4 rows per thread.
#   head_dim -> keys per tile (BLOCK_N)
TILED_BLOCK_N = {
    64: 64,    # Q, K, V, P tiles in fp32 = 70 KB of shared memory: three blocks per SM on Ampere and Hopper
    128: 32,   # at 64 keys the tiles need 119 KB, more than the 99 KB an sm_86/sm_89 block may use; 32 keys: 77 KB
}
TILED_MAX_HEAD_DIM = max(TILED_BLOCK_N)


def pick_padded(head_dim: int, choices) -> int:
    for c in sorted(choices):
        if head_dim <= c:
            return c
    raise ValueError(f"head_dim {head_dim} exceeds the largest compiled variant {max(choices)}")


def naive_spec(dtype: str, arch: str) -> KernelSpec:
    return KernelSpec("ladder/r0_naive.cu", ("naive_scores", "naive_softmax", "naive_pv"), dtype, arch)


def fused_spec(dtype: str, head_dim: int, arch: str) -> KernelSpec:
    padded = pick_padded(head_dim, FUSED_HEAD_DIMS)
    return KernelSpec("ladder/r1_fused.cu", ("fused_fwd",), dtype, arch, (("FT_HEAD_DIM", padded),))


def tiled_spec(dtype: str, head_dim: int, arch: str) -> KernelSpec:
    padded = pick_padded(head_dim, TILED_BLOCK_N)
    return KernelSpec("ladder/r2_tiled.cu", ("tiled_fwd",), dtype, arch,
                      (("FT_HEAD_DIM", padded), ("FT_BLOCK_N", TILED_BLOCK_N[padded])))


def all_specs(arch: str) -> list[KernelSpec]:
    """Every spec the library can ask for on `arch` — the list `flashtile compile` builds ahead of time."""
    specs: list[KernelSpec] = []
    for dtype in LADDER_DTYPES:
        specs.append(naive_spec(dtype, arch))
        specs += [fused_spec(dtype, d, arch) for d in FUSED_HEAD_DIMS]
        specs += [tiled_spec(dtype, d, arch) for d in TILED_BLOCK_N]
    return specs


def tiled_smem_bytes(spec: KernelSpec) -> int:
    """Dynamic shared memory of r2_tiled.cu's SharedStorage: fp32 Q, K, V tiles and P, rows padded by 4 floats."""
    defines = dict(spec.defines)
    head_dim, block_n, block_m, pad, fp32 = defines["FT_HEAD_DIM"], defines["FT_BLOCK_N"], 64, 4, 4
    return ((block_m + 2 * block_n) * (head_dim + pad) + block_m * (block_n + pad)) * fp32
