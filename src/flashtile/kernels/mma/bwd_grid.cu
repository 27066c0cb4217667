// mma/bwd_grid.cu — the backward pass of rung 4 for head dim 192 on Hopper (mma.sync).
//
// Idea:     FlashAttention-2's backward. Nothing of size seqlen x seqlen is stored: each block owns one
//           tile of kBlockN keys, keeps K and V in shared memory and dK, dV in registers, and streams the
//           query tiles (Q, dO, and two numbers per row) that see those keys through a cp.async ring.
//           Each step (one query tile) has three phases, each with its own split of the block's warps, so
//           that every fragment a warp loads from shared memory feeds several tensor-core products:
//             1. S^T = K Q^T and dP^T = V dO^T, transposed so that rows are keys (a 2-D grid of warps);
//                P^T = exp2(S^T * scale * log2e - LSE * log2e) from the forward's LSE,
//                dS^T = P^T o (dP^T - D) with D = rowsum(dO o O) from a preprocess kernel;
//                P^T and dS^T go to shared memory.
//             2. dV += P^T dO and dK += dS^T Q (warps split keys x head dim; accumulators stay in registers);
//             3. dQ += dS K (warps split queries x head dim), added into an fp32 accumulator that a third
//                kernel converts.
//           GQA: a block serves one key/value head and loops over the query heads of its group, so dK and
//           dV are summed in registers — no atomics. deterministic mode: the dQ additions of the blocks
//           that share a query tile take turns in a fixed order (a per-tile turn counter), key blocks launched
//           with the heads fastest (key_block_of in bwd_frame.cuh says why).
// Beside:   bwd.cu, 16 keys per warp with P and dS fed from registers, serves head dims up to 128 (faster
//           there: fewer instructions, no P/dS round trip), score modifications and GPUs whose shared memory
//           cannot hold this kernel's d192/d256 tiles. Past d128 bwd.cu's dK and dV do not fit the registers
//           together and it runs two passes; this kernel's warp grids spread them over the block (each warp
//           32 keys x 64 columns at d256) and run one pass, where bwd.cu recomputes S in each of its two. On
//           Hopper d64, d128 and d256 now run wgmma/bwd.cu (wgmma), so the library asks this kernel for d192
//           only; scripts/tune_bwd.py still times it at any head dim.
// Measured: see docs/performance.md (backward rows) and docs/notes.md.
// Wastes:   dQ leaves through fp32 atomics (FA3 does the same); P and dS make a round trip through shared
//           memory; mma.sync on Hopper, as in the forward.
#include "../common/bwd_frame.cuh"

// The three warp grids. Phase 1: keys x queries of S^T/dP^T. Phase 2: keys x columns of dK/dV.
// Phase 3: queries x columns of dQ. Each warp's tile is kSlabs* slabs of 16 rows by k*Tiles n8 tiles.
constexpr int kWarpsKeys1 = FT_WARPS_KEYS_SDP, kWarpsQueries1 = kWarps / kWarpsKeys1;
constexpr int kSlabs1 = kBlockN / kWarpsKeys1 / kMmaM, kQueryTiles1 = kBlockM / kWarpsQueries1 / kMmaN;
constexpr int kWarpsKeys2 = FT_WARPS_KEYS_DKV, kWarpsCols2 = kWarps / kWarpsKeys2;
constexpr int kSlabs2 = kBlockN / kWarpsKeys2 / kMmaM;
constexpr int kKTiles2 = kHeadDim / kWarpsCols2 / kMmaN, kVTiles2 = kHeadDimV / kWarpsCols2 / kMmaN;
constexpr int kWarpsQueries3 = FT_WARPS_QUERIES_DQ, kWarpsCols3 = kWarps / kWarpsQueries3;
constexpr int kSlabs3 = kBlockM / kWarpsQueries3 / kMmaM, kQTiles3 = kHeadDim / kWarpsCols3 / kMmaN;
// Phase 3 holds at most kDqAccumulators fp32 values at once (it runs beside dK and dV): wider warp tiles are
// done in several column passes.
constexpr int kDqAccumulators = 32;
constexpr int kDqPasses = (kSlabs3 * kQTiles3 * 4 + kDqAccumulators - 1) / kDqAccumulators;
constexpr int kQTilesPerPass = kQTiles3 / kDqPasses;
static_assert(kSlabs1 * kWarpsKeys1 * kMmaM == kBlockN && kQueryTiles1 * kWarpsQueries1 * kMmaN == kBlockM,
              "phase 1 grid must tile the block");
static_assert(kSlabs2 * kWarpsKeys2 * kMmaM == kBlockN && kKTiles2 * kWarpsCols2 * kMmaN == kHeadDim &&
              kVTiles2 * kWarpsCols2 * kMmaN == kHeadDimV, "phase 2 grid must tile dK and dV");
static_assert(kSlabs3 * kWarpsQueries3 * kMmaM == kBlockM && kQTiles3 * kWarpsCols3 * kMmaN == kHeadDim,
              "phase 3 grid must tile dQ");
static_assert(kQueryTiles1 % 2 == 0 && kKTiles2 % 2 == 0 && kVTiles2 % 2 == 0 && kQTilesPerPass % 2 == 0 &&
              kQTilesPerPass * kDqPasses == kQTiles3, "ldmatrix.x4 loads n8 tiles in pairs");
static_assert(kBlockM % 32 == 0, "tile shapes");

using PTile = SwizzledTile<kBlockN, kBlockM>;  // P^T and dS^T: keys x queries

struct SharedStorage {
    elem_t k[KTile::kElems];     // later the dK tile
    elem_t v[VTile::kElems];     // later the dV tile
    elem_t q[kStages][QTile::kElems];
    elem_t dout[kStages][DoTile::kElems];
    elem_t p[PTile::kElems];
    elem_t ds[PTile::kElems];
    float lse_log2[kStages][kBlockM];
    float dsum[kStages][kBlockM];
};

// Phase 1's product: acc (this warp's kSlabs1 x 16 keys by kQueryTiles1 x 8 queries) += A B^T over kDim
// columns, A = rows of a keys-major tile (K or V), B = rows of a queries-major tile (Q or dO). The loop over
// the columns stays rolled (unrolled, it spills at d128), so the fragments are double-buffered by hand: the
// next 16 columns' loads are issued before this step's mmas, and no mma waits on a load issued just before it.
template <typename ATile, typename BTile, int kDim>
__device__ __forceinline__ void keys_by_queries(float (&acc)[kSlabs1][kQueryTiles1][4], u32 a_smem, u32 b_smem,
                                                LaneOffsets a_lane, LaneOffsets b_lane, int key0, int query0) {
    constexpr int kSteps = kDim / kMmaK;
    static_assert(kSteps % 2 == 0, "the column steps go in pairs, one per fragment buffer");
    u32 a[2][kSlabs1][4], b[2][kQueryTiles1 / 2][4];
    auto load = [&](int buf, int kk) {
#pragma unroll
        for (int sl = 0; sl < kSlabs1; ++sl)
            ldmatrix_x4(a[buf][sl], a_smem + kElemBytes * ATile::fragment_offset(a_lane, key0 + sl * kMmaM, kk * kMmaK));
#pragma unroll
        for (int np = 0; np < kQueryTiles1 / 2; ++np)
            ldmatrix_x4(b[buf][np], b_smem + kElemBytes * BTile::fragment_offset(b_lane, query0 + np * 16, kk * kMmaK));
    };
    auto multiply = [&](int buf) {
#pragma unroll
        for (int np = 0; np < kQueryTiles1 / 2; ++np)
#pragma unroll
            for (int sl = 0; sl < kSlabs1; ++sl) {
                mma_16816(acc[sl][2 * np], a[buf][sl], b[buf][np][0], b[buf][np][1]);
                mma_16816(acc[sl][2 * np + 1], a[buf][sl], b[buf][np][2], b[buf][np][3]);
            }
    };
    load(0, 0);
#pragma unroll 1
    for (int kk = 0; kk < kSteps; kk += 2) {
        load(1, kk + 1);
        multiply(0);
        if (kk + 2 < kSteps) load(0, kk + 2);
        multiply(1);
    }
}

// ---------------------------------------------------------------------------------------------------
// The main kernel: one block per (key tile, key/value head, batch).
// ---------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kThreads, 1) attn_bwd(const __grid_constant__ BwdParams p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    if (dynamic_smem_bytes() < sizeof(SharedStorage)) __trap();
    const AttnParams& f = p.fwd;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int g = lane / kQuad, t = lane % kQuad;

    const KeyBlock block = key_block_of(p);  // deterministic mode: heads fastest (bwd_frame.cuh)
    const int n_block = block.n_block, h_kv = block.h_kv, b = block.b;
    const int h_first = h_kv * f.group;
    const Problem pr0 = locate_bwd_problem(p, b, h_first);
    const int n0 = n_block * kBlockN;
    if (n0 >= pr0.seqlen_k) return;
    const int n1 = min(n0 + kBlockN, pr0.seqlen_k);
    const Mask mask(f.window_left, f.window_right, pr0.seqlen_q, pr0.seqlen_k);

    const QueryTiles visited = visited_query_tiles(f, mask, pr0.seqlen_q, n0, n1);
    const int m_hi = visited.hi, m_tiles = visited.hi - visited.lo;
    const int steps = m_tiles * f.group;  // (query head of the group, query tile) pairs, head-major
    // Query tiles are visited last to first: under a causal mask every key tile then starts on the same,
    // last, query tile, so in deterministic mode no key tile waits for another to sweep up to it.
    auto m_tile_of = [&](int step) { return m_hi - 1 - step % m_tiles; };

    const u32 k_smem = smem_addr(smem.k), v_smem = smem_addr(smem.v);
    const u32 p_smem = smem_addr(smem.p), ds_smem = smem_addr(smem.ds);
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
    // Per-lane ldmatrix addresses (tile.cuh): a row-major A operand; rows of a matrix as the B operand
    // (k = its columns); a row-major k x n B operand, transposed on load; the A operand dS from dS^T.
    const auto a_lane = KTile::fragment_lane(lane % 16, (lane / 16) * 8);
    const auto b_rows_lane = QTile::fragment_lane(lane % 8 + (lane / 16) * 8, ((lane / 8) % 2) * 8);
    const auto b_trans_lane = QTile::fragment_lane(lane % 8 + ((lane / 8) % 2) * 8, (lane / 16) * 8);
    const auto a_trans_lane = b_rows_lane;
    // This warp's place in the three grids.
    const int key0_1 = (warp % kWarpsKeys1) * kSlabs1 * kMmaM, query0_1 = (warp / kWarpsKeys1) * kQueryTiles1 * kMmaN;
    const int key0_2 = (warp % kWarpsKeys2) * kSlabs2 * kMmaM;
    const int col0_k = (warp / kWarpsKeys2) * kKTiles2 * kMmaN, col0_v = (warp / kWarpsKeys2) * kVTiles2 * kMmaN;
    const int query0_3 = (warp % kWarpsQueries3) * kSlabs3 * kMmaM, col0_3 = (warp / kWarpsQueries3) * kQTiles3 * kMmaN;

    float dk[kSlabs2][kKTiles2][4] = {};
    float dv[kSlabs2][kVTiles2][4] = {};

    auto step_body = [&](int step, int stage, bool masked) {
        const int head = h_first + step / m_tiles, m_tile = m_tile_of(step), m0 = m_tile * kBlockM;
        const u32 sq = q_smem + stage * kQStageBytes, sdo = do_smem + stage * kDoStageBytes;
        const u32 lse_row = lse_smem + stage * kRowStageBytes + (query0_1 + 2 * t) * sizeof(float);
        const u32 dsum_row = dsum_smem + stage * kRowStageBytes + (query0_1 + 2 * t) * sizeof(float);
        [[maybe_unused]] const float slope = kAlibi ? f.alibi_slopes[b * f.alibi_batch_stride + head] : 0.f;

        // Phase 1a. S^T = K Q^T for this warp's keys x queries, then P^T = exp2(score * log2_factor -
        // lse_log2[query]) (masked scores give 0). P^T goes to shared memory and stays in registers as 16-bit
        // pairs (half the registers of the fp32 scores, which are dead before dP^T is computed).
        u32 p16[kSlabs1][kQueryTiles1][2];
        [[maybe_unused]] u32 dcap[kSoftcap ? kSlabs1 : 1][kSoftcap ? kQueryTiles1 : 1][2];  // 1 - tanh^2, fp16 pairs
        {
            float s[kSlabs1][kQueryTiles1][4] = {};
            keys_by_queries<KTile, QTile, kHeadDim>(s, k_smem, sq, a_lane, b_rows_lane, key0_1, query0_1);
#pragma unroll
            for (int sl = 0; sl < kSlabs1; ++sl)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int key_local = key0_1 + sl * kMmaM + g + 8 * half, key = n0 + key_local;
                    const int col_base = m0 + query0_1 + 2 * t;
                    // Columns relative to this lane's first: the key is seen by queries [lo, hi) of the tile.
                    const int lo = mask.first_query(key) - col_base, hi = mask.end_query(key) - col_base;
#pragma unroll
                    for (int j = 0; j < kQueryTiles1; ++j) {
                        float pe[2];
                        [[maybe_unused]] float dc[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = j * kMmaN + e;  // + col_base
                            float x = s[sl][j][2 * half + e];
                            if constexpr (kModScores) {
                                x *= f.softmax_scale;
                                if constexpr (kSoftcap) {
                                    const float th = fast_tanh(x * inv_softcap);
                                    x = f.softcap * th;
                                    dc[e] = 1.f - th * th;
                                }
                                if constexpr (kAlibi) x -= slope * fabsf((float)(col_base + col + mask.offset - key));
                            }
                            if (masked && (col < lo || col >= hi)) x = kNegInf;
                            pe[e] = fast_exp2(fmaf(x, log2_factor, -ld_shared_in_order(lse_row + col * sizeof(float))));
                        }
                        p16[sl][j][half] = pack2<elem_t>(pe[0], pe[1]);
                        if constexpr (kSoftcap) dcap[sl][j][half] = pack2<f16_t>(dc[0], dc[1]);
                        *reinterpret_cast<u32*>(smem.p + PTile::offset(key_local, query0_1 + j * kMmaN + 2 * t)) =
                            p16[sl][j][half];
                    }
                }
        }

        // Phase 1b. dP^T = V dO^T, then dS^T = P^T o (dP^T - D) (o the softcap's derivative) to shared memory.
        {
            float dp[kSlabs1][kQueryTiles1][4] = {};
            keys_by_queries<VTile, DoTile, kHeadDimV>(dp, v_smem, sdo, a_lane, b_rows_lane, key0_1, query0_1);
#pragma unroll
            for (int sl = 0; sl < kSlabs1; ++sl)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int key_local = key0_1 + sl * kMmaM + g + 8 * half;
#pragma unroll
                    for (int j = 0; j < kQueryTiles1; ++j) {
                        float dse[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = j * kMmaN + e;
                            dse[e] = unpack_probability<elem_t>(p16[sl][j][half], e) *
                                     (dp[sl][j][2 * half + e] - ld_shared_in_order(dsum_row + col * sizeof(float)));
                            if constexpr (kSoftcap) dse[e] *= unpack_probability<f16_t>(dcap[sl][j][half], e);
                        }
                        *reinterpret_cast<u32*>(smem.ds + PTile::offset(key_local, query0_1 + j * kMmaN + 2 * t)) =
                            pack2<elem_t>(dse[0], dse[1]);
                    }
                }
        }

        // Deterministic mode: wait until the key tiles before this one have added into this dQ tile.
        const DqTurn turn(p, mask, b, head, m_tile, m0, n_block);
        __syncthreads();  // P^T and dS^T are complete

        // Phase 2. dV += P^T dO, dK += dS^T Q (the softmax scale is applied to dK once, at the end).
#pragma unroll
        for (int kk = 0; kk < kBlockM / kMmaK; ++kk) {
            u32 a[kSlabs2][4];
#pragma unroll
            for (int sl = 0; sl < kSlabs2; ++sl)
                ldmatrix_x4(a[sl], p_smem + kElemBytes * PTile::fragment_offset(a_lane, key0_2 + sl * kMmaM, kk * kMmaK));
#pragma unroll
            for (int dp = 0; dp < kVTiles2 / 2; ++dp) {
                u32 bv[4];
                ldmatrix_x4_trans(bv, sdo + kElemBytes * DoTile::fragment_offset(b_trans_lane, kk * kMmaK, col0_v + dp * 16));
#pragma unroll
                for (int sl = 0; sl < kSlabs2; ++sl) {
                    mma_16816(dv[sl][2 * dp], a[sl], bv[0], bv[1]);
                    mma_16816(dv[sl][2 * dp + 1], a[sl], bv[2], bv[3]);
                }
            }
#pragma unroll
            for (int sl = 0; sl < kSlabs2; ++sl)
                ldmatrix_x4(a[sl], ds_smem + kElemBytes * PTile::fragment_offset(a_lane, key0_2 + sl * kMmaM, kk * kMmaK));
#pragma unroll
            for (int dp = 0; dp < kKTiles2 / 2; ++dp) {
                u32 bq[4];
                ldmatrix_x4_trans(bq, sq + kElemBytes * QTile::fragment_offset(b_trans_lane, kk * kMmaK, col0_k + dp * 16));
#pragma unroll
                for (int sl = 0; sl < kSlabs2; ++sl) {
                    mma_16816(dk[sl][2 * dp], a[sl], bq[0], bq[1]);
                    mma_16816(dk[sl][2 * dp + 1], a[sl], bq[2], bq[3]);
                }
            }
        }

        // Phase 3. dQ = dS K for this warp's queries x columns, added into dq_accum.
        float* accum = p.dq_accum + (pr0.scratch_offset + (head - h_first) * p.scratch_head_stride + m0) * kHeadDim;
#pragma unroll
        for (int pass = 0; pass < kDqPasses; ++pass) {
            const int col0 = col0_3 + pass * kQTilesPerPass * kMmaN;
            float acc[kSlabs3][kQTilesPerPass][4] = {};
#pragma unroll
            for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
                u32 a[kSlabs3][4];
#pragma unroll
                for (int sl = 0; sl < kSlabs3; ++sl)
                    ldmatrix_x4_trans(a[sl], ds_smem + kElemBytes * PTile::fragment_offset(a_trans_lane, kk * kMmaK,
                                                                                          query0_3 + sl * kMmaM));
#pragma unroll
                for (int dp = 0; dp < kQTilesPerPass / 2; ++dp) {
                    u32 bk[4];
                    ldmatrix_x4_trans(bk, k_smem + kElemBytes * KTile::fragment_offset(b_trans_lane, kk * kMmaK,
                                                                                      col0 + dp * 16));
#pragma unroll
                    for (int sl = 0; sl < kSlabs3; ++sl) {
                        mma_16816(acc[sl][2 * dp], a[sl], bk[0], bk[1]);
                        mma_16816(acc[sl][2 * dp + 1], a[sl], bk[2], bk[3]);
                    }
                }
            }
#pragma unroll
            for (int sl = 0; sl < kSlabs3; ++sl)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = query0_3 + sl * kMmaM + g + 8 * half;
                    if (m0 + row >= pr0.seqlen_q) continue;
#pragma unroll
                    for (int j = 0; j < kQTilesPerPass; ++j)
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

    stage_tile<KTile>(smem.k, dk, f.softmax_scale, key0_2, col0_k);
    stage_tile<VTile>(smem.v, dv, 1.f, key0_2, col0_v);
    __syncthreads();
    store_tile<KTile, kHeadDim>(smem.k, static_cast<elem_t*>(p.dk) + row_offset(p.dk_batch_stride, p.dk_row_stride,
                                                                                p.dk_head_stride, b, pr0.k_start, h_kv),
                                p.dk_row_stride, f.head_dim, n0, pr0.seqlen_k);
    store_tile<VTile, kHeadDimV>(smem.v, static_cast<elem_t*>(p.dv) + row_offset(p.dv_batch_stride, p.dv_row_stride,
                                                                                 p.dv_head_stride, b, pr0.k_start, h_kv),
                                 p.dv_row_stride, f.head_dim_v, n0, pr0.seqlen_k);
}
