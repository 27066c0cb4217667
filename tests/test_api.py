"""flashtile.attention on CPU tensors, and every kind of bad input it must refuse with a clear message."""

import pytest
import torch

import flashtile
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
