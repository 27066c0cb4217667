"""The host path: a planned call's per-call work (allocate, write the params, launch, record the autograd node) in
C++, where a host compiler exists; and on the CPU, the general path's kernel calls: host.cpp's own kernel for
small problems and decoding shapes, torch's kernel after the finite check elsewhere.

Python plans every call (plans.py); ``csrc/host.cpp`` only replays a plan: it takes the kernels' handles and
geometry and the params struct packed with its address fields zero, and per call writes the operands' addresses
and launches. In training its autograd node runs the backward plan the same way, so an eager training step pays
neither ``autograd.Function``'s Python layer nor Python's per-launch cost.

torch.utils.cpp_extension builds it once per torch version and source (a minute on 16 cores, about five on 2;
then it loads from the cache folder). ``FLASHTILE_HOST`` chooses:

- ``auto`` (default): the first CUDA call (or CPU call torch's kernel serves) starts the build in a background
  thread where a C++ compiler is found;
  calls take the Python path until it is ready, then the call cache is emptied so that new plans take it.
- ``on``: build on the first CUDA call and wait for it; a failed build is an error (tests and benchmarks).
- ``off``: the Python path only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable, NamedTuple

import torch
from filelock import FileLock

from . import cpu_kernel, jit, launch, plans, tma

MODE_ENV = "FLASHTILE_HOST"
MODES = ("auto", "on", "off")
SOURCE = Path(__file__).parent / "csrc" / "host.cpp"
COMPILE_FLAGS = ["-O2"]
# The CPU kernels' vector width in bytes (host.cpp's kVectorBytes): 64 where torch finds AVX-512, else 32. Tiles of
# 64-byte vectors need more registers than AVX2's sixteen of 32 bytes (or NEON's) hold and spill (notes.md, session
# thirty-five). The width enters the build's flags, and so its folder's name: a cache shared by machines of both
# kinds keeps a build for each. FLASHTILE_CPU_VECTOR_BYTES (32 or 64) overrides it (tests build the other width).
VECTOR_BYTES_ENV = "FLASHTILE_CPU_VECTOR_BYTES"
VECTOR_BYTES = (32, 64)
# at::parallel_for is inline code: compiled without OpenMP it runs its whole range on the calling thread. Where
# torch's own backend is OpenMP (its Linux builds) and the compiler is GCC (whose OpenMP needs nothing more
# installed), the extension is compiled with it; the libgomp.so.1 it names is the one torch has loaded (the
# loader matches the name). Elsewhere host.cpp's CPU kernel runs on one thread, correct but slower.
OPENMP_FLAGS = ("-fopenmp",)
GCC_SIGNATURE = "Free Software Foundation"  # what `g++ --version` prints and Clang's does not
BUILD_LOCK_TIMEOUT_S = 900.0  # another process's build (about 5 minutes on 2 cores) ends well before this
TORCH_BUILD_MARKER = "lock"   # torch.utils.cpp_extension's file while a build runs


class HostPathWarning(RuntimeWarning):
    """The C++ host path could not be built; the Python path serves every call."""


_module: ModuleType | None = None
_failed = False
_building: threading.Thread | None = None
_lock = threading.Lock()
_on_change: list[Callable[[], None]] = []
_poison = False
_suspended = False
_kept = None  # the extension's KeptCalls table (api.py's repeated calls), once the extension has loaded
MAX_KEPT_CALLS = 4096  # signatures kept: inference over ever-new shapes (a growing KV length) must not grow forever


def mode() -> str:
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {value!r}")
    return value


def on_change(listener: Callable[[], None]) -> None:
    """Call `listener` whenever the path new plans take changes: a background build finished, or
    :func:`python_path` began or ended (api.py empties its call cache)."""
    _on_change.append(listener)


def _changed() -> None:
    if _kept is not None:
        _kept.clear()
    for listener in _on_change:
        listener()


@contextlib.contextmanager
def python_path():
    """Within this block, calls planned anew take the Python path (tests and scripts/overhead.py compare both)."""
    global _suspended
    before, _suspended = _suspended, True
    _changed()
    try:
        yield
    finally:
        _suspended = before
        _changed()


def set_poison(on: bool) -> None:
    """Tests (conftest.py): every output and gradient buffer the C++ path allocates starts as NaN."""
    global _poison
    _poison = on
    if _module is not None:
        _module.set_poison(on)


def _loaded(module: ModuleType) -> ModuleType:
    global _module, _kept
    module.set_poison(_poison)
    _kept = module.KeptCalls(MAX_KEPT_CALLS)
    _module = module
    return module


def kept_calls():
    """The C++ table of kept calls (csrc/host.cpp's KeptCalls: a repeated call's lookup and run in one crossing),
    or None while the Python path serves."""
    return None if _suspended else _kept


def keep(q, k, v, options: tuple, call, return_lse: bool) -> None:
    """Keep `call`, planned for the signature of q, k, v and `options` (api.attention's), in the C++ table where
    its whole run is C++: a planned CUDA call's host path, or torch's CPU kernel. A repeated call then answers
    out, or (out, lse) where `return_lse`."""
    table = kept_calls()
    if table is None or call.host is None:
        return
    if isinstance(call.host, CpuKernel):
        table.keep_cpu(q, k, v, options, call.host.scale, call.host.causal, call.host.tuned, return_lse)
    else:
        table.keep_cuda(q, k, v, options, call.host, return_lse)


@functools.cache
def _compiler_is_gcc() -> bool:
    try:
        done = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return GCC_SIGNATURE in done.stdout


def cpu_vector_bytes() -> int:
    """The vector width host.cpp's CPU kernels are built for here (VECTOR_BYTES_ENV, else torch's CPU capability)."""
    value = os.environ.get(VECTOR_BYTES_ENV, "").strip()
    if not value:
        return 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32
    if value not in {str(b) for b in VECTOR_BYTES}:
        raise ValueError(f"{VECTOR_BYTES_ENV} must be one of {', '.join(map(str, VECTOR_BYTES))}, got {value!r}")
    return int(value)


def _compile_flags() -> list[str]:
    """A new list each call (as _openmp_flags): the optimisation level, the vector width, OpenMP's flag."""
    return COMPILE_FLAGS + [f"-DFT_VECTOR_BYTES={cpu_vector_bytes()}"] + _openmp_flags()


def _openmp_flags() -> list[str]:
    """A new list each call: torch's build appends to the lists it is given."""
    wanted = sys.platform.startswith("linux") and torch.backends.openmp.is_available() and _compiler_is_gcc()
    return list(OPENMP_FLAGS) if wanted else []


def can_build() -> bool:
    """A C++ compiler ($CXX, else c++) and Python's headers: what torch's extension build needs here."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which(os.environ.get("CXX", "c++")) is not None and headers.is_file()


def build_dir() -> Path:
    flags = " ".join(_compile_flags())
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + flags.encode()).hexdigest()[:16]
    return jit.cache_dir() / "host" / digest


def _build() -> ModuleType:
    """Build (or load the build of) the extension. Processes take turns through an OS file lock, which a killed
    process releases; torch's own marker of a build in progress (`lock` in the folder) is then stale whenever it
    exists, and torch would wait for it forever, so it goes first."""
    from torch.utils import cpp_extension

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(folder / "flashtile.lock", timeout=BUILD_LOCK_TIMEOUT_S):
        (folder / TORCH_BUILD_MARKER).unlink(missing_ok=True)
        return cpp_extension.load(f"flashtile_host_{folder.name}", [str(SOURCE)],
                                  extra_cflags=_compile_flags(), extra_ldflags=_openmp_flags(),
                                  build_directory=str(folder), verbose=False)


def _build_in_background() -> None:
    global _failed
    try:
        module = _build()
    except Exception as exc:  # any build failure leaves the Python path serving
        _failed = True
        warnings.warn(f"flashtile: the C++ host path did not build ({type(exc).__name__}: {exc}); the Python "
                      f"path serves every call (set {MODE_ENV}=off to skip the attempt)", HostPathWarning,
                      stacklevel=1)
        return
    _loaded(module)
    _changed()


def extension() -> ModuleType | None:
    """The built extension, or None while the Python path serves (off, building, no compiler, failed)."""
    global _building
    if _suspended:
        return None
    if _module is not None or _failed:
        return _module
    chosen = mode()
    if chosen == "off":
        return None
    with _lock:
        if _module is not None:
            return _module
        if chosen == "on":
            return _loaded(_build())
        if _building is None and can_build():
            _building = threading.Thread(target=_build_in_background, name="flashtile-host-build", daemon=True)
            _building.start()
    return None


def describe() -> str:
    """One line for `flashtile info`: which path eager calls take, without starting a build."""
    if _module is not None:
        return f"C++ ({_module.__file__})"
    chosen = mode()
    if chosen == "off":
        return f"Python ({MODE_ENV}=off)"
    if _failed:
        return "Python (the C++ build failed)"
    if chosen == "auto" and not can_build():
        return "Python (no C++ compiler or Python headers found)"
    return f"C++ once built (first CUDA call; {MODE_ENV}={chosen}), Python until then"


def wait() -> ModuleType | None:
    """Wait for a background build started by :func:`extension`; the module, or None."""
    if _building is not None:
        _building.join()
    return _module


def _steps(launches: tuple[launch.Launch, ...]) -> list[tuple[int, ...]]:
    for step in launches:
        launch.allow_smem(step.kernel, step.smem)
    return [(int(step.kernel.function), *step.grid, step.threads, step.smem) for step in launches]


def _backward_of(module: ModuleType, plan: plans.BwdPlan, device: int):
    packed = launch.BWD_PARAMS_STRUCT.pack(*(0,) * plans.ADDRESS_FIELDS, *plan.tail,
                                           *(0,) * plans.BWD_ADDRESS_FIELDS, *plan.bwd_tail)
    boxes = plan.boxes
    make_maps = None if boxes is None else (lambda q, k, v, dout: tma.backward_argument(q, k, v, dout, boxes))
    return module.make_backward(_steps(plan.launches), packed, launch.primary_context(device),
                                launch.BWD_ADDRESS_OFFSET, list(plan.dout_stride), plan.lse_floats, plan.accum_floats,
                                plan.semaphore_ints, plan.groups.count, plan.groups.q_heads, plan.groups.kv_heads,
                                plan.groups.lse_head_dim, make_maps)


def forward_of(plan: plans.FwdPlan, backward_plan: plans.BwdPlan | None, device: int):
    """The C++ replay of a forward plan (holding its backward plan's, for training), or None where the Python
    path keeps the call: no extension."""
    module = extension()
    if module is None:
        return None
    packed = launch.PARAMS_STRUCT.pack(*(0,) * plans.ADDRESS_FIELDS, *plan.tail)
    box, q_box, o_box = plan.kv_box, plan.q_box, plan.o_box
    make_maps = None if box is None else (lambda q, k, v, o: tma.kernel_argument(k, v, box, q, q_box, o, o_box))
    backward = None if backward_plan is None else _backward_of(module, backward_plan, device)
    return module.make_forward(_steps(plan.launches), packed, launch.primary_context(device),
                               list(plan.out_shape or ()), list(plan.lse_shape or ()), make_maps, q_box is not None,
                               o_box is not None, backward, plan.scratch_floats, plan.zeroed_floats)


class CpuKernel(NamedTuple):
    """The C++ calls of the CPU kernels for one problem's options: host.cpp's own kernel for small problems,
    torch's elsewhere, and where both serve, the faster for the kind of problem, measured on its first call
    (host.cpp's KernelChoices; not in deterministic mode, where the own kernel runs). Each returns None where
    torch's kernel would take an input that is not finite, and the backward where it would take a gradient of the
    LSE (the general path's rules then serve); the own kernel takes both."""

    forward: Callable    # (q, k, v) -> (out, lse)
    backward: Callable   # (dout, q, k, v, out, lse, dlse or None) -> (dq, dk, dv)
    train: Callable      # (q, k, v) -> (out, lse), out carrying the C++ node whose backward is the kernel's
    scale: float         # the options they were made for
    causal: bool
    tuned: bool          # whether the faster kernel is measured (not in deterministic mode)


def cpu_kernel_of(problem, deterministic: bool = False) -> CpuKernel | None:
    """The C++ calls of the CPU kernels for a CPU problem one of them computes as flashtile defines it (host.cpp's
    own kernel for small problems and decoding's few queries, any causal shape; torch's where the problem is
    square under a causal mask), or None where the general path serves every call: no extension, or neither
    kernel serves the problem. `deterministic`: the kernel is chosen by rule, never by a timing."""
    q, k, v = problem.q, problem.k, problem.v
    left, right = problem.window
    if problem.varlen or not cpu_kernel.serves(q, k, v, left, right, problem.softcap, problem.alibi_slopes):
        return None
    module = extension()
    if module is None:
        return None
    # torch's kernel's causal mask is top-left aligned: it serves square problems only
    if right == 0 and q.shape[1] != k.shape[1] and not module.own_kernel_serves(q, k, v, True):
        return None
    scale, causal, tuned = problem.scale, right == 0, not deterministic
    return CpuKernel(lambda q, k, v: module.cpu_forward(q, k, v, scale, causal, tuned),
                     lambda dout, q, k, v, out, lse, dlse: module.cpu_backward(dout, q, k, v, out, lse, dlse, scale,
                                                                              causal, tuned),
                     lambda q, k, v: module.cpu_train(q, k, v, scale, causal, tuned), scale, causal, tuned)
