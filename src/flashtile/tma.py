"""Tensor maps for Hopper's tensor memory accelerator: how rungs 4 and 5 feed their K/V rings on sm_90.

A tensor map (CUtensorMap) describes a strided global tensor and a box; the kernel (kernels/common/tma.cuh)
copies whole boxes into shared memory with one instruction. The forward's maps view K and V as 4-D tensors
(head dim, rows, kv heads, batch) — varlen packs every sequence along the rows of one batch entry — with boxes
of one swizzle block of common/tile.cuh by a tile's rows: 32 columns (64 bytes) in the 64-byte swizzle mode for
rung 4's narrow layout, 64 columns (128 bytes) in the 128-byte mode for the wide layout wgmma reads (rung 5).
Either mode writes exactly the layout the kernel's addressing reads. A box of several column blocks (KvBox.blocks,
the decode build for small pages) takes a 5-D map, the head dim split into (column, column block): its box lands
as one of common/tile.cuh's row groups. A map holds the tensor's address;
encoding one (cuTensorMapEncodeTiled through cuda.bindings) costs ~11 us of host time on the H200's host, so
maps are kept by address, shape, strides and dtype: the same memory seen the same way is described by the
same map, and a repeated call (a benchmark, a static KV buffer, the caching allocator handing back a block)
pays a dictionary lookup.
"""

from __future__ import annotations

import ctypes

import torch

from .jit import cuda_module
from .specs import TENSOR_MAP_BYTES as MAP_BYTES
from .specs import DqBox, KvBox

NO_MAPS = bytes(2 * MAP_BYTES)  # the kernel's KvMaps parameter when its build loads K/V with cp.async
MAX_KEPT_MAPS = 1024

_kept: dict[tuple, bytes] = {}

_driver = None


def _cuda():
    global _driver
    if _driver is None:
        _driver = cuda_module("cuda.bindings.driver")
    return _driver


def _encode(t: torch.Tensor, box: KvBox) -> bytes:
    d = _cuda()
    elem = t.element_size()
    if t.dim() == 3:  # varlen (total, heads, dim): one batch entry
        shape, strides = (t.shape[0], t.shape[1], 1), (t.stride(0), t.stride(1), 0)
    else:             # (batch, rows, heads, dim) -> rows, heads, batch
        shape, strides = (t.shape[1], t.shape[2], t.shape[0]), (t.stride(1), t.stride(2), t.stride(0))
    dims, box_dims = [t.shape[-1]], [box.cols, box.rows, 1, 1]
    if box.blocks > 1:  # the head dim as (column, column block): a box takes a row's every block at once
        dims = [box.cols]
        shape, strides = (shape[0], t.shape[-1] // box.cols, *shape[1:]), (strides[0], box.cols, *strides[1:])
        box_dims = [box.cols, box.rows, box.blocks, 1, 1]
    # A dimension of one index never moves: give it any legal stride (a multiple of 16 bytes below 2^40).
    span = -(-t.numel() * elem // 16) * 16
    byte_strides = [s * elem if n > 1 else span for n, s in zip(shape, strides)]
    dtype = (d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if t.dtype == torch.bfloat16
             else d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    swizzle = {64: d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
               128: d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}[box.cols * elem]
    return _encode_tiled(t.device, dtype, t.data_ptr(), [*dims, *shape], byte_strides, box_dims, swizzle,
                         f"a tensor of shape {tuple(t.shape)}, strides {t.stride()}")


def _encode_tiled(device: torch.device, dtype, address: int, dims: list[int], byte_strides: list[int],
                  box_dims: list[int], swizzle, what: str) -> bytes:
    """cuTensorMapEncodeTiled's map (no interleave, 128-byte L2 promotion, no fill) as MAP_BYTES bytes."""
    d = _cuda()

    def encode():
        return d.cuTensorMapEncodeTiled(
            dtype, len(box_dims), address, [d.cuuint64_t(n) for n in dims], [d.cuuint64_t(s) for s in byte_strides],
            [d.cuuint32_t(n) for n in box_dims], [d.cuuint32_t(1)] * len(box_dims),
            d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)

    err, tmap = encode()
    if err == d.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        # A thread where the CUDA runtime never ran (autograd's backward thread encodes the backward's maps) has
        # no current context: make the tensor's device's primary context current, once, as launch.run does.
        cuda_module("cuda.core").Device(device.index).set_current()
        err, tmap = encode()
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for {what}")
    return ctypes.string_at(tmap.getPtr(), MAP_BYTES)


def _map(t: torch.Tensor, box: KvBox) -> bytes:
    # The box as ints, which hash in C (a frozen dataclass hashes and compares in Python): a decode step asks for
    # its maps on every call.
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, box.rows, box.cols, box.blocks)
    encoded = _kept.get(key)
    if encoded is None:
        if len(_kept) >= MAX_KEPT_MAPS:
            _kept.clear()
        encoded = _kept[key] = _encode(t, box)
    return encoded


def kv_maps(k: torch.Tensor, v: torch.Tensor, box: KvBox) -> bytes:
    """The forward kernel's KvMaps parameter: K's map, then V's (kernels/common/tma.cuh)."""
    return _map(k, box) + _map(v, box)


def kernel_argument(k: torch.Tensor, v: torch.Tensor, box: KvBox | None, q: torch.Tensor | None = None,
                    q_box: KvBox | None = None, o: torch.Tensor | None = None,
                    o_box: KvBox | None = None) -> bytes | None:
    """The forward kernel's second argument (its spec's `kv_maps`, `q_map` and `o_map` say which): None for
    kernels that take one argument, empty maps for builds that load K/V with cp.async (box rows 0), else K's and
    V's maps, Q's after them where the kernel loads Q through one (`q_box`), and O's after Q's where the kernel
    stores O through one (`o_box`)."""
    if box is None:
        return None
    if not box.rows:
        return NO_MAPS
    maps = kv_maps(k, v, box)
    if q_box is not None:
        maps += _map(q, q_box)
    if o_box is not None:
        maps += _map(o, o_box)
    return maps


def backward_argument(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                      boxes: tuple[KvBox | DqBox, ...]) -> bytes:
    """The Hopper backward's BwdMaps parameter (kernels/common/tma.cuh): K's, V's, Q's and dO's maps; `boxes` are
    the spec's K/V, Q and dO boxes, and a fourth, the dQ box, where its writer adds boxes: then the accumulator's
    template follows (BwdMapsDq)."""
    kv_box, q_box, do_box, *dq_box = boxes
    maps = _map(k, kv_box) + _map(v, kv_box) + _map(q, q_box) + _map(dout, do_box)
    return maps + dq_template(q, dq_box[0]) if dq_box else maps


# The accumulator template's stand-ins for what the kernel sets (common/tma.cuh tensormap_complete): an aligned
# address and a row count; the encoder reads neither's memory.
TEMPLATE_ADDRESS = 1 << 16
TEMPLATE_ROWS = 1 << 30


def dq_template(q: torch.Tensor, box: DqBox) -> bytes:
    """The fp32 dQ accumulator's map as (the kernel's head dim, rows), boxes of `box.cols` columns x `box.rows`
    rows, no swizzle, with a stand-in address and row count: the backward's writer completes a copy on the device.
    The accumulator's rows are the kernel's head dim wide, also where q's is narrower (its last boxes then add
    the zeros of the padded columns). The same bytes for every call of a kernel."""
    key = ("dq", box.width, box.rows, box.cols)
    encoded = _kept.get(key)
    if encoded is None:
        d = _cuda()
        encoded = _kept[key] = _encode_tiled(
            q.device, d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32, TEMPLATE_ADDRESS,
            [box.width, TEMPLATE_ROWS], [box.width * 4], [box.cols, box.rows],
            d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE, f"the dQ accumulator's template, head dim {box.width}")
    return encoded

