"""Every kernel spec compiles with NVRTC for every supported architecture, with no GPU and no spills."""

import pytest

from flashtile import jit, registry, specs

# The Hopper backward's alternative builds (specs.BWD_WGMMA_ALTERNATIVES) stay buildable beside the tables' own.
ALTERNATIVES = [specs.bwd_wgmma_spec(dtype, d, tile) for d, tiles in specs.BWD_WGMMA_ALTERNATIVES.items()
                for tile in tiles for dtype in ("bf16", "f16")]
CASES = [spec for arch in specs.TEST_ARCHS for spec in registry.all_specs(arch)] + ALTERNATIVES


@pytest.mark.parametrize("spec", CASES, ids=[s.name for s in CASES])
def test_spec_compiles_without_spills(spec, cache_dir):
    module = jit.compile_spec(spec)
    assert set(module.resources) == set(spec.entries)
    for entry, res in module.resources.items():
        assert res.spill_stores == 0 and res.spill_loads == 0, f"{spec.name}:{entry} spills: {res}"
        assert res.stack_frame == 0, f"{spec.name}:{entry} uses local memory: {res}"


# The tile tables' three sizes of GPU, 227 KB (Hopper), 99 KB (consumer Ampere and newer) and 64 KB (Turing), and
# Blackwell's own rows (sm_100 has them all).
SMEM_CASES = [spec for arch in ("sm_90a", "sm_86", "sm_75", "sm_100") for spec in registry.all_specs(arch)
              if spec.smem_bytes] + ALTERNATIVES


@pytest.fixture(scope="module")
def kernel_copy(tmp_path_factory):
    """A copy of the kernel sources where probe files can sit next to the real ones."""
    import shutil

    root = tmp_path_factory.mktemp("kernels")
    shutil.copytree(jit.KERNEL_ROOT, root, dirs_exist_ok=True)
    return root


@pytest.mark.parametrize("spec", SMEM_CASES, ids=[s.name for s in SMEM_CASES])
def test_host_shared_memory_size_matches_the_kernel(spec, kernel_copy, monkeypatch, cache_dir):
    """specs.py's smem_bytes (what the launch asks for) equals sizeof(SharedStorage) in the kernel."""
    probe = spec.source.replace(".cu", f"_smem_probe_{spec.smem_bytes}.cu")
    name = spec.source.rsplit("/", 1)[-1]
    dq_pass = (f'static_assert(sizeof(DqStorage) == {spec.dq_smem_bytes}, '
               f'"specs.py dq_smem_bytes disagrees with DqStorage");\n' if spec.dq_smem_bytes else "")
    (kernel_copy / probe).write_text(f'#include "{name}"\nstatic_assert(sizeof(SharedStorage) == {spec.smem_bytes}, '
                                     f'"specs.py smem_bytes disagrees with SharedStorage");\n' + dq_pass)
    monkeypatch.setattr(jit, "KERNEL_ROOT", kernel_copy)
    jit.compile_spec(specs.KernelSpec(probe, spec.entries, spec.dtype, spec.arch, spec.defines, spec.smem_bytes))


@pytest.mark.parametrize("arch", specs.TEST_ARCHS)
def test_every_spec_fits_the_shared_memory_of_its_arch(arch):
    for spec in registry.all_specs(arch):
        assert max(spec.smem_bytes, spec.dq_smem_bytes) <= specs.smem_limit(arch), f"{spec.name}: {spec.smem_bytes} B"
