import math
import os

import pytest
import torch

from flashtile import host, plans

# The suite runs the C++ host path wherever it can be built (auto's background build would switch paths mid-run);
# tests take the `python_path` fixture for the Python path, and tests/test_host_gpu.py compares the two.
os.environ.setdefault(host.MODE_ENV, "on" if host.can_build() else "off")


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu (pyproject.toml) skip themselves where no CUDA device exists."""
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(needs_cuda)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output buffer a kernel writes starts as NaN, so an element the kernel forgets fails the test."""
    original = plans.empty_outputs

    def poisoned(*args):
        o, lse = original(*args)
        o.fill_(math.nan)
        if lse is not None:
            lse.fill_(math.nan)
        return o, lse

    monkeypatch.setattr(plans, "empty_outputs", poisoned)
    host.set_poison(True)  # the C++ host path allocates its own buffers
    yield
    host.set_poison(False)


@pytest.fixture
def poisoned_grads(monkeypatch):
    """The same for the gradient buffers of the backward kernels."""
    original = plans.empty_grads

    def poisoned(*tensors):
        return tuple(g.fill_(math.nan) for g in original(*tensors))

    monkeypatch.setattr(plans, "empty_grads", poisoned)
    host.set_poison(True)
    yield
    host.set_poison(False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty kernel cache for this test."""
    from flashtile import jit

    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path / "cache"))
    jit.clear_memo()
    yield tmp_path / "cache"
    jit.clear_memo()


@pytest.fixture
def fresh_warnings():
    """The front doors' one-time FallbackWarnings armed again, before and after the test."""
    from flashtile.compat._warn import reset_warnings

    reset_warnings()
    yield
    reset_warnings()


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


@pytest.fixture
def python_path():
    """Calls planned during this test take the Python path (ops.Attention, plans.*.run), not the C++ host path."""
    with host.python_path():
        yield
