// common/bwd_frame.cuh — what the backward main kernels share (bwd.cu: 16 keys per warp, for head dims up to
// 128, score modifications and small shared memory; bwd_grid.cu: per-phase warp grids, for d192 and d256 on
// Hopper; wgmma/bwd.cu: wgmma, for d64 and d128 on Hopper): the build's constants; the frame of a key block —
// which query tiles it visits, K and V, the query ring and the step loop, the dK/dV epilogue; dQ's fp32
// reductions and deterministic mode's turns; P's widening; and the two row kernels around the main one —
// preprocess (D = rowsum(dO o O), the LSE in base 2, dq_accum zeroed) and dq_convert (dQ = softmax_scale *
// dq_accum in the dtype of q).
#pragma once
#include "params.cuh"
#include "mask.cuh"
#include "tile.cuh"

constexpr int kHeadDim = FT_HEAD_DIM;      // padded q/k head dim of this build
constexpr int kHeadDimV = FT_HEAD_DIM_V;   // padded v head dim
constexpr int kBlockM = FT_BLOCK_M;        // queries per step    } specs.py BWD_TILES / BWD_GRID_TILES say why
constexpr int kBlockN = FT_BLOCK_N;        // keys per block      } for each head dim and arch
constexpr int kWarps = FT_WARPS;
constexpr int kStages = FT_STAGES;         // query tiles in the cp.async ring
constexpr bool kSoftcap = FT_SOFTCAP;
constexpr bool kAlibi = FT_ALIBI;
#ifndef FT_WIDE_BLOCKS
#define FT_WIDE_BLOCKS 0
#endif
constexpr bool kWideBlocks = FT_WIDE_BLOCKS;  // 128-byte swizzle blocks (tile.cuh), the layout wgmma reads
#ifndef FT_DQ_PASS
#define FT_DQ_PASS 0
#endif
// dQ by a kernel of its own (wgmma/bwd_dq.cuh) instead of the main kernel's fp32 reductions: no accumulator to zero
// or convert.
constexpr bool kDqPass = FT_DQ_PASS;
constexpr int kThreads = kWarps * kWarpSize;
static_assert(kStages >= 1, "the ring needs a stage");
static_assert(kThreads >= kBlockM, "one thread per query row loads the per-row values");

using KTile = SwizzledTile<kBlockN, kHeadDim, kWideBlocks>;
using VTile = SwizzledTile<kBlockN, kHeadDimV, kWideBlocks>;
using QTile = SwizzledTile<kBlockM, kHeadDim, kWideBlocks>;
using DoTile = SwizzledTile<kBlockM, kHeadDimV, kWideBlocks>;

constexpr u32 kElemBytes = sizeof(elem_t);
constexpr int kPreprocessRows = FT_PREPROCESS_ROWS;           // rows per block of the two row kernels
constexpr int kRowWarps = FT_ROW_WARPS;

// A problem as the backward kernels see it: locate_problem's, and its first scratch row (params.cuh). (Worked out
// here and not in locate_problem, which the forward kernels share: there the unused sum still moved their code.)
__device__ __forceinline__ Problem locate_bwd_problem(const BwdParams& p, int b, int h) {
    Problem pr = locate_problem(p.fwd, b, h);
    pr.scratch_offset = scratch_row0(p, b, h, pr.q_start);
    return pr;
}

// dq_accum += (a, b) at two neighbouring floats: one vector reduction on Hopper, two scalar ones before it.
__device__ __forceinline__ void red_add2(float* address, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(address), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(address), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(address + 1), "f"(b) : "memory");
#endif
}
// A shared-memory load the compiler may not hoist above the tensor-core work before it (asm volatile keeps
// program order): per-row values are then live only while they are used, not across the matrix products.
__device__ __forceinline__ float ld_shared_in_order(u32 address) {
    float value;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(value) : "r"(address));
    return value;
}
// One of the two 16-bit values of a packed pair of probabilities (in [0, 1]), as a float (e = 0: the low half).
// bf16 widens by a shift. For fp16, a non-negative value widens exactly as its bits shifted into fp32's
// exponent and mantissa, scaled by 2^(127 - 15) (denormals included): cvt.f32.f16 left ptxas 4 bytes short
// of registers at d128 (sm_90a) in bwd.cu and at d256 in bwd_grid.cu, this does not.
template <typename T>
__device__ __forceinline__ float unpack_probability(u32 pair, int e) {
    return to_float(T{(u16)(e ? pair >> 16 : pair & 0xffffu)});
}
constexpr int kF16ToF32MantissaShift = 23 - 10;
constexpr float kF16ToF32ExponentScale = 0x1p112f;
template <>
__device__ __forceinline__ float unpack_probability<f16_t>(u32 pair, int e) {
    const u32 bits = e ? pair >> 16 : pair & 0xffffu;
    return __uint_as_float(bits << kF16ToF32MantissaShift) * kF16ToF32ExponentScale;
}
__device__ __forceinline__ int load_acquire(const int* address) {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
    return value;
}
__device__ __forceinline__ void store_release(int* address, int value) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(address), "r"(value) : "memory");
}

// The query tiles [lo, hi) whose forward visited keys [n0, n1): tile m visits iff the forward's key range of m
// overlaps [n0, n1). It is one interval of m; start from the mask's inverse and trim to it exactly
// (deterministic mode counts on both sides agreeing on who contributes to which dQ tile).
struct QueryTiles { int lo, hi; };
__device__ __forceinline__ QueryTiles visited_query_tiles(const AttnParams& f, const Mask& mask, int seqlen_q, int n0,
                                                          int n1) {
    auto visits = [&](int m) {
        const int r0 = m * kBlockM, r1 = min(r0 + kBlockM, seqlen_q);
        return mask.key_begin(r0) < n1 && mask.key_end(r1) > n0;
    };
    const int m_tiles_all = ceil_div(seqlen_q, kBlockM);
    int m_lo = f.window_right < 0 ? 0 : max(0, n0 - mask.offset - f.window_right) / kBlockM;
    int m_hi = f.window_left < 0 ? m_tiles_all
                                 : min(m_tiles_all, max(0, ceil_div(n1 - mask.offset + f.window_left, kBlockM)));
    while (m_lo < m_hi && !visits(m_lo)) ++m_lo;
    while (m_hi > m_lo && !visits(m_hi - 1)) --m_hi;
    return {m_lo, m_hi};
}

// A block's K and V tiles (keys [n0, n0 + kBlockN) of the problem), one cp.async each, by every thread.
// (Templates, here and in QueryRing, so that a kernel whose loads go another way does not instantiate them.)
template <int kLoadThreads = kThreads>
__device__ __forceinline__ void load_keys_values(const AttnParams& f, const Problem& pr0, u32 k_smem, u32 v_smem,
                                                 int n0) {
    TileLoader<kBlockN, kHeadDim, kLoadThreads, kWideBlocks>(static_cast<const elem_t*>(f.k) + pr0.k_offset,
                                                             f.k_row_stride, f.head_dim)
        .issue(k_smem, n0, pr0.seqlen_k);
    TileLoader<kBlockN, kHeadDimV, kLoadThreads, kWideBlocks>(static_cast<const elem_t*>(f.v) + pr0.v_offset,
                                                              f.v_row_stride, f.head_dim_v)
        .issue(v_smem, n0, pr0.seqlen_k);
}

// The query ring: each step (one query head of the group, one query tile) brings Q, dO and the rows' LSE (base 2)
// and D into one of kStages buffers with cp.async, by every thread.
template <int kLoadThreads = kThreads>
struct QueryRing {
    static constexpr u32 kQStageBytes = QTile::kElems * kElemBytes, kDoStageBytes = DoTile::kElems * kElemBytes;
    static constexpr u32 kRowStageBytes = kBlockM * sizeof(float);
    TileLoader<kBlockM, kHeadDim, kLoadThreads, kWideBlocks> q_loader;
    TileLoader<kBlockM, kHeadDimV, kLoadThreads, kWideBlocks> do_loader;
    u32 q_smem, do_smem, lse_smem, dsum_smem;

    __device__ __forceinline__ QueryRing(const BwdParams& p, const Problem& pr0, int b, int h_first, u32 q, u32 dout,
                                         u32 lse, u32 dsum)
        : q_loader(static_cast<const elem_t*>(p.fwd.q) + pr0.q_offset, p.fwd.q_row_stride, p.fwd.head_dim),
          do_loader(static_cast<const elem_t*>(p.dout) + row_offset(p.do_batch_stride, p.do_row_stride,
                                                                    p.do_head_stride, b, pr0.q_start, h_first),
                    p.do_row_stride, p.fwd.head_dim_v),
          q_smem(q), do_smem(dout), lse_smem(lse), dsum_smem(dsum) {}

    // Query tile m0 / kBlockM of the group's query head `head` into buffer `stage`.
    __device__ __forceinline__ void issue(const BwdParams& p, const Problem& pr0, int head, int m0, int stage) const {
        const AttnParams& f = p.fwd;
        q_loader.issue(q_smem + stage * kQStageBytes, m0, pr0.seqlen_q, head * f.q_head_stride);
        do_loader.issue(do_smem + stage * kDoStageBytes, m0, pr0.seqlen_q, head * p.do_head_stride);
        if (threadIdx.x < kBlockM) {
            const int row = m0 + threadIdx.x;
            const i64 at = pr0.scratch_offset + head * p.scratch_head_stride + row;
            const bool valid = row < pr0.seqlen_q;
            cp_async_4(lse_smem + stage * kRowStageBytes + threadIdx.x * 4, valid ? p.lse_log2 + at : p.lse_log2, valid);
            cp_async_4(dsum_smem + stage * kRowStageBytes + threadIdx.x * 4, valid ? p.dsum + at : p.dsum, valid);
        }
    }
};

// The main loop over (query head, query tile) steps: wait for this step's tiles, refill the buffer the previous
// step used, run the step; at the end every cp.async has landed and every warp is past its last step.
// kAsyncProxyReads: the step's products read shared memory through the async proxy (wgmma), so each thread
// fences its cp.async writes before the barrier that publishes them.
template <bool kAsyncProxyReads = false, typename LoadStep, typename Step>
__device__ __forceinline__ void for_each_step(int steps, const LoadStep& load_step, const Step& run_step) {
    constexpr int kInFlight = kStages > 1 ? kStages - 2 : 0;
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<kInFlight>();
        if constexpr (kAsyncProxyReads) fence_proxy_async();
        __syncthreads();  // this step's tiles are visible; every warp is done with the previous step's buffers
        if constexpr (kStages > 1) {
            if (step + kStages - 1 < steps) load_step(step + kStages - 1, (step + kStages - 1) % kStages);
            cp_async_commit();
        }
        run_step(step, step % kStages);
        if constexpr (kStages == 1) {
            __syncthreads();
            if (step + 1 < steps) load_step(step + 1, 0);
            cp_async_commit();
        }
    }
    cp_async_wait<0>();
    __syncthreads();
}

// Epilogue of a block whose warps own kSlabs x 16 rows by kTiles n8 columns of dK or dV (bwd_grid.cu, wgmma/bwd.cu):
// each warp's piece (times `scale`) goes over the same place in the K or V tile in shared memory (free by then),
// and after a barrier the block stores the tile 16 bytes at a time.
template <typename Tile, int kSlabs, int kTiles>
__device__ __forceinline__ void stage_tile(elem_t* tile_smem, const float (&acc)[kSlabs][kTiles][4], float scale,
                                           int row0, int col0) {
    const int lane = threadIdx.x % kWarpSize, g = lane / kQuad, t = lane % kQuad;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < kTiles; ++j)
                *reinterpret_cast<u32*>(tile_smem + Tile::offset(row0 + sl * kMmaM + g + 8 * half,
                                                                 col0 + j * kMmaN + 2 * t)) =
                    pack2<elem_t>(acc[sl][j][2 * half] * scale, acc[sl][j][2 * half + 1] * scale);
}

// kStoreThreads threads store, `thread` being this one's index among them.
template <typename Tile, int kCols, int kStoreThreads = kThreads>
__device__ __forceinline__ void store_tile(const elem_t* tile_smem, elem_t* dst, i64 row_stride, int dim, int n0,
                                           int seqlen_k, int thread = threadIdx.x) {
    constexpr int kVecsPerRow = kCols / kElemsPerVector;
    for (int idx = thread; idx < kBlockN * kVecsPerRow; idx += kStoreThreads) {
        const int local_row = idx / kVecsPerRow, col = (idx % kVecsPerRow) * kElemsPerVector;
        const int row = n0 + local_row;
        if (row < seqlen_k && col < dim)
            *reinterpret_cast<uint4*>(dst + (i64)row * row_stride + col) =
                *reinterpret_cast<const uint4*>(tile_smem + Tile::offset(local_row, col));
    }
}

// The key block and key/value head a block of the main kernel serves (grid: key blocks x kv heads x batch).
// Deterministic mode hands each dQ tile from key block to key block in key order, so key block n of a head
// runs about n steps behind key block 0. Launched head by head, a wave of resident blocks holds one head's key
// blocks and most of them idle at the start; launched key block by key block (heads fastest), a wave holds
// the first few key blocks of every head and the lag stays a few steps. A block still waits only for blocks
// launched before it. The default mode keeps one head's blocks together: they share its Q and dO in L2.
// A varlen problem's batch entries run longest sequence first (p.batch_order, the host's order of the sequences by
// query rows): the longest blocks start first and the last wave holds the short ones. Deterministic turns stay
// safe: each batch entry's key blocks keep their order.
// wgmma/bwd.cu and bwd_grid.cu use it; bwd.cu reads blockIdx as it is: held in registers, the two indices tip its
// d128 tiles (at 255 registers) into spills.
struct KeyBlock { int n_block, h_kv, b; };
__device__ __forceinline__ KeyBlock key_block_of(const BwdParams& p) {
    const int b = p.batch_order != nullptr ? p.batch_order[blockIdx.z] : (int)blockIdx.z;
    if (p.dq_semaphore == nullptr) return {(int)blockIdx.x, (int)blockIdx.y, b};
    const int linear = blockIdx.y * gridDim.x + blockIdx.x;
    return {linear / (int)gridDim.y, linear % (int)gridDim.y, b};
}

// Deterministic mode: the blocks that add into one dQ tile take turns in key order. The constructor holds the
// leader thread (thread 0, or the first of the warps that add) until the key tiles before this one have added (the
// caller's next barrier holds the rest); `pass` hands on, after `sync` (by default the block's barrier) has
// gathered every adding thread.
struct BlockSync {
    __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
struct DqTurn {
    int* turn = nullptr;
    int mine = 0;

    __device__ __forceinline__ DqTurn(const BwdParams& p, const Mask& mask, int b, int head, int m_tile, int m0,
                                      int n_block, bool leader = threadIdx.x == 0) {
        if (p.dq_semaphore != nullptr) {
            turn = p.dq_semaphore + ((i64)b * p.fwd.heads_q + head) * p.m_blocks + m_tile;
            mine = n_block - mask.key_begin(m0) / kBlockN;
            if (leader)
                while (load_acquire(turn) != mine) {}
        }
    }
    template <typename Sync = BlockSync>
    __device__ __forceinline__ void pass(const Sync& sync = {}, bool leader = threadIdx.x == 0) const {
        if (turn != nullptr) {
            // The barrier orders every thread's reductions before the leader's release, and a release is
            // cumulative: one fence-free store hands the turn on (a fence per thread would stall each of
            // them until its reductions had landed).
            sync();
            if (leader) store_release(turn, mine + 1);
        }
    }
};

// ---------------------------------------------------------------------------------------------------
// The two row kernels. A row's head dim is kRowChunks vectors of kElemsPerVector, a lane each (a power of two of
// lanes a row, kRowLanes, so that a row's sum stays among its lanes; more chunks than lanes take turns), and a
// block covers kRowsAtOnce rows a pass, kPreprocessRows in kRowPasses passes whose loads are all issued before
// any result is used: each thread keeps several 16-byte loads in flight, which is what a kernel that only streams
// memory needs.
// ---------------------------------------------------------------------------------------------------
constexpr int kRowChunks = (kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV) / kElemsPerVector;
constexpr int kRowLanes = kRowChunks >= kWarpSize ? kWarpSize : kRowChunks > 8 ? 16 : kRowChunks > 4 ? 8 : 4;
constexpr int kChunksPerLane = (kRowChunks + kRowLanes - 1) / kRowLanes;
constexpr int kRowsAtOnce = kRowWarps * kWarpSize / kRowLanes;
constexpr int kRowPasses = (kPreprocessRows + kRowsAtOnce - 1) / kRowsAtOnce;
static_assert(kRowChunks * kElemsPerVector == (kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV), "whole vectors");

// This thread's row in a pass (kPreprocessRows or more when a pass covers more rows than a block has: those
// threads idle) and its first chunk.
__device__ __forceinline__ int row_in_block(int pass) { return pass * kRowsAtOnce + threadIdx.x / kRowLanes; }
__device__ __forceinline__ int row_chunk(int i) { return threadIdx.x % kRowLanes + i * kRowLanes; }
// Whether this thread's row in a pass is one of the block's rows and of the sequence (block rows from row0).
__device__ __forceinline__ bool row_valid(int pass, int row0, int seqlen_q) {
    return row_in_block(pass) < kPreprocessRows && row0 + row_in_block(pass) < seqlen_q;
}

// The sum of x over the kRowLanes lanes of a row.
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int offset = kRowLanes / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullWarpMask, x, offset);
    return x;
}

// Preprocess: D = rowsum(dO o O) - dLSE, the LSE in base 2, dq_accum zeroed; the scratch rows that pad the problem
// to whole tiles get zeros in D and the LSE.
extern "C" __global__ void __launch_bounds__(kRowWarps * kWarpSize)
attn_bwd_preprocess(const __grid_constant__ BwdParams p) {
    const int h = blockIdx.y, b = blockIdx.z;
    const Problem pr = locate_bwd_problem(p, b, h);
    const elem_t* out = static_cast<const elem_t*>(p.fwd.o) + pr.o_offset;
    const elem_t* dout = static_cast<const elem_t*>(p.dout) +
                         row_offset(p.do_batch_stride, p.do_row_stride, p.do_head_stride, b, pr.q_start, h);
    const int row0 = blockIdx.x * kPreprocessRows;
    if (row0 >= round_up_to_tile(pr.seqlen_q)) return;
    auto valid_row = [&](int pass) { return row_valid(pass, row0, pr.seqlen_q); };
    uint4 o_raw[kRowPasses][kChunksPerLane], do_raw[kRowPasses][kChunksPerLane];
    float lse[kRowPasses], dlse[kRowPasses];  // by each row's first lane, in flight with the vectors
#pragma unroll
    for (int pass = 0; pass < kRowPasses; ++pass) {
        const bool writes = valid_row(pass) && row_chunk(0) == 0;
        const i64 at = pr.lse_offset + row0 + row_in_block(pass);
        lse[pass] = writes ? p.fwd.lse[at] : 0.f;
        dlse[pass] = writes && p.dlse != nullptr ? p.dlse[at] : 0.f;
#pragma unroll
        for (int i = 0; i < kChunksPerLane; ++i) {
            const int row = row0 + row_in_block(pass), col = row_chunk(i) * kElemsPerVector;
            const bool valid = valid_row(pass) && col < p.fwd.head_dim_v;
            o_raw[pass][i] = valid ? *reinterpret_cast<const uint4*>(out + row * p.fwd.o_row_stride + col) : uint4{};
            do_raw[pass][i] = valid ? *reinterpret_cast<const uint4*>(dout + row * p.do_row_stride + col) : uint4{};
        }
    }
#pragma unroll
    for (int pass = 0; pass < kRowPasses; ++pass) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kChunksPerLane; ++i) {
            float o8[kElemsPerVector], do8[kElemsPerVector];
            widen_vector(o_raw[pass][i], o8);
            widen_vector(do_raw[pass][i], do8);
#pragma unroll
            for (int e = 0; e < kElemsPerVector; ++e) dot += o8[e] * do8[e];
        }
        dot = row_sum(dot);
        // The rows past the sequence up to its last whole tile: zeros (their D and LSE stay finite).
        if (row_in_block(pass) >= kPreprocessRows || row0 + row_in_block(pass) >= round_up_to_tile(pr.seqlen_q))
            continue;
        const i64 at = pr.scratch_offset + row0 + row_in_block(pass);
        if (row_chunk(0) == 0) {
            p.dsum[at] = valid_row(pass) ? dot - dlse[pass] : 0.f;
            p.lse_log2[at] = !valid_row(pass) ? 0.f : lse[pass] == kNegInf ? -kNegInf : lse[pass] * kLog2e;
        }
        if (!valid_row(pass)) continue;
        if constexpr (!kDqPass) {
            float4* accum = reinterpret_cast<float4*>(p.dq_accum + at * kHeadDim);
            for (int i = row_chunk(0); i < kHeadDim / 4; i += kRowLanes) accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
}

// One 16-byte store (a uint4 assigned through a cast came out as four 4-byte stores).
__device__ __forceinline__ void store_vector(void* address, const uint4& v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// dQ = softmax_scale * dq_accum, in the dtype of q.
extern "C" __global__ void __launch_bounds__(kRowWarps * kWarpSize)
attn_bwd_dq_convert(const __grid_constant__ BwdParams p) {
    const int h = blockIdx.y, b = blockIdx.z;
    const Problem pr = locate_bwd_problem(p, b, h);
    elem_t* dq = static_cast<elem_t*>(p.dq) + row_offset(p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b,
                                                         pr.q_start, h);
    const int row0 = blockIdx.x * kPreprocessRows;
    constexpr int kFloat4s = 2;  // fp32 loads per output vector of eight 16-bit values
    static_assert(kElemsPerVector == 8, "16-bit gradients");
    float4 sums[kRowPasses][kChunksPerLane][kFloat4s];
#pragma unroll
    for (int pass = 0; pass < kRowPasses; ++pass)
#pragma unroll
        for (int i = 0; i < kChunksPerLane; ++i) {
            const int row = row0 + row_in_block(pass), col = row_chunk(i) * kElemsPerVector;
            const bool valid = row_valid(pass, row0, pr.seqlen_q) && col < p.fwd.head_dim;
            const float4* accum = reinterpret_cast<const float4*>(p.dq_accum + (pr.scratch_offset + row) * kHeadDim + col);
#pragma unroll
            for (int j = 0; j < kFloat4s; ++j) sums[pass][i][j] = valid ? accum[j] : float4{};
        }
#pragma unroll
    for (int pass = 0; pass < kRowPasses; ++pass)
#pragma unroll
        for (int i = 0; i < kChunksPerLane; ++i) {
            const int row = row0 + row_in_block(pass), col = row_chunk(i) * kElemsPerVector;
            if (!row_valid(pass, row0, pr.seqlen_q) || col >= p.fwd.head_dim) continue;
            const float4 lo = sums[pass][i][0], hi = sums[pass][i][1];
            const float scale = p.fwd.softmax_scale;
            store_vector(dq + row * p.dq_row_stride + col,
                         make_uint4(pack2<elem_t>(lo.x * scale, lo.y * scale), pack2<elem_t>(lo.z * scale, lo.w * scale),
                                    pack2<elem_t>(hi.x * scale, hi.y * scale), pack2<elem_t>(hi.z * scale, hi.w * scale)));
        }
}
