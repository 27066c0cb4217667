"""Run-time compilation: the params struct layout, the disk cache, locking, corruption, faults, threads, errors."""

import dataclasses
import errno
import json
import multiprocessing
import os
import stat
import struct
import subprocess
import sys
import time

import filelock
import pytest

from flashtile import jit, launch, specs

SPEC = specs.tiled_spec("bf16", 64, "sm_80")


def _nvrtc_has_offsetof() -> bool:
    from cuda.core import Program, ProgramOptions

    probe = "struct P { long long a; int b; };\nstatic_assert(__builtin_offsetof(P, b) == 8, \"b\");\n"
    try:
        Program(probe, "c++", ProgramOptions(arch="sm_80", std="c++17")).compile("cubin")
    except Exception:
        return False
    return True


@pytest.mark.parametrize("struct_name, fields, packer, nested", [
    ("AttnParams", launch.PARAM_FIELDS, launch.PARAMS_STRUCT, ""),
    ("BwdParams", launch.BWD_EXTRA_FIELDS, launch.BWD_PARAMS_STRUCT, "AttnParams"),
])
def test_params_struct_matches_the_cuda_layout(struct_name, fields, packer, nested, tmp_path, monkeypatch):
    """NVRTC checks every field offset and the size that launch.py packs against params.cuh."""
    if not _nvrtc_has_offsetof():  # NVRTC 13.0 lacks it; CI installs a newer one
        pytest.skip(f"NVRTC {jit.nvrtc_version()} has no __builtin_offsetof")
    prefix = "@" + ("".join(fmt for _, fmt in launch.PARAM_FIELDS) + "0Q" if nested else "")
    fmts = [fmt for _, fmt in fields]
    asserts = []
    for i, (name, fmt) in enumerate(fields):
        offset = struct.calcsize(prefix + "".join(fmts[:i]) + "0" + fmt)
        asserts.append(f"static_assert(__builtin_offsetof({struct_name}, {name}) == {offset}, \"{name}\");")
    asserts.append(f"static_assert(sizeof({struct_name}) == {packer.size}, \"size\");")
    (tmp_path / "common").mkdir()
    for header in ("params.cuh", "numeric.cuh"):
        (tmp_path / "common" / header).write_text((jit.KERNEL_ROOT / "common" / header).read_text())
    (tmp_path / "layout.cu").write_text('#include "common/params.cuh"\n' + "\n".join(asserts)
                                        + f'\nextern "C" __global__ void layout_probe({struct_name} p) {{}}\n')
    monkeypatch.setattr(jit, "KERNEL_ROOT", tmp_path)
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path / "cache"))
    jit.compile_spec(specs.KernelSpec("layout.cu", ("layout_probe",), "f32", "sm_80"), use_cache=False)


def test_param_values_round_trip():
    packed = launch.PARAMS_STRUCT.pack(*launch.param_values(q=0x1000, seqlen_q=17, softcap=2.5, window_left=-1))
    values = dict(zip((n for n, _ in launch.PARAM_FIELDS), launch.PARAMS_STRUCT.unpack(packed)))
    assert values["q"] == 0x1000 and values["seqlen_q"] == 17 and values["softcap"] == 2.5
    assert values["window_left"] == -1 and values["k"] == 0


def test_compile_error_carries_log_and_spec(tmp_path, monkeypatch, cache_dir):
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void broken() { int x = undefined_name; }\n')
    monkeypatch.setattr(jit, "KERNEL_ROOT", tmp_path)
    spec = specs.KernelSpec("broken.cu", ("broken",), "f32", "sm_80")
    with pytest.raises(jit.CompileError) as info:
        jit.compile_spec(spec)
    assert info.value.spec == spec
    assert "undefined_name" in info.value.log and "broken.cu" in str(info.value)


def test_cache_round_trip_and_readable_names(cache_dir):
    first = jit.compile_spec(SPEC)
    assert first.origin == "nvrtc"
    names = sorted(p.name for p in cache_dir.iterdir())
    assert any(n.startswith(SPEC.name) and n.endswith(".cubin") for n in names), names
    assert jit.compile_spec(SPEC) is first  # in-process memo
    jit.clear_memo()
    second = jit.compile_spec(SPEC)
    assert second.origin == "disk" and second.cubin == first.cubin and second.resources == first.resources


def test_every_registered_spec_has_file_names_the_file_system_takes(cache_dir):
    from flashtile import registry

    longest_temp = len(".cubin.") + 32 + len(jit._TEMP_SUFFIX)  # _atomic_write's temporary file, beside the entry
    for arch in specs.TEST_ARCHS:
        for spec in registry.all_specs(arch):
            stem = jit.entry_stem(spec, jit.cache_key(spec))
            assert len(stem.name) + longest_temp <= 255, spec.name
            assert stem.name.startswith(spec.name[:jit.MAX_NAME_CHARS])


def test_a_spec_with_a_long_name_is_cached(cache_dir, recwarn):
    long_name = dataclasses.replace(SPEC, defines=SPEC.defines + (("FT_UNUSED_BY_THE_KERNEL_" + "X" * 200, 1),))
    assert len(long_name.name) > 255
    jit.compile_spec(long_name)
    assert not [w for w in recwarn if issubclass(w.category, jit.CacheWarning)]
    jit.clear_memo()
    assert jit.compile_spec(long_name).origin == "disk"


def test_resources_are_readable(cache_dir):
    module = jit.compile_spec(SPEC)
    res = module.resources["tiled_fwd"]
    assert 0 < res.registers <= 255 and res.spill_stores == 0 and res.stack_frame == 0
    assert jit.cubin_registers_and_frames(module.cubin)["tiled_fwd"] == (res.registers, 0)
    if "Compiling entry function" in module.log:  # the ptxas report, where this NVRTC puts it in the log
        assert f"Used {res.registers} registers" in module.log and res.barriers >= 1


def test_cache_key_covers_arch_defines_and_headers(monkeypatch):
    keys = {jit.cache_key(SPEC), jit.cache_key(specs.tiled_spec("bf16", 64, "sm_90a")),
            jit.cache_key(specs.tiled_spec("bf16", 128, "sm_80")), jit.cache_key(specs.tiled_spec("f16", 64, "sm_80"))}
    assert len(keys) == 4
    closure = jit.source_closure(SPEC.source)
    assert {"ladder/r2_tiled.cu", "common/params.cuh", "common/numeric.cuh", "common/mask.cuh"} <= set(closure)
    original = jit.source_closure
    monkeypatch.setattr(jit, "source_closure", lambda src: {**original(src), "common/mask.cuh": "changed"})
    assert jit.cache_key(SPEC) not in keys


@pytest.mark.parametrize("victim", ["cubin", "json"])
def test_corrupt_or_truncated_entry_is_rebuilt(cache_dir, victim):
    good = jit.compile_spec(SPEC)
    path = next(p for p in cache_dir.iterdir() if p.suffix == "." + victim)
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])  # truncated mid-write
    jit.clear_memo()
    rebuilt = jit.compile_spec(SPEC)
    assert rebuilt.origin == "nvrtc" and rebuilt.cubin == good.cubin
    jit.clear_memo()
    assert jit.compile_spec(SPEC).origin == "disk"  # and the entry is whole again


def _compile_in_child(cache: str, start, results) -> None:
    import os

    os.environ["FLASHTILE_CACHE_DIR"] = cache
    from flashtile import jit as child_jit

    start.wait()
    results.put(child_jit.compile_spec(SPEC).origin)


def test_two_processes_compile_one_spec_once(cache_dir):
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    children = [ctx.Process(target=_compile_in_child, args=(str(cache_dir), start, results)) for _ in range(2)]
    for child in children:
        child.start()
    start.set()
    origins = sorted(results.get(timeout=120) for _ in children)
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert origins == ["disk", "nvrtc"]
    assert len([p for p in cache_dir.iterdir() if p.suffix == ".cubin"]) == 1


# ---------------------------------------------------------------------------------------------------
# The disk cache: home folder, umask, bad entries, faults (a warning, never a failed call), locks, stale files.
# ---------------------------------------------------------------------------------------------------

SMALL = specs.naive_spec("f32", "sm_80")
OTHER_SMALL = specs.naive_spec("f16", "sm_80")


def _cache_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, jit.CacheWarning)]


def test_cache_path_that_is_a_file_warns_once_and_compiles(cache_dir, recwarn):
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    cache_dir.write_text("not a folder")
    assert jit.compile_spec(SMALL).origin == "nvrtc"
    assert jit.compile_spec(OTHER_SMALL).origin == "nvrtc"
    messages = _cache_warnings(recwarn)
    assert len(messages) == 1, messages
    assert str(cache_dir) in messages[0] and "creating the folder" in messages[0]


def test_cache_that_refuses_the_lock_warns_and_compiles(cache_dir, monkeypatch, recwarn):
    """Another user's cache: its entries may be readable, but we cannot create a lock file there."""
    class Refused(jit.FileLock):
        def acquire(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), self.lock_file)

    monkeypatch.setattr(jit, "FileLock", Refused)
    assert jit.compile_spec(SMALL).origin == "nvrtc"
    assert jit.compile_spec(OTHER_SMALL).origin == "nvrtc"
    messages = _cache_warnings(recwarn)
    assert len(messages) == 1, messages
    assert str(cache_dir) in messages[0] and "Permission denied" in messages[0]


def test_full_disk_warns_and_compiles(cache_dir, monkeypatch, recwarn):
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(jit, "_atomic_write", full)
    assert jit.compile_spec(SMALL).origin == "nvrtc"
    assert jit.compile_spec(OTHER_SMALL).origin == "nvrtc"
    messages = _cache_warnings(recwarn)
    assert len(messages) == 1, messages
    assert str(cache_dir) in messages[0] and os.strerror(errno.ENOSPC) in messages[0]


def _permissions_bind(folder) -> bool:
    """Whether a read-only folder stops us writing (it does not for root with CAP_DAC_OVERRIDE)."""
    probe = folder / "probe"
    probe.mkdir()
    probe.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        (probe / "file").touch()
    except PermissionError:
        return True
    finally:
        probe.chmod(stat.S_IRWXU)
    return False


def test_read_only_cache_dir_warns_and_compiles(cache_dir, tmp_path, recwarn):
    if not _permissions_bind(tmp_path):
        pytest.skip("running as root: a read-only folder does not stop us writing (the monkeypatched tests cover it)")
    cache_dir.mkdir()
    cache_dir.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert jit.compile_spec(SMALL).origin == "nvrtc"
    finally:
        cache_dir.chmod(stat.S_IRWXU)
    messages = _cache_warnings(recwarn)
    assert len(messages) == 1 and str(cache_dir) in messages[0], messages


@pytest.mark.parametrize("umask, mode", [(0o002, 0o664), (0o027, 0o640)])
def test_cache_files_follow_the_umask(cache_dir, umask, mode):
    """A team's shared cache needs group access: files get 0666 less the umask, like any file the user makes."""
    old = os.umask(umask)
    try:
        jit.compile_spec(SMALL)
    finally:
        os.umask(old)
    modes = {p.suffix: stat.S_IMODE(p.stat().st_mode) for p in cache_dir.iterdir()}
    assert modes == {".cubin": mode, ".json": mode, ".lock": mode}


@pytest.mark.parametrize("variable, value, expected", [
    ("FLASHTILE_CACHE_DIR", "~/kernels", "kernels"),
    ("XDG_CACHE_HOME", "~/xdg", "xdg/flashtile"),
])
def test_cache_dir_expands_the_home_folder(cache_dir, tmp_path, monkeypatch, variable, value, expected):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("FLASHTILE_CACHE_DIR")
    monkeypatch.setenv(variable, value)
    monkeypatch.chdir(work)
    assert jit.cache_dir() == home / expected
    jit.compile_spec(SMALL)
    assert (home / expected).is_dir() and list(work.iterdir()) == []


LOCK_HOLD_S = 30  # how long the other process holds the lock: the test fails rather than hangs without a timeout


def test_a_busy_lock_is_announced_then_skipped(cache_dir, monkeypatch, capsys, recwarn):
    cache_dir.mkdir()
    lock = cache_dir / f"{SMALL.name}-{jit.cache_key(SMALL)}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from filelock import FileLock; held = FileLock(sys.argv[1]); "
         "held.acquire(); print('held', flush=True); time.sleep(float(sys.argv[2]))", str(lock), str(LOCK_HOLD_S)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(filelock.Timeout):
            filelock.FileLock(str(lock)).acquire(timeout=0)
        monkeypatch.setattr(jit, "LOCK_NOTICE_S", 0.2)
        monkeypatch.setattr(jit, "LOCK_TIMEOUT_S", 1.0)
        assert jit.compile_spec(SMALL).origin == "nvrtc"
    finally:
        holder.kill()
        holder.wait()
    assert f"waiting for the kernel cache lock at {lock}" in capsys.readouterr().err
    messages = _cache_warnings(recwarn)
    assert len(messages) == 1 and "gave up waiting" in messages[0] and str(lock) in messages[0], messages
    jit.clear_memo()
    assert jit.compile_spec(SMALL).origin == "disk"  # written anyway, atomically


def test_stale_temporary_files_are_removed(cache_dir):
    cache_dir.mkdir()
    stale, fresh = cache_dir / "dead.cubin.0123.tmp", cache_dir / "live.cubin.4567.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"half a cubin")
    old = time.time() - 2 * jit.STALE_TEMP_S
    os.utime(stale, (old, old))
    jit.compile_spec(SMALL)
    assert not stale.exists() and fresh.exists()


def _set_resource(field, value):
    def mutate(meta):
        next(iter(meta["resources"].values()))[field] = value
    return mutate


@pytest.mark.parametrize("mutate", [
    _set_resource("registers", "lots"),
    _set_resource("spill_loads", -1),
    _set_resource("stack_frame", 1.5),
    _set_resource("barriers", True),
    lambda meta: meta.update(log=5),
    lambda meta: meta.update(spec=None),
    lambda meta: meta["resources"].popitem(),
], ids=["registers-str", "spill-negative", "frame-float", "barriers-bool", "log-int", "spec-none", "kernel-missing"])
def test_entry_with_wrong_field_types_is_rebuilt(cache_dir, mutate):
    good = jit.compile_spec(SMALL)
    entry = next(p for p in cache_dir.iterdir() if p.suffix == ".json")
    meta = json.loads(entry.read_text())
    mutate(meta)
    entry.write_text(json.dumps(meta))
    jit.clear_memo()
    rebuilt = jit.compile_spec(SMALL)
    assert rebuilt.origin == "nvrtc" and rebuilt.resources == good.resources


# ---------------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------------

_THREADS_CHILD = """
import threading
from flashtile import jit, specs

todo = [specs.naive_spec("f32", "sm_80"), specs.naive_spec("f16", "sm_90a"), specs.naive_spec("bf16", "sm_80"),
        specs.fused_spec("f32", 64, "sm_90a"), specs.fused_spec("bf16", 64, "sm_80"),
        specs.fused_spec("f16", 128, "sm_90a"), specs.tiled_spec("f32", 64, "sm_80"),
        specs.tiled_spec("bf16", 64, "sm_90a")]
assert len(set(todo)) == len(todo)
errors = []

def work(spec):
    try:
        jit.compile_spec(spec)
    except Exception as exc:
        errors.append(f"{spec.name}: {exc!r}")

threads = [threading.Thread(target=work, args=(spec,)) for spec in todo]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert not errors, errors
"""


def test_threads_compile_different_specs_in_a_fresh_process(tmp_path):
    """The first import of cuda.core from several threads at once must not fail."""
    env = {**os.environ, "FLASHTILE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _THREADS_CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
