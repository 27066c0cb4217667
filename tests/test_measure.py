"""The benchmark's timing rules that need no GPU: FLOP counts and the alternating best-of-rounds."""

import pytest

from flashtile.bench import measure


def test_attention_flops_conventions():
    full = measure.attention_flops(2, 3, 128, 256, 64)
    assert full == 4 * 2 * 3 * 128 * 256 * 64
    assert measure.attention_flops(2, 3, 128, 256, 64, causal=True) == full / 2
    assert measure.attention_flops(2, 3, 128, 256, 64, backward=True) == full * 2.5


def test_time_rounds_takes_each_kernels_best_median_and_alternates_the_order(monkeypatch):
    medians = {"a": [3.0, 1.0], "b": [2.0, 5.0]}
    timed, built = [], []

    def fake_time_cuda(fn, reps):
        name = fn()
        timed.append(name)
        return medians[name][sum(1 for n in timed if n == name) - 1]

    def maker(name):
        def build():
            built.append(name)
            return lambda: name
        return build

    monkeypatch.setattr(measure, "time_cuda", fake_time_cuda)
    best = measure.time_rounds({"a": maker("a"), "b": maker("b"), "none": lambda: None}, rounds=2)
    assert best == {"a": 1.0, "b": 2.0, "none": None}
    assert timed == ["a", "b", "b", "a"]          # the second round runs in reverse order
    assert built == ["a", "b", "b", "a"]          # every round builds its runner afresh


@pytest.mark.parametrize("rounds", [1, 3])
def test_time_rounds_runs_every_kernel_once_per_round(monkeypatch, rounds):
    calls = []
    monkeypatch.setattr(measure, "time_cuda", lambda fn, reps: calls.append(fn()) or 1.0)
    measure.time_rounds({k: (lambda k=k: lambda: k) for k in "xyz"}, rounds=rounds)
    assert sorted(calls) == sorted("xyz" * rounds)


def test_time_cpu_takes_turns_and_alternates_the_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    medians = measure.time_cpu(fns, reps=3, warmup=1)
    assert set(medians) == set("abc") and all(ms >= 0 for ms in medians.values())
    assert "".join(calls) == "abc" + "abc" + "cba" + "abc"


def test_performance_md_renders_every_committed_result(tmp_path):
    """performance.md is generated from docs/results: each result file there gets its section, with its numbers."""
    import json
    import shutil
    from pathlib import Path

    from flashtile.bench import report

    results = Path(__file__).parents[1] / "docs" / "results"
    shutil.copytree(results, tmp_path / "results")
    text = report.write_performance(tmp_path).read_text()
    for title in ("The standard matrix", "Decode", "Host overhead", "Context parallelism", "The ladder on the GPU"):
        assert f"## {title}" in text
    ring = json.loads((results / "ring.json").read_text())
    assert all(f"| {row['efficiency']:.3f} |" in text for row in ring["rows"])
