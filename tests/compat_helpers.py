"""What the front-door tests (test_compat_*.py) share: tolerance, seeded inputs, gradients, no fallback."""

import contextlib
import warnings

import torch

from flashtile.compat import FallbackWarning

ATOL = 1e-5


def rand(*shape, seed=0, requires_grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_(requires_grad)


def grads_of(fn, *tensors):
    out = fn(*tensors)
    out.backward(rand(*out.shape, seed=7))
    return out, [t.grad for t in tensors]


def bhsd(batch=2, hq=4, hkv=4, sq=9, sk=9, d=16, dv=None, requires_grad=False, dtype=torch.float32):
    q = rand(batch, hq, sq, d, seed=11, requires_grad=False).to(dtype)
    k = rand(batch, hkv, sk, d, seed=12).to(dtype)
    v = rand(batch, hkv, sk, dv or d, seed=13).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@contextlib.contextmanager
def no_fallback():
    """A context in which any FallbackWarning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        yield
