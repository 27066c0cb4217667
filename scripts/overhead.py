"""Where the host time of one small flashtile.attention call goes: each piece timed alone, warm."""

import ctypes

import torch

import flashtile
from flashtile import api, dispatch, ladder, launch, tma
from flashtile.bench import measure
from flashtile.forward import FwdProblem


q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
problem = FwdProblem(q, k, v, 0.125, (-1, -1))
rung = ladder.best_for(problem)
module = ladder.module_for(rung, problem)
kernel = module.kernels["attn_fwd"]
o, lse = problem.empty_outputs()
params = problem.params(o, lse)
grid = (1, 2, 1)
threads = dict(module.spec.defines)["FT_WARPS"] * 32
smem = module.spec.smem_bytes
extra = tma.kernel_argument(k, v, ladder.kv_box_rows(module.spec))
# d128 runs rung 4 with K/V fed by the tensor memory accelerator on Hopper: its maps are encoded every call.
q128, k128, v128 = (torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

libcuda = ctypes.CDLL("libcuda.so.1")
libcuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
libcuda.cuLaunchKernel.restype = ctypes.c_int
func = int(kernel.function)


def ctypes_launch():
    buffer = ctypes.create_string_buffer(launch.PARAMS_STRUCT.pack(*params))
    maps = ctypes.create_string_buffer(extra, len(extra) + 64)
    argv = (ctypes.c_void_p * 2)(ctypes.addressof(buffer), -(-ctypes.addressof(maps) // 64) * 64)
    ctypes.memmove(argv[1], extra, len(extra))
    stream = torch._C._cuda_getCurrentRawStream(0)
    err = libcuda.cuLaunchKernel(func, *grid, threads, 1, 1, smem, stream, argv, None)
    assert err == 0


rows = {
    "flashtile.attention (whole call)": lambda: flashtile.attention(q, k, v),
    "flashtile.attention d128 (TMA maps every call)": lambda: flashtile.attention(q128, k128, v128),
    "tma.kv_maps (two tensor maps)": lambda: tma.kv_maps(k128, v128, 64),
    "launch.launch (cuda.bindings)": lambda: launch.launch(kernel, grid, threads, smem, params, extra=extra),
    "ctypes cuLaunchKernel": ctypes_launch,
    "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream(0).cuda_stream,
    "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
    "torch.cuda.current_device (launch's device check)": torch.cuda.current_device,
    "problem.params": lambda: problem.params(o, lse),
    "problem.empty_outputs": problem.empty_outputs,
    "new_empty": lambda: q.new_empty(1, 64, 2, 64),
    "argument checks": lambda: (api._check_tensor("q", q, 4, ""), api._check_tensor("k", k, 4, ""),
                                api._check_tensor("v", v, 4, ""), api._check_family(q, k, v),
                                api._check_options(q, None, (-1, -1), 0.0, None, 1)),
    "_kernel_ready x3": lambda: (dispatch.kernel_ready(q), dispatch.kernel_ready(k), dispatch.kernel_ready(v)),
    "best_for": lambda: ladder.best_for(problem),
    "module_for": lambda: ladder.module_for(rung, problem),
    "torch.add (a small torch op)": lambda: torch.add(q, q),
}
for name, fn in rows.items():
    print(f"{name:<50} {measure.host_overhead_us(fn, calls=5000):7.2f} us")
kernel_ms = measure.time_cuda(lambda: launch.launch(kernel, grid, threads, smem, params, extra=extra))
print(f"kernel alone (events, CUDA graph-free): {kernel_ms * 1e3:.1f} us")
