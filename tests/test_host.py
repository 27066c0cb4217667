"""The host path's switch and build (host.py) on any machine; its kernels run in tests/test_host_gpu.py."""

import contextlib
import itertools
import math
import os
import random
import subprocess
import sys
import types
import warnings

import pytest
import torch

import flashtile
from flashtile import api, host, launch, plans

from nonfinite_cases import NONFINITE_CASES, blind_rows, case_id, check, expected_nan, make


@pytest.fixture
def fresh_host(monkeypatch):
    """host.py's module state as a new process has it, put back afterwards."""
    for name, value in (("_module", None), ("_failed", False), ("_building", None), ("_kept", None)):
        monkeypatch.setattr(host, name, value)


def test_mode_reads_the_environment_and_names_bad_values(monkeypatch):
    for value, expected in (("", "auto"), ("ON", "on"), (" off ", "off"), ("auto", "auto")):
        monkeypatch.setenv(host.MODE_ENV, value)
        assert host.mode() == expected
    monkeypatch.setenv(host.MODE_ENV, "yes")
    with pytest.raises(ValueError, match=host.MODE_ENV):
        host.mode()


def test_off_never_builds(monkeypatch, fresh_host):
    monkeypatch.setenv(host.MODE_ENV, "off")
    monkeypatch.setattr(host, "_build", lambda: pytest.fail("built"))
    assert host.extension() is None


def test_auto_without_a_compiler_serves_the_python_path(monkeypatch, fresh_host):
    monkeypatch.setenv(host.MODE_ENV, "auto")
    monkeypatch.setattr(host, "can_build", lambda: False)
    monkeypatch.setattr(host, "_build", lambda: pytest.fail("built"))
    assert host.extension() is None and host._building is None


def test_auto_builds_in_the_background_then_empties_the_call_cache(monkeypatch, fresh_host):
    monkeypatch.setenv(host.MODE_ENV, "auto")
    monkeypatch.setattr(host, "can_build", lambda: True)

    class Built:
        poisoned = None

        class KeptCalls(dict):
            def __init__(self, capacity):
                super().__init__({"a call kept before": None})
                self.capacity = capacity

        def set_poison(self, on):
            self.poisoned = on

    built = Built()
    monkeypatch.setattr(host, "_build", lambda: built)
    api._calls["a kept call"] = object()
    assert host.extension() is None  # the Python path serves while the build runs
    assert host.wait() is built and host.extension() is built
    assert "a kept call" not in api._calls and built.poisoned is False
    table = host.kept_calls()
    assert table == {} and table.capacity == host.MAX_KEPT_CALLS  # emptied with api's cache
    with host.python_path():
        assert host.kept_calls() is None


def test_a_failed_background_build_warns_once_and_the_python_path_serves(monkeypatch, fresh_host):
    monkeypatch.setenv(host.MODE_ENV, "auto")
    monkeypatch.setattr(host, "can_build", lambda: True)

    def broken():
        raise RuntimeError("no torch headers")

    monkeypatch.setattr(host, "_build", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        host.extension()
        assert host.wait() is None
    assert [w.category for w in caught] == [host.HostPathWarning] and "no torch headers" in str(caught[0].message)
    assert host.extension() is None  # no second attempt


def test_python_path_suspends_the_extension(monkeypatch):
    monkeypatch.setattr(host, "_module", object())
    api._calls["a kept call"] = object()
    with host.python_path():
        assert host.extension() is None and "a kept call" not in api._calls
    assert host.extension() is host._module


def test_describe_names_the_path_without_building(monkeypatch, fresh_host):
    monkeypatch.setattr(host, "_build", lambda: pytest.fail("built"))
    monkeypatch.setenv(host.MODE_ENV, "off")
    assert host.describe() == f"Python ({host.MODE_ENV}=off)"
    monkeypatch.setenv(host.MODE_ENV, "auto")
    monkeypatch.setattr(host, "can_build", lambda: False)
    assert host.describe() == "Python (no C++ compiler or Python headers found)"
    monkeypatch.setattr(host, "_failed", True)
    assert host.describe() == "Python (the C++ build failed)"
    monkeypatch.setattr(host, "_module", type("Built", (), {"__file__": "/cache/host/x.so"})())
    assert host.describe() == "C++ (/cache/host/x.so)"


def test_the_backward_address_block_follows_the_nested_params():
    """host.cpp writes dO's address (and the nine after it: dLSE's, then varlen's batch order) at
    BWD_ADDRESS_OFFSET."""
    values = launch.bwd_param_values(dout=0x1111, dq=0x2222, dq_semaphore=0x8888, dlse=0x9999, batch_order=0xaaaa)
    packed = launch.BWD_PARAMS_STRUCT.pack(*values)
    at = launch.BWD_ADDRESS_OFFSET
    words = [int.from_bytes(packed[at + 8 * i: at + 8 * i + 8], "little") for i in range(plans.BWD_ADDRESS_FIELDS)]
    assert words[0] == 0x1111 and words[1] == 0x2222 and words[-3:] == [0x8888, 0x9999, 0xaaaa]


# A fresh build on a 2-core machine takes about five minutes (300 s was once too few on the dev box).
BUILD_TIMEOUT_S = 900


@pytest.mark.skipif(not host.can_build(), reason="needs a C++ compiler and Python's headers")
def test_the_extension_builds_here(tmp_path):
    """The source compiles against this torch (CI's CPU build included), past a stale build marker, takes a plan's
    pieces and refuses bad ones with a Python error (a throwing bound constructor once killed the process on the
    H200). Built for the CPU vector width this machine does not take, so that both widths' kernels run against fp64
    on any machine. In a fresh process: one process cannot load two builds of one extension name."""
    script = f"""
import pytest
from flashtile import host, launch
module = host.extension()
assert host.build_dir().name in module.__file__
backward = module.make_backward([(0, 1, 1, 1, 128, 0)], bytes(launch.BWD_PARAMS_STRUCT.size), 0,
                           launch.BWD_ADDRESS_OFFSET, [1, 2, 3, 4], 8, 64, 0, 1, 1, 1, 1, None)
module.make_forward([(0, 1, 1, 1, 128, 0)], bytes(launch.PARAMS_STRUCT.size), 0, [], [1, 2, 3], None, False, False, backward, 0, 0)
with pytest.raises(RuntimeError, match="params struct"):
    module.make_forward([], bytes(4096), 0, [], [], None, False, False, None, 0, 0)
with pytest.raises(RuntimeError):
    module.make_forward([("not a launch",)], bytes(8), 0, [], [], None, False, False, None, 0, 0)
assert module.vector_bytes() == host.cpu_vector_bytes()
# The own kernel at this build's vector width (the other one than this machine's own builds take): its small-problem
# path and its decode path against fp64, forward and backward.
import torch
from flashtile import testing
for batch, sq, sk, hq, hkv, d, causal in [(2, 37, 37, 4, 2, 16, True), (1, 64, 64, 2, 2, 64, False),
                                          (1, 45, 20, 4, 1, 24, True), (2, 3, 1100, 8, 2, 64, True)]:
    g = torch.Generator().manual_seed(sk)
    q, k, v = (torch.randn(batch, n, h, d, generator=g) for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    dout = torch.randn(q.shape, generator=g)
    assert module.own_kernel_serves(q, k, v, causal)
    assert module.own_decode_serves(q, k, v, causal) == (sk == 1100)
    out, lse = module.own_forward(q, k, v, d ** -0.5, causal)
    assert testing.compare(q, k, v, out, lse, causal=causal).ok
    grads = module.own_backward(dout, q, k, v, out, lse, None, d ** -0.5, causal)
    assert testing.compare_grads(q, k, v, dout, grads, causal=causal).ok
print("built", module.__file__)
"""
    # A killed build leaves torch's marker behind, which torch alone would wait on forever.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
        folder = host.build_dir()
    folder.mkdir(parents=True)
    (folder / host.TORCH_BUILD_MARKER).write_text("left by a killed build")
    other_width = next(b for b in host.VECTOR_BYTES if b != host.cpu_vector_bytes())
    env = {**os.environ, "FLASHTILE_CACHE_DIR": str(tmp_path), host.MODE_ENV: "on",
           host.VECTOR_BYTES_ENV: str(other_width)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"built {tmp_path}" in done.stdout


def test_the_cpu_vector_width_follows_torchs_cpu_capability_and_names_the_build(monkeypatch):
    monkeypatch.delenv(host.VECTOR_BYTES_ENV, raising=False)
    for capability, width in (("AVX512", 64), ("AVX2", 32), ("DEFAULT", 32)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert host.cpu_vector_bytes() == width
    folders = set()
    for width in host.VECTOR_BYTES:
        monkeypatch.setenv(host.VECTOR_BYTES_ENV, str(width))
        assert host.cpu_vector_bytes() == width
        folders.add(host.build_dir())
    assert len(folders) == 2, "builds of both widths would share a folder"
    monkeypatch.setenv(host.VECTOR_BYTES_ENV, "48")
    with pytest.raises(ValueError, match=host.VECTOR_BYTES_ENV):
        host.cpu_vector_bytes()


# ---- torch's CPU kernel through the extension (GeneralCall.cpu_kernel) ----------------------------------------------

needs_build = pytest.mark.skipif(not host.can_build(), reason="needs a C++ compiler and Python's headers")

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, dtype): torch's kernel's calls, past what
# host.cpp's own kernel takes (seqlen_k above kOwnSeqlen)
CPU_CASES = [
    (2, 261, 261, 4, 2, 16, True, torch.float32),
    (1, 264, 264, 4, 4, 64, False, torch.bfloat16),
    (2, 20, 300, 2, 1, 32, False, torch.float64),
    (1, 270, 270, 2, 2, 8, True, torch.float16),
]
OWN_SEQLEN = 256  # host.cpp's kOwnSeqlen
DECODE_QUERIES = 16  # host.cpp's kDecodeQueries
DECODE_ROWS = 256  # host.cpp's kDecodeRows


def _cpu_leaves(case, seed=0):
    batch, sq, sk, hq, hkv, d, _, dtype = case
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d))
    return [torch.randn(s, generator=g, dtype=torch.float32).to(dtype).requires_grad_() for s in shapes]


def _cpu_step(case, leaves, dout):
    out, lse = flashtile.attention(*leaves, causal=case[6], return_lse=True)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout))


@needs_build
@pytest.mark.parametrize("case", CPU_CASES, ids=[str(c[:7]) + str(c[7])[6:] for c in CPU_CASES])
def test_the_cpu_kernel_call_matches_the_python_path_bitwise(monkeypatch, case):
    monkeypatch.setenv(host.MODE_ENV, "on")
    leaves = _cpu_leaves(case)
    dout = torch.randn(*leaves[0].shape, dtype=torch.float32).to(case[7])
    api.clear_calls()
    ours = _cpu_step(case, leaves, dout)
    assert [c.cpu_kernel is not None for c in api._calls.values()] == [True], "not the C++ kernel call"
    with host.python_path():
        theirs = _cpu_step(case, leaves, dout)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@needs_build
@pytest.mark.parametrize("case", CPU_CASES, ids=[str(c[:7]) + str(c[7])[6:] for c in CPU_CASES])
def test_cpu_training_calls_record_the_cpu_node_and_match_the_python_path(monkeypatch, case):
    """A training call whose LSE is not returned records the C++ node (its backward calls the kernel's backward
    with no second finite check); one whose LSE is returned keeps ops.Attention, where dLSE has a path. Both give
    what the Python path gives, bit for bit."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    leaves = _cpu_leaves(case)
    dout = torch.randn(*leaves[0].shape, dtype=torch.float32).to(case[7])
    api.clear_calls()
    out = flashtile.attention(*leaves, causal=case[6])
    assert out.grad_fn.name() == "flashtile::CpuAttentionBackward"
    ours = (out.detach(), *torch.autograd.grad(out, leaves, dout))
    out_with_lse, _ = flashtile.attention(*leaves, causal=case[6], return_lse=True)
    assert out_with_lse.grad_fn.name() != "flashtile::CpuAttentionBackward"
    with host.python_path():
        out = flashtile.attention(*leaves, causal=case[6])
        theirs = (out.detach(), *torch.autograd.grad(out, leaves, dout))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@needs_build
def test_the_cpu_nodes_output_changed_in_place_is_refused_at_backward(monkeypatch):
    """The kernel runs below autograd's dispatch (no view tracking), yet the output the node saved keeps its
    version counter: an in-place change before backward is an error, not a wrong gradient."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    q, k, v = _cpu_leaves(CPU_CASES[0])
    out = flashtile.attention(q, k, v, causal=True)
    assert out.grad_fn.name() == "flashtile::CpuAttentionBackward"
    loss = out.float().sum()
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match="inplace operation"):
        loss.backward()


FUZZ_CASES = 300
# How far host.cpp's own kernel may be from the Python path (torch's kernel or the chunked loop) per dtype: both
# compute in fp32 (fp64 for fp64, whose LSE is fp32 on both paths) and differ only in the order of their sums.
FUZZ_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 3e-2}


def _poison(rng, target):
    """A NaN, +Inf or -Inf in `target` (b, s, h, d): one element, or one whole head vector."""
    import math

    at = tuple(rng.randrange(n) for n in target.shape[:3])
    value = rng.choice([math.nan, math.inf, -math.inf])
    if rng.random() < 0.5:
        target[at].fill_(value)
    else:
        target[at + (rng.randrange(target.shape[3]),)] = value


def _assert_cpp_matches_python(q, k, v, causal, g):
    """The C++ calls and the Python path give the same outputs, LSEs and gradients: NaN exactly where the Python
    path has NaN, the rest within FUZZ_TOLERANCE."""
    leaves = [t.requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, generator=g).to(q.dtype)
    results = []
    for path in (contextlib.nullcontext(), host.python_path()):
        with path:
            api.clear_calls()
            out = flashtile.attention(*leaves, causal=causal)
            with torch.no_grad():
                lse = flashtile.attention(*leaves, causal=causal, return_lse=True)[1]
            results.append((out.detach(), lse, *torch.autograd.grad(out, leaves, dout)))
    for ours, theirs in zip(*results):
        tolerance = FUZZ_TOLERANCE[q.dtype]
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance, equal_nan=True)


@needs_build
def test_nonfinite_inputs_get_the_python_paths_answer_forward_and_backward(monkeypatch):
    """Seeded random NaN and Inf elements and vectors in q, k or v (shapes, GQA, causal or not, fp32, bf16, fp64):
    the C++ calls give what the Python path's rules give, outputs, LSEs and gradients, NaN for NaN. (torch's
    kernel often returns a finite LSE for a row that read a NaN in q, so no check of its outputs can stand in
    for the inputs' check.) These sizes are host.cpp's own kernel's, which reads NaN and Inf by the rules
    itself: NaN exactly where the Python path has NaN, the other values within FUZZ_TOLERANCE."""
    import random

    monkeypatch.setenv(host.MODE_ENV, "on")
    rng = random.Random(1)
    for _ in range(FUZZ_CASES):
        batch, seqlen, heads_kv, group = rng.choice([1, 2]), rng.choice([1, 3, 17]), rng.choice([1, 2]), rng.choice([1, 2])
        head_dim, causal = rng.choice([8, 16]), rng.random() < 0.5
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float64])
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        q = torch.randn(batch, seqlen, heads_kv * group, head_dim, generator=g).to(dtype)
        k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, generator=g).to(dtype) for _ in range(2))
        _poison(rng, rng.choice([q, k, v]))
        _assert_cpp_matches_python(q, k, v, causal, g)


@needs_build
def test_a_nonfinite_input_leaves_the_cpu_kernel_call_to_the_python_rules(monkeypatch):
    """torch's kernel cannot show a NaN: the C++ call returns None and the general path's rules decide (the rows
    that read the NaN are NaN, the others exact)."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    q, k, v = (t.detach() for t in _cpu_leaves(CPU_CASES[0]))
    k[0, 5, 1, 3] = float("nan")
    with torch.no_grad():
        out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
        with host.python_path():
            expected = flashtile.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out.isnan(), expected[0].isnan()) and out.isnan().any()
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, expected[1], rtol=0, atol=0, equal_nan=True)


@needs_build
@pytest.mark.parametrize("options", [dict(causal=True, softcap=5.0), dict(window_size=(4, 0)), dict(causal=True)],
                         ids=["softcap", "window", "causal-not-square"])
def test_the_cpu_kernel_call_is_not_taken_where_the_kernel_does_not_serve(monkeypatch, options):
    """Neither kernel: softcap and windows; and a causal mask on a problem that is not square and too large for
    host.cpp's own kernel, small-problem or decode path (torch's kernel's causal mask is top-left aligned)."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    api.clear_calls()
    seqlen_q = DECODE_QUERIES + 1  # past the decode path's queries too
    q = torch.randn(1, seqlen_q, 2, 16)
    k = v = torch.randn(1, seqlen_q if "causal" not in options or len(options) > 1 else OWN_SEQLEN + 1, 2, 16)
    with torch.no_grad():
        flashtile.attention(q, k, v, **options)
    assert [c.cpu_kernel for c in api._calls.values()] == [None]


# ---- host.cpp's own kernel (small problems: GeneralCall.cpu_kernel without torch's kernel) ---------------------------

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, dtype)
OWN_CASES = [
    (2, 37, 37, 4, 2, 16, True, torch.float32),
    (1, 64, 64, 4, 4, 64, False, torch.bfloat16),
    (2, 20, 45, 2, 1, 32, True, torch.float64),     # causal, fewer queries than keys: bottom-right aligned
    (1, 45, 20, 4, 1, 24, True, torch.float32),     # more queries than keys: the first 25 rows see no key
    (1, 33, 33, 2, 2, 8, True, torch.float16),
    (1, 16, 16, 16, 16, 128, True, torch.float32),
    (3, 5, 17, 6, 3, 40, False, torch.bfloat16),
    (1, 128, 128, 2, 2, 64, True, torch.float32),
    (2, 256, 256, 8, 2, 64, False, torch.float32),  # 4M multiply-adds a head: GQA's wider limit
    (1, 160, 200, 4, 4, 128, True, torch.bfloat16),  # and the causal mask's, fewer queries than keys
    (1, 300, 100, 2, 2, 128, True, torch.float32),   # more queries than keys
]


def _own_ids(cases):
    return [str(c[:7]) + str(c[7])[6:] for c in cases]


@needs_build
@pytest.mark.parametrize("case", OWN_CASES, ids=_own_ids(OWN_CASES))
def test_the_own_kernel_matches_the_fp64_reference_with_the_lse_and_its_gradient(monkeypatch, case):
    """Small problems take host.cpp's own kernel through the C++ kernel call (non-square causal ones included,
    which torch's kernel cannot mask): out and LSE, and dq, dk, dv with the loss using both out and the LSE, within
    twice PyTorch's own error in the inputs' precision against fp64 (testing.py's rule)."""
    from flashtile import testing

    monkeypatch.setenv(host.MODE_ENV, "on")
    batch, sq, sk, hq, hkv, d, causal, dtype = case
    leaves = _cpu_leaves(case, seed=1)
    assert host.extension().own_kernel_serves(*leaves, causal)
    api.clear_calls()
    out, lse = flashtile.attention(*leaves, causal=causal, return_lse=True)
    assert [c.cpu_kernel is not None for c in api._calls.values()] == [True], "not the C++ kernel call"
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    dlse = torch.randn(lse.shape, generator=g).masked_fill(torch.isneginf(lse), 0.0)  # blind rows: no gradient
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    q, k, v = (t.detach() for t in leaves)
    comparison = testing.compare(q, k, v, out.detach(), lse.detach(), causal=causal)
    assert comparison.ok, comparison
    grad_comparison = testing.compare_grads(q, k, v, dout, grads, dlse=dlse, causal=causal)
    assert grad_comparison.ok, grad_comparison
    with torch.no_grad():  # the kept call, found in the extension's table, gives the same
        again = flashtile.attention(*leaves, causal=causal, return_lse=True)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@needs_build
@pytest.mark.parametrize("case", OWN_CASES[:4], ids=_own_ids(OWN_CASES[:4]))
def test_the_own_kernels_training_call_records_the_cpu_node_and_reads_any_strides(monkeypatch, case):
    """A training call whose LSE is not returned records the C++ node, whose backward is the own kernel's; q, k, v
    as strided views (heads first in memory) give what contiguous copies give, bit for bit."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    leaves = _cpu_leaves(case, seed=3)
    strided = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in leaves]
    dout = torch.randn(*leaves[0].shape, dtype=torch.float32).to(case[7])
    api.clear_calls()
    results = []
    for operands in (leaves, strided):
        out = flashtile.attention(*operands, causal=case[6])
        assert out.grad_fn.name() == "flashtile::CpuAttentionBackward"
        results.append((out.detach(), *torch.autograd.grad(out, operands, dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _torchs_kernel(q, k, v, causal):
    """torch's CPU kernel's (out, lse) as host.cpp's torch_forward calls it: its bits, to compare with."""
    out, lse = torch._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2), lse


def _choose_own(module, q, k, causal):
    """The own kernel for the kind of problem (q, k) make, forward and backward: for tests of its bits where
    torch's kernel also serves, so that no measurement can choose torch's."""
    for backward in (False, True):
        module.set_kernel_choice(q, k, causal, backward, True)


def _chosen(module):
    """{(pass, own)} of the kinds of problem measured so far ('forward' or 'backward')."""
    return {("backward" if fields[7] else "forward", own) for fields, own in module.kernel_choices()}


MEASURED_CASES = [
    (2, 96, 96, 4, 2, 32, False, torch.float32),   # the small-problem path
    (2, 96, 96, 4, 2, 32, True, torch.float32),
    (2, 1, 300, 8, 2, 32, False, torch.float32),   # the decode path, unmasked (torch's mask is top-left)
]


@needs_build
@pytest.mark.parametrize("case", MEASURED_CASES, ids=_own_ids(MEASURED_CASES))
def test_where_both_cpu_kernels_serve_the_faster_is_measured_once_and_kept(monkeypatch, case):
    """A problem served by both the own kernel (its small-problem or its decode path) and torch's kernel: its first
    call measures both and returns the chosen kernel's bits; later calls of that kind take the chosen kernel, and a
    choice set the other way is followed, forward and backward alike."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()
    causal = case[6]
    leaves = _cpu_leaves(case, seed=5)
    q, k, v = (t.detach() for t in leaves)
    assert module.own_kernel_serves(q, k, v, causal)
    scale = case[5] ** -0.5
    by_kernel = {True: module.own_forward(q, k, v, scale, causal)[0], False: _torchs_kernel(q, k, v, causal)[0]}
    assert not torch.equal(by_kernel[True], by_kernel[False])  # else the bits could not tell the kernels apart
    module.clear_kernel_choices()
    api.clear_calls()
    with torch.no_grad():
        first = flashtile.attention(q, k, v, causal=causal)
    [(direction, forward_own)] = _chosen(module)
    assert direction == "forward" and torch.equal(first, by_kernel[forward_own])
    with torch.no_grad():
        assert torch.equal(flashtile.attention(q, k, v, causal=causal), first)  # the kept call, in C++
    for own in (not forward_own, forward_own):
        module.set_kernel_choice(q, k, causal, False, own)
        with torch.no_grad():
            assert torch.equal(flashtile.attention(q, k, v, causal=causal), by_kernel[own])
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    grads = {}
    for own in (True, False):
        module.set_kernel_choice(q, k, causal, True, own)
        out = flashtile.attention(*leaves, causal=causal)
        assert out.grad_fn.name() == "flashtile::CpuAttentionBackward"
        grads[own] = torch.autograd.grad(out, leaves, dout)
        assert ("backward", own) in _chosen(module)
    assert not all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    module.clear_kernel_choices()
    module.set_kernel_choice(q, k, causal, False, forward_own)  # the forward as above: the backward reads its bits
    out = flashtile.attention(*leaves, causal=causal)  # a measured backward returns its choice's bits
    measured = torch.autograd.grad(out, leaves, dout)
    [own] = [own for direction, own in _chosen(module) if direction == "backward"]
    assert all(torch.equal(a, b) for a, b in zip(measured, grads[own]))


@needs_build
def test_deterministic_cpu_calls_take_the_own_kernel_by_rule_and_measure_nothing(monkeypatch):
    """In deterministic mode no timing decides the kernel: the own kernel's bits, whatever was chosen for the kind,
    and no kind is measured."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()
    leaves = _cpu_leaves((1, 64, 64, 4, 4, 32, False, torch.float32), seed=7)
    q, k, v = (t.detach() for t in leaves)
    module.clear_kernel_choices()
    module.set_kernel_choice(q, k, False, False, False)
    module.set_kernel_choice(q, k, False, True, False)
    api.clear_calls()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    results = {}
    for deterministic in (True, False):
        out = flashtile.attention(*leaves, deterministic=deterministic)
        results[deterministic] = (out.detach(), *torch.autograd.grad(out, leaves, dout))
    assert torch.equal(results[True][0], module.own_forward(q, k, v, 32 ** -0.5, False)[0])
    assert torch.equal(results[False][0], _torchs_kernel(q, k, v, False)[0])
    own_grads = module.own_backward(dout, q, k, v, results[True][0], module.own_forward(q, k, v, 32 ** -0.5, False)[1],
                                    None, 32 ** -0.5, False)
    assert all(torch.equal(a, b) for a, b in zip(results[True][1:], own_grads))
    assert _chosen(module) == {("forward", False), ("backward", False)}  # the two set, nothing measured


@needs_build
@pytest.mark.parametrize("where", ["k", "q"])
def test_a_kind_chosen_for_torchs_kernel_still_keeps_the_nan_rules(monkeypatch, where):
    """torch's kernel cannot show a NaN as flashtile's rules want; where it was chosen, a NaN input takes the own
    kernel: the same output, LSE and gradients as the deterministic (own kernel) call, NaN for NaN."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()
    leaves = _cpu_leaves((1, 48, 48, 2, 2, 16, True, torch.float32), seed=9)
    with torch.no_grad():
        (leaves[1] if where == "k" else leaves[0])[0, 5, 1, 3] = float("nan")
    module.clear_kernel_choices()
    module.set_kernel_choice(leaves[0], leaves[1], True, False, False)
    module.set_kernel_choice(leaves[0], leaves[1], True, True, False)
    api.clear_calls()
    dout = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(10))
    results = []
    for deterministic in (False, True):
        out = flashtile.attention(*leaves, causal=True, deterministic=deterministic)
        results.append((out.detach(), *torch.autograd.grad(out, leaves, dout)))
    assert results[0][0].isnan().any() and not results[0][0].isnan().all()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_build
def test_the_own_kernel_leaves_to_torchs_kernel_what_it_measured_slower_at(monkeypatch):
    """host.cpp's limits. The small-problem path: not too few queries to spread each head's copy of K and V over
    (decoding), not too much K and V to copy from cache, not too many keys or too much work a head (four times
    more under a causal mask or in a GQA group). The decode path takes what the small-problem path leaves, up to
    DECODE_QUERIES queries and DECODE_ROWS query rows per (batch, kv head) (its group's heads times seqlen_q), any
    number of keys. The rest keeps torch's kernel (square or not causal) or the general path."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()

    def operands(batch, sq, sk, hq, hkv, d):
        return torch.zeros(batch, sq, hq, d), torch.zeros(batch, sk, hkv, d), torch.zeros(batch, sk, hkv, d)

    def path(*shape, causal=False):
        tensors = operands(*shape)
        small, decode = module.own_small_serves(*tensors, causal), module.own_decode_serves(*tensors, causal)
        assert not (small and decode) and module.own_kernel_serves(*tensors, causal) == (small or decode)
        return "small" if small else "decode" if decode else "torch"
    assert path(1, 8, 8, 2, 2, 16) == path(1, 128, 128, 8, 8, 64) == path(1, 4, 200, 4, 1, 64) == "small"
    assert path(8, 1, 128, 32, 32, 128) == "decode"     # decoding: one query a head
    assert path(8, 16, 128, 32, 32, 128) == "decode"    # 4M elements of K: past the small path's copies
    assert path(1, 1, 100_000, 8, 1, 64) == "decode"    # any number of keys
    assert path(2, 8, 512, 16, 4, 64) == "decode"       # 4 heads x 8 queries a kv head
    assert path(1, DECODE_QUERIES, 300, 8, 2, 16) == "decode"
    assert path(1, DECODE_QUERIES + 1, 300, 8, 2, 16) == "torch"
    assert path(1, DECODE_QUERIES, 300, DECODE_ROWS // DECODE_QUERIES * 4, 4, 16) == "decode"
    assert path(1, DECODE_QUERIES, 300, (DECODE_ROWS // DECODE_QUERIES + 1) * 4, 4, 16) == "torch"  # rows
    assert path(1, 128, 128, 2, 2, 128) == "torch"      # 2M multiply-adds a head
    assert path(1, 256, 256, 8, 8, 64) == path(4, 256, 256, 16, 16, 32) == "torch"  # 4M and 2M
    # a causal mask, or a GQA group sharing each copy: up to 4M multiply-adds a head
    assert path(1, 128, 128, 2, 2, 128, causal=True) == path(1, 256, 256, 8, 8, 64, causal=True) == "small"
    assert path(4, 256, 256, 16, 4, 64) == path(2, 128, 128, 16, 8, 128) == path(4, 256, 256, 16, 4, 32) == "small"
    assert path(1, 256, 256, 8, 8, 128, causal=True) == path(1, 256, 256, 8, 2, 128) == "torch"  # 8M
    assert path(1, 512, 512, 8, 2, 16, causal=True) == "torch"                                    # keys
    bf16 = [t.bfloat16() for t in operands(1, 1, 4096, 8, 2, 64)]
    assert module.own_decode_serves(*bf16, False) and not module.own_decode_serves(bf16[0].float(), *bf16[1:], False)


OWN_SETUPS = ("causal-gqa", "blind-rows-gqa", "decode-gqa")
KERNEL_NONFINITE_CASES = [(setup, poison) for setup, poison in NONFINITE_CASES
                          if setup in OWN_SETUPS or setup == "square-torch"]


@needs_build
@pytest.mark.parametrize("case", KERNEL_NONFINITE_CASES, ids=[case_id(c) for c in KERNEL_NONFINITE_CASES])
def test_the_cpu_kernels_poison_exactly_the_rows_and_gradients_the_rule_names(monkeypatch, case):
    """reference.py's NaN rule through the C++ kernel call: the own kernel takes non-finite inputs itself (no check
    before it); torch's kernel (square-torch) must hand them to the Python path, in training, without grad and
    with the LSE returned: q found by its LSE, v by a scan, and k by a scan in training and by its LSE without
    grad. NaN in exactly the outputs, LSEs and gradients that read a NaN or Inf (tests/nonfinite_cases.py), the
    rest within fp32 tolerance of the fp64 reference on the clean inputs; rows that see no key stay 0 with LSE
    -inf."""
    from flashtile.testing import reference_grads
    from flashtile.reference import attention_ref

    monkeypatch.setenv(host.MODE_ENV, "on")
    setup, poison = case
    (q, k, v, clean_options), (pq, pk, pv, options), dout = make(setup, poison)
    leaves = [t.requires_grad_() for t in (pq, pk, pv)]
    own = setup in OWN_SETUPS
    assert host.extension().own_kernel_serves(*leaves, bool(options.get("causal"))) == own
    api.clear_calls()
    clean_out = flashtile.attention(*[t.clone().requires_grad_() for t in (q, k, v)], **clean_options)
    assert clean_out.grad_fn.name() == "flashtile::CpuAttentionBackward"  # the kernel takes clean inputs
    out = flashtile.attention(*leaves, **options)
    assert (out.grad_fn.name() == "flashtile::CpuAttentionBackward") == own
    grads = torch.autograd.grad(out, leaves, dout)
    with torch.no_grad():
        _, lse = flashtile.attention(*leaves, return_lse=True, **options)
    out_lse, lse_lse = flashtile.attention(*leaves, return_lse=True, **options)
    lse_grads = torch.autograd.grad(out_lse, leaves, dout)  # ops.Attention's backward: the LSE unused
    want_out, want_lse = attention_ref(q, k, v, **clean_options)
    want_grads = reference_grads(attention_ref, q, k, v, dout, torch.float64, **clean_options)
    nan = expected_nan(setup, poison)
    check("out", out.detach(), want_out, nan["out"], atol=1e-5)
    check("lse", lse, want_lse, nan["lse"], atol=1e-5)
    check("lse with grad", lse_lse.detach(), want_lse, nan["lse"], atol=1e-5)
    for name, grad, lse_grad, want in zip(("dq", "dk", "dv"), grads, lse_grads, want_grads):
        check(name, grad, want, nan[name], atol=1e-4)
        check(name, lse_grad, want, nan[name], atol=1e-4)
    blind = blind_rows(setup)
    assert (out.detach().transpose(1, 2)[blind] == 0).all() and torch.isneginf(lse[blind]).all()


@needs_build
@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_through_the_own_kernel_in_fp64(monkeypatch, causal):
    """fp64 through the own kernel (GQA, more queries than keys: blind rows under the causal mask) is
    differentiable to gradcheck's precision."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 7, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 5, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 5, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert host.extension().own_kernel_serves(q, k, v, causal)
    api.clear_calls()
    assert torch.autograd.gradcheck(lambda q, k, v: flashtile.attention(q, k, v, causal=causal), (q, k, v))
    assert [c.cpu_kernel is not None for c in api._calls.values()] == [True]


# ---- host.cpp's decode path (few query rows per kv head, any number of keys: K and V read where they lie) ----------

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, dtype). One (batch, kv head) pair over 1024 keys
# or more splits its keys in parts (flash-decoding) whatever the thread count: those rows test the merge.
DECODE_CASES = [
    (2, 1, 300, 8, 2, 64, False, torch.float32),
    (1, 1, 4100, 4, 1, 128, False, torch.float32),   # split
    (1, 3, 2500, 4, 1, 40, True, torch.float32),     # split, causal, a head dim the tiles pad
    (2, 2, 700, 6, 3, 32, True, torch.bfloat16),     # causal, fewer queries than keys: bottom-right aligned
    (1, 1, 2000, 8, 1, 64, False, torch.float16),    # split
    (1, 2, 1500, 2, 1, 24, True, torch.float64),     # split
    (1, 3, 2, 2, 2, 16, True, torch.float32),        # more queries than keys: the first row sees no key
    (2, 8, 600, 8, 2, 64, True, torch.float32),      # 32 rows a kv head
    (1, 16, 1100, 1, 1, 16, False, torch.float32),   # 16 rows: key-major scores, split
    (1, 4, 700, 8, 2, 32, True, torch.bfloat16),     # 16 rows (a group of four at four queries), causal
    (1, 2, 600, 8, 2, 24, True, torch.float64),      # 8 rows: key-major in fp64, causal, a padded head dim
    (2, 16, 300, 4, 2, 16, True, torch.float16),     # 32 rows: two vectors of rows a key, causal
    # Rows of four and eight at small head dims: the tile of keys transposed in registers, keys in the lanes
    (1, 4, 1100, 1, 1, 16, False, torch.float32),    # 4 rows (MHA at four queries), split
    (2, 8, 500, 2, 2, 32, True, torch.float32),      # 8 rows, causal
    (1, 2, 900, 8, 2, 16, True, torch.bfloat16),     # 8 rows (a group of four at two queries), causal
    (1, 4, 400, 4, 4, 8, True, torch.float64),       # 4 rows in fp64, a head dim the tiles pad
    (1, 1, 600, 4, 1, 12, True, torch.float32),      # 4 rows (a group of four at one query), a padded head dim
]


@needs_build
@pytest.mark.parametrize("case", DECODE_CASES, ids=_own_ids(DECODE_CASES))
def test_the_decode_path_matches_the_fp64_reference_with_the_lse_and_its_gradient(monkeypatch, case):
    """Decoding shapes take host.cpp's decode path through the C++ kernel call: out and LSE, and dq, dk, dv with
    the loss using both out and the LSE (dLSE), within twice PyTorch's own error in the inputs' precision against
    fp64; the training call without the LSE records the C++ node and gives the same gradients bit for bit."""
    from flashtile import testing

    monkeypatch.setenv(host.MODE_ENV, "on")
    causal, dtype = case[6], case[7]
    leaves = _cpu_leaves(case, seed=1)
    assert host.extension().own_decode_serves(*leaves, causal)
    _choose_own(host.extension(), *leaves[:2], causal)
    api.clear_calls()
    out, lse = flashtile.attention(*leaves, causal=causal, return_lse=True)
    assert [c.cpu_kernel is not None for c in api._calls.values()] == [True], "not the C++ kernel call"
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    dlse = torch.randn(lse.shape, generator=g).masked_fill(torch.isneginf(lse), 0.0)  # blind rows: no gradient
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse), retain_graph=True)
    q, k, v = (t.detach() for t in leaves)
    comparison = testing.compare(q, k, v, out.detach(), lse.detach(), causal=causal)
    assert comparison.ok, comparison
    grad_comparison = testing.compare_grads(q, k, v, dout, grads, dlse=dlse, causal=causal)
    assert grad_comparison.ok, grad_comparison
    trained = flashtile.attention(*leaves, causal=causal)
    assert trained.grad_fn.name() == "flashtile::CpuAttentionBackward" and torch.equal(trained, out)
    dlse_free = torch.autograd.grad((out, lse), leaves, (dout, torch.zeros_like(lse)))
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(trained, leaves, dout), dlse_free))


STRIDED_DECODE_CASES = DECODE_CASES[:4] + DECODE_CASES[8:9] + DECODE_CASES[12:13]


@needs_build
@pytest.mark.parametrize("case", STRIDED_DECODE_CASES, ids=_own_ids(STRIDED_DECODE_CASES))
def test_the_decode_path_reads_k_and_v_in_place_at_any_strides(monkeypatch, case):
    """Views give what contiguous copies give, bit for bit (the path reads fp32 vectors in place and converts the
    others per vector, in the same order of operations): through the API, heads first in memory and the first
    keys of a longer cache whose vectors are padded (NaN in the padding and past the keys: a slip would show);
    through the kernel itself, which the API does not limit to unit strides, every other element along the
    head dim."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()
    batch, _, seqlen_k, _, heads_kv, head_dim, causal, dtype = case
    leaves = _cpu_leaves(case, seed=3)
    q, k, v = (t.detach() for t in leaves)
    _choose_own(module, q, k, causal)
    heads_first = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v)]
    caches = [torch.full((batch, seqlen_k + 5, heads_kv, head_dim + 8), float("nan"), dtype=dtype) for _ in (k, v)]
    for cache, t in zip(caches, (k, v)):
        cache[:, :seqlen_k, :, :head_dim] = t
    in_cache = [cache[:, :seqlen_k, :, :head_dim] for cache in caches]
    dout = torch.randn(*q.shape, dtype=torch.float32).to(dtype)
    results = []
    for kv in ((k, v), heads_first, in_cache, (heads_first[0], in_cache[1])):
        operands = [t.detach().requires_grad_() for t in (q, *kv)]
        assert module.own_decode_serves(*operands, causal)
        out = flashtile.attention(*operands, causal=causal)
        results.append((out.detach(), *torch.autograd.grad(out, operands, dout)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    every_other = [torch.stack([t, torch.full_like(t, float("nan"))], dim=-1).flatten(-2)[..., ::2] for t in (q, k, v)]
    scale = head_dim ** -0.5
    kernel_results = []
    for operands in ((q, k, v), every_other):
        out, lse = module.own_forward(*operands, scale, causal)
        kernel_results.append((out, lse, *module.own_backward(dout, *operands, out, lse, None, scale, causal)))
    for a, b in zip(*kernel_results):
        assert torch.equal(a, b)


@needs_build
@pytest.mark.parametrize("seqlen_k", [5, 1100], ids=["one-part", "split"])
def test_gradcheck_through_the_decode_path_in_fp64(monkeypatch, seqlen_k):
    """fp64 through the decode path (GQA, causal, three queries so that the mask cuts the last keys per row; the
    keys split in parts at 1100) is differentiable to gradcheck's precision."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, seqlen_k, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, seqlen_k, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert host.extension().own_decode_serves(q, k, v, True)
    api.clear_calls()
    assert torch.autograd.gradcheck(lambda q, k, v: flashtile.attention(q, k, v, causal=True), (q, k, v))
    assert [c.cpu_kernel is not None for c in api._calls.values()] == [True]


PAGE_FAULTS_SCRIPT = """
import resource, torch
from flashtile import host
torch.set_num_threads(2)
module = host.extension()
q = torch.randn(1, 4, 8, 16)
k, v = torch.randn(1, 2048, 8, 16), torch.randn(1, 2048, 8, 16)
dout = torch.randn_like(q)
assert module.own_decode_serves(q, k, v, False)
out, lse = module.own_forward(q, k, v, 0.25, False)
module.own_backward(dout, q, k, v, out, lse, None, 0.25, False)
calls, before = 10, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(calls):
    module.own_backward(dout, q, k, v, out, lse, None, 0.25, False)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
print("threads", torch.get_num_threads(), "faults per page", faults / (2 * k.numel() * 4 / resource.getpagesize()))
"""


@needs_build
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults as Linux and glibc do")
def test_the_decode_backwards_threads_write_disjoint_pages():
    """A key's dK and dV lines of every kv head share memory pages, so threads that split the kv heads fault each
    fresh page of dK and dV twice; splitting the keys, about once. glibc's mmap threshold fixed under the buffers'
    size makes every call's dK and dV fresh pages."""
    env = {**os.environ, host.MODE_ENV: "on", "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", PAGE_FAULTS_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    if int(words[words.index("threads") + 1]) < 2:
        pytest.skip("torch runs one thread here")
    assert float(words[-1]) < 1.5, done.stdout


DECODE_FUZZ_CASES = 60


@needs_build
def test_nonfinite_inputs_on_the_decode_path_get_the_python_paths_answer(monkeypatch):
    """As the fuzz above, on decoding shapes (one to three queries, up to 32 rows a kv head, keys split in parts
    past 1024): NaN exactly where the Python path's rules put NaN, outputs, LSEs and gradients, the rest within
    FUZZ_TOLERANCE."""
    import random

    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()
    rng = random.Random(5)
    for _ in range(DECODE_FUZZ_CASES):
        batch, seqlen_q, heads_kv, group = rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.choice([1, 4])
        seqlen_k, head_dim, causal = rng.choice([2, 300, 1500]), rng.choice([8, 16]), rng.random() < 0.5
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float64])
        _check_poisoned_decode_case(module, rng, (batch, seqlen_q, heads_kv, group, seqlen_k, head_dim), causal, dtype)


def _check_poisoned_decode_case(module, rng, shape, causal, dtype):
    """One fuzz case of the decode path: fresh inputs of `shape` (batch, seqlen_q, heads_kv, group, seqlen_k,
    head_dim), one or two of them poisoned, the C++ answer against the Python path's."""
    batch, seqlen_q, heads_kv, group, seqlen_k, head_dim = shape
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    q = torch.randn(batch, seqlen_q, heads_kv * group, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=g).to(dtype) for _ in range(2))
    assert module.own_decode_serves(q, k, v, causal)
    for _ in range(rng.choice([1, 2])):
        _poison(rng, rng.choice([q, k, v]))
    _assert_cpp_matches_python(q, k, v, causal, g)


KEY_MAJOR_FUZZ_CASES = 30


@needs_build
def test_nonfinite_inputs_on_key_major_decode_shapes_get_the_python_paths_answer(monkeypatch):
    """As the fuzz above, where a kv head's rows fill whole vectors (16 rows in fp32 and its 16-bit types, 8 or 16
    in fp64), so that its scores are key-major: causal masks cut rows lane by lane, keys split in parts past 1024."""
    import random

    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()
    rng = random.Random(11)
    for _ in range(KEY_MAJOR_FUZZ_CASES):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float64])
        group, seqlen_q = rng.choice([(1, 16), (4, 4), (2, 8)] + ([(4, 2)] if dtype == torch.float64 else []))
        batch, heads_kv = rng.choice([1, 2]), rng.choice([1, 2])
        seqlen_k, head_dim, causal = rng.choice([300, 1500]), rng.choice([8, 16]), rng.random() < 0.5
        _check_poisoned_decode_case(module, rng, (batch, seqlen_q, heads_kv, group, seqlen_k, head_dim), causal, dtype)


TRANSPOSED_TILE_FUZZ_CASES = 30


@needs_build
def test_nonfinite_inputs_where_rows_of_four_and_eight_transpose_the_tile_get_the_python_paths_answer(monkeypatch):
    """As the fuzz above, where a kv head has four or eight rows at small head dims (MHA at four or eight queries,
    a group of four at one or two), so that each tile of keys is transposed in registers and the scores come with
    the keys in the lanes: causal masks cut rows key by key, keys split in parts past 1024."""
    import random

    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()
    rng = random.Random(13)
    for _ in range(TRANSPOSED_TILE_FUZZ_CASES):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float64])
        group, seqlen_q = rng.choice([(1, 4), (1, 8), (4, 1), (4, 2), (2, 4)])
        batch, heads_kv = rng.choice([1, 2]), rng.choice([1, 2])
        seqlen_k, head_dim, causal = rng.choice([300, 1500]), rng.choice([8, 16, 32]), rng.random() < 0.5
        _check_poisoned_decode_case(module, rng, (batch, seqlen_q, heads_kv, group, seqlen_k, head_dim), causal, dtype)


def test_torchs_kernel_shows_every_row_that_reads_a_nonfinite_query_in_its_lse():
    """What host.cpp's rows_finite relies on, probed on the torch installed: with finite k and v, a row whose
    query holds a NaN or an Inf (one element or all) gets a NaN or infinite LSE from torch's CPU kernel, or the
    LSE of a masked-out row, exactly 0 (no row of a square problem is masked out). Random shapes, dtypes, scales
    and masks; keys with zero columns (Inf times 0 is NaN); rows past the kernel's blocks."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    rng = random.Random(11)
    g = torch.Generator().manual_seed(11)
    shown = 0
    for _ in range(150):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.float64])
        batch, heads_kv, group = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 4])
        seqlen, head_dim, causal = rng.choice([1, 17, 129, 300]), rng.choice([8, 64, 80]), rng.random() < 0.5
        q = torch.randn(batch, heads_kv * group, seqlen, head_dim, generator=g).to(dtype)
        k, v = (torch.randn(batch, heads_kv, seqlen, head_dim, generator=g).to(dtype) for _ in range(2))
        if rng.random() < 0.3:
            k[..., rng.randrange(head_dim)] = 0
        rows = []
        for _ in range(rng.choice([1, 3])):
            row = rng.randrange(batch), rng.randrange(heads_kv * group), rng.randrange(seqlen)
            column = rng.randrange(head_dim) if rng.random() < 0.8 else slice(None)
            q[row][column] = rng.choice([math.nan, math.inf, -math.inf])
            rows.append(row)
        _, lse = kernel(q, k, v, 0.0, causal, scale=rng.choice([None, 1e-3, 1.0]))[:2]
        for row in rows:
            value = lse[row].item()
            assert not math.isfinite(value) or value == 0.0, (dtype, q.shape, causal, row, value)
            shown += value == 0.0
    assert shown > 0  # the masked-out case happens, so the test reaches both branches


# How far torch's kernel may be from IEEE arithmetic in fp64 where a key of weight 0 holds an Inf, per dtype.
KEY_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def test_torchs_kernel_shows_every_row_that_reads_a_nonfinite_key_in_its_lse():
    """What host.cpp's KeyCheck::lse relies on, probed on the torch installed: with finite v, every row whose score
    of a key holding a NaN or an Inf is NaN or +inf gets a NaN or infinite LSE from torch's CPU kernel, or the LSE of
    a masked-out row, exactly 0; and where no row shows one (an Inf that gives every row that sees it a score of
    -inf: a key of weight 0), out and the LSE are IEEE arithmetic's. Random shapes, dtypes, scales and masks; a
    NaN or Inf in one element or a whole key; queries with a zero column (Inf times 0 is NaN) or a column of one
    sign (an Inf there gives every row a score of one sign)."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    rng = random.Random(12)
    g = torch.Generator().manual_seed(12)
    shown = quiet = 0
    for _ in range(300):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.float64])
        batch, heads_kv, group = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 4])
        seqlen, head_dim, causal = rng.choice([1, 17, 129, 300, 600]), rng.choice([8, 64, 80]), rng.random() < 0.5
        q = torch.randn(batch, heads_kv * group, seqlen, head_dim, generator=g).to(dtype)
        k, v = (torch.randn(batch, heads_kv, seqlen, head_dim, generator=g).to(dtype) for _ in range(2))
        column = rng.randrange(head_dim)
        queries = rng.choice(["zero", "one sign", "random"])
        if queries == "zero":
            q[..., column] = 0
        elif queries == "one sign":
            q[..., column] = q[..., column].abs() + 0.1
        b, h, j = rng.randrange(batch), rng.randrange(heads_kv), rng.randrange(seqlen)
        k[b, h, j, column if rng.random() < 0.8 else slice(None)] = rng.choice([math.nan, math.inf, -math.inf])
        scale = rng.choice([None, 1e-3, 1.0])
        out, lse = kernel(q, k, v, 0.0, causal, scale=scale)[:2]
        factor = head_dim ** -0.5 if scale is None else scale
        kd, vd = (t.double().repeat_interleave(group, 1) for t in (k, v))
        s = torch.einsum("bhid,bhjd->bhij", q.double(), kd) * factor
        if causal:
            s = s.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1), -math.inf)
        reads = s.isnan() | (s == math.inf)  # (b, h, i, j): the rows the rule makes NaN
        poisoned = reads.any(-1)
        showing = ~torch.isfinite(lse) | (lse == 0)
        assert showing[poisoned].all(), (dtype, q.shape, causal, scale, queries)
        if showing.any():
            shown += 1
            continue
        quiet += 1
        tolerance = KEY_PROBE_TOLERANCE[dtype]
        want = torch.einsum("bhij,bhjd->bhid", torch.softmax(s, -1), vd)
        torch.testing.assert_close(out.double(), want, rtol=0, atol=tolerance)
        torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=tolerance)
    assert shown > 0 and quiet > 0  # both branches are reached


@needs_build
@pytest.mark.parametrize("chosen", [True, False], ids=["chosen", "torch-only"])
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
def test_calls_without_gradients_find_a_nonfinite_key_on_torchs_kernel_by_the_lse(monkeypatch, chosen, poison):
    """Without gradients torch's kernel runs with no scan of k (host.cpp's KeyCheck::lse), where it was chosen and
    where it serves alone, on a first call and on a kept one. A NaN in a key, or an Inf that gives the rows that
    see it a score of +inf, sends the call to the rules (the own kernel or the Python path: NaN where the Python
    path has NaN); an Inf that gives them a score of -inf is a key of weight 0, and torch's answer stands, finite,
    within fp32 tolerance of the Python path's."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()
    case = (1, 48, 48, 2, 2, 16, True, torch.float32) if chosen else CPU_CASES[0]
    q, k, v = (t.detach() for t in _cpu_leaves(case, seed=13))
    q[..., 0] = q[..., 0].abs() + 0.1  # every score of a key with an Inf at 0 takes that Inf's sign
    k[0, 5, 1, 0] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[poison]
    assert module.own_small_serves(q, k, v, True) == chosen
    module.clear_kernel_choices()
    if chosen:
        module.set_kernel_choice(q, k, True, False, False)
    api.clear_calls()
    with torch.no_grad():
        with host.python_path():
            want_out, want_lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
        for _ in range(2):  # planned, then kept
            out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
            assert torch.equal(out.isnan(), want_out.isnan()) and torch.equal(lse.isnan(), want_lse.isnan())
            assert out.isnan().any() != (poison == "-inf")
            torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5, equal_nan=True)
            torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5, equal_nan=True)


@needs_build
def test_the_extensions_finite_check_finds_every_nonfinite_kind(monkeypatch):
    """host.cpp's check: a bit scan of contiguous tensors (in chunks of 2^18 elements for 16-bit ones past that),
    the sum of 32- and 64-bit tensors past 2^18 elements and of strided views. Every NaN (either sign) and Inf is
    found wherever it sits, and the largest finite values and subnormals are not mistaken for one."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    module = host.extension()
    chunk = 1 << 18
    for dtype, numel in itertools.product((torch.float32, torch.float64, torch.bfloat16, torch.float16),
                                          (100, 7000, chunk + 5000)):
        x = torch.randn(numel).to(dtype)
        assert all(module.finite(t) for t in (x, x[::2], x.view(-1, 100 if numel % 100 == 0 else 1).t()))
        for at in sorted({0, min(chunk - 1, numel - 1), min(chunk, numel - 1), numel - 1}):
            for bad in (float("nan"), -float("nan"), float("inf"), float("-inf")):
                y = x.clone()
                y[at] = bad
                assert not module.finite(y), (dtype, numel, at, bad)
                assert not module.finite(y[::2] if at % 2 == 0 else y[1::2]), (dtype, numel, at, bad)
        info = torch.finfo(dtype)
        extremes = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, -info.tiny / 4, 0.0, -0.0], dtype=dtype)
        assert module.finite(extremes)


# ---- The extension's kept calls (a repeated call found and run in one crossing) --------------------------------------


@needs_build
def test_a_repeated_cpu_call_is_found_and_run_in_cpp(monkeypatch):
    """The second call of a signature never reaches api.py's own lookup: the extension's table finds the kept call
    and runs it, inference and training alike, with the first call's answer."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    host.extension()
    api.clear_calls()
    case = CPU_CASES[0]
    leaves = _cpu_leaves(case)
    with torch.no_grad():
        first = flashtile.attention(*leaves, causal=True)
    trained = flashtile.attention(*leaves, causal=True)
    assert len(host.kept_calls()) == 2  # one signature without gradients, one with

    def no_lookup(*args):
        raise AssertionError("api.py's lookup ran for a call the extension keeps")
    monkeypatch.setattr(api, "_signature", no_lookup)
    with torch.no_grad():
        assert torch.equal(flashtile.attention(*leaves, causal=True), first)
    again = flashtile.attention(*leaves, causal=True)
    assert again.grad_fn.name() == "flashtile::CpuAttentionBackward" and torch.equal(again, trained)
    dout = torch.randn(again.shape, dtype=again.dtype)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(again, leaves, dout),
                                                 torch.autograd.grad(trained, leaves, dout)))


@needs_build
def test_the_extensions_table_tells_options_strides_and_dtypes_apart(monkeypatch):
    """A kept call serves only its own signature: another option, layout or dtype is planned anew and gets its
    own answer (the Python path's, bit for bit)."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    host.extension()
    api.clear_calls()
    q, k, v = (t.detach() for t in _cpu_leaves(CPU_CASES[0]))
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # same shape and values, other strides
    calls = [dict(causal=True), dict(causal=False), dict(causal=True, softmax_scale=0.5),
             dict(causal=True, return_lse=True), dict(causal=True, deterministic=True)]
    signatures = [(options, operands) for options in calls
                  for operands in ((q, k, v), (q, k_strided, v), (q.double(), k.double(), v.double()))]
    with torch.no_grad():
        ours = [[flashtile.attention(*operands, **options) for _ in range(2)]  # planned, then served as kept
                for options, operands in signatures]
        assert len(host.kept_calls()) == 12  # every signature but the three whose LSE is returned (ops.Attention's)
        with host.python_path():
            theirs = [flashtile.attention(*operands, **options) for options, operands in signatures]
    for (options, operands), results, expected in zip(signatures, ours, theirs):
        for result in results:
            for a, b in zip(*(r if isinstance(r, tuple) else (r,) for r in (result, expected))):
                assert torch.equal(a, b), (options, operands[0].dtype, operands[1].stride())


@needs_build
def test_a_kept_call_with_a_nonfinite_input_or_under_functorch_takes_pythons_path(monkeypatch):
    """The table answers nothing where api.py's path must decide: an input that is not finite (the general
    path's NaN rules) and a functorch transform (autograd.Function.apply, which names what it lacks)."""
    monkeypatch.setenv(host.MODE_ENV, "on")
    host.extension()
    api.clear_calls()
    q, k, v = (t.detach() for t in _cpu_leaves(CPU_CASES[0]))
    with torch.no_grad():
        flashtile.attention(q, k, v, causal=True)
        k[0, 5, 1, 3] = float("nan")
        out = flashtile.attention(q, k, v, causal=True)
        with host.python_path():
            expected = flashtile.attention(q, k, v, causal=True)
    assert out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    k[0, 5, 1, 3] = 0.0
    q.requires_grad_()
    flashtile.attention(q, k, v, causal=True)  # kept with gradients
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda q: flashtile.attention(q, k, v, causal=True).sum())(q.detach())


def test_keep_hands_each_kind_of_call_to_its_table(monkeypatch):
    """host.keep: a call without a host path is not kept; torch's CPU kernel goes in with its options, a planned
    CUDA call with its C++ forward; both with whether the LSE is returned."""
    kept = []

    class Table:
        def keep_cpu(self, *args):
            kept.append(("cpu", *args[4:]))

        def keep_cuda(self, *args):
            kept.append(("cuda", *args[4:]))

    monkeypatch.setattr(host, "_kept", Table())
    monkeypatch.setattr(host, "_suspended", False)
    q = torch.zeros(1, 2, 1, 8)
    options = (True, None, (-1, -1), 0.0, False, False, "auto")
    cpu = host.CpuKernel(None, None, None, 0.5, True, True)
    forward = object()
    host.keep(q, q, q, options, types.SimpleNamespace(host=None), False)
    host.keep(q, q, q, options, types.SimpleNamespace(host=cpu), False)
    host.keep(q, q, q, options, types.SimpleNamespace(host=forward), True)
    assert kept == [("cpu", 0.5, True, True, False), ("cuda", forward, True)]
