"""torch's scaled_dot_product_attention backends, the peers every flashtile number stands beside."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {
    "sdpa-math": SDPBackend.MATH,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,      # FlashAttention-2 inside torch
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
}


def sdpa_runner(backend: str, q, k, v, causal: bool) -> Callable[[], torch.Tensor] | None:
    """A no-argument callable running one SDPA backend on (b, s, h, d) inputs, or None if it cannot run them.

    Inputs are transposed to SDPA's (b, h, s, d) once, outside the timed call. SDPA's causal mask is
    top-left aligned, so for seqlen_q != seqlen_k causal rows are not comparable and are skipped.
    """
    if causal and q.shape[1] != k.shape[1]:
        return None
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    enable_gqa = q.shape[2] != k.shape[2]

    def run():
        with sdpa_kernel(SDPA_BACKENDS[backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=enable_gqa)

    try:
        run()
        if q.is_cuda:
            torch.cuda.synchronize()
    except RuntimeError:  # backend not built, not supported for this dtype/shape/GPU
        return None
    return run



def sdpa_backward_runner(backend: str, q, k, v, causal: bool) -> Callable[[], object] | None:
    """The same for the backward pass alone: one forward outside the timing, then dQ, dK, dV per call."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    forward = sdpa_runner(backend, *leaves, causal)
    return None if forward is None else backward_runner(forward, leaves)


def backward_runner(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], object] | None:
    """Run `forward` once, keeping its graph; the callable returned reruns only the backward through it."""
    try:
        out = forward()
        dout = torch.randn_like(out)

        def run():
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

        run()
        torch.cuda.synchronize()
    except RuntimeError:  # no backward for this backend, dtype or shape
        return None
    return run
