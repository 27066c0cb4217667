"""Launching compiled kernels on torch tensors: params packing, module loading, the launch itself.

cuda.core compiles (see jit.py) and loads the cubin. The launch goes through the driver's
``cuLaunchKernel`` (cuda.bindings) because cuda.core 1.2 cannot pass a struct by value, and every
flashtile kernel takes exactly one argument: the :data:`PARAM_FIELDS` struct (kernels/common/params.cuh).
Work is queued on torch's *current* stream, so flashtile composes with streams, graphs and the rest of
torch like any torch op.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import struct
import threading
from collections import namedtuple
from dataclasses import dataclass

import torch

from . import jit
from .specs import KernelSpec

# (field, struct format) in the exact order of `struct AttnParams` in kernels/common/params.cuh.
# Q = pointer, q = int64, i = int32, f = float32. tests/test_jit.py checks every offset against NVRTC.
PARAM_FIELDS: tuple[tuple[str, str], ...] = (
    ("q", "Q"), ("k", "Q"), ("v", "Q"), ("o", "Q"), ("lse", "Q"), ("scores", "Q"),
    ("cu_seqlens_q", "Q"), ("cu_seqlens_k", "Q"), ("alibi_slopes", "Q"),
    ("q_batch_stride", "q"), ("q_row_stride", "q"), ("q_head_stride", "q"),
    ("k_batch_stride", "q"), ("k_row_stride", "q"), ("k_head_stride", "q"),
    ("v_batch_stride", "q"), ("v_row_stride", "q"), ("v_head_stride", "q"),
    ("o_batch_stride", "q"), ("o_row_stride", "q"), ("o_head_stride", "q"),
    ("lse_batch_stride", "q"), ("lse_head_stride", "q"),
    ("alibi_batch_stride", "q"),
    ("batch", "i"), ("heads_q", "i"), ("heads_kv", "i"), ("group", "i"),
    ("seqlen_q", "i"), ("seqlen_k", "i"),
    ("head_dim", "i"), ("head_dim_v", "i"),
    ("softmax_scale", "f"), ("scale_log2", "f"), ("softcap", "f"),
    ("window_left", "i"), ("window_right", "i"), ("tail_tiles", "i"),
    ("seqused_k", "Q"), ("block_table", "Q"), ("o_accum", "Q"), ("lse_accum", "Q"),
    ("block_table_batch_stride", "q"), ("page_size", "i"), ("num_splits", "i"),
)
# The backward kernels' `struct BwdParams`: an AttnParams, then these fields.
BWD_EXTRA_FIELDS: tuple[tuple[str, str], ...] = (
    ("dout", "Q"), ("dq", "Q"), ("dk", "Q"), ("dv", "Q"),
    ("dq_accum", "Q"), ("dsum", "Q"), ("lse_log2", "Q"), ("dq_semaphore", "Q"), ("dlse", "Q"),
    ("batch_order", "Q"),
    ("do_batch_stride", "q"), ("do_row_stride", "q"), ("do_head_stride", "q"),
    ("dq_batch_stride", "q"), ("dq_row_stride", "q"), ("dq_head_stride", "q"),
    ("dk_batch_stride", "q"), ("dk_row_stride", "q"), ("dk_head_stride", "q"),
    ("dv_batch_stride", "q"), ("dv_row_stride", "q"), ("dv_head_stride", "q"),
    ("scratch_batch_stride", "q"), ("scratch_head_stride", "q"),
    ("m_blocks", "i"),
)
BWD_PARAM_FIELDS = PARAM_FIELDS + BWD_EXTRA_FIELDS


def _fmt(fields) -> str:
    return "".join(fmt for _, fmt in fields)


# '@' = native alignment, as the C compiler lays the struct out; '0Q' pads the end to 8 bytes like C does
# (and, in BwdParams, aligns the fields after the nested AttnParams).
PARAMS_STRUCT = struct.Struct("@" + _fmt(PARAM_FIELDS) + "0Q")
BWD_PARAMS_STRUCT = struct.Struct("@" + _fmt(PARAM_FIELDS) + "0Q" + _fmt(BWD_EXTRA_FIELDS) + "0Q")
BWD_ADDRESS_OFFSET = PARAMS_STRUCT.size  # BwdParams' own fields (dO's address first) follow the nested AttnParams
_ParamValues = namedtuple("_ParamValues", [name for name, _ in PARAM_FIELDS], defaults=[0] * len(PARAM_FIELDS))
_BwdValues = namedtuple("_BwdValues", [name for name, _ in BWD_PARAM_FIELDS], defaults=[0] * len(BWD_PARAM_FIELDS))


def param_values(**values) -> tuple:
    """The struct's field values in order, by name; fields not given are zero (null pointers, unused sizes)."""
    return tuple(_ParamValues(**values))


def bwd_param_values(**values) -> tuple:
    """The same for BwdParams (forward fields first)."""
    return tuple(_BwdValues(**values))


@dataclass
class LoadedKernel:
    function: object          # driver.CUfunction bound to the device's primary context
    device: int
    max_dynamic_smem: int = 0  # the largest dynamic shared memory this function is cleared to use
    extra_bytes: int = 0       # the size of its second argument (0: it takes only the params struct)


@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch with every geometric decision made: the kernel, its grid, threads and shared memory."""

    kernel: LoadedKernel
    grid: tuple[int, int, int]
    threads: int
    smem: int


@dataclass
class LoadedModule:
    spec: KernelSpec
    code: object                        # cuda.core ObjectCode: owns the loaded library
    kernels: dict[str, LoadedKernel]


_loaded: dict[tuple[KernelSpec, int], LoadedModule] = {}


def _check(result, what: str):
    driver = jit.cuda_module("cuda.bindings.driver")

    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {err.name} ({msg.decode() if msg else ''})")
    return result[1] if len(result) == 2 else result[1:]


def load(spec: KernelSpec, device: int) -> LoadedModule:
    """Compile (or fetch from the cache) and load `spec` on a CUDA device."""
    key = (spec, device)
    if key in _loaded:
        return _loaded[key]
    driver = jit.cuda_module("cuda.bindings.driver")
    cuda_core = jit.cuda_module("cuda.core")
    Device, ObjectCode = cuda_core.Device, cuda_core.ObjectCode

    module = jit.compile_spec(spec)
    # Load into the device's primary context (shared with torch); torch.cuda.device puts the caller's current
    # device back afterwards, so loading for another GPU does not move the caller.
    with torch.cuda.device(device):
        Device(device).set_current()
        code = ObjectCode.from_cubin(module.cubin, name=spec.name)
        kernels = {}
        for entry in spec.entries:
            handle = code.get_kernel(entry).handle
            if not isinstance(handle, driver.CUfunction):  # a library kernel: take its function in this context
                handle = _check(driver.cuKernelGetFunction(handle), f"cuKernelGetFunction({entry})")
            kernels[entry] = LoadedKernel(handle, device, extra_bytes=spec.maps_bytes)
    loaded = _loaded[key] = LoadedModule(spec, code, kernels)
    return loaded


EXTRA_BYTES = 640   # the largest second argument: the Hopper backward's BwdMapsDq (five 128-byte tensor maps)
EXTRA_ALIGN = 64    # a tensor map's alignment


class _ParamsBuffer(threading.local):
    """Per-thread home of the params struct (and a second argument, for the kernels that take one) while the
    driver reads them (cuLaunchKernel copies them at once)."""

    def __init__(self):
        self.buffer = ctypes.create_string_buffer(max(PARAMS_STRUCT.size, BWD_PARAMS_STRUCT.size))
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.buffer))  # void** kernelParams: one argument
        self.argv_address = ctypes.addressof(self.argv)
        self._extra = ctypes.create_string_buffer(EXTRA_BYTES + EXTRA_ALIGN)
        self.extra_address = -(-ctypes.addressof(self._extra) // EXTRA_ALIGN) * EXTRA_ALIGN
        self.argv2 = (ctypes.c_void_p * 2)(ctypes.addressof(self.buffer), self.extra_address)
        self.argv2_address = ctypes.addressof(self.argv2)


_params_buffer = _ParamsBuffer()
_SAME_DEVICE = contextlib.nullcontext()


def launch(kernel: LoadedKernel, grid: tuple[int, int, int], block: int, smem: int, params: tuple,
           layout: struct.Struct = PARAMS_STRUCT, extra: bytes | None = None) -> None:
    """Queue `kernel<<<grid, block, smem, current stream>>>(AttnParams{params...}[, extra])`.

    `params` are the struct's field values in PARAM_FIELDS order (FwdProblem.params builds them); the
    backward kernels take BWD_PARAMS_STRUCT and BWD_PARAM_FIELDS. `extra` is the raw bytes of a second
    argument (the forward's tensor maps, flashtile/tma.py).
    """
    run((Launch(kernel, grid, block, smem),), params, layout, extra)


def run(launches: tuple[Launch, ...], params: tuple, layout: struct.Struct = PARAMS_STRUCT,
        extra: bytes | None = None) -> None:
    """Queue `launches` in order on the current stream, all with one params struct (packed once)."""
    driver = jit.cuda_module("cuda.bindings.driver")
    args = _params_buffer
    layout.pack_into(args.buffer, 0, *params)
    argv = args.argv_address
    if extra is not None:
        if len(extra) > EXTRA_BYTES:
            raise ValueError(f"a second kernel argument of {len(extra)} bytes; the buffer holds {EXTRA_BYTES}")
        ctypes.memmove(args.extra_address, extra, len(extra))
        argv = args.argv2_address
    device = launches[0].kernel.device
    # The driver launches into the calling thread's current context: it must be the primary context of the
    # kernel's (and the tensors') device, which torch makes current when that device is its current one.
    switch = _SAME_DEVICE if device == torch.cuda.current_device() else torch.cuda.device(device)
    with switch:
        stream = _current_stream(device)
        for step in launches:
            kernel, smem = step.kernel, step.smem
            if smem > kernel.max_dynamic_smem:
                allow_smem(kernel, smem)
            if (len(extra) if extra is not None else 0) != kernel.extra_bytes:
                raise ValueError(f"this kernel takes a second argument of {kernel.extra_bytes} bytes; "
                                 f"got {None if extra is None else len(extra)}")
            result = driver.cuLaunchKernel(kernel.function, *step.grid, step.threads, 1, 1, smem, stream, argv, 0)
            if result[0] == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
                # A thread where the CUDA runtime never ran (autograd's backward thread, whose first CUDA work
                # may be ours) has no current context: make the device's primary context current, once.
                jit.cuda_module("cuda.core").Device(device).set_current()
                result = driver.cuLaunchKernel(kernel.function, *step.grid, step.threads, 1, 1, smem, stream, argv, 0)
            _check(result, "cuLaunchKernel")


def allow_smem(kernel: LoadedKernel, smem: int) -> None:
    """Clear `kernel` to use `smem` bytes of dynamic shared memory (past 48 KB the driver must be told)."""
    if smem > kernel.max_dynamic_smem:
        driver = jit.cuda_module("cuda.bindings.driver")
        _check(driver.cuFuncSetAttribute(
            kernel.function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
            "setting the dynamic shared-memory limit")
        kernel.max_dynamic_smem = smem


@functools.cache
def primary_context(device: int) -> int:
    """The handle of `device`'s primary context (torch's, where flashtile loads its kernels)."""
    driver = jit.cuda_module("cuda.bindings.driver")
    handle = _check(driver.cuDeviceGet(device), "cuDeviceGet")
    return int(_check(driver.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain"))


def _current_stream(device: int) -> int:
    """torch's current stream on `device` as a raw handle (the same stream torch's own ops use)."""
    return torch.cuda.current_stream(device).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # the same value without building a Stream object (~2 us)
    _current_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811
