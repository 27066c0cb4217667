// sm80/bwd.cu — the backward pass of rung 4 (mma.sync: Ampere, Ada, Hopper).
//
// Idea:     FlashAttention-2's backward. Nothing of size seqlen x seqlen is stored: each block owns one
//           tile of kBlockN keys, keeps K and V in shared memory and dK, dV in registers, and streams the
//           query tiles (Q, dO, and two numbers per row) that see those keys through a cp.async ring.
//           Per query tile, every warp takes 16 keys and computes, transposed so that its rows are keys:
//               S^T  = K Q^T                      (scores, recomputed)
//               P^T  = exp2(S^T * log2e * scale - LSE * log2e)   the softmax, from the forward's LSE
//               dP^T = V dO^T,   dS^T = P^T o (dP^T - D),   D = rowsum(dO o O) (a preprocess kernel)
//               dV  += P^T dO,   dK += dS^T Q     (A operands straight from the registers, as in the forward)
//               dQ  += dS K                        (dS through shared memory; fp32 atomics into dq_accum)
//           GQA: a block serves one key/value head and loops over the query heads of its group, so dK and
//           dV are summed in registers — no atomics, no extra pass. deterministic mode: the dQ additions of
//           the blocks that share a query tile take turns in a fixed order (a per-tile turn counter).
//           Head dims 192/256 would need more registers than a thread has for dK and dV together, so they
//           run two passes (FT_SPLIT): one for dV, one for dK and dQ; S is recomputed in each.
//           Serves head dims 192/256 and GPUs with 99 KB of shared memory; bwd_grid.cu serves the rest.
//           The preprocess and dQ-conversion kernels are in bwd_common.cuh.
// Measured: see docs/performance.md (backward rows).
// Wastes:   dQ leaves through fp32 atomics (FA3 does the same; a second pass over keys would avoid them at
//           the cost of recomputing S and dP); mma.sync on Hopper, as in the forward.
#include "bwd_common.cuh"

constexpr int kQueryTiles = kBlockM / kMmaN;   // n8 tiles across a query tile (columns of S^T)
constexpr int kKTiles = kHeadDim / kMmaN;      // n8 tiles of a dK row slab
constexpr int kVTiles = kHeadDimV / kMmaN;     // n8 tiles of a dV row slab
constexpr int kDqCols = 32;                    // dQ is computed in 16 x 32 pieces: 16 fp32 registers each
constexpr int kDqPieces = (kBlockM / kMmaM) * (kHeadDim / kDqCols);
static_assert(kBlockN == kWarps * kMmaM, "each warp owns 16 keys");
static_assert(kBlockM % 32 == 0 && kHeadDim % kDqCols == 0, "tile shapes");

using DsTile = SwizzledTile<kBlockN, kBlockM>;  // dS^T: keys x queries

struct SharedStorage {
    elem_t k[KTile::kElems];     // later the dK tile
    elem_t v[VTile::kElems];     // later the dV tile
    elem_t q[kStages][QTile::kElems];
    elem_t dout[kStages][DoTile::kElems];
    elem_t ds[DsTile::kElems];
    float lse_log2[kStages][kBlockM];
    float dsum[kStages][kBlockM];
};

// What one launch of the main kernel computes.
enum Pass { kAll = 0, kOnlyDv = 1, kDkDq = 2 };

// ---------------------------------------------------------------------------------------------------
// The main kernel: one block per (key tile, key/value head, batch).
// ---------------------------------------------------------------------------------------------------
// Epilogue of a block: the warp's 16 rows of dK or dV (times `scale`) go over its own rows of the K or V
// tile in shared memory, then to global memory 16 bytes at a time.
template <typename Tile, int kTiles>
__device__ __forceinline__ void store_slab(elem_t* tile_smem, const float (&acc)[kTiles][4], float scale, elem_t* dst,
                                           i64 row_stride, int dim, int n0, int seqlen_k) {
    const int warp_row0 = (threadIdx.x / kWarpSize) * kMmaM, lane = threadIdx.x % kWarpSize;
    const int g = lane / kQuad, t = lane % kQuad;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < kTiles; ++j)
            *reinterpret_cast<u32*>(tile_smem + Tile::offset(warp_row0 + g + 8 * half, j * kMmaN + 2 * t)) =
                pack2<elem_t>(acc[j][2 * half] * scale, acc[j][2 * half + 1] * scale);
    __syncwarp();
    constexpr int kVecsPerRow = kTiles * kMmaN / kElemsPerVector;
    for (int idx = lane; idx < kMmaM * kVecsPerRow; idx += kWarpSize) {
        const int local_row = warp_row0 + idx / kVecsPerRow, col = (idx % kVecsPerRow) * kElemsPerVector;
        const int row = n0 + local_row;
        if (row < seqlen_k && col < dim)
            *reinterpret_cast<uint4*>(dst + (i64)row * row_stride + col) =
                *reinterpret_cast<const uint4*>(tile_smem + Tile::offset(local_row, col));
    }
}

template <int kPass>
__device__ __forceinline__ void attn_bwd_block(const BwdParams& p) {
    constexpr bool kWantDv = kPass != kDkDq, kWantDkDq = kPass != kOnlyDv;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    if (dynamic_smem_bytes() < sizeof(SharedStorage)) __trap();
    const AttnParams& f = p.fwd;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int g = lane / kQuad, t = lane % kQuad;

    const int n_block = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z;
    const int h_first = h_kv * f.group;
    const Problem pr0 = locate_problem(f, b, h_first);
    const int n0 = n_block * kBlockN;
    if (n0 >= pr0.seqlen_k) return;
    const int n1 = min(n0 + kBlockN, pr0.seqlen_k);
    const Mask mask(f.window_left, f.window_right, pr0.seqlen_q, pr0.seqlen_k);

    // The query tiles whose forward visited this key tile: m visits n iff the forward's key range of m
    // overlaps [n0, n1). It is one interval of m; start from the mask's inverse and trim to it exactly
    // (deterministic mode counts on both sides agreeing on who contributes to which dQ tile).
    auto visits = [&](int m) {
        const int r0 = m * kBlockM, r1 = min(r0 + kBlockM, pr0.seqlen_q);
        return mask.key_begin(r0) < n1 && mask.key_end(r1) > n0;
    };
    const int m_tiles_all = ceil_div(pr0.seqlen_q, kBlockM);
    int m_lo = f.window_right < 0 ? 0 : max(0, n0 - mask.offset - f.window_right) / kBlockM;
    int m_hi = f.window_left < 0 ? m_tiles_all
                                 : min(m_tiles_all, max(0, ceil_div(n1 - mask.offset + f.window_left, kBlockM)));
    while (m_lo < m_hi && !visits(m_lo)) ++m_lo;
    while (m_hi > m_lo && !visits(m_hi - 1)) --m_hi;
    const int m_tiles = m_hi - m_lo;
    const int steps = m_tiles * f.group;  // (query head of the group, query tile) pairs, head-major
    // Query tiles are visited last to first. Under a causal mask every key tile then starts on the same,
    // last, query tile, which in deterministic mode turns the wait for earlier key tiles into a lag of one
    // step per tile instead of a wait for them to sweep up from their own first tile.
    auto m_tile_of = [&](int step) { return m_hi - 1 - step % m_tiles; };

    const u32 k_smem = smem_addr(smem.k), v_smem = smem_addr(smem.v), ds_smem = smem_addr(smem.ds);
    const u32 q_smem = smem_addr(smem.q[0]), do_smem = smem_addr(smem.dout[0]);
    const u32 lse_smem = smem_addr(smem.lse_log2[0]), dsum_smem = smem_addr(smem.dsum[0]);
    constexpr u32 kQStageBytes = QTile::kElems * kElemBytes, kDoStageBytes = DoTile::kElems * kElemBytes;
    constexpr u32 kRowStageBytes = kBlockM * sizeof(float);

    // K and V once, then the first query tiles.
    TileLoader<kBlockN, kHeadDim, kThreads>(static_cast<const elem_t*>(f.k) + pr0.k_offset, f.k_row_stride,
                                            f.head_dim).issue(k_smem, n0, pr0.seqlen_k);
    TileLoader<kBlockN, kHeadDimV, kThreads>(static_cast<const elem_t*>(f.v) + pr0.v_offset, f.v_row_stride,
                                             f.head_dim_v).issue(v_smem, n0, pr0.seqlen_k);
    const TileLoader<kBlockM, kHeadDim, kThreads> q_loader(static_cast<const elem_t*>(f.q) + pr0.q_offset,
                                                            f.q_row_stride, f.head_dim);
    const TileLoader<kBlockM, kHeadDimV, kThreads> do_loader(
        static_cast<const elem_t*>(p.dout) + row_offset(p.do_batch_stride, p.do_row_stride, p.do_head_stride, b,
                                                        pr0.q_start, h_first),
        p.do_row_stride, f.head_dim_v);
    auto load_step = [&](int step, int stage) {
        const int head = step / m_tiles, m0 = m_tile_of(step) * kBlockM;
        q_loader.issue(q_smem + stage * kQStageBytes, m0, pr0.seqlen_q, head * f.q_head_stride);
        do_loader.issue(do_smem + stage * kDoStageBytes, m0, pr0.seqlen_q, head * p.do_head_stride);
        if (threadIdx.x < kBlockM) {
            const int row = m0 + threadIdx.x;
            const i64 at = pr0.lse_offset + head * f.lse_head_stride + row;
            const bool valid = row < pr0.seqlen_q;
            cp_async_4(lse_smem + stage * kRowStageBytes + threadIdx.x * 4, valid ? p.lse_log2 + at : p.lse_log2, valid);
            cp_async_4(dsum_smem + stage * kRowStageBytes + threadIdx.x * 4, valid ? p.dsum + at : p.dsum, valid);
        }
    };
    constexpr int kPrologue = kStages > 1 ? kStages - 1 : 1;  // one buffer: load the first step, refill later
#pragma unroll
    for (int s = 0; s < kPrologue; ++s) {
        if (s < steps) load_step(s, s);
        cp_async_commit();
    }

    constexpr bool kModScores = kSoftcap || kAlibi;
    const float log2_factor = kModScores ? kLog2e : f.scale_log2;
    const float inv_softcap = kSoftcap ? 1.f / f.softcap : 0.f;
    const int warp_row0 = warp * kMmaM;   // this warp's 16 keys within the tile
    // Per-lane ldmatrix addresses (tile.cuh): a row-major A operand; rows of a matrix as the B operand
    // (k = its columns); a row-major k x n B operand, transposed on load; and the A operand dS from the
    // transposed dS^T tile.
    const auto a_lane = KTile::fragment_lane(lane % 16, (lane / 16) * 8);
    const auto b_rows_lane = QTile::fragment_lane(lane % 8 + (lane / 16) * 8, ((lane / 8) % 2) * 8);
    const auto b_trans_lane = QTile::fragment_lane(lane % 8 + ((lane / 8) % 2) * 8, (lane / 16) * 8);
    const auto a_trans_lane = b_rows_lane;

    float dk[kKTiles][4] = {};
    float dv[kVTiles][4] = {};

    auto step_body = [&](int step, int stage, bool masked) {
        const int head = h_first + step / m_tiles, m_tile = m_tile_of(step), m0 = m_tile * kBlockM;
        const u32 sq = q_smem + stage * kQStageBytes, sdo = do_smem + stage * kDoStageBytes;
        const u32 lse_row = lse_smem + stage * kRowStageBytes + 2 * t * sizeof(float);   // this lane's column 0
        const u32 dsum_row = dsum_smem + stage * kRowStageBytes + 2 * t * sizeof(float);
        [[maybe_unused]] const float slope = kAlibi ? f.alibi_slopes[b * f.alibi_batch_stride + head] : 0.f;

        // S^T = K Q^T: 16 keys x kBlockM queries.
        float s[kQueryTiles][4] = {};
#pragma unroll
        for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
            u32 a[4];
            ldmatrix_x4(a, k_smem + kElemBytes * KTile::fragment_offset(a_lane, warp_row0, kk * kMmaK));
#pragma unroll
            for (int np = 0; np < kQueryTiles / 2; ++np) {
                u32 bq[4];
                ldmatrix_x4(bq, sq + kElemBytes * QTile::fragment_offset(b_rows_lane, np * 16, kk * kMmaK));
                mma_16816(s[2 * np], a, bq[0], bq[1]);
                mma_16816(s[2 * np + 1], a, bq[2], bq[3]);
            }
        }

        // P^T = exp2(score * log2_factor - lse_log2[query]); masked scores give 0. With softcap, keep the
        // derivative of the cap, 1 - tanh^2 (in [0, 1]), for dS: as fp16 pairs, half the registers.
        [[maybe_unused]] u32 dcap[kSoftcap ? kQueryTiles : 1][2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key = n0 + warp_row0 + g + 8 * half, col0 = m0 + 2 * t;
            // Columns relative to this lane's first: the key is seen by queries [lo, hi) of the tile.
            const int lo = mask.first_query(key) - col0, hi = mask.end_query(key) - col0;
            [[maybe_unused]] float previous_th = 0.f;
#pragma unroll
            for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[j][2 * half + e];
                    const int col = j * kMmaN + e;  // + col0
                    if constexpr (kModScores) {
                        x *= f.softmax_scale;
                        if constexpr (kSoftcap) {
                            const float th = fast_tanh(x * inv_softcap);
                            x = f.softcap * th;
                            if (e == 1) dcap[j][half] = pack2<f16_t>(1.f - previous_th * previous_th, 1.f - th * th);
                            previous_th = th;
                        }
                        if constexpr (kAlibi) x -= slope * fabsf((float)(col0 + col + mask.offset - key));
                    }
                    if (masked && (col < lo || col >= hi)) x = kNegInf;
                    x = fast_exp2(fmaf(x, log2_factor, -ld_shared_in_order(lse_row + col * sizeof(float))));
                }
        }

        // dV += P^T dO.
        if constexpr (kWantDv) {
#pragma unroll
            for (int kk = 0; kk < kBlockM / kMmaK; ++kk) {
                u32 a[4];
                accumulators_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
                for (int dp = 0; dp < kVTiles / 2; ++dp) {
                    u32 bv[4];
                    ldmatrix_x4_trans(bv, sdo + kElemBytes * DoTile::fragment_offset(b_trans_lane, kk * kMmaK, dp * 16));
                    mma_16816(dv[2 * dp], a, bv[0], bv[1]);
                    mma_16816(dv[2 * dp + 1], a, bv[2], bv[3]);
                }
            }
        }
        if constexpr (!kWantDkDq) return;

        // dP^T = V dO^T, then dS^T = P^T o (dP^T - D[query]) (o the softcap's derivative).
        float ds[kQueryTiles][4] = {};
#pragma unroll
        for (int kk = 0; kk < kHeadDimV / kMmaK; ++kk) {
            u32 a[4];
            ldmatrix_x4(a, v_smem + kElemBytes * VTile::fragment_offset(a_lane, warp_row0, kk * kMmaK));
#pragma unroll
            for (int np = 0; np < kQueryTiles / 2; ++np) {
                u32 bo[4];
                ldmatrix_x4(bo, sdo + kElemBytes * DoTile::fragment_offset(b_rows_lane, np * 16, kk * kMmaK));
                mma_16816(ds[2 * np], a, bo[0], bo[1]);
                mma_16816(ds[2 * np + 1], a, bo[2], bo[3]);
            }
        }
#pragma unroll
        for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                ds[j][i] = s[j][i] * (ds[j][i] - ld_shared_in_order(dsum_row + (j * kMmaN + (i & 1)) * sizeof(float)));
                if constexpr (kSoftcap) {
                    const u32 pair = dcap[j][i / 2];
                    ds[j][i] *= to_float(f16_t{(u16)(i % 2 ? pair >> 16 : pair & 0xffffu)});
                }
            }

        // dK += dS^T Q (the softmax scale is applied once, at the end).
#pragma unroll
        for (int kk = 0; kk < kBlockM / kMmaK; ++kk) {
            u32 a[4];
            accumulators_to_a(a, ds[2 * kk], ds[2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < kKTiles / 2; ++dp) {
                u32 bq[4];
                ldmatrix_x4_trans(bq, sq + kElemBytes * QTile::fragment_offset(b_trans_lane, kk * kMmaK, dp * 16));
                mma_16816(dk[2 * dp], a, bq[0], bq[1]);
                mma_16816(dk[2 * dp + 1], a, bq[2], bq[3]);
            }
        }

        // dS^T to shared memory, then dQ = dS K over the whole key tile, added into dq_accum.
#pragma unroll
        for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                *reinterpret_cast<u32*>(smem.ds + DsTile::offset(warp_row0 + g + 8 * half, j * kMmaN + 2 * t)) =
                    pack2<elem_t>(ds[j][2 * half], ds[j][2 * half + 1]);
        int* turn = nullptr;
        int my_turn = 0;
        if (p.dq_semaphore != nullptr) {  // deterministic: wait until the key tiles before this one have added
            turn = p.dq_semaphore + ((i64)b * f.heads_q + head) * p.m_blocks + m_tile;
            my_turn = n_block - mask.key_begin(m0) / kBlockN;
            if (threadIdx.x == 0)
                while (load_acquire(turn) != my_turn) {}
        }
        __syncthreads();
        float* accum = p.dq_accum + (pr0.lse_offset + (head - h_first) * f.lse_head_stride + m0) * kHeadDim;
        for (int piece = warp; piece < kDqPieces; piece += kWarps) {
            const int q_slab = (piece % (kBlockM / kMmaM)) * kMmaM, col0 = (piece / (kBlockM / kMmaM)) * kDqCols;
            float acc[kDqCols / kMmaN][4] = {};
#pragma unroll
            for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
                u32 a[4];
                ldmatrix_x4_trans(a, ds_smem + kElemBytes * DsTile::fragment_offset(a_trans_lane, kk * kMmaK, q_slab));
#pragma unroll
                for (int dp = 0; dp < kDqCols / 16; ++dp) {
                    u32 bk[4];
                    ldmatrix_x4_trans(bk, k_smem + kElemBytes * KTile::fragment_offset(b_trans_lane, kk * kMmaK, col0 + dp * 16));
                    mma_16816(acc[2 * dp], a, bk[0], bk[1]);
                    mma_16816(acc[2 * dp + 1], a, bk[2], bk[3]);
                }
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = q_slab + g + 8 * half;
                if (m0 + row >= pr0.seqlen_q) continue;
#pragma unroll
                for (int j = 0; j < kDqCols / kMmaN; ++j)
                    red_add2(accum + row * kHeadDim + col0 + j * kMmaN + 2 * t, acc[j][2 * half], acc[j][2 * half + 1]);
            }
        }
        if (turn != nullptr) {
            // The barrier orders every thread's reductions before thread 0's release, and a release is
            // cumulative: one fence-free store hands the turn on (a fence per thread would stall each of
            // them until its reductions had landed: 1.48x the default time instead of 1.39x).
            __syncthreads();
            if (threadIdx.x == 0) store_release(turn, my_turn + 1);
        }
    };

    // Main loop over (query head, query tile) steps: wait for this step's tiles, refill the buffer the
    // previous step used, compute.
    constexpr int kInFlight = kStages > 1 ? kStages - 2 : 0;
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<kInFlight>();
        __syncthreads();  // this step's tiles are visible; every warp is done with the previous step's buffers
        if constexpr (kStages > 1) {
            if (step + kStages - 1 < steps) load_step(step + kStages - 1, (step + kStages - 1) % kStages);
            cp_async_commit();
        }
        const int stage = step % kStages, m0 = m_tile_of(step) * kBlockM;
        step_body(step, stage, !mask.tile_unmasked(m0, min(m0 + kBlockM, pr0.seqlen_q), n0, n0 + kBlockN));
        if constexpr (kStages == 1) {
            __syncthreads();
            if (step + 1 < steps) load_step(step + 1, 0);
            cp_async_commit();
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with K and V: their tiles now stage dK and dV

    if constexpr (kWantDkDq)
        store_slab<KTile>(smem.k, dk, f.softmax_scale,
                          static_cast<elem_t*>(p.dk) + row_offset(p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride,
                                                                  b, pr0.k_start, h_kv),
                          p.dk_row_stride, f.head_dim, n0, pr0.seqlen_k);
    if constexpr (kWantDv)
        store_slab<VTile>(smem.v, dv, 1.f,
                          static_cast<elem_t*>(p.dv) + row_offset(p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride,
                                                                  b, pr0.k_start, h_kv),
                          p.dv_row_stride, f.head_dim_v, n0, pr0.seqlen_k);
}

#if FT_SPLIT
extern "C" __global__ void __launch_bounds__(kThreads, 1) attn_bwd_dv(const __grid_constant__ BwdParams p) {
    attn_bwd_block<kOnlyDv>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads, 1) attn_bwd_dkdq(const __grid_constant__ BwdParams p) {
    attn_bwd_block<kDkDq>(p);
}
#else
extern "C" __global__ void __launch_bounds__(kThreads, 1) attn_bwd(const __grid_constant__ BwdParams p) {
    attn_bwd_block<kAll>(p);
}
#endif
