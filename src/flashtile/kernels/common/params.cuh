// params.cuh — the one plain-data struct that crosses from host to device.
//
// Every attention kernel takes `const __grid_constant__ AttnParams p` by value. The Python side
// (flashtile/launch.py, PARAM_FIELDS) packs the same fields in the same order; a CPU test compiles
// static_asserts on every offset so the two can never drift apart.
#pragma once
#include "numeric.cuh"

struct AttnParams {
    // Tensors. q, k, v, o are elem_t; lse is fp32.
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;                // null when the caller does not want the log-sum-exp
    float* scores;             // rung 0 only: (batch, heads_q, seqlen_q, seqlen_k) fp32 scratch
    const int* cu_seqlens_q;   // varlen: batch + 1 prefix sums of the packed sequences; null otherwise
    const int* cu_seqlens_k;
    const float* alibi_slopes; // (heads_q,) or (batch, heads_q); null when ALiBi is off

    // Strides, in elements. The last dimension is always contiguous.
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 lse_batch_stride, lse_head_stride;  // lse rows are contiguous
    i64 alibi_batch_stride;                 // 0 when the slopes are shared by the batch

    // Sizes. For varlen, seqlen_q / seqlen_k are the maxima and each sequence's own comes from cu_seqlens.
    int batch, heads_q, heads_kv, group;  // group = heads_q / heads_kv (GQA)
    int seqlen_q, seqlen_k;
    int head_dim, head_dim_v;             // the real (unpadded) sizes

    // Softmax. score = softcap * tanh(scale * q.k / softcap) - slope * |i + seqlen_k - seqlen_q - j|.
    float softmax_scale;
    float scale_log2;         // softmax_scale * log2(e), for kernels that run the softmax in base 2
    float softcap;            // 0 = off
    int window_left, window_right;  // -1 = unbounded; causal is window_right = 0
    int tail_tiles;           // rung 5's tail split (wgmma/fwd.cu): key tiles per block in the last round; 0 = off

    // Decoding only (kernels built with FT_DECODE, flashtile/decode.py); zero for every other kernel.
    const int* seqused_k;      // (batch,): keys each sequence uses, at most seqlen_k; null: seqlen_k
    const int* block_table;    // paged K/V: (batch, blocks) page indices; k/v_batch_stride then step pages
    float* o_accum;            // split-KV: (splits, batch, heads_q, seqlen_q, head_dim_v) normalised partial outputs
    float* lse_accum;          // split-KV: (splits, batch, heads_q, seqlen_q) their log-sum-exps
    i64 block_table_batch_stride;
    int page_size;             // rows per page of a paged cache
    int num_splits;            // parts of each sequence's keys, one block each; 1: no split
};

// Where one (batch, head) problem lives: its sequence lengths and the element offsets of its rows.
struct Problem {
    int seqlen_q, seqlen_k;
    i64 q_start, k_start;  // first packed row of this sequence (varlen), 0 otherwise
    i64 q_offset, k_offset, v_offset, o_offset, lse_offset;
    i64 scratch_offset;  // the backward's (bwd_frame.cuh, locate_bwd_problem): its first scratch row
};

__device__ __forceinline__ Problem locate_problem(const AttnParams& p, int b, int h) {
    Problem pr;
    const int h_kv = h / p.group;
    i64 q_start = 0, k_start = 0;
    if (p.cu_seqlens_q != nullptr) {
        q_start = p.cu_seqlens_q[b];
        k_start = p.cu_seqlens_k[b];
        pr.seqlen_q = p.cu_seqlens_q[b + 1] - (int)q_start;
        pr.seqlen_k = p.cu_seqlens_k[b + 1] - (int)k_start;
    } else {
        pr.seqlen_q = p.seqlen_q;
        pr.seqlen_k = p.seqlen_k;
    }
    pr.q_start = q_start;
    pr.k_start = k_start;
    pr.q_offset = b * p.q_batch_stride + q_start * p.q_row_stride + h * p.q_head_stride;
    pr.k_offset = b * p.k_batch_stride + k_start * p.k_row_stride + h_kv * p.k_head_stride;
    pr.v_offset = b * p.v_batch_stride + k_start * p.v_row_stride + h_kv * p.v_head_stride;
    pr.o_offset = b * p.o_batch_stride + q_start * p.o_row_stride + h * p.o_head_stride;
    pr.lse_offset = b * p.lse_batch_stride + h * p.lse_head_stride + q_start;
    return pr;
}

// The backward pass: the forward's params (o = the forward output, lse = its log-sum-exp) plus the
// gradients and the per-row scratch the backward kernels share (kernels/mma/bwd.cu).
struct BwdParams {
    AttnParams fwd;
    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    float* dq_accum;       // fp32 dQ, (scratch row) x FT_HEAD_DIM; zeroed by the preprocess kernel
    float* dsum;           // D = rowsum(dO * O) - dLSE, one per scratch row (scratch_row0 above)
    float* lse_log2;       // lse * log2(e), +inf for rows that see no key (so their P is 0), one per scratch row
    int* dq_semaphore;     // deterministic mode: (batch, heads_q, m_blocks) turn counters; null otherwise
    const float* dlse;     // the returned LSE's gradient, laid out as the LSE; null where the loss does not use it
    const int* batch_order;  // varlen: the batch entries, longest first, that key-block grids run; null otherwise

    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 dq_batch_stride, dq_row_stride, dq_head_stride;
    i64 dk_batch_stride, dk_row_stride, dk_head_stride;
    i64 dv_batch_stride, dv_row_stride, dv_head_stride;
    i64 scratch_batch_stride, scratch_head_stride;  // the scratch rows' (below)
    int m_blocks;          // query blocks per (batch, head) in the main kernel: the semaphore row length
};

// The backward's scratch rows (D, the base-2 LSE and the fp32 dQ accumulator's rows): each problem's query rows,
// padded to whole tiles of kScratchTile rows (zeros in D and the LSE), so that a query tile's rows start 16-byte
// aligned and rows past the sequence read as zeros (wgmma/bwd.cu copies a tile's D and LSE whole, by the copy
// engine). The strides are the host's (backward.py, scratch_strides). Batch entry b starts b batch strides of
// whole tiles in; a varlen head's sequences are packed instead, the b-th from (cu_seqlens_q[b] + b * kScratchTile)
// rounded down to a tile (its batch stride is one tile), which leaves every earlier sequence's tiles whole.
constexpr int kScratchTile = 128;  // a power of two: rounding is a mask (rows are never negative)
__device__ __forceinline__ i64 round_up_to_tile(i64 rows) { return (rows + kScratchTile - 1) & -kScratchTile; }
__device__ __forceinline__ i64 scratch_row0(const BwdParams& p, int b, int h, i64 q_start) {
    return h * p.scratch_head_stride + ((q_start + b * p.scratch_batch_stride) & -kScratchTile);
}

// Element offset of row `start` of head `head` in batch `b` of a (batch, seqlen, heads, dim) tensor.
__device__ __forceinline__ i64 row_offset(i64 batch_stride, i64 row_stride, i64 head_stride, int b, i64 start, int head) {
    return b * batch_stride + start * row_stride + head * head_stride;
}
