// Rung 2 — tiled: FlashAttention's tiling, on CUDA cores in fp32.
//
// Idea:     a block owns a 64-row tile of queries and streams tiles of K and V through shared memory.
//           Every K/V element loaded from global memory is now reused by 64 query rows instead of one.
//           Scores live only as a 64 x BLOCK_N tile; the online softmax of rung 1 runs per row of it.
//           256 threads form a 16 x 16 grid; each computes a 4 x (BLOCK_N/16) block of scores and a
//           4 x (HEAD_DIM/16) block of the output from 16-byte shared-memory reads.
//           Global loads are 16 bytes per thread and coalesced; rows of shared memory are padded by
//           one 16-byte vector so that the 8 threads of each quarter-warp hit 8 different bank groups.
//           With a causal or window mask, key tiles that no query of the block can see are skipped.
// Removes:  rung 1's re-reading of all of K and V per query row, and its one-score-at-a-time shuffles.
// Measured: 9.8 ms at b=4 h=16 n=4096 d=64 bf16 on the H200 (28 TFLOP/s): 35x rung 0, 11x rung 1.
// Wastes:   fp32 FMA units deliver ~1/15 of the tensor cores' bf16 rate; loads are synchronous (math
//           waits for memory); P makes a round trip through shared memory between the two products.
#include "../common/params.cuh"
#include "../common/mask.cuh"

constexpr int kHeadDim = FT_HEAD_DIM;    // padded head_dim this build serves (64 or 128)
constexpr int kBlockM = FT_BLOCK_M;      // query rows per block (specs.py TILED_BLOCK_M)
constexpr int kBlockN = FT_BLOCK_N;      // keys per tile (specs.py TILED_BLOCK_N: 64 to 16, what fits smem)
constexpr int kThreads = FT_THREADS;
constexpr int kMinBlocksPerSM = 2;       // caps registers at 128 so two blocks (16 warps) share an SM
constexpr int kThreadGrid = 16;          // kThreads = kThreadGrid x kThreadGrid
constexpr int kRowsPerThread = kBlockM / kThreadGrid;      // 4
static_assert(kThreads == kThreadGrid * kThreadGrid, "FT_THREADS must be a 16 x 16 thread grid");
constexpr int kColsPerThread = kBlockN / kThreadGrid;      // score columns per thread
constexpr int kFloatsPerVec = 4;                           // one 16-byte shared-memory access
constexpr int kDimVecsPerThread = kHeadDim / (kThreadGrid * kFloatsPerVec);  // output float4s per row
constexpr int kPad = kFloatsPerVec;      // one 16-byte vector of padding per shared-memory row
constexpr int kRowQK = kHeadDim + kPad;  // floats per padded Q / K / V row
constexpr int kRowP = kBlockN + kPad;    // floats per padded P row
static_assert(kRowsPerThread == 4, "the output loop reads 4 rows of P as one float4 per column");
static_assert(kHeadDim % (kThreadGrid * kFloatsPerVec) == 0, "FT_HEAD_DIM must be a multiple of 64 (smaller dims are padded up)");

struct SharedStorage {
    float q[kBlockM][kRowQK];   // Q tile, pre-multiplied by softmax_scale
    float k[kBlockN][kRowQK];
    float v[kBlockN][kRowQK];
    float p[kBlockM][kRowP];    // probabilities of the current tile
};

// Copy rows [row0, row0 + n_rows) of a (rows, head_dim) matrix into a padded fp32 tile, 16 bytes per
// thread per step, coalesced along each row. Rows past `valid_rows` and dims past `dim` become zero.
template <int kRows>
__device__ __forceinline__ void load_tile(float (*tile)[kRowQK], const elem_t* src, i64 row_stride,
                                          int row0, int valid_rows, int dim, float scale) {
    constexpr int kVecsPerRow = kHeadDim / kElemsPerVector;
    for (int idx = threadIdx.x; idx < kRows * kVecsPerRow; idx += kThreads) {
        const int r = idx / kVecsPerRow;
        const int c = (idx % kVecsPerRow) * kElemsPerVector;
        float vals[kElemsPerVector];
        if (row0 + r < valid_rows && c < dim) {
            const uint4 raw = *reinterpret_cast<const uint4*>(src + (i64)(row0 + r) * row_stride + c);
            widen_vector(raw, vals);
#pragma unroll
            for (int e = 0; e < kElemsPerVector; ++e) vals[e] *= scale;
        } else {
#pragma unroll
            for (int e = 0; e < kElemsPerVector; ++e) vals[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < kElemsPerVector; e += kFloatsPerVec)
            *reinterpret_cast<float4*>(&tile[r][c + e]) = make_float4(vals[e], vals[e + 1], vals[e + 2], vals[e + 3]);
    }
}

// The 16 threads that share a row of the score tile are 16 consecutive lanes: reduce across them.
__device__ __forceinline__ float row_max16(float x) {
#pragma unroll
    for (int offset = kThreadGrid / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullWarpMask, x, offset));
    return x;
}
__device__ __forceinline__ float row_sum16(float x) {
#pragma unroll
    for (int offset = kThreadGrid / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullWarpMask, x, offset);
    return x;
}

extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
tiled_fwd(const __grid_constant__ AttnParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    if (dynamic_smem_bytes() < sizeof(SharedStorage)) __trap();
    const int tx = threadIdx.x % kThreadGrid;   // score column / output dim group
    const int ty = threadIdx.x / kThreadGrid;   // row group: rows ty*4 .. ty*4+3 of the tile
    const int h = blockIdx.y, b = blockIdx.z;
    const Problem pr = locate_problem(p, b, h);
    const int m0 = blockIdx.x * kBlockM;
    if (m0 >= pr.seqlen_q) return;
    const Mask mask(p.window_left, p.window_right, pr.seqlen_q, pr.seqlen_k);
    const int m1 = min(m0 + kBlockM, pr.seqlen_q);

    const elem_t* q = static_cast<const elem_t*>(p.q) + pr.q_offset;
    const elem_t* k = static_cast<const elem_t*>(p.k) + pr.k_offset;
    const elem_t* v = static_cast<const elem_t*>(p.v) + pr.v_offset;
    load_tile<kBlockM>(smem.q, q, p.q_row_stride, m0, pr.seqlen_q, p.head_dim, p.softmax_scale);

    float acc[kRowsPerThread][kDimVecsPerThread][kFloatsPerVec] = {};
    float row_m[kRowsPerThread], row_l[kRowsPerThread];  // row_l: this thread's share of the denominator
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) { row_m[r] = kNegInf; row_l[r] = 0.f; }

    // Only key tiles that some row of this block can see: causal and window masks skip the rest.
    const int n_begin = mask.key_begin(m0) / kBlockN * kBlockN;
    const int n_end = mask.key_end(m1);
    for (int n0 = n_begin; n0 < n_end; n0 += kBlockN) {
        __syncthreads();  // the previous tile's K, V and P are no longer read
        load_tile<kBlockN>(smem.k, k, p.k_row_stride, n0, pr.seqlen_k, p.head_dim, 1.f);
        load_tile<kBlockN>(smem.v, v, p.v_row_stride, n0, pr.seqlen_k, p.head_dim_v, 1.f);
        __syncthreads();

        // S = Q K^T for rows ty*4+r, columns tx + 16*c, four dims per step.
        float s[kRowsPerThread][kColsPerThread] = {};
#pragma unroll 1
        for (int d = 0; d < kHeadDim; d += kFloatsPerVec) {
            float4 qv[kRowsPerThread], kv[kColsPerThread];
#pragma unroll
            for (int r = 0; r < kRowsPerThread; ++r) qv[r] = *reinterpret_cast<const float4*>(&smem.q[ty * kRowsPerThread + r][d]);
#pragma unroll
            for (int c = 0; c < kColsPerThread; ++c) kv[c] = *reinterpret_cast<const float4*>(&smem.k[tx + kThreadGrid * c][d]);
#pragma unroll
            for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
                for (int c = 0; c < kColsPerThread; ++c)
                    s[r][c] += qv[r].x * kv[c].x + qv[r].y * kv[c].y + qv[r].z * kv[c].z + qv[r].w * kv[c].w;
        }

        // Mask, then the online-softmax update of each row's maximum, denominator and accumulator.
        const bool needs_mask = !mask.tile_unmasked(m0, m1, n0, n0 + kBlockN);
#pragma unroll
        for (int r = 0; r < kRowsPerThread; ++r) {
            const int i = m0 + ty * kRowsPerThread + r;
            if (needs_mask) {
#pragma unroll
                for (int c = 0; c < kColsPerThread; ++c)
                    if (!mask.allowed(i, n0 + tx + kThreadGrid * c)) s[r][c] = kNegInf;
            }
            float tile_max = kNegInf;
#pragma unroll
            for (int c = 0; c < kColsPerThread; ++c) tile_max = fmaxf(tile_max, s[r][c]);
            const float m_new = fmaxf(row_m[r], row_max16(tile_max));
            const float shift = m_new == kNegInf ? 0.f : m_new;  // a row with nothing visible yet stays 0
            const float correction = __expf(row_m[r] - shift);
            row_m[r] = m_new;
            float tile_sum = 0.f;
#pragma unroll
            for (int c = 0; c < kColsPerThread; ++c) {
                const float prob = __expf(s[r][c] - shift);
                tile_sum += prob;
                smem.p[ty * kRowsPerThread + r][tx + kThreadGrid * c] = prob;
            }
            row_l[r] = row_l[r] * correction + tile_sum;
#pragma unroll
            for (int dv = 0; dv < kDimVecsPerThread; ++dv)
#pragma unroll
                for (int e = 0; e < kFloatsPerVec; ++e) acc[r][dv][e] *= correction;
        }
        __syncthreads();

        // O += P V: rows ty*4+r, dims 4*tx + 64*dv .. +3.
        for (int j = 0; j < kBlockN; ++j) {
            float prob[kRowsPerThread];
#pragma unroll
            for (int r = 0; r < kRowsPerThread; ++r) prob[r] = smem.p[ty * kRowsPerThread + r][j];
#pragma unroll
            for (int dv = 0; dv < kDimVecsPerThread; ++dv) {
                const float4 vv = *reinterpret_cast<const float4*>(&smem.v[j][(tx + kThreadGrid * dv) * kFloatsPerVec]);
#pragma unroll
                for (int r = 0; r < kRowsPerThread; ++r) {
                    acc[r][dv][0] += prob[r] * vv.x;
                    acc[r][dv][1] += prob[r] * vv.y;
                    acc[r][dv][2] += prob[r] * vv.z;
                    acc[r][dv][3] += prob[r] * vv.w;
                }
            }
        }
    }

    // Normalise and write. Rows that saw no key get 0 and log-sum-exp -inf.
    elem_t* o = static_cast<elem_t*>(p.o) + pr.o_offset;
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
        const int i = m0 + ty * kRowsPerThread + r;
        const float l = row_sum16(row_l[r]);
        if (i >= pr.seqlen_q) continue;
        const float inv_l = saw_keys(l) ? 1.f / l : 0.f;
#pragma unroll
        for (int dv = 0; dv < kDimVecsPerThread; ++dv)
#pragma unroll
            for (int e = 0; e < kFloatsPerVec; ++e) {
                const int d = (tx + kThreadGrid * dv) * kFloatsPerVec + e;
                if (d < p.head_dim_v) o[(i64)i * p.o_row_stride + d] = from_float<elem_t>(acc[r][dv][e] * inv_l);
            }
        if (p.lse != nullptr && tx == 0) p.lse[pr.lse_offset + i] = saw_keys(l) ? row_m[r] + __logf(l) : kNegInf;
    }
}
