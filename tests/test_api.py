"""flashtile.attention on CPU tensors, and every kind of bad input it must refuse with a clear message."""

import numpy as np
import pytest
import torch

import flashtile
from flashtile import api, host
from flashtile.reference import attention_ref


def qkv(batch=2, sq=33, sk=47, hq=4, hkv=2, d=32, dv=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(batch * 1000 + sq * 10 + sk)
    return (torch.randn(batch, sq, hq, d, generator=g).to(dtype),
            torch.randn(batch, sk, hkv, d, generator=g).to(dtype),
            torch.randn(batch, sk, hkv, dv or d, generator=g).to(dtype))


def test_cpu_tensors_take_the_chunked_path():
    q, k, v = qkv(d=40, dv=24)
    out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    assert out.shape == (2, 33, 4, 24) and lse.shape == (2, 4, 33)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)


def test_softmax_scale_and_plain_return():
    q, k, v = qkv()
    out = flashtile.attention(q, k, v, softmax_scale=0.3)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, softmax_scale=0.3)[0], rtol=0, atol=1e-5)


def test_non_contiguous_but_strided_inputs():
    q, k, v = qkv()
    q2 = torch.randn(2, 4, 33, 32).transpose(1, 2)  # (b, s, h, d) view of a (b, h, s, d) tensor
    out = flashtile.attention(q2, k, v)
    torch.testing.assert_close(out.double(), attention_ref(q2, k, v)[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (7, 3), "softcap": 4.0}], ids=str)
def test_cpu_outputs_are_contiguous_like_the_gpus(options, dtype, grad):
    """out (batch, seqlen_q, heads_q, head_dim_v) and lse (batch, heads_q, seqlen_q), contiguous: in eval
    `out.view(batch, seqlen, heads * head_dim)` must work as it does in training and on the GPU."""
    q, k, v = (t.requires_grad_(grad) for t in qkv(sq=47, dtype=dtype))
    out, lse = flashtile.attention(q, k, v, return_lse=True, **options)
    assert out.is_contiguous() and lse.is_contiguous()
    assert out.view(2, 47, -1).shape == (2, 47, 4 * 32)
    packed_q, packed_k, packed_v = (t.detach().flatten(0, 1).requires_grad_(grad) for t in (q, k, v))
    cu_q = torch.tensor([0, 47, 94], dtype=torch.int32)
    cu_k = torch.tensor([0, 47, 94], dtype=torch.int32)
    out, lse = flashtile.varlen_attention(packed_q, packed_k, packed_v, cu_q, cu_k, 47, 47, return_lse=True,
                                          **options)
    assert out.is_contiguous() and lse.is_contiguous()


BAD = [
    # (description, mutate(q, k, v, kwargs) -> (q, k, v, kwargs), exception, words in the message)
    ("q not a tensor", lambda q, k, v, kw: (q.tolist(), k, v, kw), TypeError, ["q", "torch.Tensor"]),
    ("integer dtype", lambda q, k, v, kw: (q.int(), k, v, kw), TypeError, ["q", "float16"]),
    ("mixed dtypes", lambda q, k, v, kw: (q, k.half(), v, kw), TypeError, ["dtype"]),
    ("rank 3 q", lambda q, k, v, kw: (q[0], k, v, kw), ValueError, ["q", "4 dimensions"]),
    ("rank 5 k", lambda q, k, v, kw: (q, k[None], v, kw), ValueError, ["k", "4 dimensions"]),
    ("batch mismatch", lambda q, k, v, kw: (q, k[:1], v[:1], kw), ValueError, ["batch"]),
    ("k/v seqlen mismatch", lambda q, k, v, kw: (q, k, v[:, :5], kw), ValueError, ["seqlen"]),
    ("k/v heads mismatch", lambda q, k, v, kw: (q, k, v[:, :, :1], kw), ValueError, ["heads"]),
    ("heads not a multiple", lambda q, k, v, kw: (q[:, :, :3], k, v, kw), ValueError, ["multiple"]),
    ("head_dim mismatch", lambda q, k, v, kw: (q, k[..., :16], v, kw), ValueError, ["head_dim"]),
    ("head_dim too large", lambda q, k, v, kw: (*[torch.randn(*t.shape[:3], 264) for t in (q, k, v)], kw),
     ValueError, ["head_dim", "256"]),
    ("last dim strided", lambda q, k, v, kw: (q[..., ::2], k[..., ::2], v, kw), ValueError, ["q", "contiguous"]),
    ("empty", lambda q, k, v, kw: (q[:, :0], k, v, kw), ValueError, ["q", "empty"]),
    ("unknown rung", lambda q, k, v, kw: (q, k, v, {**kw, "rung": "warp-speed"}), ValueError, ["rung", "naive"]),
    ("rung number out of range", lambda q, k, v, kw: (q, k, v, {**kw, "rung": 99}), ValueError, ["rung"]),
    ("GPU rung on CPU", lambda q, k, v, kw: (q, k, v, {**kw, "rung": "tiled"}), ValueError, ["rung", "CPU"]),
    ("bad scale", lambda q, k, v, kw: (q, k, v, {**kw, "softmax_scale": float("nan")}), ValueError, ["softmax_scale"]),
    ("bad window", lambda q, k, v, kw: (q, k, v, {**kw, "window_size": (-2, 3)}), ValueError, ["window_size"]),
    ("window not a pair", lambda q, k, v, kw: (q, k, v, {**kw, "window_size": 5}), ValueError, ["window_size"]),
    ("negative softcap", lambda q, k, v, kw: (q, k, v, {**kw, "softcap": -1.0}), ValueError, ["softcap"]),
    ("alibi wrong shape", lambda q, k, v, kw: (q, k, v, {**kw, "alibi_slopes": torch.rand(3)}), ValueError,
     ["alibi_slopes"]),
    ("alibi wrong dtype", lambda q, k, v, kw: (q, k, v, {**kw, "alibi_slopes": torch.rand(4).half()}), TypeError,
     ["alibi_slopes"]),
]


@pytest.mark.parametrize("name,mutate,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_clearly(name, mutate, exc, words):
    q, k, v = qkv()
    q, k, v, kwargs = mutate(q, k, v, {})
    with pytest.raises(exc) as info:
        flashtile.attention(q, k, v, **kwargs)
    for word in words:
        assert word in str(info.value), f"{name}: {word!r} not in {info.value}"


def test_float64_on_cpu_matches_the_reference():
    q, k, v = qkv(dtype=torch.float64)
    out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_float64_off_the_cpu_is_refused_clearly(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    q, k, v = (t.double().to(device) for t in qkv())
    for call in (lambda: flashtile.attention(q, k, v),
                 lambda: flashtile.varlen_attention(q[0], k[0], v[0], *[torch.tensor([0, 33], dtype=torch.int32,
                                                    device=device)] * 2, 33, 47)):
        with pytest.raises(TypeError, match="q is torch.float64.*CPU-only"):
            call()


def test_mixed_devices_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        flashtile.attention(q, k.to("meta"), v)


def test_plan_signature_covers_tensors_and_options():
    """The cached-plan key: None for non-tensors or unhashable options (the full path then explains)."""
    from flashtile import api

    q = torch.randn(1, 8, 2, 16)
    key = api._signature(q, q, q, (False, None, (-1, -1)))
    assert key is not None and key != api._signature(q, q, q, (True, None, (-1, -1)))
    assert key != api._signature(q.transpose(1, 2), q, q, (False, None, (-1, -1)))
    assert api._signature(q, q, q, (False, None, [-1, -1])) is None
    assert api._signature(q.numpy(), q, q, (False, None, (-1, -1))) is None


@pytest.fixture
def packed_problems(monkeypatch):
    """The checked problems that reach dispatch.forward, each packed into the kernels' params as a launch does."""
    from flashtile import dispatch, launch

    problems, forward = [], dispatch.forward

    def packing_forward(problem, rung="auto"):
        out, lse = forward(problem, rung)
        launch.PARAMS_STRUCT.pack(*problem.params(out, lse))
        problems.append(problem)
        return out, lse

    monkeypatch.setattr(dispatch, "forward", packing_forward)
    with host.python_path():  # the C++ kernel call (host.cpu_kernel_of) would not reach dispatch.forward
        yield problems


@pytest.fixture
def cached_calls(monkeypatch):
    """The call cache in use on the CPU: every call is kept (as a general call), as CUDA keeps planned ones."""
    from flashtile import api, dispatch

    class KeptCall(dispatch.GeneralCall):
        serves = staticmethod(lambda q, k, v: True)

    monkeypatch.setattr(api, "_calls", {})
    api.clear_calls()
    monkeypatch.setattr(dispatch, "planned_call",
                        lambda problem, rung, deterministic, grad: KeptCall(problem, deterministic, rung))
    return api._calls


WINDOW_FORMS = {
    "numpy ints": (np.int64(3), np.int32(0)),
    "list": [3, 0],
    "1-d integer tensor": torch.tensor([3, 0]),
    "0-d integer tensors": tuple(torch.tensor([3, 0])),
    "numpy array": np.array([3, 0]),
}


@pytest.mark.parametrize("form", WINDOW_FORMS.values(), ids=WINDOW_FORMS.keys())
def test_window_size_takes_any_pair_of_integers(form):
    """FlashAttention-2's own tests pass window_size=torch.randint(0, seqlen_k, (2,))."""
    q, k, v = qkv()
    expected = flashtile.attention(q, k, v, window_size=(3, 0))
    torch.testing.assert_close(flashtile.attention(q, k, v, window_size=form), expected, rtol=0, atol=0)
    cu = torch.tensor([0, 33, 66], dtype=torch.int32)
    packed = [t.flatten(0, 1) for t in qkv(sk=33)]
    torch.testing.assert_close(flashtile.varlen_attention(*packed, cu, cu, 33, 33, window_size=form),
                               flashtile.varlen_attention(*packed, cu, cu, 33, 33, window_size=(3, 0)), rtol=0, atol=0)


NOT_WINDOWS = {
    "floats": (3.0, 0), "a bool": (True, 0), "a float tensor": torch.tensor([3.0, 0.0]),
    "a 0-d bool tensor": (torch.tensor(True), 0), "numpy bools": np.array([True, False]), "below -1": (-2, 0),
    "a negative tensor": torch.tensor([3, -5]), "three bounds": (1, 2, 3), "a 0-d tensor": torch.tensor(3),
    "a 2-d tensor": torch.tensor([[3], [0]]), "a set": {3, 0}, "a string": "30",
}


@pytest.mark.parametrize("window", NOT_WINDOWS.values(), ids=NOT_WINDOWS.keys())
def test_window_size_refuses_what_is_no_pair_of_integers(window):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window_size must be a pair of integers >= -1"):
        flashtile.attention(q, k, v, window_size=window)


@pytest.mark.parametrize("window,causal,packed", [
    ((10**12, 0), False, (-1, 0)),        # a left bound past every key: causal
    ((2**31, 2**31), False, (-1, -1)),    # no window at all, though neither bound fits an int32
    ((47, 47), False, (-1, -1)),          # seqlen_k = 47: a bound of 47 lets every key in
    ((5, 2**40), True, (5, 0)),           # causal: the right bound is 0 whatever was given
    ((46, 32), False, (46, 32)),          # within the sequences: kept as given
])
def test_a_bound_past_the_sequences_is_unbounded(packed_problems, window, causal, packed):
    q, k, v = qkv()  # seqlen_q 33, seqlen_k 47
    out = flashtile.attention(q, k, v, window_size=window, causal=causal)
    assert packed_problems[-1].window == packed
    torch.testing.assert_close(out, flashtile.attention(q, k, v, window_size=packed), rtol=0, atol=0)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, window_size=window, causal=causal)[0],
                               rtol=0, atol=1e-5)


def test_a_right_bound_short_of_a_longer_q_is_kept(packed_problems):
    """With seqlen_q > seqlen_k the first rows' diagonals lie before the first key: a right bound of seqlen_k
    still hides keys from them, so only a bound reaching past the longer sequence is dropped."""
    q, k, v = qkv(sq=47, sk=33)
    out = flashtile.attention(q, k, v, window_size=(-1, 33))
    assert packed_problems[-1].window == (-1, 33)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, window_size=(-1, 33))[0], rtol=0, atol=1e-5)


def test_varlen_bounds_past_the_longest_sequences_are_unbounded(packed_problems):
    q, k, v = (t.flatten(0, 1) for t in qkv(sk=33))
    cu = torch.tensor([0, 20, 66], dtype=torch.int32)  # lengths 20 and 46: max_seqlen 46
    out = flashtile.varlen_attention(q, k, v, cu, cu, 46, 46, window_size=(46, 2**31))
    assert packed_problems[-1].window == (-1, -1)
    torch.testing.assert_close(out, flashtile.varlen_attention(q, k, v, cu, cu, 46, 46), rtol=0, atol=0)
    flashtile.varlen_attention(q, k, v, cu, cu, 46, 46, window_size=(45, 0))
    assert packed_problems[-1].window == (45, 0)


def test_the_call_cache_keys_on_window_values_not_forms(cached_calls):
    """A kept call must not serve a refused form equal to an accepted one (3.0 == 3), nor a window tensor
    changed in place since it was kept."""
    q, k, v = qkv()
    flashtile.attention(q, k, v, window_size=(3, 0))
    assert len(cached_calls) == 1
    with pytest.raises(ValueError, match="window_size"):
        flashtile.attention(q, k, v, window_size=(3.0, 0))
    window = torch.tensor([3, 0])
    torch.testing.assert_close(flashtile.attention(q, k, v, window_size=window),
                               flashtile.attention(q, k, v, window_size=(3, 0)), rtol=0, atol=0)
    window[0] = 7
    torch.testing.assert_close(flashtile.attention(q, k, v, window_size=window),
                               flashtile.attention(q, k, v, window_size=(7, 0)), rtol=0, atol=0)
    assert len(cached_calls) == 2


UNHOLDABLE = {
    "scale past float32": ("softmax_scale", 1e39),  # finite as a Python float, inf as the kernels' float32
    "scale past -float32": ("softmax_scale", -1e39),
    "scale * log2(e) past float32": ("softmax_scale", 3e38),
    "scale past float64": ("softmax_scale", 10**400),
    "scale an inf tensor": ("softmax_scale", torch.tensor(float("inf"))),
    "softcap past float32": ("softcap", 1e39),
    "1 / softcap past float32": ("softcap", 1e-40),
    "softcap a bool": ("softcap", True),
    "softcap a negative tensor": ("softcap", torch.tensor(-1.0)),
    "softcap a 1-d tensor": ("softcap", torch.tensor([5.0])),
}


@pytest.mark.parametrize("name,value", UNHOLDABLE.values(), ids=UNHOLDABLE.keys())
def test_numbers_the_kernels_cannot_hold_are_refused(name, value):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=f"{name} must be"):
        flashtile.attention(q, k, v, **{name: value})


@pytest.mark.parametrize("form", [np.float32(0.25), np.float64(0.25), torch.tensor(0.25),
                                  torch.tensor(0.25, dtype=torch.float64), np.int64(2), torch.tensor(2)],
                         ids=repr)
def test_scale_and_softcap_take_numpy_numbers_and_0d_tensors(form):
    q, k, v = qkv()
    as_float = float(form)
    torch.testing.assert_close(flashtile.attention(q, k, v, softmax_scale=form, softcap=20 * form),
                               flashtile.attention(q, k, v, softmax_scale=as_float, softcap=20 * as_float),
                               rtol=0, atol=0)


def test_the_call_cache_keys_on_number_values_not_forms(cached_calls):
    """True == 1 and an in-place change of a 0-d tensor must not reach a kept call."""
    q, k, v = qkv()
    flashtile.attention(q, k, v, softmax_scale=1, softcap=1)
    for refused in (dict(softmax_scale=True, softcap=1), dict(softmax_scale=1, softcap=True)):
        with pytest.raises(ValueError, match="must be"):
            flashtile.attention(q, k, v, **refused)
    scale = torch.tensor(0.5)
    flashtile.attention(q, k, v, softmax_scale=scale)
    scale.fill_(0.25)
    torch.testing.assert_close(flashtile.attention(q, k, v, softmax_scale=scale),
                               flashtile.attention(q, k, v, softmax_scale=0.25), rtol=0, atol=0)


def test_kernel_ready_copies_only_what_the_kernels_cannot_read():
    """16-byte loads need aligned rows; tensor maps (Hopper's K/V loads) need a positive stride wherever a
    dimension has more than one index. Everything else reaches the kernels as it is, without a copy."""
    from flashtile import dispatch

    base = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    assert dispatch.kernel_ready(base) is base
    strided = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16)[:, :, ::2]  # every other head: still aligned
    assert dispatch.kernel_ready(strided) is strided
    broadcast = base.expand(3, -1, -1, -1)                               # batch stride 0
    ready = dispatch.kernel_ready(broadcast)
    assert ready is not broadcast and ready.stride(0) > 0 and torch.equal(ready, broadcast)
    shifted = torch.randn(1, 8, 2, 17, dtype=torch.bfloat16)[..., 1:]    # base 2 bytes past alignment
    ready = dispatch.kernel_ready(shifted)
    assert ready.data_ptr() % 16 == 0 and torch.equal(ready, shifted)


def test_the_call_signature_records_whether_gradients_are_wanted():
    """A kept call answers one signature: a call that wants gradients never reuses an inference call's plan."""
    q = torch.randn(1, 4, 2, 8)
    leaf = q.clone().requires_grad_()
    assert api._signature(q, q, q, ())[api._KEY_GRAD] is False
    assert api._signature(leaf, q, q, ())[api._KEY_GRAD] is True
    with torch.no_grad():
        assert api._signature(leaf, q, q, ())[api._KEY_GRAD] is False


def test_a_repeated_cpu_call_is_kept_without_its_tensors(monkeypatch):
    """The CPU's calls are kept by signature like CUDA's plans: a repeat checks nothing again (half the host time
    of a small call), and the kept call holds no tensor of the call that made it."""
    from flashtile import dispatch

    monkeypatch.setattr(api, "_calls", {})
    api.clear_calls()
    q, k, v = qkv()
    first = flashtile.attention(q, k, v, causal=True)
    (kept,) = api._calls.values()
    assert isinstance(kept, dispatch.GeneralCall) and kept.problem.q is None and kept.problem.k is None

    def no_checks(*args):
        raise AssertionError("a kept call ran the checks again")
    monkeypatch.setattr(api, "_check_tensor", no_checks)
    q2, k2, v2 = (t + 1 for t in (q, k, v))
    torch.testing.assert_close(flashtile.attention(q2, k2, v2, causal=True),
                               attention_ref(q2, k2, v2, causal=True)[0].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flashtile.attention(q, k, v, causal=True), first, rtol=0, atol=0)


def test_a_kept_cpu_call_does_not_serve_another_device_of_the_same_signature(monkeypatch):
    """A signature records the device index, which the CPU and meta share (-1): meta operands still get the
    full path's clear error."""
    monkeypatch.setattr(api, "_calls", {})
    api.clear_calls()
    q, k, v = qkv(dtype=torch.float64)
    flashtile.attention(q, k, v)
    with pytest.raises(TypeError, match="q is torch.float64.*CPU-only"):
        flashtile.attention(q.to("meta"), k.to("meta"), v.to("meta"))
