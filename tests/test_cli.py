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
    from flashtile import dispatch

    original = dispatch.backward

    def skewed(*args):
        dq, dk, dv = original(*args)
        return dq * 1.01, dk, dv

    monkeypatch.setattr(dispatch, "backward", skewed)
    assert cli.main(["check"]) == 1
    assert "FAIL backward" in capsys.readouterr().out


def test_bad_shape_is_named():
    with pytest.raises(SystemExit):
        cli.main(["bench", "ladder", "--shape", "4,16,x,64"])
