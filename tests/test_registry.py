"""The kernel registry on the CPU: which family serves which variant on which architecture, and why the others
do not; the ladder as a view over it; the spec list `flashtile compile` builds."""

import pytest
import torch

from flashtile import backward, jit, ladder, registry, specs
from flashtile.family import Variant
from flashtile.forward import FwdProblem

BF16 = torch.bfloat16


def _variant(direction, d, dv, arch, features=(), dtype=BF16, shape="prefill"):
    """The variant of a call with these head dims: the kernels see them padded to a multiple of 8."""
    return Variant(direction, dtype, -(-d // 8) * 8, -(-dv // 8) * 8, frozenset(features), arch, shape)


@pytest.mark.parametrize("arch, d, dv, features, family, source", [
    ("sm_90a", 64, 64, (), "bwd-wgmma", "wgmma/bwd.cu"),
    ("sm_90a", 128, 128, (), "bwd-wgmma", "wgmma/bwd.cu"),
    ("sm_90a", 100, 100, (), "bwd-wgmma", "wgmma/bwd.cu"),          # padded to 128
    ("sm_90a", 96, 96, (), "bwd-mma", "mma/bwd.cu"),              # a compiled dim of its own, not 64's multiple
    ("sm_90a", 256, 256, ("window", "varlen"), "bwd-wgmma", "wgmma/bwd.cu"),
    ("sm_90a", 192, 192, (), "bwd-grid", "mma/bwd_grid.cu"),
    ("sm_90a", 192, 128, (), "bwd-grid", "mma/bwd_grid.cu"),
    ("sm_90a", 128, 64, (), "bwd-mma", "mma/bwd.cu"),             # q/k and v head dims differ
    ("sm_90a", 128, 128, ("softcap",), "bwd-mma", "mma/bwd.cu"),
    ("sm_90a", 128, 128, ("alibi",), "bwd-mma", "mma/bwd.cu"),
    ("sm_80", 128, 128, (), "bwd-mma", "mma/bwd.cu"),
    ("sm_80", 192, 192, (), "bwd-grid", "mma/bwd_grid.cu"),       # its 161 KB tile fits the A100's 163 KB
    ("sm_86", 192, 192, (), "bwd-mma", "mma/bwd.cu"),             # but not the 99 KB of consumer GPUs
    ("sm_89", 64, 64, (), "bwd-mma", "mma/bwd.cu"),
    ("sm_100", 128, 128, (), "bwd-mma", "mma/bwd.cu"),           # wgmma is Hopper's alone
    ("sm_100", 192, 192, (), "bwd-grid", "mma/bwd_grid.cu"),     # the B200 has Hopper's 227 KB
    ("sm_120", 192, 192, (), "bwd-mma", "mma/bwd.cu"),           # an RTX 50xx has 99 KB
])
def test_backward_family_choice(arch, d, dv, features, family, source):
    """wgmma's kernel serves Hopper at d64/d128/d256 without score modifications; rung 4's serve the rest."""
    chosen, spec = registry.choose(_variant("bwd", d, dv, arch, features))
    assert (chosen.name, spec.source, spec.arch) == (family, source, arch)


@pytest.mark.parametrize("arch, d, dtype, features, rung", [
    ("sm_90a", 128, BF16, (), "hopper"),
    ("sm_90a", 128, BF16, ("varlen",), "pipelined"),   # rung 5 leaves varlen to rung 4
    ("sm_80", 128, BF16, (), "pipelined"),
    ("sm_80", 256, torch.float16, ("softcap", "alibi", "varlen"), "pipelined"),
    ("sm_90a", 64, torch.float32, (), "tiled"),          # fp32: the tensor-core rungs take 16-bit types only
    ("sm_90a", 256, torch.float32, (), "fused"),         # rung 2 stops at head dim 128
    ("sm_75", 64, torch.float16, (), "tiled"),           # Turing: mma.sync m16n8k16 needs sm_80
    ("sm_75", 128, BF16, ("varlen",), "tiled"),          # bf16 too: integer rounding where cvt to bf16 needs sm_80
])
def test_forward_family_choice(arch, d, dtype, features, rung):
    chosen, _ = registry.choose(_variant("fwd", d, d, arch, features, dtype))
    assert chosen.name == rung and chosen in ladder.RUNGS


@pytest.mark.parametrize("d", [64, 128])
def test_turing_tiles_fit_its_64_kb_of_shared_memory(d):
    """Rung 2's tiles for Ampere and newer need 68 KB (d64) and 75 KB (d128): Turing gets narrower key tiles."""
    _, spec = registry.choose(_variant("fwd", d, d, "sm_75"))
    assert spec.source == "ladder/r2_tiled.cu" and spec.smem_bytes <= specs.smem_limit("sm_75") == 64 * 1024
    assert spec.smem_bytes == specs.tiled_smem(d, dict(spec.defines)["FT_BLOCK_N"])
    assert registry.choose(_variant("fwd", d, d, "sm_80"))[1] != spec


@pytest.mark.parametrize("arch", ["sm_100", "sm_120"])
@pytest.mark.parametrize("d, dv", [(64, 64), (96, 96), (120, 64), (128, 128), (192, 128), (192, 192), (256, 256)])
@pytest.mark.parametrize("features", [(), ("window", "varlen"), ("softcap",), ("alibi",)])
def test_blackwell_runs_the_mma_sync_kernels(arch, d, dv, features):
    """B200 (sm_100) and RTX 50xx (sm_120): rung 4's mma.sync forward with K/V by cp.async and the mma.sync
    backwards, in tiles that fit; Hopper's wgmma backward and TMA-fed ring are never chosen."""
    forward, fwd_spec = registry.choose(_variant("fwd", d, dv, arch, features))
    assert forward.name == "pipelined" and fwd_spec.source == specs.PIPELINED_SOURCE
    assert fwd_spec.kv_maps.rows == 0
    backward_family, bwd_spec = registry.choose(_variant("bwd", d, dv, arch, features))
    assert backward_family.name in ("bwd-grid", "bwd-mma") and not bwd_spec.source.startswith("wgmma/")
    assert fwd_spec.arch == bwd_spec.arch == arch
    assert max(fwd_spec.smem_bytes, bwd_spec.smem_bytes) <= specs.smem_limit(arch)


def test_no_family_names_every_reason():
    """A variant nothing serves raises with each family's reason."""
    with pytest.raises(ValueError) as err:
        registry.choose(_variant("bwd", 64, 64, "sm_75"))
    message = str(err.value)
    assert "no kernel serves" in message
    assert all(f"'{f.name}'" in message for f in backward.FAMILIES)


def test_reasons_are_asked_fastest_first_and_name_the_cause():
    answers = registry.reasons(_variant("fwd", 128, 128, "sm_90a", ("softcap",)))
    assert [f.rung for f, _ in answers] == [None, 5, 4, 3, 2, 1, 0]
    why = dict((f.name, reason) for f, reason in answers)
    assert why["pipelined"] is None and "softcap" in why["decode"] and "softcap" in why["hopper"]
    assert "softcap" in why["mma"] and "softcap" in why["naive"]


def test_a_named_rung_that_cannot_serve_says_why():
    with pytest.raises(ValueError, match="head_dim up to 128"):
        registry.choose(_variant("fwd", 256, 256, "sm_90a"), "mma")
    with pytest.raises(ValueError, match="rung must be"):
        registry.choose(_variant("fwd", 64, 64, "sm_90a"), "fastest")


def test_variant_of_a_problem():
    q = torch.randn(2, 5, 4, 40)
    k = torch.randn(2, 9, 2, 40)
    v = torch.randn(2, 9, 2, 24)
    problem = FwdProblem(q, k, v, 0.1, (-1, 0), softcap=3.0)  # causal is no window: every kernel serves it
    variant = Variant.of(problem, "fwd", "sm_90a")
    assert variant.features == {"softcap"}
    assert Variant.of(FwdProblem(q, k, v, 0.1, (7, 0)), "fwd", "sm_90a").features == {"window"}
    assert (variant.head_dim, variant.head_dim_v, variant.shape) == (40, 24, "prefill")
    token = FwdProblem(q[:, :1], k, v, 0.1, (-1, 0))
    assert Variant.of(token, "fwd", "sm_90a").shape == "decode"
    long = FwdProblem(torch.randn(2, 300, 4, 40), k, v, 0.1, (-1, -1))
    assert Variant.of(long, "bwd", "sm_80").shape == "prefill"


@pytest.mark.parametrize("arch, d, dv, features, tma", [
    ("sm_90a", 128, 128, (), True),
    ("sm_90a", 120, 64, (), True),                    # padded to 128: the maps zero-fill the rest
    ("sm_90a", 64, 64, (), True),
    ("sm_90a", 256, 256, (), False),                  # K and V take turns in one buffer each: cp.async
    ("sm_90a", 128, 128, ("softcap",), False),
    ("sm_80", 128, 128, (), False),                   # no tensor memory accelerator before Hopper
])
def test_pipelined_kv_loads(arch, d, dv, features, tma):
    """Rung 4's K/V ring is fed by TMA on Hopper's d64/d128 tiles (64-byte swizzle boxes of the ring's tile) and by
    cp.async everywhere else. Every rung-4 build declares the tensor maps as its second argument (empty ones for
    cp.async); the lower rungs take none."""
    spec = registry.choose(_variant("fwd", d, dv, arch, features), "pipelined")[1]
    assert spec.kv_maps == specs.KvBox(dict(spec.defines)["FT_BLOCK_N"] if tma else 0, 32)
    if d <= max(specs.MMA_HEAD_DIMS):
        assert registry.choose(_variant("fwd", d, dv, arch), "mma")[1].kv_maps is None


@pytest.mark.parametrize("d, dv, rung", [(64, 64, "hopper"), (128, 128, "hopper"), (104, 104, "hopper"),
                                         (256, 256, "hopper"), (200, 256, "hopper"), (96, 96, "pipelined"),
                                         (192, 192, "pipelined"), (128, 64, "pipelined")])
def test_hopper_rung_serves_its_head_dims(d, dv, rung):
    """Rung 5 serves head dims that pad alike to 64, 128 or 256 on sm_90a, with its K/V maps in 128-byte swizzle
    boxes of its key tile; rung 4 keeps the others, and every feature rung 5 leaves, with the reason named."""
    family, spec = registry.choose(_variant("fwd", d, dv, "sm_90a"))
    assert family.name == rung
    if rung == "hopper":
        assert spec.source == "wgmma/fwd.cu" and spec.kv_maps == specs.KvBox(dict(spec.defines)["FT_BLOCK_N"], 64)
    else:
        assert "pad alike" in ladder.get("hopper").unsupported(_variant("fwd", d, dv, "sm_90a"))
    for features in (("varlen",), ("softcap",), ("alibi",)):
        family, _ = registry.choose(_variant("fwd", 128, 128, "sm_90a", features))
        assert family.name == "pipelined"
        assert features[0] in ladder.get("hopper").unsupported(_variant("fwd", 128, 128, "sm_90a", features))
    for arch in ("sm_80", "sm_100"):
        assert arch in ladder.get("hopper").unsupported(_variant("fwd", 128, 128, arch))


def test_all_specs_cover_what_each_family_compiles():
    found = registry.all_specs("sm_90a")
    assert len(found) == len(set(found))
    sources = {s.source for s in found}
    assert {"ladder/r0_naive.cu", "ladder/r1_fused.cu", "ladder/r2_tiled.cu", "ladder/r3_mma.cu", "mma/fwd.cu",
            "mma/bwd.cu", "mma/bwd_grid.cu", "wgmma/bwd.cu", "wgmma/fwd.cu"} <= sources
    for arch in ("sm_80", "sm_100", "sm_120"):
        assert not any(s.source.startswith("wgmma/") or (s.kv_maps and s.kv_maps.rows) for s in registry.all_specs(arch))


@pytest.mark.parametrize("d, writer, repeatable_writer, keeper",
                         [(64, True, False, True), (128, True, True, False), (256, False, False, False)])
def test_the_dq_writer_serves_the_backward_where_the_table_says(d, writer, repeatable_writer, keeper):
    """The Hopper backward adds dQ through its writer warp where the tile table says so; in the deterministic
    mode it keeps the turns only where it has two staged tiles (d128), and a turn keeper warp serves the other
    split-keys tile (d64); every spec is among those compiled ahead of time."""
    wgmma = next(f for f in backward.FAMILIES if f.name == "bwd-wgmma")
    default, repeatable = (wgmma.spec(Variant("bwd", BF16, d, d, frozenset(), "sm_90a", deterministic=deterministic))
                           for deterministic in (False, True))
    assert dict(default.defines)["FT_DQ_WRITER"] == int(writer)
    assert dict(repeatable.defines)["FT_DQ_WRITER"] == int(repeatable_writer)
    assert dict(default.defines)["FT_TURN_KEEPER"] == 0
    assert dict(repeatable.defines)["FT_TURN_KEEPER"] == int(keeper)
    assert (default == repeatable) == (writer == repeatable_writer and not keeper)
    assert {default, repeatable} <= set(registry.all_specs("sm_90a"))


def test_geometry_constants_reach_the_kernels_as_defines():
    """Block shapes that the host's grids depend on come from specs.py as defines, never mirrored by hand."""
    naive = specs.naive_spec("bf16", "sm_80")
    assert dict(naive.defines)["FT_THREADS"] == specs.NAIVE_THREADS
    for spec in registry.all_specs("sm_90a"):
        defines = dict(spec.defines)
        if "attn_bwd_preprocess" in spec.entries:
            assert (defines["FT_ROW_WARPS"], defines["FT_PREPROCESS_ROWS"]) == (specs.ROW_WARPS, specs.PREPROCESS_ROWS)


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_arch_of_names_an_nvrtc_target_that_round_trips(capability):
    arch = specs.arch_of(capability)
    _, supported = jit.cuda_module("cuda.bindings.nvrtc").nvrtcGetSupportedArchs()
    assert 10 * capability[0] + capability[1] in supported
    assert specs.capability_of(arch) == capability


@pytest.mark.parametrize("arch, capability", [("sm_90a", (9, 0)), ("sm_100a", (10, 0)), ("sm_120f", (12, 0))])
def test_suffixed_targets_find_their_capability_and_shared_memory(arch, capability):
    """The CLI accepts architecture- and family-specific targets: they run on, and size tiles for, their GPU."""
    assert specs.capability_of(arch) == capability
    assert specs.smem_limit(arch) == specs.smem_limit(specs.arch_of(capability))


@pytest.mark.parametrize("arch, d, dv, features, family", [
    ("sm_90a", 128, 128, (), "decode"),
    ("sm_80", 64, 64, (), "decode"),
    ("sm_90a", 128, 64, (), "pipelined"),                 # one head dim for q/k and v
    ("sm_90a", 128, 128, ("window",), "hopper"),
    ("sm_90a", 128, 128, ("varlen",), "pipelined"),
    ("sm_75", 64, 64, (), "tiled"),                       # mma.sync needs sm_80
])
def test_decode_family_choice(arch, d, dv, features, family):
    """One query token per sequence goes to the decode family where it serves, with the others' reasons."""
    chosen, spec = registry.choose(_variant("fwd", d, dv, arch, features, shape="decode"))
    assert chosen.name == family
    if family == "decode":
        assert spec.source == registry.choose(_variant("fwd", d, dv, arch, features), "pipelined")[1].source
        assert dict(spec.defines)["FT_BLOCK_M"] == specs.DECODE_BLOCK_M  # one GQA group's slab, keys shared by warps


@pytest.mark.parametrize("arch, page_size, head_dim, rows", [
    ("sm_90a", 16, 128, 16), ("sm_90a", 48, 128, 16),    # one copy per page and tile: row groups of 16
    ("sm_90a", 32, 64, 32), ("sm_90a", 96, 128, 32),
    ("sm_90a", 64, 128, 0), ("sm_90a", 256, 128, 0),     # a column block's box is large enough
    ("sm_90a", 16, 80, 0),                               # a box would span past the head dim
    ("sm_90a", 16, 256, 0),                              # d256 decodes with cp.async: no maps
    ("sm_80", 16, 128, 0),
])
def test_small_pages_take_the_row_group_build(arch, page_size, head_dim, rows):
    from flashtile import decode

    spec = specs.decode_spec("bf16", head_dim, head_dim, arch)
    assert decode.group_rows(spec, page_size, head_dim) == rows
    if rows:
        grouped = specs.decode_spec("bf16", head_dim, head_dim, arch, rows)
        assert dict(grouped.defines)["FT_KV_GROUP_ROWS"] == rows
        assert grouped.kv_maps == specs.KvBox(rows, specs.NARROW_BOX_COLS, head_dim // specs.NARROW_BOX_COLS)
        assert grouped in registry.all_specs(arch)  # CI compiles it


@pytest.mark.parametrize("blocks, seqlen_k, splits", [
    (512, 32768, 1),         # 64 x 8 blocks already fill a wave of 132
    (64, 131072, 2),         # 64 blocks: two parts each make 128 of 132
    (8, 65536, 16),          # 8 blocks: 16 parts of 4096 keys
    (8, 3001, 2),            # any length: parts need not be equal, only at least 1024 keys
    (1024, 4096, 1),
    (2, 4096, 4),            # parts of at least 1024 keys
])
def test_decode_splits_fill_one_wave(blocks, seqlen_k, splits):
    from flashtile import decode

    assert decode.choose_splits(blocks, seqlen_k, slots=132) == splits


@pytest.mark.parametrize("heads_q, heads_kv, limit_heads, expected", [
    (16, 16, 16, 16),   # every head's accumulator fits: one launch
    (16, 16, 8, 8),     # the standard matrix's training rows: two groups of eight
    (16, 16, 7, 4),     # the largest divisor of 16 under 7: four groups alike
    (14, 7, 3, 1),      # a prime number of kv heads: one per launch
    (32, 8, 2, 2),      # GQA: the budget counts the four query heads of every kv head
])
def test_backward_head_groups_divide_the_heads(monkeypatch, heads_q, heads_kv, limit_heads, expected):
    """kv_heads_per_launch: as many kv heads as the dQ accumulator's budget holds, rounded down to a divisor of
    heads_kv, so that every group's launches are alike (one plan replays them all)."""
    from types import SimpleNamespace

    rows, head_dim = 1000, 128
    per_kv_head = rows * (heads_q // heads_kv) * head_dim * backward.FP32_BYTES
    monkeypatch.setattr(backward, "SCRATCH_LIMIT_BYTES", limit_heads * per_kv_head)
    module = SimpleNamespace(spec=SimpleNamespace(defines=(("FT_HEAD_DIM", head_dim),), dq_smem_bytes=0))
    problem = SimpleNamespace(heads_q=heads_q, heads_kv=heads_kv)
    assert backward.kv_heads_per_launch(problem, module, rows) == expected


def test_the_dq_pass_serves_d256_without_an_accumulator(monkeypatch):
    """Where the table gives the Hopper backward a dQ pass (d256), the spec ends with that pass, which has its own
    shared memory; the deterministic mode is the same build (nothing is reduced), and no accumulator bounds the
    heads a launch takes."""
    from types import SimpleNamespace

    wgmma = next(f for f in backward.FAMILIES if f.name == "bwd-wgmma")
    spec, repeatable = (wgmma.spec(Variant("bwd", BF16, 256, 256, frozenset(), "sm_90a", deterministic=deterministic))
                        for deterministic in (False, True))
    assert spec == repeatable and spec in registry.all_specs("sm_90a")
    assert spec.entries == ("attn_bwd_preprocess", "attn_bwd", "attn_bwd_dq")
    assert dict(spec.defines)["FT_DQ_PASS"] == 1
    warps = dict(spec.defines)["FT_WARPS"]
    assert 0 < spec.dq_smem_bytes == specs.bwd_dq_pass_smem(256, 64, warps) <= specs.smem_limit("sm_90a")
    assert specs.bwd_dq_pass_rows(warps) == 2 * specs.WGMMA_M  # two consumer warpgroups of 64 queries
    assert not any(t.dq_pass for t in specs.BWD_WGMMA_ALTERNATIVES[256])  # the reductions' build stays compiled
    monkeypatch.setattr(backward, "SCRATCH_LIMIT_BYTES", 1)
    problem = SimpleNamespace(heads_q=16, heads_kv=8)
    assert backward.kv_heads_per_launch(problem, SimpleNamespace(spec=spec), 10**6) == 8


HOPPER_FWD_TILES = [(d, tile) for table in (specs.HOPPER_FWD_TILES, specs.HOPPER_FWD_SHORT_CAUSAL_TILES)
                    for d, tile in sorted(table.items())]


@pytest.mark.parametrize("d, tile", HOPPER_FWD_TILES)
def test_hopper_consumers_take_only_the_registers_the_producer_gives_back(d, tile):
    """setmaxnreg.inc waits for registers the block itself has freed: the consumers' raise must fit in what the
    producer warpgroup's cut frees, or the block hangs."""
    defines = dict(specs.hopper_fwd_spec("bf16", d, d, tile).defines)
    threads = specs.hopper_fwd_threads(tile.block_m)
    start = specs.launch_registers(threads)
    assert start * threads <= specs.REGISTER_FILE
    producer, consumer = defines["FT_PRODUCER_REGISTERS"], defines["FT_CONSUMER_REGISTERS"]
    freed = (start - producer) * specs.WARPGROUP_THREADS
    assert (consumer - start) * tile.consumers * specs.WARPGROUP_THREADS <= freed
    assert consumer % specs.REGISTER_STEP == 0 and producer % specs.REGISTER_STEP == 0
    assert consumer + specs.REGISTER_STEP > start + freed // (tile.consumers * specs.WARPGROUP_THREADS)


def test_consumer_registers_of_the_tables_blocks():
    """Two consumers (384 threads start at 168 registers) reach 240, three (512 threads, 128) reach 160, with the
    producer at 24; a producer at 32 leaves two consumers 232, not 240."""
    assert (specs.consumer_registers(2), specs.consumer_registers(3)) == (240, 160)
    assert specs.launch_registers(384) == 168 and specs.launch_registers(512) == 128


def _schedule(m_blocks, heads, blocks, unit_tiles, run, paired=False):
    """kernels/wgmma/fwd.cu's persistent schedule (`settle`, `work_of`, TailSplit) line for line, as the producer
    walks it: per block, its tiles (unit, query block, first key tile, key tiles, place `at`), in order."""
    unit_blocks = -(-m_blocks // 2) if paired else m_blocks
    units = unit_blocks * heads
    unit0 = units - units % blocks

    def settle(b, at):
        if at < 2 * units and (run == 0 or at // 2 - b + blocks <= units):
            return at
        if run == 0:
            return -1
        if at <= 2 * units:
            at = 2 * units + b * run
        return at if at - 2 * units < min((b + 1) * run, (units - unit0) * unit_tiles) else -1

    def work_of(b, at):
        if at < 2 * units:
            unit, part = divmod(at, 2)
            first = unit // blocks * blocks
            width = min(blocks, units - first)
            rotated = not paired or m_blocks % 2 == 1
            tile_unit = first + (unit - first + unit // blocks) % width if rotated else unit
            j = tile_unit % unit_blocks
            second = part == 0 and paired and 2 * j + 1 != m_blocks
            query_block = m_blocks - 1 - j if part == 0 else j
            return (tile_unit, query_block, 0, unit_tiles), settle(b, at + 1 if second else 2 * min(unit + blocks, units))
        t, end = at - 2 * units, min((b + 1) * run, (units - unit0) * unit_tiles)
        u, first = divmod(t, unit_tiles)
        count = min(end - t, unit_tiles - first)
        return (unit0 + u, m_blocks - 1 - (unit0 + u) % unit_blocks, first, count), settle(b, at + count)

    pieces = {}
    for b in range(blocks):
        mine, at = [], settle(b, 2 * b)
        while at >= 0:
            assert len(mine) <= 2 * units, "the schedule does not end"
            piece, after = work_of(b, at)
            mine.append((*piece, at))
            assert after < 0 or after > at
            at = after
        pieces[b] = mine
    return pieces


@pytest.mark.parametrize("m_blocks,heads,blocks", [(16, 16, 132), (7, 3, 132), (8, 40, 132), (1, 5, 3), (33, 8, 7)])
@pytest.mark.parametrize("paired", [False, True])
def test_rung5_schedule_runs_every_work_tile_once(m_blocks, heads, blocks, paired):
    """Without a tail split (a causal mask's paired units, or none): every query block of every head, once."""
    units = (-(-m_blocks // 2) if paired else m_blocks) * heads
    pieces = _schedule(m_blocks, heads, min(blocks, units), unit_tiles=4, run=0, paired=paired)
    seen = sorted((unit // (units // heads), query_block) for mine in pieces.values()
                  for unit, query_block, first, count, _ in mine)
    assert seen == [(h, m) for h in range(heads) for m in range(m_blocks)]


@pytest.mark.parametrize("m_blocks,heads,blocks", [(6, 512, 132), (22, 128, 132), (6, 100, 66)])
def test_rung5_schedule_shares_the_short_query_blocks_out(m_blocks, heads, blocks):
    """Without a mask, each head's short query block (block 0) lands on every block about as often: dealt out in
    turn with blocks a multiple of m_blocks, a sixth of the blocks at d64 n1k would take them all."""
    pieces = _schedule(m_blocks, heads, blocks, unit_tiles=8, run=0)
    short = [sum(query_block == 0 for _, query_block, *_ in mine) for mine in pieces.values()]
    tiles = [len(mine) for mine in pieces.values()]
    assert sum(short) == heads and max(tiles) - min(tiles) <= 1
    assert max(short) - min(short) <= 1 + max(tiles) // (m_blocks * 4)


@pytest.mark.parametrize("m_blocks,heads,blocks", [(3, 1024, 132), (3, 512, 132), (11, 256, 132), (5, 264, 132)])
def test_rung5_causal_schedule_shares_the_unpaired_middle_blocks_out(m_blocks, heads, blocks):
    """Under a causal mask an odd count of query blocks leaves each head's middle block unpaired, at half a pair's
    cost (query block q sees q + 1 blocks of keys). Dealt out in turn with blocks a multiple of the units per head,
    half the blocks took every such unit at d64 n512 causal, and the rest ran 1.375x the mean; rotated, no block
    runs more than 1.05x the mean cost."""
    pieces = _schedule(m_blocks, heads, blocks, unit_tiles=4, run=0, paired=True)
    costs = [sum(query_block + 1 for _, query_block, *_ in mine) for mine in pieces.values()]
    assert sum(costs) == heads * m_blocks * (m_blocks + 1) // 2
    assert max(costs) <= 1.05 * sum(costs) / len(costs)


def test_rung5_causal_schedule_deals_an_even_counts_units_in_turn():
    """Causal units of an even count of query blocks cost alike and keep their order (rotated, d64 n1k causal
    measured 5-7% slower): block b takes units b, b + blocks, ..."""
    blocks, heads, m_blocks = 132, 512, 6
    pieces = _schedule(m_blocks, heads, blocks, unit_tiles=4, run=0, paired=True)
    for b, mine in pieces.items():
        assert [unit for unit, *_ in mine] == [u for u in range(b, m_blocks // 2 * heads, blocks) for _ in range(2)]


SPLITS = [(units, blocks, tiles) for blocks in (132, 7) for units in (140, 150, 263, 2048, 3 * blocks + 1)
          for tiles in (16, 31, 128)]


@pytest.mark.parametrize("units,blocks,unit_tiles", SPLITS)
def test_rung5_tail_split_deals_every_tail_tile_once_into_its_own_slot(units, blocks, unit_tiles):
    split = specs.hopper_tail_split(units, blocks, unit_tiles, consumers=2, dv=128)
    tail = units % blocks
    saved = unit_tiles - -(-tail * unit_tiles // blocks)
    assert (split is not None) == (units > blocks and tail > 0 and saved >= specs.TAIL_SPLIT_MIN_SAVED_TILES)
    if split is None:
        return
    pieces = _schedule(units, 1, blocks, unit_tiles, split.run)
    unit0, run = units - tail, split.run
    covered = [[0] * unit_tiles for _ in range(units)]
    slots = {}
    for b, mine in pieces.items():
        shared = [(unit, first, count, at) for unit, _, first, count, at in mine if unit >= unit0]
        assert sum(count for *_, count, _ in shared) <= run and len(shared) <= 2
        for unit, _, first, count, _ in mine:
            covered[unit][first:first + count] = [c + 1 for c in covered[unit][first:first + count]]
        for unit, first, count, at in shared:
            u = (at - 2 * units) // unit_tiles                                 # TailSplit::unit_at
            assert u == unit - unit0
            if u * unit_tiles // run != ((u + 1) * unit_tiles - 1) // run:    # first_block != last_block
                slot = b if u * unit_tiles <= b * run else blocks + u          # TailSplit::slot
                assert slot not in slots, "two pieces in one slot"
                slots[slot] = (u, b)
    assert all(c == 1 for row in covered for c in row), "a key tile dealt twice or never"
    assert max(slots) < blocks + tail
    for u in range(tail):  # TailSplit::first_block / last_block: the blocks the merge reads, in order
        first, last = u * unit_tiles // run, ((u + 1) * unit_tiles - 1) // run
        assert sorted(b for s, (uu, b) in slots.items() if uu == u) == list(range(first, last + 1))
    thread_floats = 128 // 2 + specs.TAIL_SPLIT_GROUP_FLOATS
    assert split.counter_floats == tail * 2
    assert split.scratch_floats == (blocks + tail) * 2 * thread_floats * 128 + split.counter_floats


def test_rung5_plan_takes_the_tail_split_only_without_a_mask_and_where_it_pays(monkeypatch):
    monkeypatch.setattr(ladder, "sm_count", lambda device: 132)
    tile = specs.HOPPER_FWD_TILES[128]
    spec = specs.hopper_fwd_spec("bf16", 128, 128, tile)

    class Module:
        kernels = {"attn_fwd": None}
    Module.spec = spec
    plan_of = ladder.BY_NAME["hopper"].plan
    at = [name for name, _ in ladder.launch.PARAM_FIELDS].index("tail_tiles") - ladder.plans.ADDRESS_FIELDS

    def plan(heads, n, window=(-1, -1)):
        q = torch.empty(1, n, heads, 128, dtype=BF16)
        return plan_of(FwdProblem(q, q, q, 0.1, window), Module)

    split = plan(16, 16384)  # 2048 units over 132 blocks: 68 left over, of 128 key tiles each
    assert split.tail[at] == -(-68 * 128 // 132) and split.zeroed_floats == 68 * 2
    assert split.scratch_floats == specs.hopper_tail_split(2048, 132, 128, 2, 128).scratch_floats
    for unsplit in (plan(16, 16384, (-1, 0)), plan(16, 16384, (256, 0)), plan(16, 1024), plan(1, 16384)):
        assert unsplit.tail[at] == 0 and unsplit.scratch_floats == 0 and unsplit.zeroed_floats == 0
    d64 = specs.hopper_fwd_spec("bf16", 64, 64, specs.HOPPER_FWD_TILES[64])
    assert dict(d64.defines)["FT_TAIL_SPLIT"] == 0


def test_rung5_takes_the_short_causal_tile_only_at_short_causal_forwards():
    """A causal forward of at most HOPPER_SHORT_CAUSAL_KEYS keys is its own tile class (Variant.short_causal):
    rung 5 builds it with the head dim's short causal tile where the table has one. Longer rows, other masks, the
    backward and head dims without one keep the family's build. `flashtile compile` (all_specs) builds it too."""
    keys = specs.HOPPER_SHORT_CAUSAL_KEYS

    def chosen(d, n, window, seqlen_q=None, direction="fwd"):
        q = torch.empty(2, seqlen_q or n, 2048 // d, d, dtype=BF16, device="meta")
        k = torch.empty(2, n, 2048 // d, d, dtype=BF16, device="meta")
        variant = Variant.of(FwdProblem(q, k, k, 0.1, window), direction, "sm_90a")
        family, spec = registry.choose(variant)
        return variant.short_causal, family.name, spec

    short = specs.hopper_fwd_spec("bf16", 64, 64, specs.HOPPER_FWD_SHORT_CAUSAL_TILES[64])
    table = specs.hopper_fwd_spec("bf16", 64, 64, specs.HOPPER_FWD_TILES[64])
    assert short != table
    for n, seqlen_q in ((keys, None), (1000, None), (64, None), (keys, 300)):
        assert chosen(64, n, (-1, 0), seqlen_q) == (True, "hopper", short)
    for n, window in ((keys + 1, (-1, 0)), (keys, (-1, -1)), (keys, (256, 0)), (keys, (-1, 8))):
        assert chosen(64, n, window) == (False, "hopper", table)
    assert not chosen(64, keys, (-1, 0), direction="bwd")[0]
    for d in (128, 256):
        assert d not in specs.HOPPER_FWD_SHORT_CAUSAL_TILES
        assert chosen(d, keys, (-1, 0))[2] == specs.hopper_fwd_spec("bf16", d, d, specs.HOPPER_FWD_TILES[d])
    assert short in registry.all_specs("sm_90a")
