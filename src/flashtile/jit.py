"""Run-time compilation: kernel spec -> NVRTC -> cubin, cached in memory and on disk.

The path of a request (the FlashInfer pattern): in-process memo -> disk cache (no lock) -> file lock
-> disk cache again (another process may have just built it) -> NVRTC -> atomic write. A cache entry is
two files named after the spec: ``<name>-<key>.cubin`` and ``<name>-<key>.json``. The JSON is written
last and carries the cubin's SHA-256, so a crash mid-write, a truncated or a corrupted file is noticed
and the entry is rebuilt. The key hashes the source, every header it includes, the compile options,
the architecture and the NVRTC version.

The cache only ever saves time: a folder that cannot be created, locked or written (read-only, another
user's, a full disk, a path that is a file) costs a :class:`CacheWarning` and the call returns the module
compiled in memory. A lock held too long is waited for up to :data:`LOCK_TIMEOUT_S`, then skipped.

Compilation needs no GPU: NVRTC runs on the CPU, which is how CI compiles every kernel for several
architectures.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import json
import os
import re
import struct
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

from filelock import FileLock, Timeout

from .specs import KernelSpec

KERNEL_ROOT = Path(__file__).parent / "kernels"
_CACHE_FORMAT = 1  # bump when the entry layout changes
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
LOCK_NOTICE_S = 5.0      # waiting this long for a spec's lock is said on stderr
LOCK_TIMEOUT_S = 60.0    # waiting this long, we compile without the lock
STALE_TEMP_S = 3600.0    # a temporary file this old was left by a writer that died mid-write
# An entry's file names start with at most this much of its spec's name (the key after it tells entries apart):
# the longest, a temporary file's, then stays within the 255 bytes most file systems allow a name.
MAX_NAME_CHARS = 160
_FILE_MODE = 0o666       # new cache files ask for this; the umask takes away the rest, as for any user file
_TEMP_SUFFIX = ".tmp"


class CacheWarning(RuntimeWarning):
    """The disk cache could not be used; the kernel was compiled in memory and works, only uncached."""


class CompileError(RuntimeError):
    """NVRTC rejected a kernel. Carries the spec and the full compiler log."""

    def __init__(self, spec: KernelSpec, log: str):
        super().__init__(f"NVRTC failed to compile {spec.name} ({spec.source}):\n{log}")
        self.spec = spec
        self.log = log


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel (bytes, except registers and barriers)."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_static: int
    barriers: int


@dataclass
class CompiledModule:
    spec: KernelSpec
    cubin: bytes
    resources: dict[str, KernelResources]
    log: str
    origin: str = "nvrtc"          # "nvrtc" | "disk" | "memory"
    seconds: float = 0.0           # time this request took
    key: str = field(default="", repr=False)


def cache_dir() -> Path:
    """$FLASHTILE_CACHE_DIR, else $XDG_CACHE_HOME/flashtile, else ~/.cache/flashtile (a leading ~ is expanded)."""
    override = os.environ.get("FLASHTILE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "flashtile"


_cuda_modules: dict[str, ModuleType] = {}
_CUDA_IMPORT_LOCK = threading.Lock()


def cuda_module(name: str) -> ModuleType:
    """The module `name` of cuda.core or cuda.bindings, imported safely from any thread.

    cuda.core's ``__init__`` copies its cu12/cu13 submodule's namespace, ``__spec__`` included, over its own,
    so Python stops seeing it as half-imported: a second thread importing it meanwhile gets ImportError. Every
    flashtile import of these packages goes through here, and the first one holds a lock.
    """
    module = _cuda_modules.get(name)
    if module is None:
        with _CUDA_IMPORT_LOCK:
            module = _cuda_modules.get(name) or importlib.import_module(name)
            _cuda_modules[name] = module
    return module


@cache
def nvrtc_version() -> tuple[int, int]:
    nvrtc = cuda_module("cuda.bindings.nvrtc")

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return major, minor


def source_closure(source: str) -> dict[str, str]:
    """The source file and every header it includes (transitively), keyed by path under kernels/."""
    seen: dict[str, str] = {}
    pending = [source]
    while pending:
        rel = pending.pop()
        if rel in seen:
            continue
        text = (KERNEL_ROOT / rel).read_text()
        seen[rel] = text
        folder = Path(rel).parent
        for inc in _INCLUDE.findall(text):
            pending.append(os.path.normpath(folder / inc))
    return seen


def compile_options(spec: KernelSpec) -> dict:
    return dict(
        name=spec.source,
        arch=spec.arch,
        std="c++17",
        include_path=[str(KERNEL_ROOT / Path(spec.source).parent)],
        define_macro=spec.macro_definitions(),
        ptxas_options=["-v"],
        device_as_default_execution_space=True,  # lambdas in kernels are device code (NVRTC 13.0 needs this)
    )


def cache_key(spec: KernelSpec) -> str:
    h = hashlib.sha256()
    for rel, text in sorted(source_closure(spec.source).items()):
        h.update(rel.encode() + b"\0" + text.encode() + b"\0")
    options = compile_options(spec) | {"include_path": None}  # the install location must not change the key
    h.update(json.dumps([_CACHE_FORMAT, spec.entries, options, nvrtc_version()], sort_keys=True).encode())
    return h.hexdigest()[:20]


_RESOURCE_LINE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_LINE = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_ENTRY_LINE = re.compile(r"Compiling entry function '([^']+)'")
# Records of the cubin's .nv.info section (CUDA ELF): per-function register count and stack frame size.
_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE, _EIFMT_SVAL = 0x2F, 0x11, 0x04


def cubin_registers_and_frames(cubin: bytes) -> dict[str, tuple[int, int]]:
    """{function: (registers, stack frame bytes)} read from the cubin itself (ELF .nv.info records)."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def c_string(offset: int) -> str:
        return cubin[offset:cubin.index(b"\0", offset)].decode()

    by_name = {c_string(headers[shstrndx][4] + h[0]): h for h in headers}
    symtab = by_name[".symtab"]
    strtab_offset = headers[symtab[6]][4]

    def symbol(index: int) -> str:
        (name,) = struct.unpack_from("<I", cubin, symtab[4] + index * symtab[9])
        return c_string(strtab_offset + name)

    found: dict[str, dict[int, int]] = {}
    info = by_name[".nv.info"]
    pos, end = info[4], info[4] + info[5]
    while pos < end:
        fmt, attr = cubin[pos], cubin[pos + 1]
        if fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", cubin, pos + 2)
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size == 8:
                index, value = struct.unpack_from("<II", cubin, pos + 4)
                found.setdefault(symbol(index), {})[attr] = value
            pos += 4 + size
        else:  # no value (2 bytes) or a 16-bit value (4 bytes)
            pos += 4 if fmt in (0x02, 0x03) else 2
    return {name: (attrs[_EIATTR_REGCOUNT], attrs.get(_EIATTR_FRAME_SIZE, 0))
            for name, attrs in found.items() if _EIATTR_REGCOUNT in attrs}


def parse_resources(log: str, cubin: bytes, entries: tuple[str, ...]) -> dict[str, KernelResources]:
    """Per-kernel registers, spills, stack and static shared memory.

    Registers and the stack frame come from the cubin; spills, static shared memory and barriers from the
    `ptxas -v` report in the NVRTC log. Some NVRTC builds leave that report out of the log: then the spill
    counts are bounded by the stack frame (spills live there) and reported as that bound.
    """
    from_log: dict[str, tuple[int, ...]] = {}
    parts = _ENTRY_LINE.split(log)
    for name, body in zip(parts[1::2], parts[2::2]):
        res, used = _RESOURCE_LINE.search(body), _USED_LINE.search(body)
        if res and used:
            from_log[name] = (int(res.group(2)), int(res.group(3)), int(used.group(3) or 0), int(used.group(2) or 0))
    from_elf = cubin_registers_and_frames(cubin)
    result = {}
    for entry in entries:
        registers, frame = from_elf[entry]
        spill_stores, spill_loads, smem, barriers = from_log.get(entry, (frame, frame, 0, 0))
        result[entry] = KernelResources(registers, spill_stores, spill_loads, frame, smem, barriers)
    return result


def _nvrtc_compile(spec: KernelSpec) -> tuple[bytes, str]:
    core = cuda_module("cuda.core")
    source = (KERNEL_ROOT / spec.source).read_text()
    program = core.Program(source, "c++", core.ProgramOptions(**compile_options(spec)))
    log = io.StringIO()
    try:
        obj = program.compile("cubin", logs=log)
    except Exception as exc:  # cuda.core raises NVRTCError with the log in its message
        raise CompileError(spec, f"{exc}\n{log.getvalue()}") from None
    finally:
        program.close()
    return bytes(obj.code), log.getvalue().replace("\x00", "")


def _build(spec: KernelSpec, key: str) -> CompiledModule:
    cubin, log = _nvrtc_compile(spec)
    return CompiledModule(spec, cubin, parse_resources(log, cubin, spec.entries), log, origin="nvrtc", key=key)


_warned: set[tuple[str, str, int | None]] = set()


def _cache_fault(folder: Path, doing: str, exc: OSError) -> None:
    """Warn that the cache at `folder` failed while `doing` something: once per process for each cause."""
    cause = (str(folder), doing, exc.errno)
    if cause not in _warned:
        _warned.add(cause)
        warnings.warn(f"flashtile kernel cache {folder}: {doing} failed ({exc}); kernels are compiled in memory "
                      f"and not cached", CacheWarning)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary file beside it, then a rename. Its mode is
    :data:`_FILE_MODE` less the umask, so a team's shared cache works like any folder the team shares."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{_TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_stale_temps(folder: Path) -> None:
    """Delete the temporary files of writers that died mid-write (older than :data:`STALE_TEMP_S`)."""
    cutoff = time.time() - STALE_TEMP_S
    for path in folder.glob("*" + _TEMP_SUFFIX):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
        except OSError:  # another process removed it first, or it is not ours to remove
            continue


def _store(stem: Path, module: CompiledModule) -> None:
    """Write the entry: the cubin, then the JSON that vouches for it. A failure is a warning."""
    meta = {"key": module.key, "spec": module.spec.name, "sha256": hashlib.sha256(module.cubin).hexdigest(),
            "resources": {n: dataclasses.asdict(r) for n, r in module.resources.items()}, "log": module.log}
    try:
        _remove_stale_temps(stem.parent)
        _atomic_write(stem.with_suffix(".cubin"), module.cubin)
        _atomic_write(stem.with_suffix(".json"), json.dumps(meta, indent=1).encode())
    except OSError as exc:
        _cache_fault(stem.parent, "writing an entry", exc)


_ENTRY_TYPES = {"key": str, "spec": str, "sha256": str, "log": str, "resources": dict}
_RESOURCE_FIELDS = {f.name for f in dataclasses.fields(KernelResources)}


def _entry_is_valid(meta: object, key: str, entries: tuple[str, ...]) -> bool:
    """Whether a JSON entry has every field with its type, `key`, and for each of `entries` every resource
    as a non-negative int."""
    if not isinstance(meta, dict) or not all(isinstance(meta.get(f), t) for f, t in _ENTRY_TYPES.items()):
        return False
    resources = meta["resources"]
    return meta["key"] == key and set(resources) == set(entries) and all(
        isinstance(r, dict) and set(r) == _RESOURCE_FIELDS and all(type(v) is int and v >= 0 for v in r.values())
        for r in resources.values())


def _read_entry(stem: Path, spec: KernelSpec, key: str) -> CompiledModule | None:
    """The cached module, or None if the entry is missing, truncated, corrupt or of the wrong shape."""
    try:
        meta = json.loads(stem.with_suffix(".json").read_text())
        cubin = stem.with_suffix(".cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if not _entry_is_valid(meta, key, spec.entries) or hashlib.sha256(cubin).hexdigest() != meta["sha256"]:
        return None
    resources = {name: KernelResources(**r) for name, r in meta["resources"].items()}
    return CompiledModule(spec, cubin, resources, meta["log"], origin="disk", key=key)


def _acquire(lock: FileLock) -> bool:
    """Take `lock`: after :data:`LOCK_NOTICE_S` say on stderr that we wait; after :data:`LOCK_TIMEOUT_S`
    give up and return False."""
    notice = min(LOCK_NOTICE_S, LOCK_TIMEOUT_S)
    try:
        lock.acquire(timeout=notice)
        return True
    except Timeout:
        print(f"flashtile: waiting for the kernel cache lock at {lock.lock_file}: another compile of this kernel "
              f"holds it (giving up after {LOCK_TIMEOUT_S:g} s)", file=sys.stderr, flush=True)
    try:
        lock.acquire(timeout=LOCK_TIMEOUT_S - notice)
        return True
    except Timeout:
        return False


def _compile_and_store(spec: KernelSpec, key: str, stem: Path, use_cache: bool) -> CompiledModule:
    """NVRTC under the spec's file lock, the entry written; the module alone when the cache cannot be used."""
    folder = stem.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _cache_fault(folder, "creating the folder", exc)
        return _build(spec, key)
    lock = FileLock(str(stem) + ".lock")
    try:
        held = _acquire(lock)
    except OSError as exc:
        _cache_fault(folder, "taking a lock", exc)
        return _build(spec, key)
    if not held:
        # The holder may be stuck for good, so we compile and still write: each file lands whole by rename,
        # and if another writer's cubin meets our JSON the SHA-256 check rejects the pair and it is rebuilt.
        warnings.warn(f"flashtile kernel cache: gave up waiting {LOCK_TIMEOUT_S:g} s for the lock at "
                      f"{lock.lock_file}; compiling without it", CacheWarning)
    try:
        module = _read_entry(stem, spec, key) if use_cache else None
        if module is None:
            module = _build(spec, key)
            _store(stem, module)
        return module
    finally:
        if held:
            lock.release()


_memo: dict[KernelSpec, CompiledModule] = {}


def entry_stem(spec: KernelSpec, key: str) -> Path:
    """The cache entry's path less its suffix: the spec's readable name, cut to MAX_NAME_CHARS, and the key."""
    return cache_dir() / f"{spec.name[:MAX_NAME_CHARS]}-{key}"


def compile_spec(spec: KernelSpec, *, use_cache: bool = True) -> CompiledModule:
    """The compiled module for `spec`, from memory, the disk cache, or NVRTC — in that order."""
    start = time.perf_counter()
    if use_cache and spec in _memo:
        return _memo[spec]
    key = cache_key(spec)
    stem = entry_stem(spec, key)
    module = _read_entry(stem, spec, key) if use_cache else None
    if module is None:
        module = _compile_and_store(spec, key, stem, use_cache)
    module.seconds = time.perf_counter() - start
    _memo[spec] = module
    return module


def clear_memo() -> None:
    """Forget in-process results (tests use this to exercise the disk cache)."""
    _memo.clear()
