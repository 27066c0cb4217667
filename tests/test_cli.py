"""The command line on any machine: info, check (forward and backward), bad arguments."""

import pytest

from flashtile import cli


def test_info_runs(capsys):
    assert cli.main(["info"]) == 0
    assert "cache dir" in capsys.readouterr().out


def test_check_passes_and_covers_the_backward(capsys):
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "backward" in out and "FAIL" not in out


def test_check_reports_a_wrong_gradient(monkeypatch, capsys):
    """A backward that returns wrong gradients makes `check` fail (the check can fail)."""
    from flashtile import ops

    original = ops.backward_op

    def skewed(*args):
        dq, dk, dv = original(*args)
        return dq * 1.01, dk, dv

    monkeypatch.setattr(ops, "backward_op", skewed)
    assert cli.main(["check"]) == 1
    assert "FAIL backward" in capsys.readouterr().out


def test_bad_shape_is_named():
    with pytest.raises(SystemExit):
        cli.main(["bench", "ladder", "--shape", "4,16,x,64"])


def test_cpu_ladder_shows_flashtile_beside_torchs_cpu_sdpa(tmp_path, capsys):
    """Without a GPU `bench ladder` times the CPU path; the table's speed-up is the ratio to torch's CPU SDPA."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU the ladder times the rungs")
    assert cli.main(["bench", "ladder", "--shape", "1,2,64,16", "--dtype", "fp32", "--causal",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "speed-up over sdpa-flash (cpu)" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") == 5}
    assert {"flashtile (cpu)", "chunked loop (cpu)", "sdpa-flash (cpu)", "sdpa-math (cpu)"} <= set(rows)
    assert rows["sdpa-flash (cpu)"].split("│")[4].strip() == "1.00×"
