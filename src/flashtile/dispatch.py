"""From a checked problem to the kernels that run it: operand alignment, the registry's choice, the plans, and
the calls that api.py keeps per input signature.

A :class:`PlannedCall` is a signature's forward plan and, when the signature wants gradients, its backward plan
(both built on the first call): a repeated call with the same shapes, strides, dtypes and options costs one lookup
plus its launches, in training as in inference. :func:`forward` and :func:`backward` are the general path every other call takes (operands that
must be padded or copied first, packed varlen batches, the CPU); the torch.library ops (ops.py) call them too.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import backward as bwd
from . import host, launch, plans, reference, registry, specs
from .family import Variant
from .forward import MAX_GRID_BATCH, FwdProblem
from .ladder import device_capability

HEAD_DIM_MULTIPLE = 8        # GPU kernels load 16 bytes at a time: head dims are padded to a multiple of 8
ALIGN_BYTES = plans.ALIGN_BYTES


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


def bounded_offsets(problem: FwdProblem) -> FwdProblem:
    """A varlen problem whose cu_seqlens cannot send a kernel outside the packed tensors: offsets clamped to
    [0, total] and made non-decreasing, on the device (two small torch ops, no host synchronisation). api.py
    names bad offsets in eager mode; under torch.compile and graph capture they are never read on the host."""
    if not problem.varlen:
        return problem
    bounded = [torch.cummax(cu.clamp(0, total), 0).values.to(torch.int32)
               for cu, total in ((problem.cu_seqlens_q, problem.q.shape[0]), (problem.cu_seqlens_k, problem.k.shape[0]))]
    return dataclasses.replace(problem, cu_seqlens_q=bounded[0], cu_seqlens_k=bounded[1])


def variant_of(problem: FwdProblem, direction: str, deterministic: bool = False) -> Variant:
    return Variant.of(problem, direction, specs.arch_of(device_capability(problem.q.device.index)), deterministic)


def load(problem: FwdProblem, direction: str, rung="auto", deterministic: bool = False):
    """(family, loaded module) serving `problem` on its device (`deterministic`: for a bitwise repeatable
    backward)."""
    family, spec = registry.choose(variant_of(problem, direction, deterministic), rung)
    return family, launch.load(spec, problem.q.device.index)


def _cuda_forward(problem: FwdProblem, rung) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pad/align the operands, run the chosen family's plan, cut the padding off the output."""
    head_dim_v = problem.v.shape[-1]
    problem = bounded_offsets(dataclasses.replace(problem, q=kernel_ready(problem.q), k=kernel_ready(problem.k),
                                                  v=kernel_ready(problem.v)))
    family, module = load(problem, "fwd", rung)
    if problem.batch <= MAX_GRID_BATCH:
        o, lse = family.plan(problem, module).run(problem.q, problem.k, problem.v, problem.cu_seqlens_q,
                                                  problem.cu_seqlens_k, problem.alibi_slopes)
    else:
        o, lse = plans.empty_outputs(problem.q, problem.out_shape(), problem.lse_shape())
        for b0, b1, part in problem.batch_parts():
            outputs = (o, lse) if problem.varlen else (o[b0:b1], None if lse is None else lse[b0:b1])
            family.plan(part, module, outputs).run(part.q, part.k, part.v, part.cu_seqlens_q, part.cu_seqlens_k,
                                                   part.alibi_slopes, out=outputs)
    return (o[..., :head_dim_v] if o.shape[-1] != head_dim_v else o), lse


def forward(problem: FwdProblem, rung="auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) of a checked problem on its device: CUDA kernels, or the chunked PyTorch path on the CPU."""
    if problem.q.is_cuda:
        return _cuda_forward(problem, rung)
    options = dict(causal=False, softmax_scale=problem.scale, window_size=problem.window, softcap=problem.softcap,
                   alibi_slopes=problem.alibi_slopes)
    if problem.varlen:
        return reference.varlen_apply(reference.attention_chunked, problem.q, problem.k, problem.v,
                                      problem.cu_seqlens_q, problem.cu_seqlens_k, **options)
    return reference.attention_chunked(problem.q, problem.k, problem.v, **options)


def backward(problem: FwdProblem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, deterministic: bool,
             dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a checked problem, shaped like q, k, v (dk/dv summed over each GQA group); `dlse` is the
    gradient of the returned log-sum-exp, None when the loss does not use it."""
    q, k, v = problem.q, problem.k, problem.v
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if q.is_cuda and _backward_kernels_serve(problem):
        ready = bounded_offsets(dataclasses.replace(problem, q=kernel_ready(q), k=kernel_ready(k), v=kernel_ready(v)))
        _, module = load(ready, "bwd", deterministic=deterministic)
        dq, dk, dv = bwd.run(ready, module, kernel_ready(out), lse.contiguous(), kernel_ready(dout), deterministic,
                             dlse)
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
    options = dict(causal=False, softmax_scale=problem.scale, window_size=problem.window, softcap=problem.softcap,
                   alibi_slopes=problem.alibi_slopes)
    if problem.varlen:
        return reference.varlen_apply_backward(dout, q, k, v, out, lse, problem.cu_seqlens_q, problem.cu_seqlens_k,
                                               dlse=dlse, **options)
    return reference.attention_chunked_backward(dout, q, k, v, out, lse, dlse=dlse, **options)


def _backward_kernels_serve(problem: FwdProblem) -> bool:
    """Whether a CUDA backward kernel serves the problem; fp32 and pre-Ampere GPUs take the chunked path."""
    return any(why is None for _, why in registry.reasons(variant_of(problem, "bwd")))


class PlannedCall:
    """One input signature's plans: the forward's, and the backward's when the call is differentiated. It holds
    no tensors: every call brings its own."""

    __slots__ = ("forward_plan", "backward_plan", "host")

    def __init__(self, forward_plan: plans.FwdPlan, backward_plan: plans.BwdPlan | None, device: int):
        self.forward_plan = forward_plan
        self.backward_plan = backward_plan
        # The same plans replayed in C++ (host.py), or None where the Python path runs them.
        self.host = (host.forward_of(forward_plan, backward_plan, device)
                     if isinstance(forward_plan, plans.FwdPlan) else None)

    @staticmethod
    def serves(q, k, v) -> bool:
        """Whether this call's kernels can read these operands: their base addresses are 16-byte aligned (the
        strides were checked when the call was planned). Otherwise the full path copies them."""
        return not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGN_BYTES

    def forward(self, q, k, v):
        if self.host is not None:
            return self.host.run(q, k, v)
        return self.forward_plan.run(q, k, v)

    def backward(self, dout, q, k, v, out, lse, dlse=None):
        return self.backward_plan.run(dout, q, k, v, out, lse, dlse=dlse)


def planned_call(problem: FwdProblem, rung, deterministic: bool, want_grad: bool) -> PlannedCall | None:
    """The call to keep for a dense, ALiBi-free problem whose operands the kernels take as they are, or None
    (the general path then serves every call with this signature)."""
    q, k, v = problem.q, problem.k, problem.v
    if (not q.is_cuda or problem.varlen or problem.alibi_slopes is not None or problem.batch > MAX_GRID_BATCH
            or any(kernel_ready(t) is not t for t in (q, k, v))):
        return None
    family, module = load(problem, "fwd", rung)
    forward_plan = family.plan(problem, module)
    if not want_grad:
        return PlannedCall(forward_plan, None, q.device.index)
    if not _backward_kernels_serve(problem):
        return None
    _, bwd_module = load(problem, "bwd", deterministic=deterministic)
    out, lse = plans.empty_outputs(q, problem.out_shape(), problem.lse_shape())
    backward_plan = bwd.plan(problem, bwd_module, out, lse, out, plans.empty_grads(q, k, v), deterministic)
    return PlannedCall(forward_plan, backward_plan, q.device.index)


class GeneralCall:
    """A call the general path serves (the CPU's, and CUDA calls no plan takes): the checked problem's options;
    each run brings its own q, k, v."""

    __slots__ = ("problem", "deterministic", "rung", "cpu_kernel", "host")

    def __init__(self, problem: FwdProblem, deterministic: bool, rung="auto", cpu_kernel=None, lse_returned=False):
        self.problem = problem
        self.deterministic = deterministic
        self.rung = rung
        # On the CPU, host.cpu_kernel_of's C++ calls of torch's kernel where it serves; None: the Python path.
        self.cpu_kernel = cpu_kernel
        # The C++ node in training (ops.attention), where the LSE is not returned: its gradient has no path through
        # the kernel. None: ops.Attention runs this call's backward.
        self.host = cpu_kernel if cpu_kernel is not None and not lse_returned else None

    @staticmethod
    def serves(q, k, v) -> bool:
        """Whether a call kept for its signature may run these operands: on the CPU, every one (a signature's
        device index does not tell the CPU from other devices without one, such as meta)."""
        return q.is_cpu

    def forward(self, q, k, v):
        if self.cpu_kernel is not None:
            result = self.cpu_kernel.forward(q, k, v)
            if result is not None:  # None: an input holds a NaN or an Inf, which the Python path's rules take
                return result
        return forward(self.problem.on(q, k, v), self.rung)

    def backward(self, dout, q, k, v, out, lse, dlse=None):
        if self.cpu_kernel is not None:
            result = self.cpu_kernel.backward(dout, q, k, v, out, lse, dlse)
            if result is not None:  # None: a NaN or Inf, or a dLSE term, that torch's kernel cannot take
                return result
        return backward(self.problem.on(q, k, v), out, lse, dout, self.deterministic, dlse)
