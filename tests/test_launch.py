"""launch.launch on a machine without a GPU: the driver call is replaced by a recorder, so what is tested is
which device is current when the kernel is queued (multi-GPU: tensors on a device other than torch's
current one)."""

import contextlib

import pytest
import torch

from flashtile import launch, tma

cuda_bindings = pytest.importorskip("cuda.bindings")


@pytest.fixture
def recorded(monkeypatch):
    """Current device 0; every cuLaunchKernel records the device current at that moment."""
    from cuda.bindings import driver

    state = {"current": 0, "launched_on": []}

    @contextlib.contextmanager
    def enter(device):
        previous, state["current"] = state["current"], device
        try:
            yield
        finally:
            state["current"] = previous

    def fake_launch(*args):
        state["launched_on"].append(state["current"])
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", enter)
    monkeypatch.setattr(driver, "cuLaunchKernel", fake_launch)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 0)
    return state


@pytest.mark.parametrize("device", [0, 1, 3])
def test_launch_enters_the_kernels_device(recorded, device):
    kernel = launch.LoadedKernel(function=object(), device=device, max_dynamic_smem=1 << 20)
    launch.launch(kernel, (1, 1, 1), 32, 0, launch.param_values())
    assert recorded["launched_on"] == [device]
    assert recorded["current"] == 0  # the caller's current device is back


def test_a_missing_or_extra_second_argument_is_refused(recorded):
    """The pipelined forward takes its tensor maps as a second argument; launching it without them (or another
    kernel with them) would hand the driver the wrong argument list: a clear error instead."""
    maps_kernel = launch.LoadedKernel(function=object(), device=0, max_dynamic_smem=1 << 20,
                                      extra_bytes=2 * tma.MAP_BYTES)
    plain_kernel = launch.LoadedKernel(function=object(), device=0, max_dynamic_smem=1 << 20)
    with pytest.raises(ValueError, match="second argument of 256 bytes"):
        launch.launch(maps_kernel, (1, 1, 1), 32, 0, launch.param_values())
    with pytest.raises(ValueError, match="second argument of 0 bytes"):
        launch.launch(plain_kernel, (1, 1, 1), 32, 0, launch.param_values(), extra=bytes(256))
    launch.launch(maps_kernel, (1, 1, 1), 32, 0, launch.param_values(), extra=bytes(256))
    assert recorded["launched_on"] == [0]


def test_every_second_argument_fits_the_launch_buffers(recorded):
    """launch.run copies a kernel's second argument into a per-thread buffer of EXTRA_BYTES and host.cpp into one of
    kMaxMapsBytes: every spec's maps fit both (the Hopper backward's four maps once overran the first, 384 bytes),
    and a larger argument is refused, not copied."""
    import re
    from pathlib import Path

    from flashtile import registry, specs

    host_source = (Path(launch.__file__).parent / "csrc" / "host.cpp").read_text()
    host_bytes = int(re.search(r"constexpr size_t kMaxMapsBytes = (\d+);", host_source).group(1))
    alternatives = [specs.bwd_wgmma_spec("bf16", d, tile) for d, tiles in specs.BWD_WGMMA_ALTERNATIVES.items()
                    for tile in tiles]
    largest = max(s.maps_bytes for s in alternatives + [s for arch in ("sm_80", "sm_90a", "sm_100", "sm_120")
                                                         for s in registry.all_specs(arch)])
    assert largest == 5 * tma.MAP_BYTES
    assert largest <= launch.EXTRA_BYTES == host_bytes
    big = launch.EXTRA_BYTES + tma.MAP_BYTES
    kernel = launch.LoadedKernel(function=object(), device=0, max_dynamic_smem=1 << 20, extra_bytes=big)
    with pytest.raises(ValueError, match="the buffer holds"):
        launch.launch(kernel, (1, 1, 1), 32, 0, launch.param_values(), extra=bytes(big))
    assert recorded["launched_on"] == []
