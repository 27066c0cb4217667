"""Results out: a terminal table, JSON, Markdown, a PNG, and docs/performance.md regenerated from them."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = "results"          # docs/results/<kind>.json, one file per benchmark kind
PERFORMANCE = "performance.md"


def _fmt(x, spec, dash="-"):
    return dash if x is None else format(x, spec)


def _tflops_spec(doc: dict) -> str:
    """TFLOP/s digits: a CPU does tenths of a TFLOP/s at best."""
    return ".3f" if doc["kind"] == "ladder-cpu" else ".1f"


def ladder_markdown(doc: dict) -> str:
    s = doc["shape"]
    lines = [f"Shape: batch {s['batch']}, heads {s['heads']}, seqlen {s['seqlen']}, head_dim {s['head_dim']}, "
             f"{doc['dtype']}, {'causal' if doc['causal'] else 'non-causal'} "
             f"({doc['flops'] / 1e9:.1f} GFLOP per call). Speed-up is over `{doc['baseline']}`.", "",
             "| kernel | ms | TFLOP/s | speed-up |", "|---|---:|---:|---:|"]
    for r in doc["rows"]:
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(f"| {r['name']}{note} | {_fmt(r['ms'], '.3f')} | {_fmt(r['tflops'], _tflops_spec(doc))} | "
                     f"{_fmt(r['speedup'], '.2f')}{'×' if r['speedup'] else ''} |")
    rt = doc.get("runtime")
    if rt:
        lines += ["", f"Runtime costs ({rt['spec']}): cold NVRTC compile {rt['cold_compile_s']:.2f} s, "
                  f"load from the disk cache {rt['cached_load_ms']:.1f} ms, host overhead of a warm "
                  f"`flashtile.attention` call ({rt['overhead_shape']}) {rt['host_overhead_us']:.1f} µs"
                  + (f" (a small torch op, `torch.add`, on the same host: {rt['torch_op_us']:.1f} µs)."
                     if "torch_op_us" in rt else ".")]
    return "\n".join(lines)


def print_table(doc: dict) -> None:
    if doc["kind"] == "matrix":
        from .matrix import markdown as matrix_markdown

        print(matrix_markdown(doc))
        return
    if doc["kind"] == "decode":
        from . import decode

        print(decode.description(doc), "", decode.markdown(doc), sep="\n")
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(ladder_markdown(doc))
        return
    table = Table(title=f"flashtile bench {doc['kind']}", caption=f"speed-up over {doc['baseline']}")
    for col in ("kernel", "ms", "TFLOP/s", "speed-up"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in doc["rows"]:
        table.add_row(r["name"], _fmt(r["ms"], ".3f"), _fmt(r["tflops"], _tflops_spec(doc)),
                      _fmt(r["speedup"], ".2f") + ("×" if r["speedup"] else ""))
    Console().print(table)


def plot_ladder(doc: dict, path: Path) -> bool:
    """A bar chart of TFLOP/s per kernel (log scale). False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in doc["rows"] if r["tflops"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = ["tab:blue" if r["kind"] in ("rung", "flashtile") else "tab:gray" for r in rows]
    bars = ax.bar([r["name"] for r in rows], [r["tflops"] for r in rows], color=colors)
    for bar, r in zip(bars, rows):
        if r["speedup"]:
            ax.annotate(f"{r['speedup']:.1f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("TFLOP/s (log scale)")
    s = doc["shape"]
    ax.set_title(f"flashtile ladder — {doc['system'].get('gpu') or 'CPU'}, b={s['batch']} h={s['heads']} "
                 f"n={s['seqlen']} d={s['head_dim']} {doc['dtype']}{' causal' if doc['causal'] else ''}")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def save(doc: dict, docs_dir: Path) -> list[Path]:
    """Write docs/results/<kind>.json (+ .png for the ladder) and regenerate docs/performance.md."""
    results = docs_dir / RESULTS
    results.mkdir(parents=True, exist_ok=True)
    written = [results / f"{doc['kind']}.json"]
    written[0].write_text(json.dumps(doc, indent=1))
    if doc["kind"].startswith("ladder") and plot_ladder(doc, results / f"{doc['kind']}.png"):
        written.append(results / f"{doc['kind']}.png")
    written.append(write_performance(docs_dir))
    return written


def _system_line(system: dict) -> str:
    if system.get("gpu"):
        return (f"{system['gpu']} ({system['arch']}, {system['sms']} SMs), NVIDIA driver "
                f"{system.get('nvidia_driver') or '?'} (CUDA {system['cuda_driver']}), torch {system['torch']}, "
                f"NVRTC {system['nvrtc']}, cuda-core {system['cuda_core']}, flashtile {system['flashtile']}")
    return f"CPU only ({system.get('cpu')}), torch {system['torch']}, flashtile {system['flashtile']}"


def write_performance(docs_dir: Path) -> Path:
    sections = ["# Performance", "",
                "Generated by `flashtile bench` from the files in `docs/results/`; do not edit by hand. "
                "Every ratio compares kernels measured in the same run on the same GPU (CUDA events, warm-up, "
                "median of 30 runs, fresh random inputs; the matrix and decode take each kernel's better median of two "
                "rounds, the second round in reverse order; in the matrix the training and inference forwards of "
                "every kernel take turns in the same rounds).", ""]
    matrix_json = docs_dir / RESULTS / "matrix.json"
    if matrix_json.exists():
        from .matrix import markdown as matrix_markdown

        doc = json.loads(matrix_json.read_text())
        sections += ["## The standard matrix (`flashtile bench`)", "",
                     f"Measured {doc['system']['date']} on {_system_line(doc['system'])}.", "",
                     matrix_markdown(doc), ""]
    decode_json = docs_dir / RESULTS / "decode.json"
    if decode_json.exists():
        from . import decode

        doc = json.loads(decode_json.read_text())
        sections += ["## Decode (`flashtile bench decode`)", "",
                     f"Measured {doc['system']['date']} on {_system_line(doc['system'])}. {decode.description(doc)}",
                     "", decode.markdown(doc), ""]
    overhead_json = docs_dir / RESULTS / "overhead.json"
    if overhead_json.exists():
        doc = json.loads(overhead_json.read_text())
        sections += ["## Host overhead (`scripts/overhead.py`)", "",
                     f"Measured {doc['system']['date']} on {_system_line(doc['system'])}. Wall µs per call, "
                     f"{'x'.join(map(str, doc['shape']))} (batch x seqlen x heads x head_dim) {doc['dtype']} causal; "
                     "flashtile and sdpa-flash take turns, a batch of 200 calls each, and each reports its median batch "
                     "(the Python path is timed after them).", ""]
        columns = list(next(iter(doc["per_call_us"].values())))
        sections += ["| call | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
        sections += [f"| {name} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |"
                     for name, row in doc["per_call_us"].items()]
        sections.append("")
    ring_json = docs_dir / RESULTS / "ring.json"
    if ring_json.exists():
        doc = json.loads(ring_json.read_text())
        sections += ["## Context parallelism (`scripts/bench_ring.py`)", "",
                     f"Measured {doc['system']['date']} on {doc['world']} x {_system_line(doc['system'])}. Forward + "
                     f"backward of one sequence, batch 1, {doc['heads']} heads, d{doc['head_dim']} {doc['dtype']} "
                     f"causal, {doc['layout']} layout; efficiency = t(1 GPU) / ({doc['world']} · t({doc['world']} GPUs)).",
                     "", f"| tokens | 1 GPU (s) | {doc['world']} GPUs (s) | efficiency |", "|---:|---:|---:|---:|"]
        sections += [f"| {r['tokens']} | {r['single_s']:.3f} | {r['ring_s']:.3f} | {r['efficiency']:.3f} |"
                     for r in doc["rows"]]
        sections.append("")
    for kind, title in (("ladder", "The ladder on the GPU"), ("ladder-cpu", "The CPU path")):
        path = docs_dir / RESULTS / f"{kind}.json"
        if path.exists():
            doc = json.loads(path.read_text())
            sections += [f"## {title} (`flashtile bench ladder`)", "",
                         f"Measured {doc['system']['date']} on {_system_line(doc['system'])}.", "",
                         ladder_markdown(doc), "", f"![{kind}](results/{kind}.png)", ""]
    path = docs_dir / PERFORMANCE
    path.write_text("\n".join(sections))
    return path
