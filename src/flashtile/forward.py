"""One forward problem, validated and normalised, and its translation into the kernels' params struct."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .launch import pack_params

LOG2E = 1.4426950408889634  # 1 / ln 2: exp(x) = exp2(x * LOG2E)


@dataclass
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

    def empty_outputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Output in the layout of q (last dim = head_dim_v), and the fp32 log-sum-exp if wanted.

        LSE is (batch, heads_q, seqlen_q) dense, (heads_q, total_q) varlen — FlashAttention's layouts.
        """
        o = self.q.new_empty(*self.q.shape[:-1], self.head_dim_v)
        lse = None
        if self.want_lse:
            shape = (self.heads_q, self.q.shape[0]) if self.varlen else (self.batch, self.heads_q, self.seqlen_q)
            lse = torch.empty(shape, dtype=torch.float32, device=self.q.device)
        return o, lse

    def params(self, o: torch.Tensor, lse: torch.Tensor | None, scores: torch.Tensor | None = None) -> bytes:
        """The AttnParams struct for this problem writing into `o` / `lse` (see kernels/common/params.cuh)."""
        q, k, v = self.q, self.k, self.v
        if self.varlen:  # (total, heads, dim): no batch stride, rows are located through cu_seqlens
            qs, ks, vs, os_ = (0, *q.stride()[:2]), (0, *k.stride()[:2]), (0, *v.stride()[:2]), (0, *o.stride()[:2])
            lse_strides = (0, lse.stride(0)) if lse is not None else (0, 0)
        else:
            qs, ks, vs, os_ = q.stride()[:3], k.stride()[:3], v.stride()[:3], o.stride()[:3]
            lse_strides = lse.stride()[:2] if lse is not None else (0, 0)
        slopes = self.alibi_slopes
        return pack_params(
            q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=o.data_ptr(),
            lse=lse.data_ptr() if lse is not None else 0,
            scores=scores.data_ptr() if scores is not None else 0,
            cu_seqlens_q=self.cu_seqlens_q.data_ptr() if self.varlen else 0,
            cu_seqlens_k=self.cu_seqlens_k.data_ptr() if self.varlen else 0,
            alibi_slopes=slopes.data_ptr() if slopes is not None else 0,
            q_batch_stride=qs[0], q_row_stride=qs[1], q_head_stride=qs[2],
            k_batch_stride=ks[0], k_row_stride=ks[1], k_head_stride=ks[2],
            v_batch_stride=vs[0], v_row_stride=vs[1], v_head_stride=vs[2],
            o_batch_stride=os_[0], o_row_stride=os_[1], o_head_stride=os_[2],
            lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[1],
            alibi_batch_stride=slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
            batch=self.batch, heads_q=self.heads_q, heads_kv=self.heads_kv, group=self.heads_q // self.heads_kv,
            seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k, head_dim=self.head_dim, head_dim_v=self.head_dim_v,
            softmax_scale=self.scale, scale_log2=self.scale * LOG2E, softcap=self.softcap,
            window_left=self.window[0], window_right=self.window[1],
        )


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
