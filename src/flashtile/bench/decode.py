"""`flashtile bench decode`: decoding bandwidth beside torch's SDPA backends, measured in one run.

One query token per sequence against a KV cache (shared/TARGETS.md's decode rows). Per row, in one
`measure.time_rounds` call: flashtile's `flash_attn_with_kvcache` on the contiguous cache and on the same cache
laid out in pages of PAGE_SIZES rows (pages in a random order, so a sequence's pages are not adjacent), and
sdpa-flash and sdpa-cudnn on the contiguous cache. Effective TB/s = bytes of K and V in the cache / time: every
layout holds the same bytes, so the columns compare directly.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable

import torch

from ..compat.kvcache import flash_attn_with_kvcache
from . import measure, peers

ROWS = ((64, 32768, 64, 8), (8, 131072, 32, 8), (128, 4096, 32, 8), (32, 8192, 32, 32), (1, 65536, 32, 8))
"""(batch, cache length, query heads, kv heads) of each row."""
HEAD_DIM = 128
PAGE_SIZES = (16, 256)
CONTIGUOUS = "flashtile"    # flashtile on the contiguous cache; the paged layouts are named by paged_name
CUDNN = "sdpa-cudnn"
SDPA_PEERS = ("sdpa-flash", CUDNN)
QUICK_CACHE = 4096   # --quick: every row's cache cut to this many rows (a smoke run, not the standard rows)
QUICK_REPS = 5       # --quick: timed runs per kernel
CUDNN_TARGET = 0.95  # shared/TARGETS.md: contiguous decode on every row >= this x sdpa-cudnn
PAGED_TARGET = 0.9   # shared/TARGETS.md: paged decode (pages of 16 and 256) >= this x our contiguous figure


def page_label(page_size: int) -> str:
    return f"paged-{page_size}"


def paged_name(page_size: int) -> str:
    """The kernel's name (results column) for flashtile on a cache in pages of `page_size` rows."""
    return f"{CONTIGUOUS} {page_label(page_size)}"


def to_pages(k: torch.Tensor, v: torch.Tensor, page_size: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous caches k, v (batch, length, heads_kv, d) as pages (num_blocks, page_size, heads_kv, d) and the
    (batch, length / page_size) int32 block table they share: page j of sequence b is block block_table[b, j].
    The blocks are a random permutation of all batch * length / page_size of them."""
    batch, length = k.shape[:2]
    if length % page_size:
        raise ValueError(f"the cache length ({length}) must be a multiple of the page size ({page_size})")
    per_sequence = length // page_size
    blocks = batch * per_sequence
    order = torch.randperm(blocks, generator=generator, device=k.device)

    def pages(cache: torch.Tensor) -> torch.Tensor:
        shape = (blocks, page_size, *cache.shape[2:])
        paged = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        paged[order] = cache.reshape(shape)
        return paged

    return pages(k), pages(v), order.view(batch, per_sequence).to(torch.int32)


def _kvcache_runner(q, k_cache, v_cache, block_table=None) -> Callable[[], torch.Tensor]:
    """One decode step over the whole cache: every sequence holds all of its rows."""
    length = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    lengths = torch.full((q.shape[0],), length, dtype=torch.int32, device=q.device)
    return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table,
                                           causal=True)


def makers(q, k, v, layouts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
           ) -> dict[str, Callable[[], Callable[[], torch.Tensor] | None]]:
    """The runner builders of one row, for `measure.time_rounds`: flashtile on the contiguous cache k, v and on
    each paged layout (page size -> `to_pages`' result), then the SDPA peers on k, v."""
    built = {CONTIGUOUS: partial(_kvcache_runner, q, k, v)}
    for page_size, (k_pages, v_pages, block_table) in layouts.items():
        built[paged_name(page_size)] = partial(_kvcache_runner, q, k_pages, v_pages, block_table)
    for peer in SDPA_PEERS:
        # One query token: SDPA's causal mask is top-left aligned and would hide every key but the first.
        built[peer] = partial(peers.sdpa_runner, peer, q, k, v, causal=False)
    return built


def measure_row(batch: int, cache: int, heads_q: int, heads_kv: int, dtype, reps: int,
                generator: torch.Generator, head_dim: int = HEAD_DIM) -> dict:
    """One row of results: every kernel timed in one `measure.time_rounds` call on fresh inputs on the generator's
    device, as TB/s of the K and V bytes in the cache."""
    device = generator.device
    q = torch.randn(batch, 1, heads_q, head_dim, device=device, dtype=dtype, generator=generator)
    k, v = (torch.randn(batch, cache, heads_kv, head_dim, device=device, dtype=dtype, generator=generator)
            for _ in range(2))
    layouts = {page_size: to_pages(k, v, page_size, generator) for page_size in PAGE_SIZES}
    cache_bytes = 2 * k.numel() * k.element_size()   # K and V, each read once
    times = measure.time_rounds(makers(q, k, v, layouts), reps=reps)
    return {"batch": batch, "cache": cache, "heads_q": heads_q, "heads_kv": heads_kv,
            "tbps": {name: cache_bytes / ms / 1e9 if ms else None for name, ms in times.items()}}


def run(dtype=torch.bfloat16, reps: int = 30, quick: bool = False, progress=None) -> dict:
    """Time every row of ROWS (caches cut to QUICK_CACHE and QUICK_REPS runs when `quick`). Returns the results
    document."""
    doc = {"kind": "decode", "dtype": str(dtype).removeprefix("torch."), "head_dim": HEAD_DIM,
           "page_sizes": list(PAGE_SIZES), "quick": quick, "rows": []}
    generator = torch.Generator(device="cuda").manual_seed(time.time_ns() % 2**63)  # fresh inputs every run
    for batch, cache, heads_q, heads_kv in ROWS:
        row = measure_row(batch, min(cache, QUICK_CACHE) if quick else cache, heads_q, heads_kv, dtype,
                          QUICK_REPS if quick else reps, generator)
        doc["rows"].append(row)
        if progress:
            progress(row)
    return doc


def row_label(row: dict) -> str:
    return f"{row['batch']}, {row['cache'] // 1024}k, {row['heads_q']}/{row['heads_kv']}"


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def progress_line(row: dict) -> str:
    """One measured row, as `flashtile bench decode` prints it while the run goes on."""
    return f"{row_label(row)}: " + ", ".join(f"{name} {_cell(x)}" for name, x in row["tbps"].items()) + " TB/s"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def cudnn_ratio(row: dict) -> float | None:
    """flashtile on the contiguous cache / sdpa-cudnn (TARGETS.md's contiguous criterion)."""
    return _ratio(row["tbps"].get(CONTIGUOUS), row["tbps"].get(CUDNN))


def paged_ratios(row: dict, page_sizes) -> dict[int, float | None]:
    """Page size -> flashtile on that paged layout / flashtile on the contiguous cache (TARGETS.md's paged
    criterion)."""
    tbps = row["tbps"]
    return {size: _ratio(tbps.get(paged_name(size)), tbps.get(CONTIGUOUS)) for size in page_sizes}


def _verdict(values: dict[str, float | None], target: float, what: str) -> str:
    """One line: whether every value reaches `target` (an unmeasured one does not), and the lowest."""
    measured = {where: x for where, x in values.items() if x is not None}
    if not measured:
        return f"{what}: not measured."
    lowest = min(measured, key=measured.get)
    every = len(measured) == len(values) and measured[lowest] >= target
    return f"{what} ≥ {target:.2f} everywhere: {'yes' if every else 'no'} (lowest {measured[lowest]:.2f}: {lowest})."


def markdown(doc: dict) -> str:
    """The decode table (TB/s per kernel, then the ratios) and a verdict on each decode target. Reads results
    written before the paged columns existed (no `page_sizes`: contiguous and the peers only)."""
    page_sizes = doc.get("page_sizes", [])
    kernels = list(doc["rows"][0]["tbps"])
    ratio_names = [f"{CONTIGUOUS} / {CUDNN}", *(f"{page_label(size)} / contiguous" for size in page_sizes)]
    lines = ["| batch, cache, heads q/kv | " + " | ".join(kernels + ratio_names) + " |",
             "|---|" + "---:|" * (len(kernels) + len(ratio_names))]
    by_cudnn, by_page = {}, {}
    for r in doc["rows"]:
        label, paged = row_label(r), paged_ratios(r, page_sizes)
        by_cudnn[f"row {label}"] = cudnn_ratio(r)
        by_page.update({f"row {label}, pages of {size}": x for size, x in paged.items()})
        cells = [_cell(r["tbps"][k]) for k in kernels] + [_cell(x) for x in (cudnn_ratio(r), *paged.values())]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", _verdict(by_cudnn, CUDNN_TARGET, f"{CONTIGUOUS} contiguous / {CUDNN}")]
    if page_sizes:
        lines.append(_verdict(by_page, PAGED_TARGET, "flashtile paged / contiguous"))
    return "\n".join(lines)


def description(doc: dict) -> str:
    """What the rows measure, in one paragraph."""
    page_sizes = doc.get("page_sizes", [])
    layouts = ("a contiguous cache" if not page_sizes else
               f"a contiguous cache (`{CONTIGUOUS}`) and the same cache in pages of "
               + " and ".join(f"{size} rows (`{paged_name(size)}`)" for size in page_sizes)
               + ", the pages in a random order")
    text = (f"One query token per sequence against {layouts}, d{doc['head_dim']} {doc['dtype']}; effective TB/s = "
            "bytes of K and V in the cache / time; SDPA's backends run on the contiguous cache.")
    if doc.get("quick"):
        text += (f" A `--quick` run: caches cut to {QUICK_CACHE // 1024}k rows and {QUICK_REPS} runs per kernel "
                 "(a smoke check, not the standard rows).")
    return text
