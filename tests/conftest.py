import math

import pytest

from flashtile import api
from flashtile.forward import FwdProblem


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output buffer a kernel writes starts as NaN, so an element the kernel forgets fails the test."""
    original = FwdProblem.empty_outputs

    def poisoned(self):
        o, lse = original(self)
        o.fill_(math.nan)
        if lse is not None:
            lse.fill_(math.nan)
        return o, lse

    monkeypatch.setattr(FwdProblem, "empty_outputs", poisoned)
    monkeypatch.setattr(api, "_plans", _NoPlans())  # cached launch plans allocate without poisoning


class _NoPlans(dict):
    """A plan cache that keeps nothing: every call takes the full path."""

    def __setitem__(self, key, value):
        pass


@pytest.fixture
def poisoned_grads(monkeypatch):
    """The same for the gradient buffers of the backward kernels."""
    from flashtile import backward

    original = backward.empty_grads

    def poisoned(*tensors):
        return tuple(g.fill_(math.nan) for g in original(*tensors))

    monkeypatch.setattr(backward, "empty_grads", poisoned)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty kernel cache for this test."""
    from flashtile import jit

    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path / "cache"))
    jit.clear_memo()
    yield tmp_path / "cache"
    jit.clear_memo()


@pytest.fixture
def torch_kernel_calls(monkeypatch):
    """Names ("forward", "backward") of the calls the CPU path makes to torch's fused kernel, in order."""
    from flashtile import cpu_kernel

    calls = []
    for name in ("forward", "backward"):
        def spy(*args, _run=getattr(cpu_kernel, name), _name=name, **kwargs):
            calls.append(_name)
            return _run(*args, **kwargs)

        monkeypatch.setattr(cpu_kernel, name, spy)
    return calls
