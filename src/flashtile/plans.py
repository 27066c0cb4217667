"""Launch plans: a call with every decision made, so that from call to call only the tensors' addresses change.

A family (family.py) builds a plan once per input signature; dispatch.py keeps it. Running a plan allocates the
outputs (and any scratch), packs the params struct once and queues its launches: the forward's one kernel (or
rung 0's three), the backward's preprocess, main kernel(s) and dQ conversion. The buffers a kernel writes are
allocated by :func:`empty_outputs` and :func:`empty_grads` alone, so tests can poison them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import launch, tma
from .specs import DqBox, KvBox

# The first ADDRESS_FIELDS of AttnParams are the tensors' addresses; everything after them is fixed by shapes,
# strides and options. BwdParams appends BWD_ADDRESS_FIELDS more addresses, then its strides.
ADDRESS_FIELDS = 9
BWD_ADDRESS_FIELDS = 10
assert all(fmt == "Q" for _, fmt in launch.PARAM_FIELDS[:ADDRESS_FIELDS])
assert all(fmt == "Q" for _, fmt in launch.BWD_EXTRA_FIELDS[:BWD_ADDRESS_FIELDS])
ALIGN_BYTES = 16             # the kernels' vector loads: every operand's base address is a multiple of this
FP32 = torch.float32
SCRATCH_ALIGN_FLOATS = 64    # scratch regions inside one fp32 buffer start on 256-byte boundaries
MAX_KEPT_MAPS = 64           # K/V address pairs a plan keeps maps for (a static KV cache, the allocator's reuse)


def kept_maps(maps: dict, key: tuple[int, ...], make) -> bytes:
    """The tensor maps a plan keeps for the addresses `key` (all forgotten once MAX_KEPT_MAPS are kept), `make()`
    encoding them the first time."""
    extra = maps.get(key)
    if extra is None:
        if len(maps) >= MAX_KEPT_MAPS:
            maps.clear()
        extra = maps[key] = make()
    return extra


def empty_outputs(q: torch.Tensor, out_shape: tuple[int, ...] | None, lse_shape: tuple[int, ...] | None):
    """The forward's output (like q, or `out_shape` when the v head dim differs) and its fp32 LSE if wanted."""
    o = torch.empty_like(q) if out_shape is None else q.new_empty(out_shape)
    lse = None if lse_shape is None else torch.empty(lse_shape, dtype=FP32, device=q.device)
    return o, lse


def empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gradient buffers the backward kernels write."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def longest_first(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """A varlen batch's entries by query rows, longest first (ties in batch order), as int32 on the device: the order
    in which the backward's key-block grids run them (kernels/common/bwd_frame.cuh, key_block_of). No host sync."""
    return torch.argsort(cu_seqlens_q[1:] - cu_seqlens_q[:-1], descending=True, stable=True).to(torch.int32)


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@dataclass(frozen=True, slots=True)
class FwdPlan:
    launches: tuple[launch.Launch, ...]
    out_shape: tuple[int, ...] | None   # None: the output is torch.empty_like(q)
    lse_shape: tuple[int, ...] | None   # None: no LSE wanted
    scratch_floats: int                 # fp32 scratch the kernels share (rung 0's scores); 0: none
    tail: tuple                         # the params after the address fields
    kv_box: KvBox | None                # the K/V tensor maps' box (tma.kernel_argument); None: one argument
    q_box: KvBox | None = None          # Q's map's box, where the kernel loads Q through one
    o_box: KvBox | None = None          # O's map's box, where the kernel stores O through one
    zeroed_floats: int = 0              # the scratch's last floats, zeroed before each call (counters)
    # The tensor maps by the addresses they describe (K's and V's, and Q's and O's where there are such maps):
    # the plan fixes everything else a map describes.
    maps: dict[tuple[int, ...], bytes] = field(default_factory=dict, compare=False)

    def run(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None, out=None):
        """(out, lse): fresh, or written into `out` = (o, lse) laid out as the plan was built. The operands' base
        addresses are 16-byte aligned (dispatch.kernel_ready, or the caller's check): the plan's kernels read
        them with 16-byte vector loads."""
        o, lse = out or empty_outputs(q, self.out_shape, self.lse_shape)
        scratch = torch.empty(self.scratch_floats, dtype=FP32, device=q.device) if self.scratch_floats else None
        if self.zeroed_floats:
            scratch[-self.zeroed_floats:].zero_()
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0 if lse is None else lse.data_ptr(),
                     0 if scratch is None else scratch.data_ptr())
        if cu_seqlens_q is None and alibi_slopes is None:  # the common call: dense, no ALiBi
            addresses += (0, 0, 0)
        else:
            addresses += (_address(cu_seqlens_q), _address(cu_seqlens_k), _address(alibi_slopes))
        extra = None
        if self.kv_box is not None:
            key = (addresses[0] if self.q_box else 0, *addresses[1:3], addresses[3] if self.o_box else 0)
            extra = kept_maps(self.maps, key,
                              lambda: tma.kernel_argument(k, v, self.kv_box, q, self.q_box, o, self.o_box))
        launch.run(self.launches, addresses + self.tail, launch.PARAMS_STRUCT, extra)
        return o, lse


@dataclass(frozen=True, slots=True)
class HeadGroups:
    """How a backward plan covers the heads: `count` runs of its launches, each over `q_heads` query heads and
    their `kv_heads` key/value heads (one run over all of them when count is 1). A group's operands are the
    caller's at the group's first head; its LSE is a contiguous copy of the group's rows (the kernels index D, the
    base-2 LSE and the dQ accumulator as they index the LSE), sliced along `lse_head_dim`."""

    count: int
    q_heads: int
    kv_heads: int
    lse_head_dim: int


@dataclass(frozen=True, slots=True)
class BwdPlan:
    launches: tuple[launch.Launch, ...]  # preprocess, the main kernel (or its two passes), the dQ conversion
    tail: tuple                          # AttnParams after its addresses (one head group's)
    bwd_tail: tuple                      # BwdParams after its addresses: dO, dQ, dK, dV, scratch strides, m_blocks
    dout_stride: tuple[int, ...]         # dO must be laid out like the forward's output
    lse_floats: int                      # D and the base-2 LSE: one float per scratch row of a head group each
    accum_floats: int                    # the fp32 dQ accumulator of a head group (and its blocks' map slots)
    semaphore_ints: int                  # deterministic mode's turn counters of a head group; 0 when off
    groups: HeadGroups
    boxes: tuple[KvBox | DqBox, ...] | None = None  # the maps' boxes (K/V, Q, dO[, dQ]) where the kernel takes maps
    # The tensor maps by the addresses they describe (Q's, K's, V's, dO's): the plan fixes the rest.
    maps: dict[tuple[int, ...], bytes] = field(default_factory=dict, compare=False)

    def maps_for(self, q, k, v, dout) -> bytes | None:
        """The main kernel's second argument for one head group's operands (None: it takes one argument)."""
        if self.boxes is None:
            return None
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr())
        return kept_maps(self.maps, key, lambda: tma.backward_argument(q, k, v, dout, self.boxes))

    def run(self, dout, q, k, v, o, lse, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None, grads=None,
            dlse=None):
        """(dq, dk, dv) shaped like q, k, v: fresh, or written into `grads` (laid out as the plan was built).

        `dlse`, the gradient of the returned log-sum-exp (None: the loss does not use it), enters as D - dLSE
        (the preprocess kernel subtracts it, read laid out as the LSE): d lse_i / d s_ij = P_ij, so
        dS = P * (dP - D + dLSE). The head groups run one after the other on the stream, so they share one scratch
        buffer."""
        if dout.stride() != self.dout_stride or dout.data_ptr() % ALIGN_BYTES:
            dout = torch.empty_like(o).copy_(dout)
        dq, dk, dv = empty_grads(q, k, v) if grads is None else grads
        accum_at = -(-2 * self.lse_floats // SCRATCH_ALIGN_FLOATS) * SCRATCH_ALIGN_FLOATS
        scratch = torch.empty(accum_at + self.accum_floats, dtype=FP32, device=q.device)
        base = scratch.data_ptr()
        groups = self.groups
        semaphore = (torch.zeros(groups.count * self.semaphore_ints, dtype=torch.int32, device=q.device)
                     if self.semaphore_ints else None)
        order = None if cu_seqlens_q is None else longest_first(cu_seqlens_q)
        for g in range(groups.count):
            q_, k_, v_, o_, dout_, dq_, dk_, dv_ = q, k, v, o, dout, dq, dk, dv
            lse_, dlse_, slopes = lse, dlse, alibi_slopes
            if groups.count > 1:
                qh = slice(g * groups.q_heads, (g + 1) * groups.q_heads)
                kv = slice(g * groups.kv_heads, (g + 1) * groups.kv_heads)
                q_, o_, dout_, dq_ = (t[..., qh, :] for t in (q, o, dout, dq))
                k_, v_, dk_, dv_ = (t[..., kv, :] for t in (k, v, dk, dv))
                lse_ = lse.narrow(groups.lse_head_dim, qh.start, groups.q_heads).contiguous()
                dlse_ = None if dlse is None else dlse.narrow(groups.lse_head_dim, qh.start, groups.q_heads)
                slopes = None if alibi_slopes is None else alibi_slopes[..., qh]
            turns = 0 if semaphore is None else semaphore.data_ptr() + g * self.semaphore_ints * 4
            if dlse_ is not None and (dlse_.dtype != FP32 or dlse_.stride() != lse_.stride()):
                dlse_ = torch.empty_like(lse_).copy_(dlse_)  # laid out as the LSE, which the kernel reads it as
            params = ((q_.data_ptr(), k_.data_ptr(), v_.data_ptr(), o_.data_ptr(), lse_.data_ptr(), 0,
                       _address(cu_seqlens_q), _address(cu_seqlens_k), _address(slopes)) + self.tail
                      + (dout_.data_ptr(), dq_.data_ptr(), dk_.data_ptr(), dv_.data_ptr(), base + accum_at * 4, base,
                         base + self.lse_floats * 4, turns, _address(dlse_), _address(order)) + self.bwd_tail)
            launch.run(self.launches, params, launch.BWD_PARAMS_STRUCT, self.maps_for(q_, k_, v_, dout_))
        return dq, dk, dv
