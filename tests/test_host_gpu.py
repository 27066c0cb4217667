"""The C++ host path (csrc/host.cpp) against the Python path on the same plans: the same kernels read the same
params, so outputs, LSEs and (deterministic) gradients must agree bit for bit; and its autograd node keeps
autograd's rules (saved tensors, create_graph, streams)."""

import pytest
import torch

import flashtile
from autograd_checks import check_create_graph_refuses_a_second_order
from flashtile import api, host
from flashtile.testing import compare, compare_grads

pytestmark = pytest.mark.gpu  # skipped where no CUDA device exists (conftest.py)

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, causal): rung 5 with its tensor maps (d64,
# d128, d256), rung 4 where the head dims differ or are not padded alike, GQA, seqlen_q != seqlen_k.
CASES = [
    (2, 300, 300, 8, 2, 64, 64, True),
    (1, 1000, 1000, 4, 4, 128, 128, False),
    (2, 129, 513, 4, 1, 128, 128, True),
    (1, 257, 257, 2, 2, 256, 256, True),
    (2, 100, 140, 4, 2, 128, 64, False),
    (1, 77, 77, 3, 3, 96, 96, True),
]


def _leaves(case, dtype=torch.bfloat16, seed=0):
    batch, sq, sk, hq, hkv, d, dv, _ = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, dv))
    return [torch.randn(s, device="cuda", dtype=dtype, generator=g).requires_grad_() for s in shapes]


def _train_step(case, leaves, dout, dlse=None):
    q, k, v = leaves
    out, lse = flashtile.attention(q, k, v, causal=case[-1], return_lse=True, deterministic=True)
    loss_terms = [out, lse] if dlse is not None else [out]
    grads = torch.autograd.grad(loss_terms, (q, k, v), [dout, dlse] if dlse is not None else [dout])
    return out.detach(), lse.detach(), grads


def _host_call(q, k, v, causal):
    key = api._signature(q, k, v, (causal, None, (-1, -1), 0.0, True, True, "auto"))
    return api._calls[key]


@pytest.fixture(autouse=True)
def built():
    """This module needs the extension: on the H200 a compiler exists (conftest.py sets FLASHTILE_HOST=on)."""
    module = host.extension()
    assert module is not None, f"the host path did not build ({host.MODE_ENV}={host.mode()})"


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_host_path_matches_python_path_bitwise(case, with_dlse, poisoned_outputs, poisoned_grads):
    leaves = _leaves(case)
    q, k, v = leaves
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1], device="cuda") if with_dlse else None
    ours = _train_step(case, leaves, dout, dlse)
    assert _host_call(q, k, v, case[-1]).host is not None, "the call did not take the host path"
    with host.python_path():
        theirs = _train_step(case, leaves, dout, dlse)
        assert _host_call(q, k, v, case[-1]).host is None
    for a, b in zip((ours[0], ours[1], *ours[2]), (theirs[0], theirs[1], *theirs[2])):
        assert torch.equal(a, b)
    # and both are right: the fp64 reference
    result = compare(q.detach(), k.detach(), v.detach(), ours[0], ours[1], causal=case[-1])
    assert result.ok, result
    grads = compare_grads(q.detach(), k.detach(), v.detach(), dout, ours[2], dlse=dlse, causal=case[-1])
    assert grads.ok, grads


@pytest.fixture
def heads_in_groups(monkeypatch):
    """Backward plans made in this test run one key/value head per launch (a dQ accumulator budget of one byte);
    no call planned under it outlives the test."""
    from flashtile import backward

    api.clear_calls()
    monkeypatch.setattr(backward, "SCRATCH_LIMIT_BYTES", 1)
    yield
    api.clear_calls()


GROUPED_CASES = [case for case in CASES if case[4] > 1]  # more than one key/value head: more than one group


@pytest.mark.parametrize("case", GROUPED_CASES, ids=[str(c) for c in GROUPED_CASES])
def test_heads_in_groups_keep_the_host_path_and_its_bits(case, poisoned_outputs, poisoned_grads, request):
    """Past SCRATCH_LIMIT_BYTES the planned call runs its backward once per group of heads (the matrix's
    training shapes do; a backward with no dQ accumulator never groups): C++ and Python alike, bit for bit what
    one launch over all heads gives (deterministic mode), the LSE's gradient included."""
    leaves = _leaves(case)
    q, k, v = leaves
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1], device="cuda")
    whole = _train_step(case, leaves, dout, dlse)
    assert _host_call(q, k, v, case[-1]).backward_plan.groups.count == 1
    request.getfixturevalue("heads_in_groups")
    grouped = _train_step(case, leaves, dout, dlse)
    call = _host_call(q, k, v, case[-1])
    # A plan without an accumulator (the dQ pass, the last launch with shared memory: d256 on Hopper) has no
    # scratch to budget: one launch for all heads.
    groups = case[4] if call.backward_plan.launches[-1].smem == 0 else 1
    assert call.host is not None and call.backward_plan.groups.count == groups
    with host.python_path():
        python = _train_step(case, leaves, dout, dlse)
    for a, b, c in zip((whole[0], whole[1], *whole[2]), (grouped[0], grouped[1], *grouped[2]),
                       (python[0], python[1], *python[2])):
        assert torch.equal(a, b) and torch.equal(b, c)
    grads = compare_grads(q.detach(), k.detach(), v.detach(), dout, grouped[2], dlse=dlse, causal=case[-1])
    assert grads.ok, grads


def test_no_grad_calls_take_the_host_path_and_write_every_element(poisoned_outputs):
    q, k, v = (t.detach() for t in _leaves(CASES[1]))
    with torch.no_grad():
        out = flashtile.attention(q, k, v)
        out_again = flashtile.attention(q, k, v)
    key = api._signature(q, k, v, (False, None, (-1, -1), 0.0, False, False, "auto"))
    assert api._calls[key].host is not None
    assert torch.equal(out, out_again) and not out.isnan().any()
    assert compare(q, k, v, out).ok


def test_a_second_backward_through_a_freed_graph_is_refused():
    q, k, v = _leaves(CASES[0])
    out = flashtile.attention(q, k, v, causal=True)
    assert out.grad_fn.name() == "flashtile::AttentionBackward"
    out.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()


def test_an_output_changed_in_place_is_refused_at_backward():
    q, k, v = _leaves(CASES[0])
    out = flashtile.attention(q, k, v, causal=True)
    loss = out.float().sum()
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match="inplace operation"):
        loss.backward()


def test_create_graph_gives_the_same_gradients_and_refuses_a_second_order():
    q, k, v = _leaves(CASES[0])
    check_create_graph_refuses_a_second_order(q, k, v, torch.randn_like(q).requires_grad_())


def test_side_stream_forward_and_backward_match_the_default_stream():
    q, k, v = _leaves(CASES[1])
    dout = torch.randn_like(q)
    expected = _train_step(CASES[1], (q, k, v), dout)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = _train_step(CASES[1], (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(stream)
    for a, b in zip((expected[0], *expected[2]), (got[0], *got[2])):
        assert torch.equal(a, b)


def test_gradients_reach_only_the_inputs_that_require_them():
    q, k, v = _leaves(CASES[0])
    k.requires_grad_(False)
    out = flashtile.attention(q, k, v, causal=True)
    out.float().sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None


@pytest.mark.parametrize("case", CASES[:3], ids=[str(c) for c in CASES[:3]])
def test_repeated_calls_are_found_and_run_in_cpp(case, monkeypatch, poisoned_outputs, poisoned_grads):
    """A repeated call crosses into C++ once: the extension's table finds the planned call and runs it (no_grad,
    training with the node, the LSE returned), bit for bit as the first call; operands at an address the kernels'
    16-byte loads cannot take are left to api.py, which copies them."""
    api.clear_calls()
    q, k, v = _leaves(case)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)
    calls = (lambda: flashtile.attention(q, k, v, causal=case[-1], return_lse=True, deterministic=True),
             lambda: flashtile.attention(q, k, v, causal=case[-1]))
    first = [call() for call in calls]
    with torch.no_grad():
        first_no_grad = flashtile.attention(q, k, v, causal=case[-1])
    assert len(host.kept_calls()) == 3

    def no_lookup(*args):
        raise AssertionError("api.py's lookup ran for a call the extension keeps")
    with monkeypatch.context() as patch:
        patch.setattr(api, "_signature", no_lookup)
        again = [call() for call in calls]
        with torch.no_grad():
            assert torch.equal(flashtile.attention(q, k, v, causal=case[-1]), first_no_grad)
    assert torch.equal(again[0][0], first[0][0]) and torch.equal(again[0][1], first[0][1])
    assert again[0][0].grad_fn.name() == "flashtile::AttentionBackward"
    grads = [torch.autograd.grad(out, (q, k, v), dout) for out, _ in (again[0], first[0])]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert torch.equal(again[1], first[1]) and not again[1].isnan().any()
    assert compare(q.detach(), k.detach(), v.detach(), first_no_grad, causal=case[-1]).ok
    packed = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    q_odd = packed[1:].view(q.shape).copy_(q.detach())  # 2 bytes past an aligned address
    with torch.no_grad():
        assert torch.equal(flashtile.attention(q_odd, k.detach(), v.detach(), causal=case[-1]), first_no_grad)
