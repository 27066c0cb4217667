"""`flashtile explain`: a call's first performance questions, answered from the registry.

Which family and kernel serve the call and why each other family does not; the tile and the reason for it;
what the compiled kernel uses (registers, spills, shared memory); the FLOPs and the fewest bytes the call must
move; the roofline bound on this GPU (tensor-core peak from its SM count and clock, memory bandwidth from its
memory clock and bus width) and, where a GPU is present, the measured time beside it. Without a GPU it explains
for a named architecture, on that architecture's reference GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from . import api, dispatch, jit, registry, specs
from .bench import measure
from .family import Variant
from .forward import FwdProblem

# Dense 16-bit tensor-core FLOPs per clock per SM with fp32 accumulation (the vendors' datasheets: peak FLOP/s
# over SMs x boost clock). GeForce parts run fp32 accumulation at half their fp16-accumulate rate.
TENSOR_FLOPS_PER_CLOCK = {(7, 5): 512, (8, 0): 2048, (8, 6): 256, (8, 7): 1024, (8, 9): 256, (9, 0): 4096,
                          (10, 0): 8192, (12, 0): 256}


@dataclass(frozen=True)
class Machine:
    """What bounds a kernel: SMs, SM clock, memory bandwidth."""

    name: str
    sms: int
    clock_hz: float
    bandwidth: float          # bytes per second
    capability: tuple[int, int]

    @property
    def peak_flops(self) -> float:
        return self.sms * self.clock_hz * TENSOR_FLOPS_PER_CLOCK.get(self.capability, 0)


# Without a GPU: the usual GPU of each architecture, from its datasheet.
REFERENCE_MACHINES = {
    "sm_75": Machine("Tesla T4 (datasheet)", 40, 1.59e9, 320e9, (7, 5)),
    "sm_80": Machine("A100 SXM 80 GB (datasheet)", 108, 1.41e9, 2.04e12, (8, 0)),
    "sm_86": Machine("RTX 3090 (datasheet)", 82, 1.695e9, 936e9, (8, 6)),
    "sm_89": Machine("RTX 4090 (datasheet)", 128, 2.52e9, 1.008e12, (8, 9)),
    "sm_90a": Machine("H100 SXM (datasheet)", 132, 1.83e9, 3.35e12, (9, 0)),
    "sm_100": Machine("B200 (datasheet)", 148, 1.965e9, 8.0e12, (10, 0)),
    "sm_120": Machine("RTX 5090 (datasheet)", 170, 2.41e9, 1.79e12, (12, 0)),
}
DDR = 2  # memory transfers per memory clock


def this_gpu(device: int = 0) -> Machine:
    """This GPU's SMs and clocks, read from the driver."""
    driver = jit.cuda_module("cuda.bindings.driver")
    props = torch.cuda.get_device_properties(device)
    attr = driver.CUdevice_attribute

    def read(which) -> int:
        err, value = driver.cuDeviceGetAttribute(which, device)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuDeviceGetAttribute({which.name}) failed: {err.name}")
        return value

    driver.cuInit(0)
    clock_khz = read(attr.CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
    memory_khz = read(attr.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
    bus_bits = read(attr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
    return Machine(props.name, props.multi_processor_count, clock_khz * 1e3, DDR * memory_khz * 1e3 * bus_bits / 8,
                   (props.major, props.minor))


@dataclass
class Direction:
    """One direction of the call (forward or backward), explained."""

    direction: str
    family: str | None
    reasons: list[tuple[str, str | None]]       # (family, why it does not serve; None: it serves)
    spec: specs.KernelSpec | None = None
    tile: str | None = None
    resources: dict = field(default_factory=dict)   # entry -> jit.KernelResources
    flops: float = 0.0
    bytes: float = 0.0
    bound_ms: float | None = None
    bound_by: str = ""
    measured_ms: float | None = None


@dataclass
class Explanation:
    call: str
    arch: str
    machine: Machine
    directions: list[Direction]

    def __str__(self) -> str:
        m = self.machine
        lines = [f"call: {self.call}",
                 f"target: {self.arch} on {m.name}: {m.sms} SMs at {m.clock_hz / 1e9:.2f} GHz, tensor-core peak "
                 f"{m.peak_flops / 1e12:.0f} TFLOP/s, memory {m.bandwidth / 1e12:.2f} TB/s"]
        for d in self.directions:
            lines += ["", f"{d.direction}: " + (f"kernel family {d.family!r}" if d.family else "no CUDA kernel serves "
                                                 "it (the chunked PyTorch path runs)")]
            for name, why in d.reasons:
                verdict = "chosen" if name == d.family else "serves" if why is None else "no"
                lines.append(f"  {verdict:<7} {name}" + (f": {why}" if why else ""))
            if d.spec is None:
                continue
            lines.append(f"  kernel: {d.spec.name} ({d.spec.source}), {d.spec.smem_bytes / 1024:.0f} KB dynamic "
                         "shared memory")
            if d.tile:
                lines.append(f"  tile: {d.tile}")
            for entry, r in d.resources.items():
                lines.append(f"  {entry}: {r.registers} registers, {r.spill_stores + r.spill_loads} B spilled, "
                             f"{r.stack_frame} B stack")
            lines.append(f"  work: {d.flops / 1e9:.2f} GFLOP, at least {d.bytes / 1e6:.1f} MB moved; roofline "
                         f"bound {d.bound_ms * 1e3:.1f} us ({d.bound_by}-bound)")
            if d.measured_ms is not None:
                lines.append(f"  measured: {d.measured_ms * 1e3:.1f} us, {d.flops / d.measured_ms / 1e9:.0f} "
                             f"TFLOP/s, {d.bound_ms / d.measured_ms:.0%} of the bound")
        return "\n".join(lines)


def _visible_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """How many (query, key) pairs the mask lets through, per (batch, head): bottom-right aligned windows."""
    rows = torch.arange(sq, dtype=torch.int64) + (sk - sq)
    first = (rows - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    last = (rows + right).clamp(max=sk - 1) if right >= 0 else torch.full_like(rows, sk - 1)
    return int((last - first + 1).clamp(min=0).sum())


def _work(problem: FwdProblem, direction: str) -> tuple[float, float]:
    """(FLOPs, fewest bytes moved): two products over the visible pairs (the backward 2.5x that, as
    FlashAttention counts), every operand read once and every result written once."""
    b, hq, hkv = problem.batch, problem.heads_q, problem.heads_kv
    sq, sk, d, dv = problem.seqlen_q, problem.seqlen_k, problem.head_dim, problem.head_dim_v
    pairs = b * hq * _visible_pairs(sq, sk, *problem.window)
    flops = 2.0 * pairs * (d + dv) * (measure.BWD_FLOP_FACTOR if direction == "bwd" else 1.0)
    elem = problem.q.element_size()
    q_bytes, kv_bytes, o_bytes = b * sq * hq * d * elem, b * sk * hkv * (d + dv) * elem, b * sq * hq * dv * elem
    lse_bytes = b * hq * sq * 4
    if direction == "fwd":
        return flops, q_bytes + kv_bytes + o_bytes + lse_bytes
    return flops, 2 * (q_bytes + kv_bytes) + 2 * o_bytes + lse_bytes  # q, k, v, o, dO, lse in; dq, dk, dv out


def explain(q, k, v, *, causal=False, softmax_scale=None, window_size=api.NO_WINDOW, softcap=api.NO_SOFTCAP,
            alibi_slopes=None, deterministic=False, arch: str | None = None,
            measure_time: bool = True) -> Explanation:
    """Explain `flashtile.attention(q, k, v, ...)` (same arguments) and its backward.

    `arch` names a target (e.g. "sm_90a") to explain for without a GPU; by default the tensors' GPU. q, k, v
    may be meta tensors (shapes and dtypes only). On a GPU the call is also timed (`measure_time`).
    """
    api._check_family(q, k, v)
    scale, window, softcap = api._check_options(q, softmax_scale, window_size, softcap, alibi_slopes, q.shape[0],
                                                max(q.shape[1], k.shape[1]))
    windowed = f", window {window}" if window != api.NO_WINDOW else ""
    window = (window[0], 0 if causal else window[1])
    on_gpu = q.is_cuda and arch is None
    if on_gpu:
        arch = specs.arch_of(torch.cuda.get_device_capability(q.device))
        machine = this_gpu(q.device.index or 0)
    elif arch is None:
        raise ValueError("explain needs CUDA tensors or a named arch (e.g. arch='sm_90a') to explain for")
    elif arch not in REFERENCE_MACHINES:
        raise ValueError(f"arch must be one of {sorted(REFERENCE_MACHINES)}, got {arch!r}")
    else:
        machine = REFERENCE_MACHINES[arch]
    problem = FwdProblem(q, k, v, scale, window, softcap, alibi_slopes, want_lse=True)
    kernel_dims = tuple(-(-n // dispatch.HEAD_DIM_MULTIPLE) * dispatch.HEAD_DIM_MULTIPLE
                        for n in (problem.head_dim, problem.head_dim_v))  # the head dims the kernels see
    call = (f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} {q.dtype}"
            + (", causal" if causal else "") + windowed
            + (f", softcap {softcap}" if softcap else "") + (", ALiBi" if alibi_slopes is not None else ""))
    directions = []
    for direction in ("fwd", "bwd"):
        variant = dataclasses.replace(Variant.of(problem, direction, arch, deterministic), head_dim=kernel_dims[0],
                                      head_dim_v=kernel_dims[1])
        answers = registry.reasons(variant)
        chosen = next((f for f, why in answers if why is None), None)
        d = Direction(direction, chosen.name if chosen else None, [(f.name, why) for f, why in answers])
        d.flops, d.bytes = _work(problem, direction)
        compute_ms, memory_ms = d.flops / machine.peak_flops * 1e3, d.bytes / machine.bandwidth * 1e3
        d.bound_ms, d.bound_by = max(compute_ms, memory_ms), "compute" if compute_ms >= memory_ms else "memory"
        if chosen is not None:
            d.spec = chosen.spec(variant)
            tile = chosen.tile(variant) if chosen.tile else None
            d.tile = f"{_fields(tile)}; why: {tile.why}" if tile is not None else f"fixed: {_fields(d.spec)}"
            d.resources = jit.compile_spec(d.spec).resources
        if on_gpu and measure_time:
            d.measured_ms = _time(q, k, v, direction, dict(causal=causal, softmax_scale=softmax_scale,
                                                           window_size=window_size, softcap=softcap,
                                                           alibi_slopes=alibi_slopes, deterministic=deterministic))
        directions.append(d)
    return Explanation(call, arch, machine, directions)


def _fields(thing) -> str:
    if isinstance(thing, specs.KernelSpec):
        return ", ".join(f"{key.removeprefix('FT_').lower()}={value}" for key, value in thing.defines) or "-"
    return ", ".join(f"{f.name}={getattr(thing, f.name)}" for f in dataclasses.fields(thing) if f.name != "why")


def _time(q, k, v, direction: str, options: dict) -> float:
    """Median milliseconds of the call's forward (inference) or backward alone, on fresh random inputs."""
    from .bench import peers

    q, k, v = (torch.randn_like(t) for t in (q, k, v))
    if direction == "fwd":
        with torch.no_grad():
            return measure.time_cuda(lambda: api.attention(q, k, v, **options))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    return measure.time_cuda(peers.backward_runner(lambda: api.attention(*leaves, **options), leaves))

