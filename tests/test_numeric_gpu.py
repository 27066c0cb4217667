"""common/numeric.cuh on the GPU: Turing's integer fp32 -> bf16 rounding equals the hardware's cvt.rn.bf16.f32."""

import shutil

import pytest
import torch

from flashtile import jit, launch, specs

pytestmark = pytest.mark.gpu  # skipped where no CUDA device exists (conftest.py)

FLOAT_PATTERNS = 2**32
PROBE_THREADS = 1024
# Thread i converts the float whose bits are i, both ways; the first of the two output words counts the
# disagreements, the second holds one disagreeing input. The probe takes the kernels' one argument, AttnParams.
PROBE = r"""
#include "common/params.cuh"
extern "C" __global__ void bf16_rounding_probe(const __grid_constant__ AttnParams p) {
    const u32 bits = blockIdx.x * blockDim.x + threadIdx.x;
    const float x = __uint_as_float(bits);
    if (bf16_bits_rn(x) != from_float<bf16_t>(x).bits) {
        u32* out = static_cast<u32*>(p.o);
        atomicAdd(out, 1u);
        out[1] = bits;
    }
}
"""


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                    reason="compares against cvt.rn.bf16.f32, which needs sm_80")
def test_integer_bf16_rounding_matches_the_hardware_for_every_float(tmp_path, monkeypatch, cache_dir):
    root = tmp_path / "kernels"
    shutil.copytree(jit.KERNEL_ROOT, root)
    (root / "bf16_probe.cu").write_text(PROBE)
    monkeypatch.setattr(jit, "KERNEL_ROOT", root)
    arch = specs.arch_of(torch.cuda.get_device_capability())
    module = launch.load(specs.KernelSpec("bf16_probe.cu", ("bf16_rounding_probe",), "bf16", arch), 0)
    out = torch.zeros(2, dtype=torch.int32, device="cuda")
    launch.launch(module.kernels["bf16_rounding_probe"], (FLOAT_PATTERNS // PROBE_THREADS, 1, 1), PROBE_THREADS, 0,
                  launch.param_values(o=out.data_ptr()))
    disagreements, example = out.tolist()
    assert disagreements == 0, f"{disagreements} floats round differently, e.g. bits {example & 0xffffffff:#010x}"
