"""The backward pass on CUDA: the kernels (specs.bwd_spec picks them: kernels/sm90/bwd.cu on Hopper, rung 4's
kernels/sm80/bwd.cu and bwd_grid.cu otherwise) and the buffers around them.

Three launches: a preprocess over query rows (D = rowsum(dO * O), the LSE in base 2, the fp32 dQ
accumulator zeroed), the main kernel over key tiles (one launch, or two for sm80/bwd.cu past head dim 128:
dV, then dK and dQ), and the conversion of the dQ accumulator to the dtype of q.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import launch, specs
from .forward import FwdProblem
from .ladder import device_capability

ROW_WARPS = 4           # bwd_common.cuh kRowWarps: warps per block of the two row kernels
ROWS_PER_BLOCK = 16     # bwd_common.cuh kPreprocessRows
WARP = 32
DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)  # mma.sync and cp.async
SCRATCH_LIMIT_BYTES = 64 * 2**20  # the fp32 dQ accumulator's budget: beyond it, heads go in groups
FP32_BYTES = 4


def unsupported(problem: FwdProblem) -> str | None:
    """Why the CUDA backward kernels cannot serve `problem` (the caller then differentiates the chunked path)."""
    if problem.q.dtype not in DTYPES:
        return f"the backward kernels take float16/bfloat16, not {problem.q.dtype}"
    if device_capability(problem.q.device.index) < MIN_CAPABILITY:
        return f"the backward kernels need compute capability {MIN_CAPABILITY} or newer"
    return None


_modules: dict[tuple, launch.LoadedModule] = {}


def _module(problem: FwdProblem) -> launch.LoadedModule:
    device = problem.q.device.index
    key = (problem.q.dtype, problem.head_dim, problem.head_dim_v, problem.softcap > 0,
           problem.alibi_slopes is not None, device)
    module = _modules.get(key)
    if module is None:
        spec = specs.bwd_spec(specs.DTYPES[problem.q.dtype], problem.head_dim, problem.head_dim_v,
                              specs.arch_of(device_capability(device)), softcap=problem.softcap > 0,
                              alibi=problem.alibi_slopes is not None)
        module = _modules[key] = launch.load(spec, device)
    return module


def _strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements; packed varlen tensors have no batch stride."""
    return (0, *t.stride()[:2]) if varlen else t.stride()[:3]


def empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gradient buffers the kernels write (tests poison them with NaN)."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def cuda_backward(problem: FwdProblem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                  deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of the attention `problem` (q/k/v already kernel-ready) given the forward's out and lse.

    `out` and `dout` have the (padded) head dim of v; `lse` is the forward's. The fp32 dQ accumulator is
    the one large scratch buffer; past SCRATCH_LIMIT_BYTES the heads are processed in groups so that it
    stays bounded (training at long sequence lengths then needs little more than its own tensors).
    """
    module = _module(problem)
    head_dim = dict(module.spec.defines)["FT_HEAD_DIM"]
    grads = empty_grads(problem.q, problem.k, problem.v)
    group = problem.heads_q // problem.heads_kv
    accum_bytes_per_kv_head = lse.numel() // problem.heads_q * group * head_dim * FP32_BYTES
    chunk = max(1, SCRATCH_LIMIT_BYTES // accum_bytes_per_kv_head)
    if chunk >= problem.heads_kv:
        _launch(module, problem, out, lse.contiguous(), dout, grads, deterministic)
        return grads
    for h0 in range(0, problem.heads_kv, chunk):
        kv, qh = slice(h0, h0 + chunk), slice(h0 * group, (h0 + chunk) * group)
        slopes = problem.alibi_slopes[..., qh] if problem.alibi_slopes is not None else None
        part = dataclasses.replace(problem, q=problem.q[..., qh, :], k=problem.k[..., kv, :], v=problem.v[..., kv, :],
                                   alibi_slopes=slopes)
        part_lse = (lse[qh] if problem.varlen else lse[:, qh]).contiguous()
        part_grads = (grads[0][..., qh, :], grads[1][..., kv, :], grads[2][..., kv, :])
        _launch(module, part, out[..., qh, :], part_lse, dout[..., qh, :], part_grads, deterministic)
    return grads


def _launch(module: launch.LoadedModule, problem: FwdProblem, out, lse, dout, grads, deterministic: bool) -> None:
    defines = dict(module.spec.defines)
    block_m, block_n, warps = defines["FT_BLOCK_M"], defines["FT_BLOCK_N"], defines["FT_WARPS"]
    q = problem.q
    varlen = problem.varlen
    dq, dk, dv = grads
    rows = torch.empty((2, *lse.shape), dtype=torch.float32, device=q.device)  # D and the base-2 LSE
    dq_accum = torch.empty(lse.numel() * defines["FT_HEAD_DIM"], dtype=torch.float32, device=q.device)
    m_blocks = math.ceil(problem.seqlen_q / block_m)
    semaphore = (torch.zeros(problem.batch * problem.heads_q * m_blocks, dtype=torch.int32, device=q.device)
                 if deterministic else None)

    params = problem.params(out, lse) + (
        dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
        dq_accum.data_ptr(), rows[0].data_ptr(), rows[1].data_ptr(),
        semaphore.data_ptr() if semaphore is not None else 0,
        *_strides(dout, varlen), *_strides(dq, varlen), *_strides(dk, varlen), *_strides(dv, varlen),
        m_blocks,
    )
    kernels = module.kernels
    row_grid = (math.ceil(problem.seqlen_q / ROWS_PER_BLOCK), problem.heads_q, problem.batch)
    key_grid = (math.ceil(problem.seqlen_k / block_n), problem.heads_kv, problem.batch)
    layout = launch.BWD_PARAMS_STRUCT
    launch.launch(kernels["attn_bwd_preprocess"], row_grid, ROW_WARPS * WARP, 0, params, layout)
    for entry in module.spec.entries[1:-1]:  # attn_bwd, or attn_bwd_dv then attn_bwd_dkdq
        launch.launch(kernels[entry], key_grid, warps * WARP, module.spec.smem_bytes, params, layout)
    launch.launch(kernels["attn_bwd_dq_convert"], row_grid, ROW_WARPS * WARP, 0, params, layout)
