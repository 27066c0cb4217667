"""The kernel side of hardening on the GPU: NaN rows, batches past a grid's limit, cu_seqlens that lie, and the
gradient of the returned log-sum-exp."""

import dataclasses
import itertools

import pytest
import torch

import flashtile
from flashtile import ladder, ops
from flashtile.forward import MAX_GRID_BATCH
from flashtile.reference import attention_ref
from flashtile.testing import compare, compare_grads

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


@pytest.mark.parametrize("rung", ["auto", *(r.name for r in ladder.RUNGS)])
def test_a_nan_key_poisons_exactly_the_rows_that_read_it(rung, poisoned_outputs):
    """Batch 0's key 5 is NaN: under the causal mask rows 5.. of batch 0 read it (NaN out and LSE); rows 0-4 and
    batch 1 do not, and stay exact."""
    q, k, v = (torch.randn(2, 40, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    k[0, 5, 1, 3] = float("nan")
    out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True, rung=rung)
    assert out[0, 5:, 1].isnan().all() and lse[0, 1, 5:].isnan().all()
    assert not out[0, :5].isnan().any() and not lse[0, :, :5].isnan().any()
    assert not out[0, :, 0].isnan().any()  # the other head reads another key row
    clean = k.clone()
    clean[0, 5, 1, 3] = 0.0
    assert compare(q[1:], clean[1:], v[1:], out[1:], lse[1:], causal=True).ok
    ref_out, ref_lse = attention_ref(q[:1], clean[:1], v[:1], causal=True)
    out0, lse0 = out[:1].clone(), lse[:1].clone()  # the NaN rows replaced by the reference: the rest must be exact
    out0[0, 5:, 1], lse0[0, 1, 5:] = ref_out[0, 5:, 1].to(out.dtype), ref_lse[0, 1, 5:].float()
    assert compare(q[:1], clean[:1], v[:1], out0, lse0, causal=True).ok


def test_a_nan_query_reaches_its_own_gradient_rows_only():
    """dQ of a row depends on that row's scores alone: the NaN query's row is NaN, every other row finite (dK and
    dV of the keys it saw are NaN too, as they must be)."""
    q, k, v = (torch.randn(2, 40, 2, 64, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        q[1, 7, 0, 0] = float("nan")
    out = flashtile.attention(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert dq[1, 7, 0].isnan().all()
    rest = torch.ones(dq.shape[:3], dtype=torch.bool, device="cuda")
    rest[1, 7, 0] = False
    assert not dq[rest].isnan().any() and not dk[0].isnan().any() and dv[1, :8, 0].isnan().any()


@pytest.mark.parametrize("causal", [False, True])
def test_a_batch_past_the_grid_limit(causal, poisoned_outputs, poisoned_grads):
    """More batch entries than a grid's z dimension holds run in parts: forward, LSE and backward."""
    batch = MAX_GRID_BATCH + 7
    q, k, v = (torch.randn(batch, 3, 1, 64, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    out, lse = flashtile.attention(q, k, v, causal=causal, return_lse=True)
    assert compare(q, k, v, out, lse, causal=causal).ok
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert compare_grads(q, k, v, dout, grads, causal=causal).ok


def test_a_varlen_batch_past_the_grid_limit(poisoned_outputs):
    """Sequences of 3 rows each, packed: the same attention as the dense batch they reshape into."""
    batch, rows, heads = MAX_GRID_BATCH + 3, 3, 2
    cu = torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(batch * rows, heads, 64, device="cuda", dtype=BF16) for _ in range(3))
    out, lse = flashtile.varlen_attention(q, k, v, cu, cu, rows, rows, causal=True, return_lse=True)
    dense = [t.view(batch, rows, heads, 64) for t in (q, k, v)]
    lse_dense = lse.view(heads, batch, rows).transpose(0, 1)
    assert compare(*dense, out.view(batch, rows, heads, 64), lse_dense, causal=True).ok


def test_offsets_that_lie_are_clamped_on_the_device(poisoned_outputs):
    """The ops do not read cu_seqlens on the host (torch.compile and graph capture cannot): offsets past the
    packed rows, falling, or longer than max_seqlen must not make a kernel touch memory outside its tensors.
    Sequences the offsets describe truthfully stay exact; compute-sanitizer checks the rest (scripts/sanitize.py)."""
    total, heads, d = 100, 2, 64
    q, k, v = (torch.randn(total, heads, d, device="cuda", dtype=BF16) for _ in range(3))
    lying = torch.tensor([0, 30, 10**6, 20, -5, 100], dtype=torch.int32, device="cuda")
    out, lse = ops.forward(q, k, v, lying, lying, 30, 30, d**-0.5, -1, 0, 0.0, None, False)
    torch.cuda.synchronize()
    ref_out, _ = attention_ref(q[None, :30], k[None, :30], v[None, :30], causal=True)
    assert (out[:30].double() - ref_out[0]).abs().max() < 2e-2
    dq, dk, dv = ops.backward_op(torch.randn_like(out), q, k, v, out, lse, lying, lying, 30, 30, d**-0.5, -1, 0, 0.0,
                                 None, False)
    torch.cuda.synchronize()
    assert dq.shape == q.shape


@pytest.mark.parametrize("d,options", [(64, {"causal": True}), (128, {"deterministic": True}),
                                       (256, {"window_size": (50, 7)}), (96, {"softcap": 20.0}),
                                       (192, {"causal": True})])
def test_the_lse_is_differentiable(d, options, poisoned_grads):
    """Every backward kernel: the gradient of the returned LSE enters as D - dLSE."""
    q, k, v = (torch.randn(2, 300, 4, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    out, lse = flashtile.attention(q, k, v, return_lse=True, **options)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    reference = {name: value for name, value in options.items() if name != "deterministic"}
    assert compare_grads(q, k, v, dout, grads, dlse=dlse, **reference).ok
    assert not compare_grads(q, k, v, dout, grads, **reference).ok


def test_the_lse_of_a_varlen_batch_is_differentiable():
    lengths = [17, 300, 1, 64]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), 4, 128, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    out, lse = flashtile.varlen_attention(q, k, v, cu, cu, 300, 300, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))

    def reference(q, k, v, dtype):
        outs = [attention_ref(q[None, a:b], k[None, a:b], v[None, a:b], causal=True, dtype=dtype)
                for a, b in zip(cu.tolist(), cu.tolist()[1:])]
        return torch.cat([o[0] for o, _ in outs]), torch.cat([lse_[0] for _, lse_ in outs], dim=-1)

    assert compare_grads(q, k, v, dout, grads, fn=reference, dlse=dlse).ok


def test_a_failed_launch_names_the_drivers_error():
    """A launch the driver refuses (a grid of zero blocks) raises at once, naming the CUDA error; the next
    launches are unaffected."""
    from flashtile import dispatch, launch
    from flashtile.forward import FwdProblem

    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=BF16) for _ in range(3))
    problem = FwdProblem(q, k, v, 0.125, (-1, -1))
    family, module = dispatch.load(problem, "fwd")
    plan = family.plan(problem, module)
    broken = dataclasses.replace(plan, launches=tuple(launch.Launch(s.kernel, (0, 1, 1), s.threads, s.smem)
                                                      for s in plan.launches))
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"):
        broken.run(q, k, v)
    out, _ = plan.run(q, k, v)
    assert compare(q, k, v, out, None).ok
