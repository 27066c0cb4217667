"""Every kernel spec compiles with NVRTC for every supported architecture, with no GPU and no spills."""

import pytest

from flashtile import jit, specs

CASES = [spec for arch in specs.TEST_ARCHS for spec in specs.all_specs(arch)]


@pytest.mark.parametrize("spec", CASES, ids=[s.name for s in CASES])
def test_spec_compiles_without_spills(spec, cache_dir):
    module = jit.compile_spec(spec)
    assert set(module.resources) == set(spec.entries)
    for entry, res in module.resources.items():
        assert res.spill_stores == 0 and res.spill_loads == 0, f"{spec.name}:{entry} spills: {res}"
        assert res.stack_frame == 0, f"{spec.name}:{entry} uses local memory: {res}"
