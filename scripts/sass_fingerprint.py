"""Fingerprints of the kernels' machine code, for kernel changes that claim to change nothing.

Usage: python scripts/sass_fingerprint.py [kernel source ...] > before.txt, make the change, run it again into
after.txt, and `diff before.txt after.txt`. Sources are paths under kernels/ (e.g. mma/bwd.cu); without one,
every spec of registry.all_specs. No GPU is needed: NVRTC compiles each spec for every architecture the tests
cover and cuobjdump (pip install nvidia-cuda-cuobjdump, or CUDA's own on PATH) disassembles it. Identical
fingerprints mean identical SASS, so the H200 evidence gathered on the code before the change still holds —
a refactor of a kernel proved this way needs no GPU time.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from flashtile import jit, registry, specs


def cuobjdump() -> str:
    """The pip wheel's cuobjdump (nvidia/cu*/bin), else the one on PATH."""
    import nvidia  # namespace package of NVIDIA's CUDA wheels

    for root in nvidia.__path__:
        for found in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(found)
    found = shutil.which("cuobjdump")
    if found is None:
        sys.exit("cuobjdump not found: pip install nvidia-cuda-cuobjdump, or put CUDA's bin on PATH")
    return found


def fingerprint(spec: specs.KernelSpec, tool: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(jit.compile_spec(spec).cubin)
        cubin.flush()
        # cuobjdump runs nvdisasm, which the wheel keeps beside it.
        env = {**os.environ, "PATH": os.pathsep.join([str(Path(tool).parent), os.environ.get("PATH", "")])}
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True, env=env).stdout
    # Per function, in name order: a change that only moves a function within the module is not a change.
    functions = sorted(sass.split("Function : ")[1:])
    return hashlib.sha256("".join(functions).encode()).hexdigest()[:16]


def main(sources: list[str]) -> None:
    todo = [spec for arch in specs.TEST_ARCHS for spec in registry.all_specs(arch)
            if not sources or spec.source in sources]
    tool = cuobjdump()
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        for spec, digest in zip(todo, pool.map(fingerprint, todo, [tool] * len(todo))):
            print(f"{digest}  {spec.name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
