"""Correctness checks shared by the test suite and ``flashtile check``.

The rule is FlashAttention's: a kernel's error against an fp64 reference may be at most twice the error
PyTorch itself makes computing the same attention in the inputs' precision, plus a small floor for cases
where PyTorch happens to be exact. NaN never passes; the positions of -inf in the LSE must match exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import attention_ref

ERROR_RATIO = 2.0
ABS_FLOOR = 1e-5


@dataclass
class Comparison:
    out_error: float         # max |ours - fp64 reference|
    out_error_torch: float   # max |PyTorch in the input dtype - fp64 reference|
    lse_error: float = 0.0
    lse_error_torch: float = 0.0
    lse_inf_mismatch: bool = False
    finite: bool = True

    @property
    def ok(self) -> bool:
        return (self.finite and not self.lse_inf_mismatch
                and self.out_error <= ERROR_RATIO * self.out_error_torch + ABS_FLOOR
                and self.lse_error <= ERROR_RATIO * self.lse_error_torch + ABS_FLOOR)

    def __str__(self) -> str:
        return (f"out err {self.out_error:.2e} (torch {self.out_error_torch:.2e}), "
                f"lse err {self.lse_error:.2e} (torch {self.lse_error_torch:.2e})"
                + ("" if self.finite else ", NON-FINITE OUTPUT")
                + (", -inf LSE MISMATCH" if self.lse_inf_mismatch else ""))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def compare(q, k, v, out, lse=None, **options) -> Comparison:
    """Compare a kernel's `out` (and `lse`) with the fp64 reference, scaled by PyTorch's own error."""
    ref_out, ref_lse = attention_ref(q, k, v, dtype=torch.float64, **options)
    torch_out, torch_lse = attention_ref(q, k, v, dtype=q.dtype, **options)
    result = Comparison(_max_abs(out, ref_out), _max_abs(torch_out, ref_out),
                        finite=bool(torch.isfinite(out).all()))
    if lse is not None:
        ref_inf = torch.isinf(ref_lse)
        result.lse_inf_mismatch = bool((torch.isinf(lse) != ref_inf).any() or (lse[ref_inf] > 0).any())
        result.finite = result.finite and not bool(torch.isnan(lse).any())
        seen = ~ref_inf
        result.lse_error = _max_abs(lse[seen], ref_lse[seen])
        result.lse_error_torch = _max_abs(torch_lse.float()[seen], ref_lse[seen])
    return result


@dataclass
class GradComparison:
    errors: dict[str, tuple[float, float]]   # "dq"/"dk"/"dv" -> (max |ours - fp64|, max |PyTorch - fp64|)
    finite: bool = True

    @property
    def ok(self) -> bool:
        return self.finite and all(ours <= ERROR_RATIO * theirs + ABS_FLOOR for ours, theirs in self.errors.values())

    def __str__(self) -> str:
        parts = [f"{name} err {ours:.2e} (torch {theirs:.2e})" for name, (ours, theirs) in self.errors.items()]
        return ", ".join(parts) + ("" if self.finite else ", NON-FINITE GRADIENT")


def reference_grads(fn, q, k, v, dout, dtype, dlse=None, **options) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of `fn(q, k, v, dtype=dtype, **options)` (an attention_ref-like function returning out and lse)
    by autograd, with `dout` the gradient of out and `dlse` (if given) that of lse."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, dtype=dtype, **options)
    if dlse is None:
        return torch.autograd.grad(out, leaves, dout.to(dtype))
    return torch.autograd.grad((out, lse), leaves, (dout.to(dtype), dlse.to(dtype)))


def compare_grads(q, k, v, dout, grads, fn=attention_ref, dlse=None, **options) -> GradComparison:
    """Compare a kernel's (dq, dk, dv) with fp64 autograd of the reference, scaled by PyTorch's own error.
    `dlse`: the gradient the loss sends to the returned log-sum-exp, if it uses it."""
    ref = reference_grads(fn, q, k, v, dout, torch.float64, dlse, **options)
    theirs = reference_grads(fn, q, k, v, dout, q.dtype, dlse, **options)
    errors = {name: (_max_abs(ours, r), _max_abs(t, r))
              for name, ours, r, t in zip(("dq", "dk", "dv"), grads, ref, theirs)}
    return GradComparison(errors, finite=all(bool(torch.isfinite(g).all()) for g in grads))
