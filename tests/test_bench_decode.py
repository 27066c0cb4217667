"""`flashtile bench decode` without a GPU: the command's wiring and --out rule, the paged layout it times, the
kernels of a row agreeing on CPU, and the report of old (contiguous only) and new (paged) results."""

import json
from pathlib import Path

import pytest
import torch

from flashtile import cli
from flashtile.bench import decode, report

# A results document from before the paged columns (session eight's H200 run), as scripts/bench_decode.py wrote it.
OLD_DOC = {"kind": "decode", "dtype": "bf16", "head_dim": 128, "rows": [
    {"batch": 64, "cache": 32768, "heads_q": 64, "heads_kv": 8,
     "tbps": {"flashtile": 4.47, "sdpa-flash": 2.44, "sdpa-cudnn": 4.46}},
    {"batch": 1, "cache": 65536, "heads_q": 32, "heads_kv": 8,
     "tbps": {"flashtile": 0.91, "sdpa-flash": 3.27, "sdpa-cudnn": 3.80}}]}
GPU_SYSTEM = {"date": "2026-12-01 10:00 UTC", "gpu": "NVIDIA H200", "arch": "sm_90a", "sms": 132,
              "nvidia_driver": "580.159.04", "cuda_driver": "13.0", "torch": "2.11.0", "nvrtc": "13.0",
              "cuda_core": "1.2.0", "flashtile": "0.1.0"}


def _new_doc(quick: bool = False) -> dict:
    """A results document as `decode.run` writes it, with made-up TB/s (one paged cell not measured)."""
    tbps = {decode.CONTIGUOUS: 4.0, decode.paged_name(16): 3.2, decode.paged_name(256): None,
            "sdpa-flash": 2.5, "sdpa-cudnn": 4.4}
    return {"kind": "decode", "dtype": "bf16", "head_dim": decode.HEAD_DIM, "page_sizes": list(decode.PAGE_SIZES),
            "quick": quick, "rows": [{"batch": 64, "cache": 32768, "heads_q": 64, "heads_kv": 8, "tbps": tbps}],
            "system": GPU_SYSTEM}


def _cache(batch=3, length=64, heads_kv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, length, heads_kv, d, generator=g) for _ in range(2))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_pages_gathered_through_the_block_table_are_the_contiguous_cache(page_size):
    k, v = _cache()
    k_pages, v_pages, table = decode.to_pages(k, v, page_size, torch.Generator().manual_seed(1))
    batch, length = k.shape[:2]
    assert table.dtype == torch.int32 and tuple(table.shape) == (batch, length // page_size)
    assert tuple(k_pages.shape) == (batch * length // page_size, page_size, *k.shape[2:])
    assert sorted(table.flatten().tolist()) == list(range(k_pages.shape[0]))   # every block once
    for pages, cache in ((k_pages, k), (v_pages, v)):
        assert torch.equal(pages[table.long()].reshape(cache.shape), cache)
    if table.numel() > 2:
        assert not torch.equal(table.flatten(), torch.arange(table.numel(), dtype=torch.int32))  # not in order


def test_the_gather_check_fails_on_a_wrong_block_table():
    """Two sequences' pages swapped in the table: the gather no longer gives the cache (the check above can fail)."""
    k, v = _cache()
    k_pages, _, table = decode.to_pages(k, v, 16, torch.Generator().manual_seed(1))
    swapped = table.flip(0)
    assert not torch.equal(k_pages[swapped.long()].reshape(k.shape), k)


def test_a_cache_that_is_not_whole_pages_is_refused():
    k, v = _cache(length=40)
    with pytest.raises(ValueError, match="multiple of the page size"):
        decode.to_pages(k, v, 16)


def test_a_rows_kernels_agree_on_cpu():
    """The callables a row times (flashtile contiguous and paged, and the SDPA peers that run on CPU) compute the
    same attention of one query token per sequence."""
    k, v = _cache(batch=2, length=512, heads_kv=2, d=16)
    q = torch.randn(2, 1, 4, 16, generator=torch.Generator().manual_seed(2))
    layouts = {size: decode.to_pages(k, v, size, torch.Generator().manual_seed(size)) for size in decode.PAGE_SIZES}
    runners = {name: make() for name, make in decode.makers(q, k, v, layouts).items()}
    assert list(runners) == [decode.CONTIGUOUS, *map(decode.paged_name, decode.PAGE_SIZES), *decode.SDPA_PEERS]
    expected = runners[decode.CONTIGUOUS]()
    assert expected.shape == q.shape
    reference = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) / 4, dim=-1)
    torch.testing.assert_close(expected, torch.einsum("bhqk,bkhd->bqhd", reference, v.repeat_interleave(2, dim=2)))
    for name, run in runners.items():
        if run is not None:
            out = run()
            torch.testing.assert_close(out.transpose(1, 2) if name in decode.SDPA_PEERS else out, expected,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_a_row_times_every_kernel_in_one_call_and_counts_the_caches_bytes(monkeypatch):
    """measure_row on CPU with the timer replaced: one time_rounds call holding every kernel; TB/s = K and V bytes
    (batch x cache x heads_kv x d x 2 bytes x 2) / time."""
    calls = []

    def fake_time_rounds(makers, reps):
        calls.append((list(makers), reps))
        return {name: None if name == "sdpa-cudnn" else 2.0 for name in makers}   # 2 ms; cuDNN does not run

    monkeypatch.setattr(decode.measure, "time_rounds", fake_time_rounds)
    row = decode.measure_row(2, 256, 4, 2, torch.bfloat16, 3, torch.Generator().manual_seed(0), head_dim=16)
    assert calls == [([decode.CONTIGUOUS, *map(decode.paged_name, decode.PAGE_SIZES), *decode.SDPA_PEERS], 3)]
    assert (row["batch"], row["cache"], row["heads_q"], row["heads_kv"]) == (2, 256, 4, 2)
    cache_bytes = 2 * 256 * 2 * 16 * 2 * 2
    assert row["tbps"][decode.CONTIGUOUS] == pytest.approx(cache_bytes / 2.0 / 1e9)
    assert row["tbps"]["sdpa-cudnn"] is None


def test_bench_decode_is_wired_and_writes_nothing_without_out(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("flashtile.bench.system.describe", lambda: GPU_SYSTEM)
    monkeypatch.setattr(decode, "run", lambda dtype, reps, quick, progress: calls.append((dtype, reps, quick))
                        or _new_doc(quick))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "decode", "--quick", "--reps", "7"]) == 0
    assert calls == [(torch.bfloat16, 7, True)]
    out = capsys.readouterr().out
    assert "flashtile paged-16" in out and "wrote" not in out
    assert list(tmp_path.iterdir()) == []


def test_bench_decode_writes_only_where_out_says(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("flashtile.bench.system.describe", lambda: GPU_SYSTEM)
    monkeypatch.setattr(decode, "run", lambda dtype, reps, quick, progress: _new_doc(quick))
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli.main(["bench", "decode", "--out", str(out)]) == 0
    assert list(work.iterdir()) == []
    assert json.loads((out / "results" / "decode.json").read_text())["rows"][0]["tbps"][decode.paged_name(16)] == 3.2
    assert "## Decode (`flashtile bench decode`)" in (out / "performance.md").read_text()


def test_bench_decode_without_a_gpu_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "decode", "--out", str(tmp_path / "out")]) == 1
    assert "No CUDA GPU" in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_quick_is_for_decode_only(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "matrix", "--quick"])
    assert info.value.code == 2 and "--quick" in capsys.readouterr().err


def test_report_renders_old_decode_results(tmp_path):
    """A decode.json from before the paged columns: its table has the contiguous ratio and no paged one."""
    (tmp_path / "results").mkdir()
    old = dict(OLD_DOC, system=GPU_SYSTEM)
    (tmp_path / "results" / "decode.json").write_text(json.dumps(old))
    text = report.write_performance(tmp_path).read_text()
    assert "## Decode (`flashtile bench decode`)" in text and "paged" not in text
    assert "| batch, cache, heads q/kv | flashtile | sdpa-flash | sdpa-cudnn | flashtile / sdpa-cudnn |" in text
    first = old["rows"][0]["tbps"]
    assert f"| 64, 32k, 64/8 | {first['flashtile']:.2f} |" in text
    assert f"| {first['flashtile'] / first['sdpa-cudnn']:.2f} |" in text


def test_report_renders_paged_columns_ratios_and_verdicts(tmp_path):
    report.save(_new_doc(quick=True), tmp_path)
    text = (tmp_path / report.PERFORMANCE).read_text()
    header = ("| batch, cache, heads q/kv | flashtile | flashtile paged-16 | flashtile paged-256 | sdpa-flash | "
              "sdpa-cudnn | flashtile / sdpa-cudnn | paged-16 / contiguous | paged-256 / contiguous |")
    assert header in text
    assert "| 64, 32k, 64/8 | 4.00 | 3.20 | - | 2.50 | 4.40 | 0.91 | 0.80 | - |" in text
    assert "flashtile contiguous / sdpa-cudnn ≥ 0.95 everywhere: no (lowest 0.91: row 64, 32k, 64/8)" in text
    assert "flashtile paged / contiguous ≥ 0.90 everywhere: no (lowest 0.80: row 64, 32k, 64/8, pages of 16)" in text
    assert "pages of 16 rows (`flashtile paged-16`) and 256 rows" in text and "`--quick` run" in text


def test_verdict_is_yes_only_when_every_ratio_is_measured_and_reaches_the_target():
    doc = _new_doc()
    doc["rows"][0]["tbps"].update({decode.paged_name(16): 3.9, decode.paged_name(256): 3.7})
    assert "flashtile paged / contiguous ≥ 0.90 everywhere: yes" in decode.markdown(doc)
    doc["rows"][0]["tbps"][decode.paged_name(256)] = None
    assert "flashtile paged / contiguous ≥ 0.90 everywhere: no" in decode.markdown(doc)
