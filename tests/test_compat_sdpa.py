"""The torch SDPA front door: flashtile.sdpa, scaled_dot_product_attention's drop-in."""

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import flashtile
from compat_helpers import ATOL, bhsd, grads_of, no_fallback, rand
from flashtile.compat import FallbackWarning

pytestmark = pytest.mark.usefixtures("fresh_warnings")


def test_sdpa_signature_is_torchs():
    params = inspect.signature(flashtile.sdpa).parameters.values()
    assert [(p.name, p.default, p.kind == inspect.Parameter.KEYWORD_ONLY) for p in params] == [
        ("query", inspect.Parameter.empty, False), ("key", inspect.Parameter.empty, False),
        ("value", inspect.Parameter.empty, False), ("attn_mask", None, False), ("dropout_p", 0.0, False),
        ("is_causal", False, False), ("scale", None, True), ("enable_gqa", False, True)]


@pytest.mark.parametrize("sq,sk", [(9, 9), (5, 12), (12, 5), (1, 7)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_matches_torch(sq, sk, is_causal):
    q, k, v = bhsd(sq=sq, sk=sk, dv=24)
    with no_fallback():
        out = flashtile.sdpa(q, k, v, is_causal=is_causal)
    assert out.shape == (2, 4, sq, 24)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), rtol=0, atol=ATOL)


def test_sdpa_positional_scale_gqa_and_mqa():
    q, k, v = bhsd(hkv=2, sq=6, sk=10)
    with no_fallback():
        out = flashtile.sdpa(q, k, v, None, 0.0, True, scale=0.25, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
        q, k, v = bhsd(hkv=1)  # one key/value head broadcasts in torch without enable_gqa
        torch.testing.assert_close(flashtile.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v), rtol=0, atol=ATOL)


@pytest.mark.parametrize("sq,sk", [(5, 12), (12, 5)])
def test_sdpa_gradients_match_torch(sq, sk):
    q, k, v = bhsd(hkv=2, sq=sq, sk=sk, requires_grad=True)
    out, grads = grads_of(lambda *t: flashtile.sdpa(*t, is_causal=True, enable_gqa=True), q, k, v)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, ref_grads = grads_of(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True),
                              q2, k2, v2)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=ATOL)


def test_sdpa_heads_mismatch_without_enable_gqa_fails_like_torch():
    q, k, v = bhsd(hkv=2)
    with pytest.raises(RuntimeError) as torch_error:
        F.scaled_dot_product_attention(q, k, v)
    with no_fallback(), pytest.raises(RuntimeError) as ours:
        flashtile.sdpa(q, k, v)
    assert str(ours.value) == str(torch_error.value)


def test_sdpa_mask_falls_back_to_torch_and_warns_once():
    q, k, v = bhsd(sq=6, sk=8)
    mask = rand(6, 8, seed=14) > 0
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = flashtile.sdpa(q, k, v, attn_mask=mask)
        second = flashtile.sdpa(q, k, v, mask)
    assert [(w.category, "attn_mask" in str(w.message)) for w in record] == [(FallbackWarning, True)]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.testing.assert_close(second, expected, rtol=0, atol=0)


def test_sdpa_dropout_and_fp64_fall_back_to_torch():
    q, k, v = bhsd()
    torch.manual_seed(3)
    with pytest.warns(FallbackWarning, match="dropout_p"):
        ours = flashtile.sdpa(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, dropout_p=0.3), rtol=0, atol=0)
    q, k, v = bhsd(dtype=torch.float64)
    with pytest.warns(FallbackWarning, match="float64"):
        out = flashtile.sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=0)


def test_sdpa_three_dim_inputs_fall_back():
    q, k, v = (t[0] for t in bhsd())
    with pytest.warns(FallbackWarning, match="4-D"):
        out = flashtile.sdpa(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)


def outcome(fn, *args):
    try:
        return fn(*args)
    except (RuntimeError, TypeError, ValueError) as error:
        return type(error), str(error)


def test_sdpa_inputs_torch_rejects_behave_as_in_torch():
    q, k, v = bhsd()
    with no_fallback():
        for args in [(q, k.half(), v), (q, k, v[:, :, :5]), ("q", k, v), (q, k[..., :8], v)]:
            ours, theirs = outcome(flashtile.sdpa, *args), outcome(F.scaled_dot_product_attention, *args)
            if isinstance(theirs, torch.Tensor):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
            else:
                assert ours == theirs
