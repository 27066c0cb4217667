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


SMEM_CASES = [spec for spec in specs.all_specs("sm_90a") + specs.all_specs("sm_86") if spec.smem_bytes]


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
    (kernel_copy / probe).write_text(f'#include "{name}"\nstatic_assert(sizeof(SharedStorage) == {spec.smem_bytes}, '
                                     f'"specs.py smem_bytes disagrees with SharedStorage");\n')
    monkeypatch.setattr(jit, "KERNEL_ROOT", kernel_copy)
    jit.compile_spec(specs.KernelSpec(probe, spec.entries, spec.dtype, spec.arch, spec.defines, spec.smem_bytes))


@pytest.mark.parametrize("arch", specs.TEST_ARCHS)
def test_every_spec_fits_the_shared_memory_of_its_arch(arch):
    for spec in specs.all_specs(arch):
        assert spec.smem_bytes <= specs.SMEM_LIMIT[arch], f"{spec.name}: {spec.smem_bytes} B"


@pytest.mark.parametrize("arch, d, dv, mods, source", [
    ("sm_90a", 64, 64, {}, "sm90/bwd.cu"),
    ("sm_90a", 128, 128, {}, "sm90/bwd.cu"),
    ("sm_90a", 100, 100, {}, "sm90/bwd.cu"),        # padded to 128
    ("sm_90a", 96, 96, {}, "sm80/bwd.cu"),          # a compiled dim of its own, not a multiple of 64
    ("sm_90a", 256, 256, {}, "sm90/bwd.cu"),
    ("sm_90a", 192, 192, {}, "sm80/bwd_grid.cu"),
    ("sm_90a", 192, 128, {}, "sm80/bwd_grid.cu"),
    ("sm_90a", 128, 64, {}, "sm80/bwd.cu"),          # q/k and v head dims differ
    ("sm_90a", 128, 128, {"softcap": True}, "sm80/bwd.cu"),
    ("sm_90a", 128, 128, {"alibi": True}, "sm80/bwd.cu"),
    ("sm_80", 128, 128, {}, "sm80/bwd.cu"),
    ("sm_89", 64, 64, {}, "sm80/bwd.cu"),
])
def test_backward_kernel_choice(arch, d, dv, mods, source):
    """wgmma's kernel serves Hopper at d64/d128/d256 without score modifications; rung 4's serve the rest."""
    spec = specs.bwd_spec("bf16", d, dv, arch, **mods)
    assert spec.source == source
    assert spec.arch == arch


@pytest.mark.parametrize("arch, d, dv, mods, tma", [
    ("sm_90a", 128, 128, {}, True),
    ("sm_90a", 120, 64, {}, True),                   # padded to 128: the maps zero-fill the rest
    ("sm_90a", 64, 64, {}, True),
    ("sm_90a", 256, 256, {}, False),                 # K and V take turns in one buffer each: cp.async
    ("sm_90a", 128, 128, {"softcap": True}, False),
    ("sm_80", 128, 128, {}, False),                  # no tensor memory accelerator before Hopper
])
def test_forward_kv_loads(arch, d, dv, mods, tma):
    """The forward's K/V ring is fed by TMA on Hopper's d128 tile and by cp.async everywhere else; the TMA
    build takes the tensor maps as a second argument and the others empty ones."""
    from flashtile import ladder

    spec = specs.fwd_spec("bf16", d, dv, arch, **mods)
    assert dict(spec.defines)["FT_TMA_KV"] == int(tma)
    assert ladder.kv_box_rows(spec) == (dict(spec.defines)["FT_BLOCK_N"] if tma else 0)
    assert ladder.kv_box_rows(specs.mma_spec("bf16", 64, arch)) is None

