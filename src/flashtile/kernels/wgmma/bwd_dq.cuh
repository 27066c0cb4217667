// wgmma/bwd_dq.cuh — the dQ pass of the Hopper backward (attn_bwd_dq), where the main kernel leaves dQ out
// (FT_DQ_PASS; specs.py BWD_WGMMA_TILES says where). Included at the end of wgmma/bwd.cu: it shares that file's
// build constants, tiles and product helpers.
//
// Idea:     the main kernel's dQ leaves each step as 64 x head dim fp32 reductions into L2, one per (query tile,
//           key block) pair: at d256 their bandwidth, not the tensor cores, set the backward's speed. Here a block
//           owns kDqRows queries of one head instead, with Q, dO and their rows' LSE and D resident, and walks the
//           key blocks their rows see; per key block each consumer warpgroup (64 queries, independent of the other)
//           computes
//               S  = Q K^T,   dP = dO V^T                (SS: both K-major in shared memory)
//               P  = exp2(S * scale * log2e - LSE * log2e),   dS = P o (dP - D)
//               dQ += dS K                               (RS: dS straight from the accumulators, K MN-major)
//           and at the end stores softmax_scale * dQ in the dtype of q. No reductions, no scratch, and the same
//           bits on every run. It recomputes S and dP (two products of the main kernel's five), so it pays where
//           the reductions cost more than that.
//           Loads: a producer warp brings Q and dO once by the tensor memory accelerator, then K into a ring of
//           kDqKStages stages and V into kDqVStages (shared memory holds no more beside Q and dO: V, read only by
//           dP, is released before dQ's product and refilled behind it). A varlen sequence's last key block is
//           copied by the warp's cp.async, zero-filling the keys past the sequence (the copy engine would bring
//           the next sequence's, and a NaN there would reach this one's dQ through 0 * NaN). Query rows past a
//           sequence are computed with an LSE of +inf (P = 0) and never stored.
// Wastes:   a warpgroup waits for its dQ product before its next S; the other warpgroup's products fill the gap
//           (the two taking turns on the tensor cores, as rung 5's ping-pong, measured level: docs/notes.md).
static_assert(kDqPass, "the dQ pass is built where the main kernel leaves dQ to it");
static_assert(!kSplitKeys && kBlockM == kWgmmaM && kBlockN == kWgmmaM,
              "the dQ pass reads the split-columns build's tiles: 64-row Q and dO tiles, 64-key K and V tiles");

constexpr int kDqRows = kWarpgroups * kWgmmaM;  // queries per block: 64 per consumer warpgroup
constexpr int kDqKStages = FT_DQ_K_STAGES;      // } specs.py BWD_DQ_PASS_*_STAGES
constexpr int kDqVStages = FT_DQ_V_STAGES;      // }
constexpr int kDqN = 128;                         // dQ's columns per product (the widest wgmma.cuh has)
constexpr int kDqProducts = kHeadDim / kDqN;
constexpr int kDqPassAccumulators = kDqN / 2;
constexpr int kKeySteps = kBlockN / kWgmmaK;      // k16 steps of dQ += dS K
static_assert(kHeadDim % kDqN == 0, "dQ in whole products of 128 columns");

struct __align__(kSwizzleAtomBytes) DqStorage {
    elem_t q[kWarpgroups][QTile::kElems];  // a consumer's 64 rows of Q, later of its dQ
    elem_t dout[kWarpgroups][DoTile::kElems];
    elem_t k[kDqKStages][KTile::kElems];
    elem_t v[kDqVStages][VTile::kElems];
    u64 q_full;                // Q and dO have landed
    u64 k_full[kDqKStages];    // a key block's K has landed (the copy engine, or the warp's cp.async)
    u64 k_empty[kDqKStages];   // every consumer warp's dQ product has read it
    u64 v_full[kDqVStages];
    u64 v_empty[kDqVStages];   // every consumer warp's dP has read it
};

extern "C" __global__ void __launch_bounds__(kThreads, 1)
attn_bwd_dq(const __grid_constant__ BwdParams p, const __grid_constant__ Maps maps) {
    extern __shared__ __align__(kSwizzleAtomBytes) unsigned char smem_raw[];
    DqStorage& smem = checked_storage<DqStorage>(smem_raw);
    const AttnParams& f = p.fwd;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int warpgroup = uniform_warpgroup();

    // One block per kDqRows queries of one query head, heaviest first (under a causal mask the last rows see the
    // most keys).
    const int h = blockIdx.y, b = blockIdx.z, h_kv = h / f.group;
    const Problem pr = locate_bwd_problem(p, b, h);
    const int m0 = (gridDim.x - 1 - blockIdx.x) * kDqRows;
    if (m0 >= pr.seqlen_q) return;
    const Mask mask(f.window_left, f.window_right, pr.seqlen_q, pr.seqlen_k);
    const Mask::Tiles tiles = mask.key_tiles<kBlockN>(m0, min(m0 + kDqRows, pr.seqlen_q));
    const bool varlen = f.cu_seqlens_q != nullptr;

    const u32 q_smem = smem_addr(smem.q[0]), do_smem = smem_addr(smem.dout[0]);
    const u32 k_smem = smem_addr(smem.k[0]), v_smem = smem_addr(smem.v[0]);
    const u32 q_full = smem_addr(&smem.q_full);
    const u32 k_full = smem_addr(&smem.k_full[0]), k_empty = smem_addr(&smem.k_empty[0]);
    const u32 v_full = smem_addr(&smem.v_full[0]), v_empty = smem_addr(&smem.v_empty[0]);
    constexpr u32 kQTileBytes = QTile::kElems * kElemBytes, kDoTileBytes = DoTile::kElems * kElemBytes;
    constexpr u32 kKStageBytes = KTile::kElems * kElemBytes, kVStageBytes = VTile::kElems * kElemBytes;
    if (threadIdx.x == kProducerThread) {
        mbarrier_init(q_full, 1);
        for (int s = 0; s < kDqKStages; ++s) {
            mbarrier_init(k_full + s * kMbarrierBytes, 1);
            mbarrier_init(k_empty + s * kMbarrierBytes, kConsumerWarps);
        }
        for (int s = 0; s < kDqVStages; ++s) {
            mbarrier_init(v_full + s * kMbarrierBytes, 1);
            mbarrier_init(v_empty + s * kMbarrierBytes, kConsumerWarps);
        }
        mbarrier_init_fence();
    }
    __syncthreads();  // the only block-wide barrier

    if (warpgroup == 0) {
        // Producer: Q and dO of the block's rows (rows past the tensor read as zeros; a varlen sequence's next rows
        // only ever reach rows that are not stored), then each key block's K and V as soon as their slots are free.
        setmaxnreg_dec<kProducerRegisters>();
        if (warp != 0) return;
        const int map_batch = varlen ? 0 : b;
        if (lane == 0) {
            mbarrier_arrive_expect_bytes(q_full, kWarpgroups * (kQTileBytes + kDoTileBytes));
#pragma unroll
            for (int c = 0; c < kWarpgroups; ++c)
#pragma unroll
                for (int blk = 0; blk < kHeadDim / kSwizzleRowElems; ++blk) {
                    const int row = (int)pr.q_start + m0 + c * kWgmmaM;
                    tma_load_4d(q_smem + c * kQTileBytes + blk * kColumnBlockBytes<QTile>, maps.q,
                                blk * kSwizzleRowElems, row, h, map_batch, q_full);
                    tma_load_4d(do_smem + c * kDoTileBytes + blk * kColumnBlockBytes<DoTile>, maps.dout,
                                blk * kSwizzleRowElems, row, h, map_batch, q_full);
                }
        }
        // One key block's K or V into a slot: by the copy engine, or (a varlen sequence's last block) by the warp.
        auto load = [&](u32 slot, const TensorMap& map, const elem_t* rows, i64 row_stride, int dim, u32 bytes,
                        u32 full_bar, int n0, auto tile) {
            using Tile = decltype(tile);
            if (varlen && n0 + kBlockN > pr.seqlen_k) {
                copy_rows<Tile>(slot, rows, row_stride, dim, pr.seqlen_k - n0, n0, lane);
                cp_async_wait_all();
                fence_proxy_async();
                __syncwarp();
                if (lane == 0) mbarrier_arrive(full_bar);
            } else if (lane == 0) {
                mbarrier_arrive_expect_bytes(full_bar, bytes);
#pragma unroll
                for (int blk = 0; blk < kHeadDim / kSwizzleRowElems; ++blk)
                    tma_load_4d(slot + blk * kColumnBlockBytes<Tile>, map, blk * kSwizzleRowElems,
                                (int)pr.k_start + n0, h_kv, map_batch, full_bar);
            }
        };
        for (int it = 0; it < tiles.count; ++it) {
            const int n0 = tiles.begin + it * kBlockN;
            const int ks = it % kDqKStages, vs = it % kDqVStages;
            if (it >= kDqKStages) mbarrier_wait(k_empty + ks * kMbarrierBytes, (it / kDqKStages - 1) & 1);
            load(k_smem + ks * kKStageBytes, maps.k, static_cast<const elem_t*>(f.k) + pr.k_offset, f.k_row_stride,
                 f.head_dim, kKStageBytes, k_full + ks * kMbarrierBytes, n0, KTile{});
            if (it >= kDqVStages) mbarrier_wait(v_empty + vs * kMbarrierBytes, (it / kDqVStages - 1) & 1);
            load(v_smem + vs * kVStageBytes, maps.v, static_cast<const elem_t*>(f.v) + pr.v_offset, f.v_row_stride,
                 f.head_dim_v, kVStageBytes, v_full + vs * kMbarrierBytes, n0, VTile{});
        }
        return;
    }

    // Consumers: warpgroup c owns query rows [m0 + 64 (c - 1), m0 + 64 c).
    setmaxnreg_inc<kConsumerRegisters>();
    const int c = warpgroup - 1;
    const int g = lane / kQuad, t = lane % kQuad, warp_in_group = warp % kWarpgroupWarps;
    const int row0 = m0 + c * kWgmmaM, row1 = min(row0 + kWgmmaM, pr.seqlen_q);
    const float log2_factor = f.scale_log2;

    // This thread's two rows' LSE (base 2) and D; a row past the sequence takes an LSE of +inf, so its P is 0.
    float lse_log2[2], dsum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = row0 + warp_in_group * kMmaM + g + 8 * half;
        const bool valid = row < pr.seqlen_q;
        lse_log2[half] = valid ? p.lse_log2[pr.scratch_offset + row] : -kNegInf;
        dsum[half] = valid ? p.dsum[pr.scratch_offset + row] : 0.f;
    }

    // The warpgroup's own key blocks [lo, hi) of the block's: under a causal mask its first rows see fewer keys.
    // It hands the others' slots back once they have landed (an early release would count toward the slot's
    // previous round).
    const Mask::Tiles own = row0 < row1 ? mask.key_tiles<kBlockN>(row0, row1) : Mask::Tiles{0, 0};
    const int lo = own.count > 0 ? (own.begin - tiles.begin) / kBlockN : tiles.count;
    const int hi = own.count > 0 ? lo + own.count : tiles.count;
    auto k_bar = [&](u32 bars, int it) { return bars + it % kDqKStages * kMbarrierBytes; };
    auto v_bar = [&](u32 bars, int it) { return bars + it % kDqVStages * kMbarrierBytes; };
    auto wait_k = [&](int it) { mbarrier_wait(k_bar(k_full, it), (it / kDqKStages) & 1); };
    auto wait_v = [&](int it) { mbarrier_wait(v_bar(v_full, it), (it / kDqVStages) & 1); };
    auto release_k = [&](int it) {
        __syncwarp();
        if (lane == 0) mbarrier_arrive(k_bar(k_empty, it));
    };
    auto release_v = [&](int it) {
        __syncwarp();
        if (lane == 0) mbarrier_arrive(v_bar(v_empty, it));
    };

    mbarrier_wait(q_full, 0);
    float dq[kDqProducts][kDqPassAccumulators] = {};
    for (int it = 0; it < tiles.count; ++it) {
        if (it < lo || it >= hi) {
            wait_k(it);
            release_k(it);
            wait_v(it);
            release_v(it);
            continue;
        }
        const int n0 = tiles.begin + it * kBlockN;
        const u32 k_tile = k_smem + it % kDqKStages * kKStageBytes, v_tile = v_smem + it % kDqVStages * kVStageBytes;
        // The warpgroup's Q and dO tiles, worked out here from an index the compiler cannot see through: hoisted out
        // of the loop, their products' 32 descriptors spill.
        const u32 q_tile = q_smem + opaque(c) * kQTileBytes, do_tile = do_smem + opaque(c) * kDoTileBytes;
        // S and dP, two commit groups: P's exponentials run while dP is still on the tensor cores.
        float s[kScoreAccumulators], dp[kScoreAccumulators];
        wait_k(it);
        fence_operands(s);
        fence_operands(dp);
        wgmma_fence();
        keys_by_queries<QTile, KTile>(s, q_tile, k_tile);
        wgmma_commit();
        wait_v(it);
        wgmma_fence();  // (after the wait's loop, as ptxas would insert it)
        keys_by_queries<DoTile, VTile>(dp, do_tile, v_tile);
        wgmma_commit();
        wgmma_wait<1>();
        fence_operands(s);
        const bool masked = !mask.tile_unmasked(row0, row1, n0, n0 + kBlockN);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + warp_in_group * kMmaM + g + 8 * half;
            const int col0 = n0 + 2 * t;  // columns relative to this lane's first: the row sees keys [lo, hi)
            const int first = mask.first_key(row) - col0, end = mask.end_key(row) - col0;
#pragma unroll
            for (int j = 0; j < kBlockN / kMmaN; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[4 * j + 2 * half + e];
                    const int col = j * kMmaN + e;
                    if (masked && (col < first || col >= end)) x = kNegInf;
                    x = fast_exp2(fmaf(x, log2_factor, -lse_log2[half]));
                }
        }
        u32 p16[kKeySteps][4], ds16[kKeySteps][4];
        to_fragments(p16, s);
        wgmma_wait<0>();
        fence_operands(dp);
        release_v(it);
        // dS = P o (dP - D), from the 16-bit P (as the main kernel's dS, so both passes see the same dS).
#pragma unroll
        for (int j = 0; j < kBlockN / kMmaN; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float prob = unpack_probability<elem_t>(p16[j / 2][2 * (j % 2) + i / 2], i % 2);
                dp[4 * j + i] = prob * (dp[4 * j + i] - dsum[i / 2]);
            }
        to_fragments(ds16, dp);
#pragma unroll
        for (int n = 0; n < kDqProducts; ++n) fence_operands(dq[n]);
        wgmma_fence();
        add_products_rs(dq, ds16, k_tile, kColumnBlockBytes<KTile>);  // dQ += dS K
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int n = 0; n < kDqProducts; ++n) fence_operands(dq[n]);
        release_k(it);
    }

    // Epilogue: each warp stages its 16 rows of softmax_scale * dQ over its rows of Q (every product that read Q
    // has landed) and stores them, 16 bytes a lane, rows past the sequence and columns past the head dim left out.
    elem_t* const dq_rows = smem.q[c];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int local_row = warp_in_group * kMmaM + g + 8 * half;
#pragma unroll
        for (int n = 0; n < kDqProducts; ++n)
#pragma unroll
            for (int j = 0; j < kDqN / kMmaN; ++j)
                *reinterpret_cast<u32*>(dq_rows + QTile::offset(local_row, n * kDqN + j * kMmaN + 2 * t)) =
                    pack2<elem_t>(dq[n][4 * j + 2 * half] * f.softmax_scale,
                                  dq[n][4 * j + 2 * half + 1] * f.softmax_scale);
    }
    __syncwarp();
    elem_t* const out = static_cast<elem_t*>(p.dq) +
                        row_offset(p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b, pr.q_start, h);
    constexpr int kVecsPerRow = kHeadDim / kElemsPerVector;
#pragma unroll 4
    for (int idx = lane; idx < kMmaM * kVecsPerRow; idx += kWarpSize) {
        const int local_row = warp_in_group * kMmaM + idx / kVecsPerRow, col = idx % kVecsPerRow * kElemsPerVector;
        const int row = row0 + local_row;
        if (row < pr.seqlen_q && col < f.head_dim)
            *reinterpret_cast<uint4*>(out + (i64)row * p.dq_row_stride + col) =
                *reinterpret_cast<const uint4*>(dq_rows + QTile::offset(local_row, col));
    }
}
