"""The torch.library ops and autograd on CPU: schemas and fake kernels, gradients, torch.compile tracing."""

import itertools

import pytest
import torch

import flashtile
from autograd_checks import check_create_graph_refuses_a_second_order
from flashtile import ops
from flashtile.reference import attention_ref, varlen_apply
from flashtile.testing import compare_grads, reference_grads
from nonfinite_cases import NONFINITE_CASES, case_id, check, expected_nan, make


def _dense(batch=2, sq=37, sk=45, hq=4, hkv=2, d=16, dv=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(batch, sk, hkv, d, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(batch, sk, hkv, dv, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


def _forward_args(q, k, v, cu_q=None, cu_k=None, max_q=0, max_k=0, scale=0.25, left=-1, right=0, softcap=0.0,
                  slopes=None, deterministic=False):
    return (q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, softcap, slopes, deterministic)


def test_forward_op_passes_opcheck():
    q, k, v = _dense()
    torch.library.opcheck(ops.forward, _forward_args(q, k, v))
    torch.library.opcheck(ops.forward, _forward_args(q, k, v, left=7, right=3, softcap=5.0,
                                                     slopes=torch.rand(4)))


def test_varlen_forward_op_passes_opcheck():
    cu = torch.tensor([0, 5, 5, 30], dtype=torch.int32)
    q = torch.randn(30, 4, 16, requires_grad=True)
    k = torch.randn(30, 2, 16, requires_grad=True)
    v = torch.randn(30, 2, 16, requires_grad=True)
    torch.library.opcheck(ops.forward, _forward_args(q, k, v, cu, cu, 25, 25))


def test_backward_op_passes_opcheck():
    q, k, v = _dense()
    out, lse = ops.forward(*_forward_args(q.detach(), k.detach(), v.detach()))
    torch.library.opcheck(ops.backward_op, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                            None, None, 0, 0, 0.25, -1, 0, 0.0, None, False))


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (5, 2), "softcap": 3.0},
                                     {"causal": True, "alibi": True}], ids=str)
def test_cpu_gradients_match_the_reference(options):
    options = dict(options)
    q, k, v = _dense()
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(q.shape[2])
    out = flashtile.attention(q, k, v, **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    result = compare_grads(q, k, v, dout, grads, **options)
    assert result.ok, result


def test_cpu_varlen_gradients_match_the_reference():
    lengths = [3, 40, 1, 17]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lengths), h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    out = flashtile.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def packed_ref(q, k, v, dtype, **kw):
        return varlen_apply(lambda *a, **o: attention_ref(*a, dtype=dtype, **o), q, k, v, cu, cu, **kw)

    assert compare_grads(q, k, v, dout, grads, fn=packed_ref, causal=True).ok


def test_gradcheck_of_the_forward_op_in_fp64():
    q, k, v = _dense(batch=1, sq=6, sk=9, hq=2, hkv=1, d=4, dv=3, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: ops.forward(*_forward_args(q, k, v, softcap=2.0))[0],
                                    (q, k, v), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("shape,options", [
    ((6, 6, 4, 2), {"causal": True}),
    ((5, 9, 4, 2), {"causal": True}),
    ((6, 9, 2, 1), {"window_size": (3, 1), "softcap": 1.5}),
], ids=str)
def test_gradcheck_through_flashtile_attention_in_fp64(shape, options):
    """fp64 on CPU: flashtile.attention and varlen_attention are differentiable to gradcheck's precision."""
    sq, sk, hq, hkv = shape
    q, k, v = _dense(batch=2, sq=sq, sk=sk, hq=hq, hkv=hkv, d=4, dv=4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: flashtile.attention(q, k, v, **options), (q, k, v))
    cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
    cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32)
    packed = [t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: flashtile.varlen_attention(q, k, v, cu_q, cu_k, sq, sk, **options), packed)


@pytest.mark.parametrize("options", [{"causal": True}, {"softcap": 3.0, "window_size": (9, 4)}])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_lse_is_differentiable(options, compiled):
    """A loss that uses the returned LSE gets its term: d lse_i / d s_ij = P_ij enters as D - dLSE."""
    q, k, v = _dense()
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=g)
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=g)

    def loss(q, k, v):
        out, lse = flashtile.attention(q, k, v, return_lse=True, **options)
        return (out * dout).sum() + (lse * dlse).sum()

    fn = torch.compile(loss, fullgraph=True, backend="aot_eager") if compiled else loss
    grads = torch.autograd.grad(fn(q, k, v), (q, k, v))
    result = compare_grads(q, k, v, dout, grads, dlse=dlse, **options)
    assert result.ok, result
    without = compare_grads(q, k, v, dout, grads, **options)
    assert not without.ok  # the LSE's term is not negligible: dropping it would fail


def test_a_loss_of_the_lse_alone():
    q, k, v = _dense()
    _, lse = flashtile.attention(q, k, v, return_lse=True, causal=True)
    grads = torch.autograd.grad(lse.sum(), (q, k, v))
    result = compare_grads(q, k, v, torch.zeros(*q.shape[:-1], v.shape[-1]), grads, dlse=torch.ones_like(lse),
                           causal=True)
    assert result.ok, result


def test_no_grad_calls_skip_autograd():
    q, k, v = _dense()
    with torch.no_grad():
        out = flashtile.attention(q, k, v)
    assert out.grad_fn is None


def test_a_backward_recorded_with_create_graph_refuses_a_second_backward():
    q, k, v = _dense()
    check_create_graph_refuses_a_second_order(q, k, v, torch.randn(*q.shape[:-1], v.shape[-1], requires_grad=True))


def test_autograd_function_apply_serves_under_functorch():
    """Under torch.func transforms flashtile's node takes autograd.Function.apply's full path: functorch asks
    for a setup_context, and the error says so instead of a wrong gradient."""
    q, k, v = (t.detach() for t in _dense())
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda q: flashtile.attention(q, k, v).sum())(q)


def test_torch_compile_fullgraph_traces_forward_and_backward():
    q, k, v = _dense()

    def loss(q, k, v):
        return flashtile.attention(q, k, v, causal=True, window_size=(9, -1)).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("bad,match", [({"deterministic": 1}, "deterministic"),
                                       ({"rung": "tiled"}, "forward-only")])
def test_bad_training_options_are_named(bad, match):
    q, k, v = _dense()
    with pytest.raises((TypeError, ValueError), match=match):
        flashtile.attention(q, k, v, **bad)


@pytest.mark.parametrize("setup,poison", NONFINITE_CASES, ids=[case_id(c) for c in NONFINITE_CASES])
def test_nonfinite_inputs_through_flashtile_attention(setup, poison):
    """The public call, forward and backward, on whichever CPU kernel serves these options."""
    (q, k, v, clean_options), (pq, pk, pv, options), dout = make(setup, poison)
    want_out, want_lse = attention_ref(q, k, v, **clean_options)
    want = reference_grads(attention_ref, q, k, v, dout, torch.float64, **clean_options)
    nan = expected_nan(setup, poison)
    with torch.no_grad():
        out, lse = flashtile.attention(pq, pk, pv, return_lse=True, **options)
    check("out (no grad)", out, want_out, nan["out"], atol=1e-5)
    check("lse (no grad)", lse, want_lse, nan["lse"], atol=1e-5)
    leaves = [x.requires_grad_() for x in (pq, pk, pv)]
    out, lse = flashtile.attention(*leaves, return_lse=True, **options)
    check("out", out.detach(), want_out, nan["out"], atol=1e-5)
    check("lse", lse, want_lse, nan["lse"], atol=1e-5)
    for name, grad, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout), want):
        check(name, grad, w, nan[name], atol=1e-4)
