"""`flashtile explain`: the registry's answer for a call, its tile, work and roofline bound — on the CPU for a
named architecture, and on the GPU with the measured time beside the bound."""

import pytest
import torch

import flashtile
from flashtile import cli
from flashtile.bench import measure
from flashtile.explain import REFERENCE_MACHINES, explain


def _meta(b, sq, sk, hq, hkv, d, dv, dtype=torch.bfloat16):
    return (torch.empty(b, sq, hq, d, device="meta", dtype=dtype), torch.empty(b, sk, hkv, d, device="meta", dtype=dtype),
            torch.empty(b, sk, hkv, dv, device="meta", dtype=dtype))


def test_hopper_call_names_its_kernels_tiles_and_bound():
    result = explain(*_meta(2, 1024, 1024, 8, 8, 128, 128), arch="sm_90a")
    fwd, bwd = result.directions
    assert (fwd.family, bwd.family) == ("hopper", "bwd-wgmma")
    assert fwd.spec.source == "wgmma/fwd.cu" and bwd.spec.source == "wgmma/bwd.cu"
    assert "why:" in fwd.tile and fwd.resources["attn_fwd"].spill_stores == 0
    assert fwd.flops == pytest.approx(measure.attention_flops(2, 8, 1024, 1024, 128))
    assert bwd.flops == pytest.approx(measure.attention_flops(2, 8, 1024, 1024, 128, backward=True))
    machine = REFERENCE_MACHINES["sm_90a"]
    assert fwd.bound_ms == pytest.approx(max(fwd.flops / machine.peak_flops, fwd.bytes / machine.bandwidth) * 1e3)
    assert fwd.measured_ms is None
    text = str(result)
    assert "chosen  hopper" in text and "bwd-grid:" in text and "roofline bound" in text


def test_each_family_that_does_not_serve_says_why():
    result = explain(*_meta(1, 256, 256, 4, 4, 128, 128), softcap=30.0, arch="sm_90a")
    fwd, bwd = result.directions
    reasons = dict(fwd.reasons)
    assert fwd.family == "pipelined" and "softcap" in reasons["mma"] and "softcap" in reasons["naive"]
    assert bwd.family == "bwd-mma" and "bwd-wgmma" in dict(bwd.reasons)


def test_causal_and_window_count_only_the_visible_pairs():
    full = explain(*_meta(1, 512, 512, 2, 2, 64, 64), arch="sm_80").directions[0]
    causal = explain(*_meta(1, 512, 512, 2, 2, 64, 64), causal=True, arch="sm_80").directions[0]
    window = explain(*_meta(1, 512, 512, 2, 2, 64, 64), window_size=(15, 0), arch="sm_80").directions[0]
    assert causal.flops == pytest.approx(full.flops * (512 + 1) / 2 / 512)
    assert window.flops == pytest.approx(full.flops * (16 * 512 - 15 * 16 / 2) / 512**2)


def test_fp32_backward_is_explained_as_the_chunked_path():
    bwd = explain(*_meta(1, 64, 64, 2, 2, 64, 64, torch.float32), arch="sm_90a").directions[1]
    assert bwd.family is None and bwd.spec is None and all(why for _, why in bwd.reasons)


def test_without_a_gpu_an_arch_is_needed():
    q, k, v = (torch.empty(1, 8, 2, 64) for _ in range(3))
    with pytest.raises(ValueError, match="arch"):
        explain(q, k, v, arch="sm_42")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="named arch"):
            explain(q, k, v)


def test_cli_explains_for_a_named_arch(capsys):
    assert cli.main(["explain", "--arch", "sm_80", "--shape", "1,4,300,96", "--causal", "--no-time"]) == 0
    out = capsys.readouterr().out
    assert "bwd-mma" in out and "A100" in out
    assert cli.main(["explain", "--arch", "sm_87", "--no-time"]) == 2  # a target without a reference GPU


@pytest.mark.gpu
def test_explain_on_the_gpu_times_the_call():
    q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    result = flashtile.explain(q, k, v, causal=True)
    props = torch.cuda.get_device_properties(0)
    assert result.machine.sms == props.multi_processor_count and result.machine.bandwidth > 1e11
    for direction in result.directions:
        assert direction.measured_ms > 0 and direction.family is not None
        assert direction.measured_ms > 0.5 * direction.bound_ms  # nothing beats its roofline by 2x
    assert "measured:" in str(result)
