"""Ring attention over gloo on the CPU (2 and 4 processes) and over NCCL on two or more GPUs: each rank's shard
against attention on the whole sequence, forward, LSE and gradients (tests/distributed_worker.py is one rank)."""

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtile import distributed

TIMEOUT_S = 180
# fp64 inputs, but the LSE that weighs each part in the merge is fp32: errors of ~1e-6 are rounding, a wrong mask
# or a lost part is O(1).
TOLERANCE = 1e-5
WORKER = Path(__file__).with_name("distributed_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(world: int, layout: str, causal: bool, tmp_path, device: str = "cpu", window=(-1, -1)) -> list[dict]:
    """Start `world` worker processes, wait for all; each rank's JSON result."""
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), port, layout, str(int(causal)),
                               str(tmp_path / f"rank{rank}.json"), device, ",".join(map(str, window))],
                              env=env, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    try:
        codes = [r.wait(timeout=TIMEOUT_S) for r in ranks]
    finally:
        for r in ranks:
            r.kill()
    assert codes == [0] * world, [r.stderr.read()[-2000:] for r in ranks]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", distributed.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_matches_attention_on_the_whole_sequence(world, layout, causal, tmp_path):
    for rank, errors in enumerate(_run_ranks(world, layout, causal, tmp_path)):
        assert all(e < TOLERANCE for e in errors.values()), (rank, errors)


# Windows that reach across shards (the whole sequence is 16 x world tokens: zigzag chunks of 8, contiguous ones of
# 16), with and without the causal mask: (world, layout, causal, window).
WINDOW_CASES = [(2, layout, causal, window) for layout in distributed.LAYOUTS
                for causal, window in ((False, (5, 0)), (False, (9, 3)), (False, (0, 20)), (True, (30, -1)),
                                       (False, (-1, 7)))] + [(4, "zigzag", True, (9, 3)), (4, "contiguous", False, (3, 12))]


@pytest.mark.parametrize("world, layout, causal, window", WINDOW_CASES, ids=str)
def test_ring_attention_with_a_sliding_window(world, layout, causal, window, tmp_path):
    for rank, errors in enumerate(_run_ranks(world, layout, causal, tmp_path, window=window)):
        assert all(e < TOLERANCE for e in errors.values()), (rank, errors)


def test_each_pair_of_chunks_sees_exactly_the_windows_band():
    """_pair_bounds against the mask's definition, pair by pair: the rows and keys it keeps and the sub-problem's
    bottom-right-aligned window let through exactly the (query, key) pairs of the whole sequence's window."""
    def visible(i, j, left, right):
        return (left < 0 or j >= i - left) and (right < 0 or j <= i + right)

    for chunk in (1, 3, 8):
        for q_index, k_index in itertools.product(range(6), range(6)):
            for left, right in itertools.product([-1, 0, 1, 2, 7, 8, 9, 17, 100], [-1, 0, 1, 5, 8, 20]):
                want = {(a, b) for a in range(chunk) for b in range(chunk)
                        if visible(q_index * chunk + a, k_index * chunk + b, left, right)}
                got = set()
                bounds = distributed._pair_bounds(q_index, k_index, chunk, (left, right))
                if bounds is not None:
                    (q0, q1), (k0, k1), (pair_left, pair_right) = bounds
                    assert pair_left >= -1 and pair_right >= -1
                    offset = (k1 - k0) - (q1 - q0)
                    got = {(q0 + a, k0 + b) for a in range(q1 - q0) for b in range(k1 - k0)
                           if (pair_left < 0 or b >= a + offset - pair_left)
                           and (pair_right < 0 or b <= a + offset + pair_right)}
                assert got == want, (chunk, q_index, k_index, left, right, bounds)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", distributed.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_varlen_attention_matches_varlen_attention_on_the_whole_batch(world, layout, causal, tmp_path):
    """A packed batch of documents (one empty, several crossing chunk boundaries) split over the ranks like one
    sequence: each document attends within itself, as flashtile.varlen_attention on the whole batch does."""
    for rank, errors in enumerate(_run_ranks(world, layout, causal, tmp_path, device="varlen")):
        assert all(e < TOLERANCE for e in errors.values()), (rank, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("mode, layout, causal, window", [
    ("cuda", "zigzag", True, (-1, -1)), ("cuda", "contiguous", True, (-1, -1)), ("cuda", "zigzag", False, (-1, -1)),
    ("cuda", "contiguous", False, (-1, -1)), ("cuda", "zigzag", False, (300, 40)), ("cuda", "contiguous", True, (700, -1)),
    ("cuda-varlen", "zigzag", True, (-1, -1)), ("cuda-varlen", "contiguous", False, (-1, -1)),
], ids=str)
def test_ring_attention_on_gpus_matches_the_fp64_reference(mode, layout, causal, window, tmp_path):
    """NCCL over every GPU of the machine, bf16: the unsharded output, LSE and gradients meet the single-GPU tests'
    rule against the fp64 reference, as single-GPU flashtile does on the same inputs (dense, with windows across
    shards, and packed documents). On a machine of one GPU the ring has one rank, whose two zigzag chunks still
    meet as an off-diagonal pair."""
    world = torch.cuda.device_count()
    found = _run_ranks(world, layout, causal, tmp_path, device=mode, window=window)[0]
    assert found["single"]["forward_ok"] and found["single"]["grads_ok"], found["single"]
    assert found["ring"]["forward_ok"] and found["ring"]["grads_ok"], found["ring"]


def test_shard_and_unshard_are_inverse_layouts_single_process():
    """With one rank each layout keeps the whole sequence; the chunk order of zigzag is tested above."""
    assert distributed._chunks_of(1, 4, "zigzag") == (1, 6)
    assert distributed._chunks_of(3, 4, "contiguous") == (3,)
    assert distributed._pair_window(2, 1, causal=True) == (-1, -1)
    assert distributed._pair_window(2, 2, causal=True) == (-1, 0)
    assert distributed._pair_window(1, 2, causal=True) is None
    assert distributed._pair_window(1, 2, causal=False) == (-1, -1)


def test_bad_arguments_are_named():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="layout"):
        distributed.ring_attention(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="window_size"):
        distributed.ring_attention(q, q, q, window_size=(-4, 0))
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.ring_attention(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.ring_varlen_attention(q[0], q[0], q[0], [0, 8])
