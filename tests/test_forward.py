"""FwdProblem.params packs every AttnParams field where params.cuh expects it."""

import torch

from flashtile import launch, plans
from flashtile.forward import LOG2E, FwdProblem


def unpack(values: tuple) -> dict:
    """Through the real struct layout and back, by field name."""
    packed = launch.PARAMS_STRUCT.pack(*values)
    return dict(zip((name for name, _ in launch.PARAM_FIELDS), launch.PARAMS_STRUCT.unpack(packed)))


def test_dense_problem_fields_by_name():
    q = torch.randn(3, 50, 8, 64)[:, :, :, :40]     # strided: (3, 50, 8, 40) view
    k = torch.randn(3, 70, 2, 40)
    v = torch.randn(3, 70, 2, 24)
    slopes = torch.rand(3, 8)
    p = FwdProblem(q, k, v, 0.25, (12, 0), softcap=7.0, alibi_slopes=slopes, want_lse=True)
    o, lse = plans.empty_outputs(p.q, p.out_shape(), p.lse_shape())
    scores = torch.empty(4)
    f = unpack(p.params(o, lse, scores))
    assert (f["q"], f["k"], f["v"], f["o"]) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())
    assert (f["lse"], f["scores"], f["alibi_slopes"]) == (lse.data_ptr(), scores.data_ptr(), slopes.data_ptr())
    assert f["cu_seqlens_q"] == f["cu_seqlens_k"] == 0
    assert (f["q_batch_stride"], f["q_row_stride"], f["q_head_stride"]) == q.stride()[:3]
    assert (f["k_batch_stride"], f["k_row_stride"], f["k_head_stride"]) == k.stride()[:3]
    assert (f["v_batch_stride"], f["v_row_stride"], f["v_head_stride"]) == v.stride()[:3]
    assert (f["o_batch_stride"], f["o_row_stride"], f["o_head_stride"]) == o.stride()[:3]
    assert o.shape == (3, 50, 8, 24) and lse.shape == (3, 8, 50)
    assert (f["lse_batch_stride"], f["lse_head_stride"]) == (8 * 50, 50)
    assert f["alibi_batch_stride"] == 8
    assert (f["batch"], f["heads_q"], f["heads_kv"], f["group"]) == (3, 8, 2, 4)
    assert (f["seqlen_q"], f["seqlen_k"], f["head_dim"], f["head_dim_v"]) == (50, 70, 40, 24)
    assert f["softmax_scale"] == 0.25 and abs(f["scale_log2"] - 0.25 * LOG2E) < 1e-6 and f["softcap"] == 7.0
    assert (f["window_left"], f["window_right"]) == (12, 0)


def test_varlen_problem_fields_by_name():
    q, k, v = torch.randn(30, 4, 64), torch.randn(45, 2, 64), torch.randn(45, 2, 64)
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 45], dtype=torch.int32)
    p = FwdProblem(q, k, v, 0.125, (-1, -1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                   max_seqlen_q=20, max_seqlen_k=25, want_lse=True)
    o, lse = plans.empty_outputs(p.q, p.out_shape(), p.lse_shape())
    f = unpack(p.params(o, lse))
    assert (f["cu_seqlens_q"], f["cu_seqlens_k"]) == (cu_q.data_ptr(), cu_k.data_ptr())
    assert (f["q_batch_stride"], f["q_row_stride"], f["q_head_stride"]) == (0, 4 * 64, 64)
    assert lse.shape == (4, 30) and (f["lse_batch_stride"], f["lse_head_stride"]) == (0, 30)
    assert (f["batch"], f["seqlen_q"], f["seqlen_k"]) == (2, 20, 25)
    assert (f["window_left"], f["window_right"]) == (-1, -1)


def test_a_plan_encodes_maps_once_per_address_and_forgets_them_past_its_bound():
    kept, made = {}, []
    make = lambda key: lambda: made.append(key) or bytes(key)  # noqa: E731
    assert plans.kept_maps(kept, (1, 2), make((1, 2))) == bytes((1, 2))
    assert plans.kept_maps(kept, (1, 2), make((1, 2))) == bytes((1, 2)) and made == [(1, 2)]
    for i in range(plans.MAX_KEPT_MAPS - 1):
        plans.kept_maps(kept, (3, i), make((3, i)))
    assert len(kept) == plans.MAX_KEPT_MAPS
    plans.kept_maps(kept, (4, 4), make((4, 4)))
    assert kept == {(4, 4): bytes((4, 4))}
