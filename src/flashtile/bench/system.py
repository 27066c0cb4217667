"""Facts about this machine that belong next to every number: date, GPU, driver, versions."""

from __future__ import annotations

import datetime
import platform

import torch


def describe() -> dict:
    from .. import __version__, jit

    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "flashtile": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "nvrtc": "{}.{}".format(*jit.nvrtc_version()),
        "gpu": None,
    }
    try:
        from cuda.core import __version__ as cuda_core_version

        facts["cuda_core"] = cuda_core_version
    except ImportError:
        facts["cuda_core"] = None
    if torch.cuda.is_available():
        from cuda.bindings import driver

        from ..specs import arch_of

        props = torch.cuda.get_device_properties(0)
        driver.cuInit(0)
        _, version = driver.cuDriverGetVersion()
        facts.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                     arch=arch_of((props.major, props.minor)), sms=props.multi_processor_count,
                     memory_gb=round(props.total_memory / 2**30, 1),
                     cuda_driver=f"{version // 1000}.{version % 1000 // 10}",
                     nvidia_driver=_nvidia_driver_version())
    else:
        facts["cpu"] = platform.processor() or platform.machine()
    return facts


def _nvidia_driver_version() -> str | None:
    """The kernel module's version, e.g. 580.159.04 (Linux only)."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return None
    return next((w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit()), None)
