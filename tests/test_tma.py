"""flashtile/tma.py without a GPU: which maps are encoded, and when one is reused."""

import types

import pytest
import torch

from flashtile import specs, tma
from flashtile.specs import KvBox


def test_tensor_maps_are_kept_by_address_shape_strides_and_dtype(monkeypatch):
    """Encoding a map costs ~11 us of host time: the same view of the same memory reuses its map."""
    encoded = []
    monkeypatch.setattr(tma, "_encode",
                        lambda t, box: encoded.append((t.shape, box.rows, box.cols)) or bytes(tma.MAP_BYTES))
    tma._kept.clear()
    k = torch.zeros(2, 64, 4, 128, dtype=torch.bfloat16)
    assert len(tma.kv_maps(k, k, KvBox(64, 32))) == 2 * tma.MAP_BYTES
    assert encoded == [(k.shape, 64, 32)]                 # k and v are the same view here
    tma.kv_maps(k, k[:, :32], KvBox(64, 32))              # same address, another shape: a map of its own
    tma.kv_maps(k, k, KvBox(32, 32))                      # another box
    tma.kv_maps(k, k, KvBox(64, 64))                      # another swizzle (rung 5's 128-byte boxes)
    assert len(encoded) == 4
    tma.kv_maps(k, k, KvBox(64, 32))
    assert len(encoded) == 4
    assert tma.kernel_argument(k, k, None) is None
    assert tma.kernel_argument(k, k, KvBox(0, 32)) == tma.NO_MAPS


def test_rung_five_takes_k_v_q_then_o_maps(monkeypatch):
    """Rung 5's producer loads Q through a map and its consumers store O through one: the second argument is K's,
    V's, Q's, then O's map (common/tma.cuh QkvoMaps), as many bytes as its spec declares, with O's box one warp's
    rows; the maps are kept by the addresses of all four."""
    monkeypatch.setattr(tma, "_encode", lambda t, box: bytes([t.shape[-1] % 251, box.rows]) * (tma.MAP_BYTES // 2))
    tma._kept.clear()
    q, k, v, o = (torch.zeros(1, 128, 2, d, dtype=torch.bfloat16) for d in (8, 16, 24, 40))
    for d, tile in specs.HOPPER_FWD_TILES.items():
        spec = specs.hopper_fwd_spec("bf16", d, d, tile)
        argument = tma.kernel_argument(k, v, spec.kv_maps, q, spec.q_map, o, spec.o_map)
        assert len(argument) == spec.maps_bytes == 4 * tma.MAP_BYTES
        assert [argument[i * tma.MAP_BYTES] for i in range(4)] == [16, 24, 8, 40]
        assert argument[2 * tma.MAP_BYTES + 1] == specs.WGMMA_M           # Q's box: one consumer's rows
        assert argument[3 * tma.MAP_BYTES + 1] == specs.O_STORE_ROWS      # O's box: one warp's rows
        assert tma.kernel_argument(k, v, spec.kv_maps) == argument[:2 * tma.MAP_BYTES]


def test_a_forward_plan_keeps_its_maps_by_the_output_address_too(monkeypatch):
    """O is a fresh tensor each call: a plan whose kernel stores O through a map must not reuse the map of an
    earlier output at another address."""
    from flashtile import plans
    monkeypatch.setattr(tma, "_encode", lambda t, box: t.data_ptr().to_bytes(8, "little") * (tma.MAP_BYTES // 8))
    monkeypatch.setattr(plans.launch, "run", lambda launches, params, struct, extra: made.append(extra))
    tma._kept.clear()
    made = []
    spec = specs.hopper_fwd_spec("bf16", 64, 64, specs.HOPPER_FWD_TILES[64])
    plan = plans.FwdPlan((), None, None, 0, (), spec.kv_maps, spec.q_map, spec.o_map)
    q, k, v = (torch.zeros(1, 128, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    outputs = [(torch.zeros_like(q), None) for _ in range(2)]
    for o in outputs * 2:
        plan.run(q, k, v, out=o)
    stored = [int.from_bytes(m[3 * tma.MAP_BYTES:3 * tma.MAP_BYTES + 8], "little") for m in made]
    assert stored == [o.data_ptr() for o, _ in outputs * 2]


def test_hopper_backward_takes_k_v_q_then_do_maps(monkeypatch):
    """The Hopper backward's producer loads K, V, Q and dO through maps (common/tma.cuh BwdMaps): four maps in that
    order, with the spec's boxes (K/V: a key block's rows, Q and dO: a step's), as many bytes as the spec declares
    (the builds whose dQ needs no fifth map: the next test has the writer's boxes)."""
    monkeypatch.setattr(tma, "_encode", lambda t, box: bytes([t.shape[-1] % 251, box.rows]) * (tma.MAP_BYTES // 2))
    tma._kept.clear()
    q, k, v, dout = (torch.zeros(1, 128, 2, d, dtype=torch.bfloat16) for d in (8, 16, 24, 32))
    for d in specs.BWD_WGMMA_TILES:
        tile = specs.bwd_wgmma_tile(d, d, "sm_90a", deterministic=True)
        spec = specs.bwd_wgmma_spec("bf16", d, tile)
        if spec.dq_map is not None:
            continue
        argument = tma.backward_argument(q, k, v, dout, (spec.kv_maps, spec.q_map, spec.do_map))
        assert len(argument) == spec.maps_bytes == 4 * tma.MAP_BYTES
        assert [argument[i * tma.MAP_BYTES] for i in range(4)] == [16, 24, 8, 32]
        assert [argument[i * tma.MAP_BYTES + 1] for i in range(4)] == [tile.block_n] * 2 + [tile.block_m] * 2


def test_a_backward_that_adds_dq_boxes_takes_the_accumulators_template_fifth(monkeypatch):
    """Where the Hopper backward's writer adds dQ boxes (BwdMapsDq), the accumulator's template follows dO's map:
    fp32, (the kernel's head dim, rows) with a stand-in address and row count, rows d * 4 bytes apart, boxes of the
    spec's dQ box, no swizzle; the rows are the kernel's head dim wide also where q's is narrower (a d96 q in the
    d128 kernel); one encoding serves every call of a kernel; the deterministic d64 build takes no template."""
    driver = _FakeDriver()
    driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32 = "f32"
    driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE = 0
    monkeypatch.setattr(tma, "_cuda", lambda: driver)
    monkeypatch.setattr(tma.ctypes, "string_at", lambda address, size: bytes([7]) * size)
    monkeypatch.setattr(tma, "_encode", lambda t, box: bytes([t.shape[-1] % 251, box.rows]) * (tma.MAP_BYTES // 2))
    tma._kept.clear()
    tile = specs.bwd_wgmma_tile(128, 128, "sm_90a")
    spec = specs.bwd_wgmma_spec("bf16", 128, tile)
    boxes = (spec.kv_maps, spec.q_map, spec.do_map, spec.dq_map)
    first, second = (tma.backward_argument(*(torch.zeros(1, 128, 2, d, dtype=torch.bfloat16) for _ in range(4)), boxes)
                     for d in (128, 96))
    assert len(first) == len(second) == spec.maps_bytes == 5 * tma.MAP_BYTES
    assert first[4 * tma.MAP_BYTES:] == second[4 * tma.MAP_BYTES:] == bytes([7]) * tma.MAP_BYTES
    assert len(driver.calls) == 1
    rank, dims, strides, box = driver.calls[0]
    assert (rank, dims, strides, box) == (2, [128, tma.TEMPLATE_ROWS], [128 * 4], [8, tile.block_m])
    repeatable = specs.bwd_wgmma_tile(64, 64, "sm_90a", deterministic=True)
    assert specs.bwd_wgmma_spec("bf16", 64, repeatable).dq_map is None


def test_every_dq_template_is_as_wide_as_its_kernels_accumulator():
    """The accumulator's rows are the kernel's head dim wide (wgmma/bwd.cu indexes them by kHeadDim) and a box is
    the kernel's step of rows by the staged boxes' columns: a template as wide as q's head dim instead read a d40 q's
    dQ from the wrong places in the d64 kernel."""
    from flashtile import registry

    templates = [s for s in registry.all_specs("sm_90a") if s.dq_map is not None]
    assert {dict(s.defines)["FT_HEAD_DIM"] for s in templates} == {64, 128}
    for spec in templates:
        defines = dict(spec.defines)
        assert spec.dq_map == specs.DqBox(defines["FT_BLOCK_M"], specs.DQ_BOX_COLS, defines["FT_HEAD_DIM"])


def test_each_hopper_backward_block_has_a_slot_for_every_map_it_completes():
    """wgmma/bwd.cu's blocks complete maps of their own in the scratch (block_maps_of): the dQ writer's where it
    adds boxes, dK's and dV's for the epilogue's stores, the rows map for the loads of D and the LSE, and K's, V's,
    Q's and dO's bounded by a varlen block's sequence. The plan leaves as many 128-byte slots a block; kernels that
    take no maps need none."""
    from flashtile import backward, registry

    counts = set()
    for spec in registry.all_specs("sm_90a"):
        if spec.source != "wgmma/bwd.cu":
            continue
        writer_boxes = spec.dq_map is not None
        assert backward.block_maps(spec, varlen=False) == writer_boxes + 3
        assert backward.block_maps(spec, varlen=True) == writer_boxes + 7
        counts.add(writer_boxes)
    assert counts == {False, True}  # both kinds of build exist, so both sums were checked
    grid = specs.bwd_grid_spec("bf16", 192, 128, "sm_90a", specs.bwd_grid_tile(192, "sm_90a", ()))
    assert backward.block_maps(grid, varlen=True) == 0


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_backward_scratch_holds_every_query_tile_whole(varlen, seed):
    """The backward's scratch rows (kernels/common/params.cuh scratch_row0, sized by backward.scratch_strides): each
    problem's rows start on a whole tile and its padded tiles (the Hopper backward copies a tile's LSE and D whole)
    overlap no other problem's and end inside the rows the plan allocates: dense, and varlen with sequences of any
    length (empty ones too) and an LSE whose head stride passes its packed rows (a view)."""
    import types

    from flashtile import backward

    g = torch.Generator().manual_seed(seed)
    tile, batch, heads = backward.SCRATCH_TILE, 1 + seed * 3, 1 + seed
    lengths = torch.randint(0, 3 * tile, (batch,), generator=g).tolist()
    lengths[0] = 0 if varlen else lengths[0]
    seqlen = max(lengths) if varlen else 1 + seed * 77
    starts = [sum(lengths[:b]) for b in range(batch)] if varlen else [0] * batch
    lse = torch.empty(heads, sum(lengths) + seed * 5)[:, :sum(lengths)] if varlen else torch.empty(batch, heads, seqlen)
    problem = types.SimpleNamespace(varlen=varlen, batch=batch, heads_q=heads, seqlen_q=seqlen)
    batch_stride, head_stride = backward.scratch_strides(problem, lse)
    spans = []
    for h in range(heads):
        for b in range(batch):
            row0 = h * head_stride + ((starts[b] + b * batch_stride) & -tile)  # scratch_row0
            rows = lengths[b] if varlen else seqlen
            assert row0 % tile == 0
            spans.append((row0, row0 + -(-rows // tile) * tile))
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= heads * head_stride


def test_the_host_pads_scratch_rows_to_the_kernels_tile():
    """backward.SCRATCH_TILE mirrors params.cuh's kScratchTile, which scratch_row0 rounds to: apart, the host would
    size the scratch for one tiling and the kernels copy whole tiles of another."""
    import re

    from flashtile import backward, jit

    source = (jit.KERNEL_ROOT / "common" / "params.cuh").read_text()
    assert int(re.search(r"constexpr int kScratchTile = (\d+);", source).group(1)) == backward.SCRATCH_TILE


class _FakeDriver:
    """cuda.bindings.driver's few names tma._encode uses, recording what it is asked to encode."""

    def __init__(self):
        self.calls = []
        self.cuuint64_t = self.cuuint32_t = int
        self.CUtensorMapDataType = types.SimpleNamespace(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16="bf16",
                                                         CU_TENSOR_MAP_DATA_TYPE_FLOAT16="f16")
        self.CUtensorMapSwizzle = types.SimpleNamespace(CU_TENSOR_MAP_SWIZZLE_64B=64, CU_TENSOR_MAP_SWIZZLE_128B=128)
        self.CUtensorMapInterleave = types.SimpleNamespace(CU_TENSOR_MAP_INTERLEAVE_NONE=0)
        self.CUtensorMapL2promotion = types.SimpleNamespace(CU_TENSOR_MAP_L2_PROMOTION_L2_128B=128)
        self.CUtensorMapFloatOOBfill = types.SimpleNamespace(CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE=0)
        self.CUresult = types.SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_INVALID_CONTEXT=201)

    def cuTensorMapEncodeTiled(self, dtype, rank, address, dims, strides, box, element_strides, *modes):
        self.calls.append((rank, list(dims), list(strides), list(box)))
        return 0, types.SimpleNamespace(getPtr=lambda: 0)


def test_a_box_of_column_blocks_takes_a_five_dimensional_map(monkeypatch):
    """Pages (blocks, page rows, kv heads, d): the 4-D map is (d, rows, heads, pages) with one 64-byte column block
    per box; with KvBox.blocks the head dim splits into (column, column block), strided 64 bytes apart, and one
    box spans every block (the decode build's row groups)."""
    driver = _FakeDriver()
    monkeypatch.setattr(tma, "_cuda", lambda: driver)
    monkeypatch.setattr(tma.ctypes, "string_at", lambda address, size: bytes(size))
    pages = torch.zeros(10, 16, 4, 128, dtype=torch.bfloat16)
    row, head, page = 4 * 128 * 2, 128 * 2, 16 * 4 * 128 * 2
    tma._encode(pages, KvBox(16, 32))
    tma._encode(pages, KvBox(16, 32, 4))
    assert driver.calls[0] == (4, [128, 16, 4, 10], [row, head, page], [32, 16, 1, 1])
    assert driver.calls[1] == (5, [32, 16, 4, 4, 10], [row, 64, head, page], [32, 16, 4, 1, 1])


def test_a_thread_without_a_context_gets_its_devices_and_encodes_again(monkeypatch):
    """Autograd's backward thread may have no current CUDA context when it encodes the backward's maps: the encoder
    makes the tensor's device's primary context current and tries once more; any other failure is an error."""
    driver = _FakeDriver()
    answers = [201, 0]
    calls = driver.calls
    driver.cuTensorMapEncodeTiled = lambda *args: (calls.append(args) or answers.pop(0),
                                                   types.SimpleNamespace(getPtr=lambda: 0))
    made_current = []

    class _Device:
        def __init__(self, index):
            self.index = index

        def set_current(self):
            made_current.append(self.index)

    monkeypatch.setattr(tma, "_cuda", lambda: driver)
    monkeypatch.setattr(tma, "cuda_module", lambda name: types.SimpleNamespace(Device=_Device))
    monkeypatch.setattr(tma.ctypes, "string_at", lambda address, size: bytes(size))
    k = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 3)), raising=False)
    assert len(tma._encode(k, KvBox(64, 64))) == tma.MAP_BYTES
    assert made_current == [3] and len(calls) == 2
    answers[:] = [201, 201]
    with pytest.raises(RuntimeError, match="INVALID|201"):
        tma._encode(k, KvBox(64, 64))


def test_a_varlen_backward_runs_its_longest_sequences_first():
    """plans.longest_first: the order the backward's key-block grids run a varlen batch's entries in (bwd_frame.cuh
    key_block_of): by query rows, longest first, ties (and empty sequences) in batch order, int32 on the offsets'
    device."""
    from flashtile import plans

    cu = torch.tensor([0, 5, 5, 80, 90, 165, 165], dtype=torch.int32)  # lengths 5, 0, 75, 10, 75, 0
    order = plans.longest_first(cu)
    assert order.dtype == torch.int32 and order.device == cu.device
    assert order.tolist() == [2, 4, 3, 0, 1, 5]
