"""The command line on any machine: info, check (forward and backward), bad arguments."""

import re

import pytest

from flashtile import cli, specs


def test_info_runs(capsys):
    assert cli.main(["info"]) == 0
    assert "cache dir" in capsys.readouterr().out


def test_check_passes_and_covers_the_backward(capsys):
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "backward" in out and "FAIL" not in out


def test_check_reports_a_wrong_gradient(monkeypatch, capsys, python_path):
    """A backward that returns wrong gradients makes `check` fail (the check can fail). The wrong backward is
    the Python path's node, so the calls take that path."""
    from flashtile import ops

    original = ops.Attention.backward

    def skewed(ctx, *grads):
        dq, dk, dv, rest = original(ctx, *grads)
        return dq * 1.01, dk, dv, rest

    monkeypatch.setattr(ops.Attention, "backward", staticmethod(skewed))
    assert cli.main(["check"]) == 1
    assert "FAIL backward" in capsys.readouterr().out


def test_bad_shape_is_named():
    with pytest.raises(SystemExit):
        cli.main(["bench", "ladder", "--shape", "4,16,x,64"])


@pytest.mark.parametrize("arch", ["foo", "sm80", "sm_8", "90a", "sm_90b", "compute_90"])
def test_bad_arch_is_a_one_line_error(arch, capsys, cache_dir):
    with pytest.raises(SystemExit) as info:
        cli.main(["compile", "--arch", arch])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--arch" in err and repr(arch) in err and "sm_90a" in err
    assert "Traceback" not in err and not cache_dir.exists()


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90a", "sm_100a", "sm_120f"])
def test_good_arch_is_accepted(arch):
    assert cli._arch(arch) == arch


def test_compile_for_turing_builds_every_spec(capsys, cache_dir):
    """Turing's rungs 0-2 in every dtype, bf16 included, compile without spills (the spec list is short)."""
    from flashtile import registry

    assert cli.main(["compile", "--arch", "sm_75"]) == 0
    out = capsys.readouterr().out
    assert f"{len(registry.all_specs('sm_75'))} specs ready for sm_75" in out and "spills" not in out


SMALL_BENCH = ["bench", "ladder", "--shape", "1,2,64,64", "--dtype", "f32", "--reps", "1"]


def test_bench_writes_no_files_without_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(SMALL_BENCH) == 0
    assert list(tmp_path.iterdir()) == [] and "wrote" not in capsys.readouterr().out


def test_bench_writes_only_where_out_says(tmp_path, monkeypatch):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli.main([*SMALL_BENCH, "--out", str(out)]) == 0
    assert list(work.iterdir()) == [] and (out / "performance.md").is_file()
    assert any(p.suffix == ".json" for p in (out / "results").iterdir())


def test_cpu_ladder_shows_flashtile_beside_torchs_cpu_sdpa(tmp_path, capsys):
    """Without a GPU `bench ladder` times the CPU path; the table's speed-up is the ratio to torch's CPU SDPA. The
    table is rich's where the `bench` extra is installed, Markdown otherwise."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU the ladder times the rungs")
    assert cli.main(["bench", "ladder", "--shape", "1,2,64,16", "--dtype", "fp32", "--causal",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    bar = "│" if "│" in out else "|"
    assert re.search(r"speed-up (is )?over `?sdpa-flash \(cpu\)", out, re.IGNORECASE)
    rows = {line.split(bar)[1].strip(): line for line in out.splitlines() if line.count(bar) == 5}
    assert {"flashtile (cpu)", "chunked loop (cpu)", "sdpa-flash (cpu)", "sdpa-math (cpu)"} <= set(rows)
    assert rows["sdpa-flash (cpu)"].split(bar)[4].strip() == "1.00×"


@pytest.mark.parametrize("spec", [specs.naive_spec("bf16", "sm_80"),
                                  specs.hopper_fwd_spec("bf16", 128, 128, specs.HOPPER_FWD_TILES[128])],
                         ids=["one-argument", "tensor-maps"])
def test_bench_ladder_times_a_cold_compile_in_a_fresh_process(spec, cache_dir):
    """`bench ladder` rebuilds the top rung's spec from its repr in a new process (nothing warm there); every
    field type of a spec must survive that (the Hopper rung's KvBox once did not)."""
    from flashtile.bench import ladder as bench_ladder

    assert bench_ladder._cold_compile_seconds(spec) > 0
