"""Rung 4 (the production forward) against the fp64 reference: every feature and their combinations."""

import itertools

import pytest
import torch

import flashtile
from flashtile import specs
from feature_cases import DTYPES, case_id, feature_cases, feature_options
from flashtile.reference import varlen_apply, attention_ref
from flashtile.testing import compare, ERROR_RATIO, ABS_FLOOR

pytestmark = pytest.mark.gpu  # skipped where no CUDA device exists (conftest.py)

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128), (128, 64),
             (40, 40), (72, 72), (136, 136), (200, 200), (8, 8)]
SEQLENS = [(1, 1), (63, 63), (1000, 1000), (4097, 4097), (63, 1000), (1000, 63), (1, 4097), (257, 129)]

CASES = feature_cases(HEAD_DIMS, SEQLENS)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_pipelined_feature_combinations(case, poisoned_outputs):
    batch, sq, sk, hq, hkv, d, dv, dtype, features = case
    torch.manual_seed(hash(str(case)) % 2**31)
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, hkv, dv, device="cuda", dtype=dtype)
    options = feature_options(features, hq, batch, per_batch=batch > 1 and sq % 2 == 1)
    out, lse = flashtile.attention(q, k, v, return_lse=True, rung="pipelined", **options)
    result = compare(q, k, v, out, lse, **options)
    assert result.ok, f"{case}: {result}"


# Rung 5 (Hopper) serves the masks, GQA and the LSE at head dims padding to 64, 128 or 256 alike; the registry routes
# the rest to rung 4 (tests/test_registry.py).
HOPPER_CASES = [c for c in feature_cases(HEAD_DIMS + [(104, 104)], SEQLENS)
                if not ({"softcap", "alibi"} & set(c[8])) and c[5] == c[6] and (c[5] <= 64 or c[5] in (104, 128, 200, 256))]


@pytest.mark.parametrize("case", HOPPER_CASES, ids=[case_id(c) for c in HOPPER_CASES])
def test_hopper_feature_combinations(case, poisoned_outputs):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("rung 'hopper' runs on sm_90a")
    batch, sq, sk, hq, hkv, d, dv, dtype, features = case
    torch.manual_seed(hash(str(case)) % 2**31)
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, hkv, dv, device="cuda", dtype=dtype)
    options = feature_options(features, hq, batch)
    out, lse = flashtile.attention(q, k, v, return_lse=True, rung="hopper", **options)
    result = compare(q, k, v, out, lse, **options)
    assert result.ok, f"{case}: {result}"


VARLEN = [
    ([1, 63, 1000, 17], [1, 63, 1000, 17], {}),
    ([5, 300, 1], [700, 64, 3], {"causal": True}),
    ([129, 1, 4097], [129, 1, 4097], {"causal": True, "alibi": True}),
    ([100, 200, 300], [50, 400, 300], {"window_size": (32, 32), "softcap": 10.0}),
    ([64, 64, 64, 64], [128, 0, 64, 1], {"causal": True}),  # an empty key sequence: its rows see nothing
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("lengths_q,lengths_k,features", VARLEN)
def test_varlen(lengths_q, lengths_k, features, d, dv, dtype, poisoned_outputs):
    hq, hkv = 4, 2
    cu_q = torch.tensor([0] + list(itertools.accumulate(lengths_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(itertools.accumulate(lengths_k)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths_q), hq, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lengths_k), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lengths_k), hkv, dv, device="cuda", dtype=dtype)
    options = feature_options(features, hq, len(lengths_q), per_batch=True)
    out, lse = flashtile.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                          return_lse=True, rung="pipelined", **options)
    slopes = options.pop("alibi_slopes", None)
    ref_out, ref_lse = varlen_apply(attention_ref, q, k, v, cu_q, cu_k, alibi_slopes=slopes, **options)
    torch_out, torch_lse = varlen_apply(lambda *a, **kw: attention_ref(*a, dtype=dtype, **kw),
                                        q, k, v, cu_q, cu_k, alibi_slopes=slopes, **options)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    err = (out.double() - ref_out).abs().max().item()
    err_torch = (torch_out.double() - ref_out).abs().max().item()
    assert err <= ERROR_RATIO * err_torch + ABS_FLOOR, (err, err_torch)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    seen = ~torch.isinf(ref_lse)
    lse_err = (lse[seen].double() - ref_lse[seen]).abs().max().item()
    lse_err_torch = (torch_lse.double()[seen] - ref_lse[seen]).abs().max().item()
    assert lse_err <= ERROR_RATIO * lse_err_torch + ABS_FLOOR, (lse_err, lse_err_torch)


def test_strided_views_of_a_packed_qkv(poisoned_outputs):
    """q, k, v as views into one (b, s, 3, h, d) buffer: non-contiguous heads and rows."""
    qkv = torch.randn(2, 777, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
    assert compare(q, k, v, out, lse, causal=True).ok


@pytest.mark.parametrize("d,dv", [(104, 104), (120, 64), (128, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_kv_through_tensor_maps(d, dv, causal, poisoned_outputs):
    """On Hopper the d128 build loads K and V through tensor maps (tma.py): head dims short of the padded 128
    (the maps zero-fill the columns past them), K and V broadcast over the batch with stride 0 (copied first:
    a map cannot describe them), GQA, and key rows that end inside a tile."""
    torch.manual_seed(d + dv + causal)
    q = torch.randn(3, 1000, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 777, 2, d, device="cuda", dtype=torch.bfloat16).expand(3, -1, -1, -1)
    v = torch.randn(1, 777, 2, dv, device="cuda", dtype=torch.bfloat16).expand(3, -1, -1, -1)
    out, lse = flashtile.attention(q, k, v, causal=causal, return_lse=True)
    result = compare(q, k, v, out, lse, causal=causal)
    assert result.ok, result


@pytest.mark.parametrize("d", [64, 104, 256])
@pytest.mark.parametrize("causal,sq,sk", [(False, 1000, 1000), (True, 1000, 1000), (True, 1100, 700),
                                           (True, 1500, 1300), (False, 777, 1300)])
def test_hopper_blocks_that_run_many_tiles(d, causal, sq, sk, poisoned_outputs):
    """Rung 5 with several work tiles per persistent block: each tile's Q lands in one of two buffers while the
    tile before runs, the consumers' turns run on from tile to tile, and a consumer passes the key tiles its own
    rows do not see (past the sequence's end, above the causal diagonal, or every key when sk < sq). Q is a
    strided view of a packed tensor and d104 leaves columns for Q's map to zero-fill. Causal rows of at most
    specs.HOPPER_SHORT_CAUSAL_KEYS keys take the head dim's short causal tile where it has one, longer ones the
    table's."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("rung 'hopper' runs on sm_90a")
    torch.manual_seed(d + sq + sk + causal)
    padded = specs.pick_padded(d, specs.FWD_HEAD_DIMS)
    block_m, hq, hkv = specs.hopper_fwd_tile(padded, padded, "sm_90a").block_m, 8, 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = -(-4 * sms // (-(-sq // block_m) * hq))  # four work tiles per SM
    packed = torch.randn(batch, sq, hq, d + 8, device="cuda", dtype=torch.bfloat16)
    q = packed[..., 8:]
    k = torch.randn(batch, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    out, lse = flashtile.attention(q, k, v, causal=causal, return_lse=True, rung="hopper")
    result = compare(q, k, v, out, lse, causal=causal)
    assert result.ok, result


def _tail_split_heads(sq, sk, crossing):
    """Heads (batch 1, d128) for which rung 5's plan shares the last round out by key tiles on this GPU, with runs
    that end inside a unit (`crossing`) or not."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tile = specs.HOPPER_FWD_TILES[128]
    m_blocks, unit_tiles = -(-sq // tile.block_m), -(-sk // tile.block_n)
    for heads in range(1, 64):
        split = specs.hopper_tail_split(m_blocks * heads, min(m_blocks * heads, sms), unit_tiles, tile.consumers, 128)
        if split is not None and (unit_tiles % split.run != 0) == crossing:
            return heads
    raise AssertionError(f"no head count splits {sq}x{sk} on {sms} SMs")


@pytest.mark.parametrize("sq,sk,crossing,kv_group", [(2048, 2048, False, 1), (2048, 2500, True, 1),
                                                     (1900, 2000, False, 1), (1000, 3000, True, 0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hopper_tail_split(sq, sk, crossing, kv_group, dtype, poisoned_outputs):
    """Rung 5 without a mask where the units past the blocks' last full round are shared out by key tiles: pieces
    of one or several key tiles, runs that cross into the next unit, rows past the sequence (sq not a multiple of
    the block), a partly masked last key tile, MQA (kv_group 0: one K/V head). Each split unit's pieces merge in
    block order: a second call gives the same bits. A NaN key in the last head (a tail unit) makes that head's
    rows NaN, output and LSE, and leaves the other heads exact."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("rung 'hopper' runs on sm_90a")
    torch.manual_seed(sq + sk)
    hq = _tail_split_heads(sq, sk, crossing)
    hkv = hq if kv_group else 1
    q = torch.randn(1, sq, hq, 128, device="cuda", dtype=dtype)
    k = torch.randn(1, sk, hkv, 128, device="cuda", dtype=dtype)
    v = torch.randn(1, sk, hkv, 128, device="cuda", dtype=dtype)
    out, lse = flashtile.attention(q, k, v, return_lse=True, rung="hopper")
    result = compare(q, k, v, out, lse)
    assert result.ok, result
    again, lse_again = flashtile.attention(q, k, v, return_lse=True, rung="hopper")
    assert torch.equal(out, again) and torch.equal(lse, lse_again)
    if kv_group:
        k[0, sk // 3, -1, 5] = float("nan")
        out, lse = flashtile.attention(q, k, v, return_lse=True, rung="hopper")
        assert out[:, :, -1].isnan().all() and lse[:, -1].isnan().all()
        result = compare(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], out[:, :, :-1], lse[:, :-1])
        assert result.ok, result


def test_more_than_2_to_the_31_elements(poisoned_outputs):
    """q and out hold > 2^31 elements: every offset must be 64-bit."""
    sq, hq, d = (2**31 // (16 * 64)) + 1000, 16, 64
    q = torch.randn(1, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    assert q.numel() > 2**31
    k = torch.randn(1, 96, hq, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 96, hq, d, device="cuda", dtype=torch.bfloat16)
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    tail = slice(sq - 300, sq)  # rows whose offsets are past 2^31
    result = compare(q[:, tail], k, v, out[:, tail], lse[:, :, tail])
    assert result.ok, result
    assert torch.isfinite(out[:, :1000]).all()


@pytest.mark.parametrize("rung,option,value", [("tiled", "softcap", 5.0), ("mma", "softcap", 5.0),
                                               ("naive", "alibi_slopes", "slopes")])
def test_unsupported_option_for_a_rung_is_named(rung, option, value):
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    if value == "slopes":
        value = torch.rand(2, device="cuda")
    with pytest.raises(ValueError, match=option.split("_")[0]):
        flashtile.attention(q, q, q, rung=rung, **{option: value})


def test_a_repeated_call_runs_its_cached_plan():
    """The second call with one signature skips the checks and launches the cached plan; results stay exact,
    and an address that breaks 16-byte alignment falls back to the full path (which copies)."""
    from flashtile import api

    api.clear_calls()
    shape = (2, 300, 4, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flashtile.attention(q, k, v, causal=True, return_lse=True)
    assert len(api._calls) == 1
    q2, k2, v2 = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = flashtile.attention(q2, k2, v2, causal=True, return_lse=True)
    assert compare(q2, k2, v2, out, lse, causal=True).ok
    buffer = torch.randn(q2.numel() + 1, device="cuda", dtype=torch.bfloat16)
    shifted = buffer[1:].view(shape)  # same shape and strides, base address 2 bytes off
    shifted.copy_(q2)
    out, lse = flashtile.attention(shifted, k2, v2, causal=True, return_lse=True)
    assert compare(q2, k2, v2, out, lse, causal=True).ok
