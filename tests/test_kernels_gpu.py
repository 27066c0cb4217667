"""Every ladder rung against the fp64 reference on the GPU. Skipped only where no CUDA device exists."""

import pytest
import torch

import flashtile
from flashtile import dispatch, ladder
from flashtile.forward import FwdProblem, default_scale
from flashtile.testing import compare

pytestmark = pytest.mark.gpu  # skipped where no CUDA device exists (conftest.py)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, causal
SHAPES = [
    (1, 1, 1, 1, 1, 64, 64, False),
    (1, 1, 1, 2, 1, 64, 64, True),
    (2, 17, 17, 3, 3, 64, 64, False),
    (2, 17, 17, 2, 1, 64, 64, True),
    (1, 1000, 1000, 2, 2, 64, 64, True),
    (1, 1000, 1000, 2, 2, 128, 128, False),
    (1, 4097, 4097, 1, 1, 64, 64, False),
    (1, 4097, 4097, 2, 1, 128, 128, True),
    (2, 1, 1000, 4, 2, 64, 64, True),       # decode-like: one query, bottom-right causal sees every key
    (2, 1000, 1, 2, 2, 64, 64, True),       # seqlen_q > seqlen_k: all but the last row see nothing
    (3, 63, 129, 4, 4, 32, 32, False),
    (3, 129, 63, 4, 4, 32, 32, True),
    (1, 300, 513, 8, 2, 96, 96, False),
    (1, 513, 300, 8, 2, 96, 96, True),
    (2, 65, 65, 2, 2, 128, 64, False),      # head_dim_v < head_dim
    (2, 200, 77, 2, 2, 40, 40, False),      # head_dim not a multiple of 16: padded
    (1, 64, 64, 1, 1, 8, 8, True),
    (1, 257, 1025, 6, 3, 80, 80, True),
    (4, 128, 128, 2, 2, 64, 64, False),
    (1, 2048, 2048, 1, 1, 128, 128, True),
    (1, 33, 4097, 2, 2, 64, 64, False),
    (1, 4097, 33, 2, 2, 64, 64, False),
]


def skip_unless_served(rung: str, q, k, v, window=(-1, -1)) -> None:
    """Skip where the registry says the rung does not serve these inputs on this GPU (its reason as the skip's)."""
    problem = FwdProblem(q, k, v, default_scale(q.shape[-1]), window)
    why_not = ladder.get(rung).unsupported(dispatch.variant_of(problem, "fwd"))
    if why_not:
        pytest.skip(why_not)


def make_inputs(shape, dtype, seed):
    batch, sq, sk, hq, hkv, d, dv, _ = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(batch, sk, hkv, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(batch, sk, hkv, dv, device="cuda", generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("rung", [r.name for r in ladder.RUNGS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rung_matches_reference(rung, dtype, shape, poisoned_outputs):
    q, k, v = make_inputs(shape, dtype, seed=hash((rung, str(dtype), shape)) % 2**31)
    causal = shape[-1]
    skip_unless_served(rung, q, k, v, (-1, 0) if causal else (-1, -1))
    out, lse = flashtile.attention(q, k, v, causal=causal, return_lse=True, rung=rung)
    torch.cuda.synchronize()
    result = compare(q, k, v, out, lse, causal=causal)
    assert result.ok, f"{rung} {dtype} {shape}: {result}"


@pytest.mark.parametrize("rung", [r.name for r in ladder.RUNGS])
def test_rung_window_gqa_and_strided_inputs(rung, poisoned_outputs):
    """Sliding window, GQA, and q/k/v that are views into larger tensors (arbitrary strides)."""
    big = torch.randn(2, 300, 8, 3, 64, device="cuda", dtype=torch.bfloat16)
    q = big[:, :, :, 0]                  # (2, 300, 8, 64), row stride 8 * 3 * 64
    k = big[:, :257, ::4, 1]             # heads 0 and 4 -> 2 kv heads
    v = big[:, :257, 1::4, 2]
    skip_unless_served(rung, q, k, v, (32, 0))
    for window in [(32, 0), (16, 8), (-1, 5)]:
        out, lse = flashtile.attention(q, k, v, window_size=window, return_lse=True, rung=rung)
        result = compare(q, k, v, out, lse, window_size=window)
        assert result.ok, f"{rung} window={window}: {result}"


def test_misaligned_storage_offset_is_handled(poisoned_outputs):
    """A view whose start is not 16-byte aligned must not be misread by 16-byte vector loads."""
    flat = torch.randn(1 * 100 * 2 * 64 + 3, device="cuda", dtype=torch.float16)
    q = flat[3:].view(1, 100, 2, 64)
    assert q.data_ptr() % 16 != 0
    k = torch.randn(1, 100, 2, 64, device="cuda", dtype=torch.float16)
    out, lse = flashtile.attention(q, k, k, return_lse=True)
    assert compare(q, k, k, out, lse).ok


def test_auto_picks_the_top_rung_that_serves():
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    variant = dispatch.variant_of(FwdProblem(q, q, q, 0.125, (-1, -1)), "fwd")
    top = next(r for r in reversed(ladder.RUNGS) if r.unsupported(variant) is None)
    out_auto = flashtile.attention(q, q, q)
    out_top = flashtile.attention(q, q, q, rung=top.name)
    assert torch.equal(out_auto, out_top)


def test_runs_on_the_current_stream():
    q = torch.randn(2, 512, 4, 64, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = flashtile.attention(q, q, q)
    side.synchronize()
    assert compare(q, q, q, out).ok


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_a_device_other_than_the_current_one():
    """The launch enters the tensors' device even when torch's current device is another one."""
    q, k, v = (torch.randn(1, 300, 4, 64, device="cuda:1", dtype=torch.bfloat16) for _ in range(3))
    with torch.cuda.device(0):
        out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
    assert out.device == q.device and compare(q, k, v, out, lse, causal=True).ok
