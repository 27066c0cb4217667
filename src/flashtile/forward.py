"""One forward problem, validated and normalised, and its translation into the kernels' params struct."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


LOG2E = 1.4426950408889634  # 1 / ln 2: exp(x) = exp2(x * LOG2E)
MAX_GRID_BATCH = 65535        # a grid's z dimension, where the kernels put the batch: larger batches go in parts
# AttnParams' decoding fields (seqused_k, block_table, o_accum, lse_accum, block_table_batch_stride, page_size,
# num_splits): unused by every kernel but the decode builds, whose plan (decode.py) fills them.
NO_DECODE_FIELDS = (0, 0, 0, 0, 0, 0, 1)
NO_TAIL_SPLIT = 0             # AttnParams.tail_tiles of every plan but rung 5's with a tail split (ladder.py)


@dataclass(slots=True)
class FwdProblem:
    """Inputs of one attention call after api.py checked them.

    Dense: q (batch, seqlen_q, heads_q, d), k (batch, seqlen_k, heads_kv, d), v (..., dv).
    Varlen: q (total_q, heads_q, d), k/v (total_k, heads_kv, d|dv) with cu_seqlens_q/k (batch + 1,) int32.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    window: tuple[int, int]            # (left, right), causal already folded in as right = 0
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    want_lse: bool = False

    def on(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> FwdProblem:
        """The same problem on other operands of the same signature (a quarter of dataclasses.replace's cost)."""
        return FwdProblem(q, k, v, self.scale, self.window, self.softcap, self.alibi_slopes, self.cu_seqlens_q,
                          self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k, self.want_lse)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1 if self.varlen else self.q.shape[0]

    @property
    def heads_q(self) -> int:
        return self.q.shape[-2]

    @property
    def heads_kv(self) -> int:
        return self.k.shape[-2]

    @property
    def seqlen_q(self) -> int:
        return self.max_seqlen_q if self.varlen else self.q.shape[1]

    @property
    def seqlen_k(self) -> int:
        return self.max_seqlen_k if self.varlen else self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def head_dim_v(self) -> int:
        return self.v.shape[-1]

    @property
    def causal(self) -> bool:
        return self.window[1] == 0

    def batch_parts(self):
        """(b0, b1, the problem of batch entries b0..b1-1) in parts a grid can hold (views: nothing is copied).
        Varlen parts keep the packed tensors whole and take their slice of the offsets."""
        for b0 in range(0, self.batch, MAX_GRID_BATCH):
            b1 = min(b0 + MAX_GRID_BATCH, self.batch)
            slopes = self.alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[b0:b1]
            if self.varlen:
                yield b0, b1, dataclasses.replace(self, cu_seqlens_q=self.cu_seqlens_q[b0:b1 + 1],
                                                  cu_seqlens_k=self.cu_seqlens_k[b0:b1 + 1], alibi_slopes=slopes)
            else:
                yield b0, b1, dataclasses.replace(self, q=self.q[b0:b1], k=self.k[b0:b1], v=self.v[b0:b1],
                                                  alibi_slopes=slopes)

    def out_shape(self) -> tuple[int, ...] | None:
        """The output's shape where it differs from q's (a v head dim unlike q's); None: the output is like q."""
        q = self.q
        return None if q.shape[-1] == self.head_dim_v else (*q.shape[:-1], self.head_dim_v)

    def lse_shape(self) -> tuple[int, ...] | None:
        """FlashAttention's LSE layouts, (batch, heads_q, seqlen_q) dense and (heads_q, total_q) varlen; None
        when no LSE is wanted."""
        if not self.want_lse:
            return None
        return (self.heads_q, self.q.shape[0]) if self.varlen else (self.batch, self.heads_q, self.seqlen_q)

    def params(self, o: torch.Tensor, lse: torch.Tensor | None, scores: torch.Tensor | None = None,
               tail_tiles: int = NO_TAIL_SPLIT) -> tuple:
        """AttnParams field values for this problem writing into `o` / `lse` (kernels/common/params.cuh); rung 5's
        plan passes its tail split's run as `tail_tiles`."""
        q, k, v = self.q, self.k, self.v
        heads_q, heads_kv = q.shape[-2], k.shape[-2]
        if self.cu_seqlens_q is not None:  # (total, heads, dim): no batch stride, rows located via cu_seqlens
            batch, seqlen_q, seqlen_k = self.cu_seqlens_q.shape[0] - 1, self.max_seqlen_q, self.max_seqlen_k
            qs, ks, vs, os_ = (0, *q.stride()[:2]), (0, *k.stride()[:2]), (0, *v.stride()[:2]), (0, *o.stride()[:2])
            lse_strides = (0, lse.stride(0)) if lse is not None else (0, 0)
            cu_q, cu_k = self.cu_seqlens_q.data_ptr(), self.cu_seqlens_k.data_ptr()
        else:
            batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
            qs, ks, vs, os_ = q.stride()[:3], k.stride()[:3], v.stride()[:3], o.stride()[:3]
            lse_strides = lse.stride()[:2] if lse is not None else (0, 0)
            cu_q = cu_k = 0
        slopes = self.alibi_slopes
        # Positional, in the order of struct AttnParams (hot path: keywords would cost ~4 us per call;
        # tests/test_forward.py checks every field by name).
        return (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
            lse.data_ptr() if lse is not None else 0,
            scores.data_ptr() if scores is not None else 0,
            cu_q, cu_k,
            slopes.data_ptr() if slopes is not None else 0,
            *qs, *ks, *vs, *os_, *lse_strides,
            slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
            batch, heads_q, heads_kv, heads_q // heads_kv,
            seqlen_q, seqlen_k, q.shape[-1], v.shape[-1],
            self.scale, self.scale * LOG2E, self.softcap,
            self.window[0], self.window[1], tail_tiles,
            *NO_DECODE_FIELDS,
        )


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
