"""The ladder: attention kernels from naive to state of the art, in order, each runnable and tested.

Every rung is a :class:`Rung`: its number and name, what it can serve, the specs it compiles and a
``run`` that launches it on a :class:`~flashtile.forward.FwdProblem`. ``flashtile check`` tests each rung
against the reference, ``flashtile bench ladder`` times them side by side, docs/ladder.md tells their story.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import launch, specs
from .forward import FwdProblem

THREADS_NAIVE = 256      # r0_naive.cu kThreadsPerBlock
MAX_GRID_X = 2**31 - 1   # grid-stride loops cover whatever a grid of this many blocks does not
WARPS_FUSED = 4          # r1_fused.cu kWarpsPerBlock: query rows per block
THREADS_FUSED = WARPS_FUSED * 32
BLOCK_M_TILED = 64       # r2_tiled.cu kBlockM
THREADS_TILED = 256


@dataclass(frozen=True)
class Rung:
    number: int
    name: str
    summary: str
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int
    features: frozenset[str]            # options beyond plain attention: "causal", "window", "gqa", ...
    specs: Callable[[str, int, str], list[specs.KernelSpec]]   # (dtype, head_dim, arch) -> specs
    run: Callable[[FwdProblem], tuple[torch.Tensor, torch.Tensor | None]]
    min_capability: tuple[int, int] = (7, 5)

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
        return None


def _arch_and_device(problem: FwdProblem) -> tuple[str, int]:
    device = problem.q.device.index if problem.q.device.index is not None else torch.cuda.current_device()
    return specs.arch_of(torch.cuda.get_device_capability(device)), device


def _run_naive(problem: FwdProblem):
    arch, device = _arch_and_device(problem)
    kernels = launch.load(specs.naive_spec(specs.DTYPES[problem.q.dtype], arch), device).kernels
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


def _run_fused(problem: FwdProblem):
    arch, device = _arch_and_device(problem)
    dim = max(problem.head_dim, problem.head_dim_v)
    kernel = launch.load(specs.fused_spec(specs.DTYPES[problem.q.dtype], dim, arch), device).kernels["fused_fwd"]
    o, lse = problem.empty_outputs()
    grid = (-(-problem.seqlen_q // WARPS_FUSED), problem.heads_q, problem.batch)
    launch.launch(kernel, grid, THREADS_FUSED, 0, problem.params(o, lse))
    return o, lse


def _run_tiled(problem: FwdProblem):
    arch, device = _arch_and_device(problem)
    dim = max(problem.head_dim, problem.head_dim_v)
    spec = specs.tiled_spec(specs.DTYPES[problem.q.dtype], dim, arch)
    kernel = launch.load(spec, device).kernels["tiled_fwd"]
    o, lse = problem.empty_outputs()
    grid = (-(-problem.seqlen_q // BLOCK_M_TILED), problem.heads_q, problem.batch)
    launch.launch(kernel, grid, THREADS_TILED, specs.tiled_smem_bytes(spec), problem.params(o, lse))
    return o, lse


_CUDA_CORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BASIC = frozenset({"causal", "window", "gqa"})

RUNGS: tuple[Rung, ...] = (
    Rung(0, "naive", "S = QK^T in global memory, softmax in place, O = PV: three kernels",
         _CUDA_CORE_DTYPES, 256, _BASIC, lambda dt, d, arch: [specs.naive_spec(dt, arch)], _run_naive),
    Rung(1, "fused", "one kernel, online softmax, one warp per query row",
         _CUDA_CORE_DTYPES, max(specs.FUSED_HEAD_DIMS), _BASIC | {"varlen"},
         lambda dt, d, arch: [specs.fused_spec(dt, d, arch)], _run_fused),
    Rung(2, "tiled", "Q/K/V tiles in shared memory, fp32 on CUDA cores",
         _CUDA_CORE_DTYPES, specs.TILED_MAX_HEAD_DIM, _BASIC | {"varlen"},
         lambda dt, d, arch: [specs.tiled_spec(dt, d, arch)], _run_tiled),
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
    capability = torch.cuda.get_device_capability(problem.q.device)
    for r in reversed(RUNGS):
        if capability >= r.min_capability and r.unsupported(problem) is None:
            return r
    raise ValueError(RUNGS[-1].unsupported(problem))
