"""The host path's switch and build (host.py) on any machine; its kernels run in tests/test_host_gpu.py."""

import os
import shutil
import subprocess
import sys
import warnings

import pytest

from flashtile import api, host, launch, plans


@pytest.fixture
def fresh_host(monkeypatch):
    """host.py's module state as a new process has it, put back afterwards."""
    for name, value in (("_module", None), ("_failed", False), ("_building", None)):
        monkeypatch.setattr(host, name, value)


def test_mode_reads_the_environment_and_names_bad_values(monkeypatch):
    for value, expected in (("", "auto"), ("ON", "on"), (" off ", "off"), ("auto", "auto")):
        monkeypatch.setenv(host.MODE_ENV, value)
        assert host.mode() == expected
    monkeypatch.setenv(host.MODE_ENV, "yes")
    with pytest.raises(ValueError, match=host.MODE_ENV):
        host.mode()


def test_off_never_builds(monkeypatch, fresh_host):
    monkeypatch.setenv(host.MODE_ENV, "off")
    monkeypatch.setattr(host, "_build", lambda: pytest.fail("built"))
    assert host.extension() is None


def test_auto_without_a_compiler_serves_the_python_path(monkeypatch, fresh_host):
    monkeypatch.setenv(host.MODE_ENV, "auto")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(host, "_build", lambda: pytest.fail("built"))
    assert host.extension() is None and host._building is None


def test_auto_builds_in_the_background_then_empties_the_call_cache(monkeypatch, fresh_host):
    monkeypatch.setenv(host.MODE_ENV, "auto")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/c++")

    class Built:
        poisoned = None

        def set_poison(self, on):
            self.poisoned = on

    built = Built()
    monkeypatch.setattr(host, "_build", lambda: built)
    api._calls["a kept call"] = object()
    assert host.extension() is None  # the Python path serves while the build runs
    assert host.wait() is built and host.extension() is built
    assert "a kept call" not in api._calls and built.poisoned is False


def test_a_failed_background_build_warns_once_and_the_python_path_serves(monkeypatch, fresh_host):
    monkeypatch.setenv(host.MODE_ENV, "auto")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/c++")

    def broken():
        raise RuntimeError("no torch headers")

    monkeypatch.setattr(host, "_build", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        host.extension()
        assert host.wait() is None
    assert [w.category for w in caught] == [host.HostPathWarning] and "no torch headers" in str(caught[0].message)
    assert host.extension() is None  # no second attempt


def test_python_path_suspends_the_extension(monkeypatch):
    monkeypatch.setattr(host, "_module", object())
    api._calls["a kept call"] = object()
    with host.python_path():
        assert host.extension() is None and "a kept call" not in api._calls
    assert host.extension() is host._module


def test_describe_names_the_path_without_building(monkeypatch, fresh_host):
    monkeypatch.setattr(host, "_build", lambda: pytest.fail("built"))
    monkeypatch.setenv(host.MODE_ENV, "off")
    assert host.describe() == f"Python ({host.MODE_ENV}=off)"
    monkeypatch.setenv(host.MODE_ENV, "auto")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert host.describe() == "Python (no C++ compiler found)"
    monkeypatch.setattr(host, "_failed", True)
    assert host.describe() == "Python (the C++ build failed)"
    monkeypatch.setattr(host, "_module", type("Built", (), {"__file__": "/cache/host/x.so"})())
    assert host.describe() == "C++ (/cache/host/x.so)"


def test_the_backward_address_block_follows_the_nested_params():
    """host.cpp writes dO's address (and the seven after it) at BWD_ADDRESS_OFFSET."""
    values = launch.bwd_param_values(dout=0x1111, dq=0x2222, dq_semaphore=0x8888)
    packed = launch.BWD_PARAMS_STRUCT.pack(*values)
    at = launch.BWD_ADDRESS_OFFSET
    words = [int.from_bytes(packed[at + 8 * i: at + 8 * i + 8], "little") for i in range(plans.BWD_ADDRESS_FIELDS)]
    assert words[0] == 0x1111 and words[1] == 0x2222 and words[-1] == 0x8888


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_the_extension_builds_here(tmp_path):
    """The source compiles against this torch (CI's CPU build included), past a stale build marker, and takes a
    plan's pieces. In a fresh process: one process cannot load two builds of one extension name."""
    script = f"""
import pytest
from flashtile import host, launch
module = host.extension()
assert host.build_dir().name in module.__file__
backward = module.Backward([(0, 1, 1, 1, 128, 0)], bytes(launch.BWD_PARAMS_STRUCT.size), 0,
                           launch.BWD_ADDRESS_OFFSET, [1, 2, 3, 4], 8, 64, 0)
module.Forward([(0, 1, 1, 1, 128, 0)], bytes(launch.PARAMS_STRUCT.size), 0, [], [1, 2, 3], None, backward)
with pytest.raises(RuntimeError, match="params struct"):
    module.Forward([], bytes(4096), 0, [], [], None, None)
print("built", module.__file__)
"""
    # A killed build leaves torch's marker behind, which torch alone would wait on forever.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
        folder = host.build_dir()
    folder.mkdir(parents=True)
    (folder / host.TORCH_BUILD_MARKER).write_text("left by a killed build")
    env = {**os.environ, "FLASHTILE_CACHE_DIR": str(tmp_path), host.MODE_ENV: "on"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"built {tmp_path}" in done.stdout
