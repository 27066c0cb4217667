"""The ladder: attention kernels from naive to state of the art, in order, each runnable and tested.

Every rung is a :class:`Rung`: its number and name, what it can serve, the specs it compiles and a
``run`` that launches it on a :class:`~flashtile.forward.FwdProblem`. ``flashtile check`` tests each rung
against the reference, ``flashtile bench ladder`` times them side by side, docs/ladder.md tells their story.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from . import launch, specs, tma
from .forward import FwdProblem

THREADS_NAIVE = 256      # r0_naive.cu kThreadsPerBlock
MAX_GRID_X = 2**31 - 1   # grid-stride loops cover whatever a grid of this many blocks does not
WARPS_FUSED = 4          # r1_fused.cu kWarpsPerBlock: query rows per block
THREADS_FUSED = WARPS_FUSED * 32
BLOCK_M_TILED = 64       # r2_tiled.cu kBlockM
THREADS_TILED = 256
BLOCK_M_MMA = 64         # r3_mma.cu kBlockM = 4 warps x 16 rows
THREADS_MMA = 128
WARP = 32


@dataclass(frozen=True)
class Rung:
    number: int
    name: str
    summary: str
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int
    features: frozenset[str]            # options beyond plain attention: "window", "varlen", "softcap", "alibi"
    spec_for: Callable[[FwdProblem, str], specs.KernelSpec]   # (problem, arch) -> the spec that serves it
    launch: Callable[[FwdProblem, launch.LoadedModule], tuple[torch.Tensor, torch.Tensor | None]]
    min_capability: tuple[int, int] = (7, 5)
    # For rungs that are one kernel: (problem, module) -> (entry, grid, threads, dynamic smem). api.py
    # caches it per input signature, so a repeated call is one launch.
    geometry: Callable[[FwdProblem, launch.LoadedModule], tuple] | None = None

    def unsupported(self, problem: FwdProblem) -> str | None:
        """Why this rung cannot serve `problem`, or None if it can."""
        if problem.q.dtype not in self.dtypes:
            return f"rung {self.name!r} supports dtypes {[str(d) for d in self.dtypes]}, not {problem.q.dtype}"
        if max(problem.head_dim, problem.head_dim_v) > self.max_head_dim:
            return f"rung {self.name!r} supports head_dim up to {self.max_head_dim}"
        for feature, used in (("window", problem.window[0] >= 0 or problem.window[1] > 0),
                              ("softcap", problem.softcap > 0), ("alibi", problem.alibi_slopes is not None),
                              ("varlen", problem.varlen)):
            if used and feature not in self.features:
                return f"rung {self.name!r} does not support {feature}"
        if device_capability(problem.q.device.index) < self.min_capability:
            return f"rung {self.name!r} needs compute capability {self.min_capability} or newer"
        return None

    def run(self, problem: FwdProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.launch(problem, module_for(self, problem))


@functools.cache
def device_capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


_modules: dict[tuple, launch.LoadedModule] = {}


def module_for(rung: Rung, problem: FwdProblem) -> launch.LoadedModule:
    """The loaded kernels of `rung` for this problem on its device (memoised: this is the hot path)."""
    device = problem.q.device.index
    key = (rung.number, problem.q.dtype, problem.head_dim, problem.head_dim_v, problem.softcap > 0,
           problem.alibi_slopes is not None, device)
    module = _modules.get(key)
    if module is None:
        spec = rung.spec_for(problem, specs.arch_of(device_capability(device)))
        module = _modules[key] = launch.load(spec, device)
    return module


def _dims(problem: FwdProblem) -> int:
    return max(problem.head_dim, problem.head_dim_v)


def _dtype(problem: FwdProblem) -> str:
    return specs.DTYPES[problem.q.dtype]


def _launch_naive(problem: FwdProblem, module: launch.LoadedModule):
    kernels = module.kernels
    o, lse = problem.empty_outputs()
    n_rows = problem.batch * problem.heads_q * problem.seqlen_q
    scores = torch.empty(n_rows * problem.seqlen_k, dtype=torch.float32, device=problem.q.device)
    params = problem.params(o, lse, scores=scores)

    def blocks(n: int) -> tuple[int, int, int]:
        return (min(-(-n // THREADS_NAIVE), MAX_GRID_X), 1, 1)

    launch.launch(kernels["naive_scores"], blocks(scores.numel()), THREADS_NAIVE, 0, params)
    launch.launch(kernels["naive_softmax"], blocks(n_rows), THREADS_NAIVE, 0, params)
    launch.launch(kernels["naive_pv"], blocks(n_rows * problem.head_dim_v), THREADS_NAIVE, 0, params)
    return o, lse


def _grid_geometry(entry: str, block_m: int, threads: int):
    """Geometry of the rungs that are one kernel over a (query blocks, heads, batch) grid."""
    def geometry(problem: FwdProblem, module: launch.LoadedModule):
        grid = (-(-problem.seqlen_q // block_m), problem.heads_q, problem.batch)
        return entry, grid, threads, module.spec.smem_bytes
    return geometry


def _pipelined_geometry(problem: FwdProblem, module: launch.LoadedModule):
    defines = dict(module.spec.defines)
    return _grid_geometry("attn_fwd", defines["FT_BLOCK_M"], defines["FT_WARPS"] * WARP)(problem, module)


@functools.cache
def kv_box_rows(spec: specs.KernelSpec) -> int | None:
    """What the pipelined kernel takes beside its params (tma.kernel_argument): None for the other kernels,
    0 for builds that load K/V with cp.async, else the rows of a K/V box for the tensor memory accelerator."""
    if spec.source != specs.PIPELINED_SOURCE:
        return None
    defines = dict(spec.defines)
    return defines["FT_BLOCK_N"] if defines["FT_TMA_KV"] else 0


def _one_kernel(geometry):
    def launch_it(problem: FwdProblem, module: launch.LoadedModule):
        o, lse = problem.empty_outputs()
        entry, grid, threads, smem = geometry(problem, module)
        launch.launch(module.kernels[entry], grid, threads, smem, problem.params(o, lse),
                      extra=tma.kernel_argument(problem.k, problem.v, kv_box_rows(module.spec)))
        return o, lse
    return launch_it


_FUSED = _grid_geometry("fused_fwd", WARPS_FUSED, THREADS_FUSED)
_TILED = _grid_geometry("tiled_fwd", BLOCK_M_TILED, THREADS_TILED)
_MMA = _grid_geometry("mma_fwd", BLOCK_M_MMA, THREADS_MMA)
_CUDA_CORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
_BASIC = frozenset({"window"})
_ALL = frozenset({"window", "varlen", "softcap", "alibi"})
_AMPERE = (8, 0)

RUNGS: tuple[Rung, ...] = (
    Rung(0, "naive", "S = QK^T in global memory, softmax in place, O = PV: three kernels",
         _CUDA_CORE_DTYPES, 256, _BASIC, lambda pr, arch: specs.naive_spec(_dtype(pr), arch), _launch_naive),
    Rung(1, "fused", "one kernel, online softmax, one warp per query row",
         _CUDA_CORE_DTYPES, max(specs.FUSED_HEAD_DIMS), _BASIC | {"varlen"},
         lambda pr, arch: specs.fused_spec(_dtype(pr), _dims(pr), arch),
         _one_kernel(_FUSED), geometry=_FUSED),
    Rung(2, "tiled", "Q/K/V tiles in shared memory, fp32 on CUDA cores",
         _CUDA_CORE_DTYPES, specs.TILED_MAX_HEAD_DIM, _BASIC | {"varlen"},
         lambda pr, arch: specs.tiled_spec(_dtype(pr), _dims(pr), arch),
         _one_kernel(_TILED), geometry=_TILED),
    Rung(3, "mma", "tensor cores (mma.sync), FlashAttention-2 work split, synchronous loads",
         _TENSOR_CORE_DTYPES, max(specs.MMA_HEAD_DIMS), _BASIC | {"varlen"},
         lambda pr, arch: specs.mma_spec(_dtype(pr), _dims(pr), arch),
         _one_kernel(_MMA), _AMPERE, _MMA),
    Rung(4, "pipelined", "cp.async pipeline, swizzled smem, exp2 softmax, every forward feature",
         _TENSOR_CORE_DTYPES, max(specs.FWD_HEAD_DIMS), _ALL,
         lambda pr, arch: specs.fwd_spec(_dtype(pr), pr.head_dim, pr.head_dim_v, arch,
                                         softcap=pr.softcap > 0, alibi=pr.alibi_slopes is not None),
         _one_kernel(_pipelined_geometry), _AMPERE, _pipelined_geometry),
)
BY_NAME = {r.name: r for r in RUNGS}


def get(rung: str | int) -> Rung:
    """A rung by name or number; ValueError listing the choices otherwise."""
    for r in RUNGS:
        if rung == r.name or (isinstance(rung, int) and not isinstance(rung, bool) and rung == r.number):
            return r
    choices = ", ".join(f"{r.number}/{r.name!r}" for r in RUNGS)
    raise ValueError(f"rung must be 'auto' or one of {choices}; got {rung!r}")


def best_for(problem: FwdProblem) -> Rung:
    """The fastest rung that serves `problem` on its device (the 'auto' choice)."""
    reasons = []
    for r in reversed(RUNGS):
        why_not = r.unsupported(problem)
        if why_not is None:
            return r
        reasons.append(why_not)
    raise ValueError("no kernel serves these inputs: " + "; ".join(reasons))
