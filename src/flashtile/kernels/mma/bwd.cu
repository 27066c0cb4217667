// mma/bwd.cu — the backward pass of rung 4 (mma.sync: Ampere, Ada, Hopper).
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
//           In one-pass steps of 64 or more queries, P^T is kept as 16-bit pairs after the softmax (the dV
//           product takes it so anyway): the registers that let d128 run FA2's 64 x 128 tile. dQ is computed
//           in 32 x 32 pieces where that still gives every warp one, so each dS and K fragment read from shared
//           memory (the kernel's bound) feeds two mma.
//           GQA: a block serves one key/value head and loops over the query heads of its group, so dK and
//           dV are summed in registers — no atomics, no extra pass. deterministic mode: the dQ additions of
//           the blocks that share a query tile take turns in a fixed order (a per-tile turn counter).
//           Head dims 192/256 would need more registers than a thread has for dK and dV together, so they
//           run two passes (FT_SPLIT): one for dV, one for dK and dQ; S is recomputed in each. On Hopper
//           those dims go to bwd_grid.cu instead, which spreads dK and dV over the block in one pass.
//           Preprocess (D, LSE in base 2, dq_accum zeroed) and the final dQ conversion are two small kernels.
// Measured: see docs/performance.md (backward rows).
// Wastes:   dQ leaves through fp32 atomics (FA3 does the same; a second pass over keys would avoid them at
//           the cost of recomputing S and dP); mma.sync on Hopper, as in the forward.
#include "../common/bwd_frame.cuh"

constexpr int kQueryTiles = kBlockM / kMmaN;   // n8 tiles across a query tile (columns of S^T)
constexpr int kKTiles = kHeadDim / kMmaN;      // n8 tiles of a dK row slab
constexpr int kVTiles = kHeadDimV / kMmaN;     // n8 tiles of a dV row slab
// dQ = dS K is computed in kDqRows x 32 pieces, one warp at a time. 32 x 32 pieces read dS and K from shared
// memory once per 8 mma (16 x 32: once per 4 mma, 1.5x the bytes); 16-row pieces only where 32-row ones
// would leave warps idle.
constexpr int kDqCols = 32;
constexpr int kDqRows = (kBlockM / 32) * (kHeadDim / kDqCols) >= kWarps ? 32 : kMmaM;
constexpr int kDqSlabs = kDqRows / kMmaM;
constexpr int kDqPieces = (kBlockM / kDqRows) * (kHeadDim / kDqCols);
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

// acc (one warp's 16 keys x kBlockM queries) += A B^T over kDim columns: A = the warp's 16 rows of a keys-major
// tile (K or V), B = the rows of a queries-major tile (Q or dO). S^T and dP^T are both this product.
template <typename ATile, typename BTile, int kDim>
__device__ __forceinline__ void keys_by_queries(float (&acc)[kQueryTiles][4], u32 a_smem, u32 b_smem,
                                                const LaneOffsets& a_lane, const LaneOffsets& b_lane, int key0) {
#pragma unroll
    for (int kk = 0; kk < kDim / kMmaK; ++kk) {
        u32 a[4];
        ldmatrix_x4(a, a_smem + kElemBytes * ATile::fragment_offset(a_lane, key0, kk * kMmaK));
#pragma unroll
        for (int np = 0; np < kQueryTiles / 2; ++np) {
            u32 b[4];
            ldmatrix_x4(b, b_smem + kElemBytes * BTile::fragment_offset(b_lane, np * 16, kk * kMmaK));
            mma_16816(acc[2 * np], a, b[0], b[1]);
            mma_16816(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// acc (one warp's 16 keys x kTiles n8 columns) += A B: A = a 16 x 16 fragment of P^T or dS^T (keys by the 16
// queries from query0), B = those 16 rows of a queries-major tile (dO or Q), transposed on load. dV and dK
// grow by this product, 16 queries at a time.
template <typename BTile, int kTiles>
__device__ __forceinline__ void add_fragment_times_rows(float (&acc)[kTiles][4], const u32 (&a)[4], u32 b_smem,
                                                        const LaneOffsets& b_lane, int query0) {
#pragma unroll
    for (int dp = 0; dp < kTiles / 2; ++dp) {
        u32 b[4];
        ldmatrix_x4_trans(b, b_smem + kElemBytes * BTile::fragment_offset(b_lane, query0, dp * 16));
        mma_16816(acc[2 * dp], a, b[0], b[1]);
        mma_16816(acc[2 * dp + 1], a, b[2], b[3]);
    }
}

template <int kPass>
__device__ __forceinline__ void attn_bwd_block(const BwdParams& p) {
    constexpr bool kWantDv = kPass != kDkDq, kWantDkDq = kPass != kOnlyDv;
    constexpr bool kPackP = kBlockM > 32 && kPass == kAll;  // P^T as 16-bit pairs after the softmax, see there
    extern __shared__ __align__(128) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    if (dynamic_smem_bytes() < sizeof(SharedStorage)) __trap();
    const AttnParams& f = p.fwd;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int g = lane / kQuad, t = lane % kQuad;

    const int n_block = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z;
    const int h_first = h_kv * f.group;
    const Problem pr0 = locate_bwd_problem(p, b, h_first);
    const int n0 = n_block * kBlockN;
    if (n0 >= pr0.seqlen_k) return;
    const int n1 = min(n0 + kBlockN, pr0.seqlen_k);
    const Mask mask(f.window_left, f.window_right, pr0.seqlen_q, pr0.seqlen_k);

    const QueryTiles visited = visited_query_tiles(f, mask, pr0.seqlen_q, n0, n1);
    const int m_hi = visited.hi, m_tiles = visited.hi - visited.lo;
    const int steps = m_tiles * f.group;  // (query head of the group, query tile) pairs, head-major
    // Query tiles are visited last to first. Under a causal mask every key tile then starts on the same,
    // last, query tile, which in deterministic mode turns the wait for earlier key tiles into a lag of one
    // step per tile instead of a wait for them to sweep up from their own first tile.
    auto m_tile_of = [&](int step) { return m_hi - 1 - step % m_tiles; };

    const u32 k_smem = smem_addr(smem.k), v_smem = smem_addr(smem.v), ds_smem = smem_addr(smem.ds);
    const u32 q_smem = smem_addr(smem.q[0]), do_smem = smem_addr(smem.dout[0]);
    const u32 lse_smem = smem_addr(smem.lse_log2[0]), dsum_smem = smem_addr(smem.dsum[0]);
    constexpr u32 kQStageBytes = QueryRing<>::kQStageBytes, kDoStageBytes = QueryRing<>::kDoStageBytes;
    constexpr u32 kRowStageBytes = QueryRing<>::kRowStageBytes;

    // K and V once, then the first query tiles.
    load_keys_values<>(f, pr0, k_smem, v_smem, n0);
    const QueryRing<> ring(p, pr0, b, h_first, q_smem, do_smem, lse_smem, dsum_smem);
    auto load_step = [&](int step, int stage) { ring.issue(p, pr0, step / m_tiles, m_tile_of(step) * kBlockM, stage); };
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
        keys_by_queries<KTile, QTile, kHeadDim>(s, k_smem, sq, a_lane, b_rows_lane, warp_row0);

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
        // With 64-query steps (one pass), P^T goes on as 16-bit pairs (the dV product takes it so anyway): half
        // the registers of the fp32 scores, which makes room for 64-query steps at d128.
        u32 p16[kPackP ? kQueryTiles : 1][2];
        if constexpr (kPackP) {
#pragma unroll
            for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
                for (int half = 0; half < 2; ++half) p16[j][half] = pack2<elem_t>(s[j][2 * half], s[j][2 * half + 1]);
        }
        auto p_elem = [&](int j, int i) { return kPackP ? unpack_probability<elem_t>(p16[j][i / 2], i % 2) : s[j][i]; };

        // dV += P^T dO.
        if constexpr (kWantDv) {
#pragma unroll
            for (int kk = 0; kk < kBlockM / kMmaK; ++kk) {
                u32 a[4];
                if constexpr (kPackP) {
                    a[0] = p16[2 * kk][0], a[1] = p16[2 * kk][1], a[2] = p16[2 * kk + 1][0], a[3] = p16[2 * kk + 1][1];
                } else {
                    accumulators_to_a(a, s[2 * kk], s[2 * kk + 1]);
                }
                add_fragment_times_rows<DoTile>(dv, a, sdo, b_trans_lane, kk * kMmaK);
            }
        }
        if constexpr (!kWantDkDq) return;

        // dP^T = V dO^T, then dS^T = P^T o (dP^T - D[query]) (o the softcap's derivative).
        float ds[kQueryTiles][4] = {};
        keys_by_queries<VTile, DoTile, kHeadDimV>(ds, v_smem, sdo, a_lane, b_rows_lane, warp_row0);
#pragma unroll
        for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                ds[j][i] = p_elem(j, i) * (ds[j][i] - ld_shared_in_order(dsum_row + (j * kMmaN + (i & 1)) * sizeof(float)));
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
            add_fragment_times_rows<QTile>(dk, a, sq, b_trans_lane, kk * kMmaK);
        }

        // dS^T to shared memory, then dQ = dS K over the whole key tile, added into dq_accum.
#pragma unroll
        for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                *reinterpret_cast<u32*>(smem.ds + DsTile::offset(warp_row0 + g + 8 * half, j * kMmaN + 2 * t)) =
                    pack2<elem_t>(ds[j][2 * half], ds[j][2 * half + 1]);
        const DqTurn turn(p, mask, b, head, m_tile, m0, n_block);  // deterministic mode: wait for this dQ tile
        __syncthreads();
        // (32-bit within the launch's scratch rows: the 64-bit product held more registers and spilled on sm_100)
        const int tile_row = (head - h_first) * (int)p.scratch_head_stride + m0;
        float* accum = p.dq_accum + (pr0.scratch_offset + tile_row) * kHeadDim;
        for (int piece = warp; piece < kDqPieces; piece += kWarps) {
            const int row0 = (piece % (kBlockM / kDqRows)) * kDqRows, col0 = (piece / (kBlockM / kDqRows)) * kDqCols;
            float acc[kDqSlabs][kDqCols / kMmaN][4] = {};
#pragma unroll 4
            for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
                u32 a[kDqSlabs][4];
#pragma unroll
                for (int sl = 0; sl < kDqSlabs; ++sl)
                    ldmatrix_x4_trans(a[sl], ds_smem + kElemBytes * DsTile::fragment_offset(a_trans_lane, kk * kMmaK,
                                                                                           row0 + sl * kMmaM));
#pragma unroll
                for (int dp = 0; dp < kDqCols / 16; ++dp) {
                    u32 bk[4];
                    ldmatrix_x4_trans(bk, k_smem + kElemBytes * KTile::fragment_offset(b_trans_lane, kk * kMmaK, col0 + dp * 16));
#pragma unroll
                    for (int sl = 0; sl < kDqSlabs; ++sl) {
                        mma_16816(acc[sl][2 * dp], a[sl], bk[0], bk[1]);
                        mma_16816(acc[sl][2 * dp + 1], a[sl], bk[2], bk[3]);
                    }
                }
            }
#pragma unroll
            for (int sl = 0; sl < kDqSlabs; ++sl)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = row0 + sl * kMmaM + g + 8 * half;
                    if (m0 + row >= pr0.seqlen_q) continue;
#pragma unroll
                    for (int j = 0; j < kDqCols / kMmaN; ++j)
                        red_add2(accum + row * kHeadDim + col0 + j * kMmaN + 2 * t, acc[sl][j][2 * half],
                                 acc[sl][j][2 * half + 1]);
                }
        }
        turn.pass();
    };

    // Main loop over (query head, query tile) steps; afterwards K and V's tiles are free to stage dK and dV.
    for_each_step(steps, load_step, [&](int step, int stage) {
        const int m0 = m_tile_of(step) * kBlockM;
        step_body(step, stage, !mask.tile_unmasked(m0, min(m0 + kBlockM, pr0.seqlen_q), n0, n0 + kBlockN));
    });

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
