import math

import pytest

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


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty kernel cache for this test."""
    from flashtile import jit

    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path / "cache"))
    jit.clear_memo()
    yield tmp_path / "cache"
    jit.clear_memo()
