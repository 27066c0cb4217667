"""Autograd checks shared by the CPU path's tests (test_ops.py) and the C++ host path's (test_host_gpu.py)."""

import pytest
import torch

import flashtile


def check_create_graph_refuses_a_second_order(q, k, v, dout):
    """The first backward is the same with or without create_graph (dout requires grad, so the gradients join the
    graph); differentiating it again is a clear error, never a silently wrong (disconnected) second derivative.
    Deterministic mode, so that "the same" can be bitwise: the default CUDA backward adds dQ with atomics, whose
    order (and so dQ's last bit) may change from one call to the next."""
    plain = torch.autograd.grad(flashtile.attention(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    recorded = torch.autograd.grad(flashtile.attention(q, k, v, causal=True, deterministic=True), (q, k, v), dout,
                                   create_graph=True)
    for a, b in zip(plain, recorded):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert recorded[0].requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        recorded[0].float().sum().backward()
