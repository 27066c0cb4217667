"""From a checked problem to a kernel: operand alignment, the choice of rung, the forward launch.

api.py checks arguments and ops.py defines the autograd-aware torch ops; both come here to run the
forward on CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import ladder, launch, tma
from .forward import FwdProblem

HEAD_DIM_MULTIPLE = 8        # GPU kernels load 16 bytes at a time: head dims are padded to a multiple of 8
ALIGN_BYTES = 16


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """Make 16-byte vector loads legal: head dim a multiple of 8 (zero padding), aligned base and strides;
    and every dimension describable by a tensor map (tma.py): none broadcast with a zero stride."""
    if t.shape[-1] % HEAD_DIM_MULTIPLE:
        return F.pad(t, (0, -t.shape[-1] % HEAD_DIM_MULTIPLE))  # a fresh, contiguous, aligned tensor
    strides = t.stride()
    any_stride = strides[0] | strides[1] | (strides[2] if len(strides) == 4 else 0)
    if (any_stride * t.element_size() | t.data_ptr()) % ALIGN_BYTES:  # some stride or the base is misaligned
        return t.clone(memory_format=torch.contiguous_format)
    if 0 in strides[:-1] and any(s == 0 and n > 1 for n, s in zip(t.shape[:-1], strides[:-1])):
        return t.clone(memory_format=torch.contiguous_format)
    return t


# (rung argument, dtype, head dims, features, device) -> (rung, loaded kernels): the per-call dispatch is one
# dictionary lookup once a configuration has been seen.
_dispatch: dict[tuple, tuple] = {}


def _dispatch_key(problem: FwdProblem, rung) -> tuple:
    window = problem.window
    return (rung, problem.q.dtype, problem.q.shape[-1], problem.v.shape[-1], window[0] >= 0 or window[1] > 0,
            problem.softcap > 0, problem.alibi_slopes is not None, problem.cu_seqlens_q is not None,
            problem.q.device.index)


def cuda_forward(problem: FwdProblem, rung):
    """Pad/align the operands, run the chosen rung, cut the padding off the output."""
    head_dim_v = problem.v.shape[-1]
    problem.q, problem.k, problem.v = kernel_ready(problem.q), kernel_ready(problem.k), kernel_ready(problem.v)
    key = _dispatch_key(problem, rung)
    hit = _dispatch.get(key)
    if hit is None:
        if rung == "auto":
            chosen = ladder.best_for(problem)
        else:
            chosen = ladder.get(rung)
            why_not = chosen.unsupported(problem)
            if why_not:
                raise ValueError(why_not)
        hit = _dispatch[key] = (chosen, ladder.module_for(chosen, problem))
    chosen, module = hit
    o, lse = chosen.launch(problem, module)
    return (o[..., :head_dim_v] if o.shape[-1] != head_dim_v else o), lse


# The first PARAM_FIELDS are the tensors' addresses; everything after them is fixed by shapes and options.
ADDRESS_FIELDS = 9
assert all(fmt == "Q" for _, fmt in launch.PARAM_FIELDS[:ADDRESS_FIELDS])


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """A forward call with every decision made; from call to call only the tensors' addresses change."""

    kernel: launch.LoadedKernel
    grid: tuple[int, int, int]
    threads: int
    smem: int
    out_shape: tuple[int, ...] | None   # None: the output is torch.empty_like(q)
    lse_shape: tuple[int, ...] | None   # None: no LSE wanted
    tail: tuple                         # the params after the address fields
    kv_box_rows: int | None             # the kernel's second argument (ladder.kv_box_rows)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(out, lse), or None when an address breaks 16-byte alignment (the full path copies then)."""
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (qp | kp | vp) % ALIGN_BYTES:
            return None
        o = torch.empty_like(q) if self.out_shape is None else q.new_empty(self.out_shape)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        launch.launch(self.kernel, self.grid, self.threads, self.smem,
                      (qp, kp, vp, o.data_ptr(), 0 if lse is None else lse.data_ptr(), 0, 0, 0, 0) + self.tail,
                      extra=tma.kernel_argument(k, v, self.kv_box_rows))
        return o, lse


def plan_for(problem: FwdProblem, rung) -> LaunchPlan | None:
    """The plan of a dense, ALiBi-free problem that cuda_forward just ran without copying its operands."""
    chosen, module = _dispatch[_dispatch_key(problem, rung)]
    if chosen.geometry is None or problem.varlen or problem.alibi_slopes is not None:
        return None
    o, lse = problem.empty_outputs()
    entry, grid, threads, smem = chosen.geometry(problem, module)
    same_dims = problem.head_dim == problem.head_dim_v
    return LaunchPlan(module.kernels[entry], grid, threads, smem, None if same_dims else tuple(o.shape),
                      None if lse is None else tuple(lse.shape), problem.params(o, lse)[ADDRESS_FIELDS:],
                      ladder.kv_box_rows(module.spec))
