"""Ring attention over gloo on the CPU (2 and 4 processes) and over NCCL on two or more GPUs: each rank's shard
against attention on the whole sequence, forward, LSE and gradients (tests/distributed_worker.py is one rank)."""

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


def _run_ranks(world: int, layout: str, causal: bool, tmp_path, device: str = "cpu") -> list[dict]:
    """Start `world` worker processes, wait for all; each rank's JSON result."""
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), port, layout, str(int(causal)),
                               str(tmp_path / f"rank{rank}.json"), device], env=env, stderr=subprocess.PIPE, text=True)
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


@pytest.mark.gpu
@pytest.mark.parametrize("layout", distributed.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_on_gpus_matches_the_fp64_reference(layout, causal, tmp_path):
    """NCCL on every GPU of the machine (two or more), bf16: the unsharded output, LSE and gradients meet the
    single-GPU tests' rule against the fp64 reference, as single-GPU flashtile does on the same inputs."""
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("ring attention over NCCL needs two or more GPUs")
    found = _run_ranks(world, layout, causal, tmp_path, device="cuda")[0]
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
    with pytest.raises(ValueError, match="window"):
        distributed.ring_attention(q, q, q, window_size=(4, 0))
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.ring_attention(q, q, q)
