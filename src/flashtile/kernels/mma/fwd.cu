// mma/fwd.cu — rung 4 "pipelined": the production forward on Ampere, Ada and Hopper (mma.sync).
//
// Idea:     rung 3's tensor-core algorithm, with the memory system kept busy and the arithmetic lean:
//           * K/V tiles stream through a ring of FT_STAGES shared-memory buffers with cp.async: while the
//             tensor cores work on tile i, tiles i+1 .. i+STAGES-1 are already in flight (one barrier/tile);
//             with FT_STAGES 1, K and V take turns in one buffer each (half the memory, two barriers/tile);
//             on Hopper (FT_TMA_KV) one thread feeds the ring through the tensor memory accelerator instead
//             (common/tma.cuh): 8 copies per tile where every thread issued 16 cp.async. The loop paid for
//             issuing those copies, not for waiting on their data, so handing them to the copy engine is
//             what frees it (docs/notes.md has the ablations);
//           * shared memory is XOR-swizzled (common/tile.cuh) instead of padded: no bank conflicts, no waste;
//           * each warp owns 16 * kSlabs rows, so every K/V fragment read from shared memory feeds kSlabs mmas;
//           * the softmax runs in base 2 with the scale folded in: p = exp2(s * scale * log2(e) - m'), one
//             FFMA and one MUFU.EX2 per score; O is rescaled only when a row's maximum grows by more than 2^8;
//           * 32-bit shared addresses and per-lane offsets computed once: the loop is HMMA, LDSM and the
//             softmax, with little address arithmetic or rescaling left between them (counts: docs/notes.md);
//           * masks are evaluated only on tiles that cut the mask boundary; tiles nobody sees are skipped;
//           * the output tile is staged in shared memory so it leaves in coalesced 16-byte stores.
//           Features: GQA/MQA, causal and sliding window (bottom-right aligned), softcap and ALiBi (compile-
//           time switches, so the plain path pays nothing for them), varlen, head_dim != head_dim_v, any strides.
// Removes:  rung 3's synchronous loads (memory and math now overlap), its bank-conflict padding and its
//           per-element mask tests on interior tiles.
// Measured: 2.1x rung 3 at b=4 h=16 n=4096 d=64 bf16 on the H200 (2026-11-29); against torch's
//           FlashAttention-2: docs/performance.md.
// Wastes:   on Hopper, mma.sync falls well short of the tensor cores' wgmma rate, and a warp cannot
//           overlap its softmax with its own matrix products — the Hopper rung's job.
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/tile.cuh"
#include "../common/tma.cuh"

constexpr int kHeadDim = FT_HEAD_DIM;      // padded q/k head dim of this build
constexpr int kHeadDimV = FT_HEAD_DIM_V;   // padded v head dim
constexpr int kBlockM = FT_BLOCK_M;        // query rows per block   } specs.py FWD_TILES says why
constexpr int kBlockN = FT_BLOCK_N;        // keys per tile          } for each head dim and arch
constexpr int kWarps = FT_WARPS;
constexpr int kStages = FT_STAGES;         // K/V buffers in the cp.async ring; 1: one K and one V buffer
constexpr int kMinBlocksPerSM = FT_MIN_BLOCKS;
constexpr bool kSoftcap = FT_SOFTCAP;
constexpr bool kAlibi = FT_ALIBI;
constexpr bool kWide = FT_WIDE_BLOCKS;     // 128-byte swizzle blocks (common/tile.cuh)
constexpr bool kTmaKv = FT_TMA_KV;         // K/V ring fed by the tensor memory accelerator (sm_90)
#ifndef FT_DECODE
#define FT_DECODE 0
#endif
// Decode builds (flashtile/decode.py): a block's rows are one kv head's query heads, and its warps share each tile's
// keys (kKeyWarps below); each sequence's keys may be split into parts (p.num_splits) whose normalised outputs and
// LSEs go to fp32 scratch for attn_combine below; p.seqused_k counts each sequence's keys; on Hopper K/V may live
// in pages (p.block_table).
constexpr bool kDecode = FT_DECODE;
#ifndef FT_KV_GROUP_ROWS
#define FT_KV_GROUP_ROWS FT_BLOCK_N
#endif
// Decode builds for small pages: K/V tiles stored in groups of this many rows (common/tile.cuh's row groups), so a
// page's rows by the whole head dim land as one box of a 5-D map instead of one box per 64-byte column block: a
// tile in pages of 16 rows takes 16 copies instead of 64. FT_BLOCK_N (no groups) otherwise.
constexpr int kKvGroupRows = FT_KV_GROUP_ROWS;
constexpr bool kRowGroups = kKvGroupRows < kBlockN;

// Decode builds share each tile's keys among the warps instead of its rows: a block's rows are one GQA group (a
// few rows in one 16-row slab), so sharing rows would have every warp read all of K and V from shared memory and
// multiply rows that are not there. Each warp keeps its own softmax state; the states merge at the end.
constexpr int kKeyWarps = kDecode ? kWarps : 1;      // warps that share each tile's keys
constexpr int kRowWarps = kWarps / kKeyWarps;        // warps that share the block's rows
constexpr int kWarpKeys = kBlockN / kKeyWarps;       // keys of a tile per warp

constexpr int kThreads = kWarps * kWarpSize;
constexpr int kSlabs = kBlockM / (kRowWarps * kMmaM);  // 16-row slabs per warp
constexpr int kWarpRows = kSlabs * kMmaM;
constexpr int kScoreTiles = kWarpKeys / kMmaN;         // n8 score tiles per slab
constexpr int kOutTiles = kHeadDimV / kMmaN;           // n8 output tiles per slab
static_assert(kSlabs >= 1 && kBlockM == kRowWarps * kWarpRows, "BLOCK_M must be a multiple of 16 * row warps");
static_assert(kWarpKeys % kMmaK == 0, "a warp's keys must be a multiple of 16");
static_assert(!kRowGroups || (kDecode && kTmaKv && kWarpKeys % kKvGroupRows == 0),
              "row groups are for decode builds fed by TMA, and a warp's keys start a group");
static_assert(kStages >= 1, "K and V need a buffer each");
// With one buffer each, K and V take turns (FlashAttention-2's schedule): V of tile i loads while Q K_i^T runs,
// K of tile i+1 while the softmax and P V_i run. Half the shared memory of a two-stage ring, for two blocks per
// SM where the ring would allow one (d256: 96 KB instead of 160 KB at 64 x 64); two barriers per tile.
constexpr bool kTakeTurns = kStages == 1;
constexpr int kRingInFlight = kTakeTurns ? 0 : kStages - 2;  // tiles a ring step leaves in flight while waiting
static_assert(!kTmaKv || (!kTakeTurns && !kWide), "TMA feeds the ring, in 64-byte swizzle blocks");

using QTile = SwizzledTile<kBlockM, kHeadDim, kWide>;
using OTile = SwizzledTile<kBlockM, kHeadDimV, kWide>;
using KTile = SwizzledTile<kBlockN, kHeadDim, kWide, kKvGroupRows>;
using VTile = SwizzledTile<kBlockN, kHeadDimV, kWide, kKvGroupRows>;

struct SharedStorage {
    elem_t q[QTile::kElems > OTile::kElems ? QTile::kElems : OTile::kElems];  // Q, later the output tile
    elem_t k[kStages][KTile::kElems];
    elem_t v[kStages][VTile::kElems];
    unsigned long long kv_full[kStages];  // TMA: stage s's mbarrier, complete when its tile has landed
};

template <bool B> struct Bool { static constexpr bool value = B; };

// The running maximum a row's probabilities are measured against moves only when a new score exceeds it by
// more than this (in log2 units): until then p = exp2(s - m_ref) <= 2^8, harmless in fp32 sums and in the
// 16-bit P, and the 4 * kOutTiles multiplies that rescale O are skipped — after the first few tiles, almost
// always. The result is the same softmax, measured from a different reference point.
constexpr float kRescaleThreshold = 8.f;
constexpr u32 kElemBytes = sizeof(elem_t);

// Zeros in rows [first, kBlockN) of a V stage (decode builds, the tile that ends a sequence's keys). The stage is
// refilled by the copy engine later: the fence orders these ordinary stores before its writes.
__device__ __forceinline__ void zero_rows_from(elem_t* tile, int first) {
    constexpr int kVecsPerRow = kHeadDimV / kChunkElems;
    for (int idx = max(first, 0) * kVecsPerRow + threadIdx.x; idx < kBlockN * kVecsPerRow; idx += kThreads)
        *reinterpret_cast<uint4*>(tile + VTile::offset(idx / kVecsPerRow, (idx % kVecsPerRow) * kChunkElems)) =
            make_uint4(0, 0, 0, 0);
    fence_proxy_async();
}

// Decode builds: the key warps' softmax states merge into warp 0's registers through shared memory (`scratch`,
// the K/V stages, adjacent in SharedStorage and free once the last tile has been read). Each warp measures its
// exponentials from its own reference maximum; the block's is the largest, and a warp's sums and O scale by
// 2^(its reference - the block's).
// A warp that saw no key (reference -inf) adds nothing; a NaN reference makes the row's factor, so its O, NaN.
constexpr int kMergeLaneValues = kSlabs * 2;                // a lane's rows: the maxima and sums it keeps
constexpr int kMergeOutValues = kSlabs * kOutTiles * 4;     // a lane's O accumulators
constexpr int kMergeFloats = (kKeyWarps * 2 * kMergeLaneValues + (kKeyWarps - 1) * kMergeOutValues) * kWarpSize;

__device__ __forceinline__ void merge_key_warps(float* scratch, float (&o)[kSlabs][kOutTiles][4],
                                                float (&row_max)[kSlabs][2], float (&row_sum)[kSlabs][2],
                                                float log2_factor, int warp, int lane) {
    float* maxima = scratch;                                             // [warp][value][lane]
    float* sums = maxima + kKeyWarps * kMergeLaneValues * kWarpSize;     // [warp][value][lane]
    float* outs = sums + kKeyWarps * kMergeLaneValues * kWarpSize;       // [warp - 1][value][lane]
    auto at = [&](float* base, int w, int value, int values) { return base + (w * values + value) * kWarpSize + lane; };
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int half = 0; half < 2; ++half) *at(maxima, warp, 2 * sl + half, kMergeLaneValues) = row_max[sl][half];
    __syncthreads();
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float m = kNegInf;
#pragma unroll
            for (int w = 0; w < kKeyWarps; ++w) m = fmaxf(m, *at(maxima, w, 2 * sl + half, kMergeLaneValues));
            const float mine = row_max[sl][half];
            const float factor = mine == kNegInf ? 0.f : fast_exp2((mine - m) * log2_factor);
            row_max[sl][half] = m;
            row_sum[sl][half] *= factor;
#pragma unroll
            for (int j = 0; j < kOutTiles; ++j) {
                o[sl][j][2 * half] *= factor;
                o[sl][j][2 * half + 1] *= factor;
            }
            if (warp != 0) *at(sums, warp, 2 * sl + half, kMergeLaneValues) = row_sum[sl][half];
        }
    if (warp != 0) {
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
            for (int j = 0; j < kOutTiles; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) *at(outs, warp - 1, (sl * kOutTiles + j) * 4 + e, kMergeOutValues) = o[sl][j][e];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int w = 1; w < kKeyWarps; ++w)
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
#pragma unroll
            for (int half = 0; half < 2; ++half) row_sum[sl][half] += *at(sums, w, 2 * sl + half, kMergeLaneValues);
#pragma unroll
            for (int j = 0; j < kOutTiles; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[sl][j][e] += *at(outs, w - 1, (sl * kOutTiles + j) * 4 + e, kMergeOutValues);
        }
}

// A split part's epilogue (decode builds): each row's normalised output and log-sum-exp, in fp32, at
// (split, b, h, row) of p.o_accum / p.lse_accum. `row0` is the lane's first row (the slab's row g).
__device__ __forceinline__ void store_part(const AttnParams& p, const float (&o)[kSlabs][kOutTiles][4],
                                           const float (&row_max)[kSlabs][2], const float (&row_sum)[kSlabs][2],
                                           float log2_factor, int split, int b, int h, int row0, int seqlen_q,
                                           int t) {
    const i64 part_rows = (((i64)split * p.batch + b) * p.heads_q + h) * p.seqlen_q;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + sl * kMmaM + 8 * half;
            const float l = quad_sum(row_sum[sl][half]);
            const float inv_l = saw_keys(l) ? 1.f / l : 0.f;
            if (row >= seqlen_q) continue;
            float* out = p.o_accum + (part_rows + row) * p.head_dim_v;
#pragma unroll
            for (int j = 0; j < kOutTiles; ++j) {
                const int col = j * kMmaN + 2 * t;
                if (col < p.head_dim_v)
                    *reinterpret_cast<float2*>(out + col) =
                        make_float2(o[sl][j][2 * half] * inv_l, o[sl][j][2 * half + 1] * inv_l);
            }
            if (t == 0)
                p.lse_accum[part_rows + row] =
                    saw_keys(l) ? (row_max[sl][half] * log2_factor + __log2f(l)) / kLog2e : kNegInf;
        }
}

extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
attn_fwd(const __grid_constant__ AttnParams p, const __grid_constant__ KvMaps maps) {
    extern __shared__ __align__(kSwizzle64Period) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    if (dynamic_smem_bytes() < sizeof(SharedStorage)) __trap();
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int g = lane / kQuad, t = lane % kQuad;

    // Heaviest blocks first: under a causal mask the last query block sees the most keys. Decode builds: the
    // grid's x holds (query block, part of the keys) pairs.
    int m_block = gridDim.x - 1 - blockIdx.x, split = 0;
    if constexpr (kDecode) {
        const int m_blocks = gridDim.x / p.num_splits;
        split = blockIdx.x / m_blocks;
        m_block = m_blocks - 1 - blockIdx.x % m_blocks;
    }
    const int h = blockIdx.y, b = blockIdx.z;
    const Problem pr = [&] {
        Problem located = locate_problem(p, b, h);
        if constexpr (kDecode) {
            if (p.seqused_k != nullptr) located.seqlen_k = max(0, min(p.seqused_k[b], located.seqlen_k));
        }
        return located;
    }();
    const int m0 = m_block * kBlockM;
    if (m0 >= pr.seqlen_q) return;
    const int m1 = min(m0 + kBlockM, pr.seqlen_q);
    const Mask mask(p.window_left, p.window_right, pr.seqlen_q, pr.seqlen_k);
    const Mask::Tiles tiles = [&] {
        Mask::Tiles visited = mask.key_tiles<kBlockN>(m0, m1);
        if constexpr (kDecode) {  // this block's part: an equal share of the key tiles, possibly none
            const int share = (visited.count + p.num_splits - 1) / p.num_splits;
            visited.begin += split * share * kBlockN;
            visited.count = max(0, min(share, visited.count - split * share));
        }
        return visited;
    }();
    const int n_begin = tiles.begin, n_tiles = tiles.count;

    // 32-bit shared-memory addresses of the tiles (ldmatrix and cp.async take these directly).
    const u32 q_smem = smem_addr(smem.q);
    const u32 k_smem = smem_addr(smem.k[0]), v_smem = smem_addr(smem.v[0]);
    constexpr u32 kKStageBytes = KTile::kElems * kElemBytes, kVStageBytes = VTile::kElems * kElemBytes;

    const TileLoader<kBlockN, kHeadDim, kThreads, kWide> k_loader(
        static_cast<const elem_t*>(p.k) + pr.k_offset, p.k_row_stride, p.head_dim);
    const TileLoader<kBlockN, kHeadDimV, kThreads, kWide> v_loader(
        static_cast<const elem_t*>(p.v) + pr.v_offset, p.v_row_stride, p.head_dim_v);
    // TMA: one mbarrier per stage, and the maps' coordinates of this block's K/V rows. The maps see K and V as
    // (head dim, rows, kv heads, batch); varlen packs every sequence along the rows of batch 0. A tile's rows
    // past the sequence read zeros (past the tensor) or the next sequence's keys: the mask hides both.
    const u32 kv_full = smem_addr(smem.kv_full);
    const int map_row0 = (int)pr.k_start, map_head = h / p.group, map_batch = p.cu_seqlens_k != nullptr ? 0 : b;
    // Paged K/V (decode builds on Hopper): the maps see the pages as (head dim, page rows, kv heads, pages) with
    // boxes of `page_rows` rows, the largest power of two dividing the page size, at most a tile; with row groups,
    // as (64-byte column, page rows, column block, kv heads, pages) with boxes of a group's rows by every column
    // block. Warp 0 loads a tile, lane i its rows [i * page_rows, (i + 1) * page_rows); each lane reads its page
    // index one load ahead (tiles load in order), so the block table's latency stays off the loop. Boxes past the
    // sequence start at row page_size of its first page, out of the map, so they arrive as zeros. Guarded by the
    // preprocessor: left to dead-code elimination, this state made ptxas spill in rung 4's d128 Hopper build.
#if FT_DECODE
    const int page_rows = kRowGroups ? kKvGroupRows : min(p.page_size & -p.page_size, kBlockN);
    const int* pages = p.block_table + b * p.block_table_batch_stride;
    const bool box_lane = warp == 0 && lane * page_rows < kBlockN;
    auto page_index = [&](int key) { return pages[key < pr.seqlen_k ? key / p.page_size : 0]; };
    int next_page = p.block_table != nullptr && box_lane ? page_index(n_begin + lane * page_rows) : 0;
    auto load_paged_kv = [&](int n0, int stage, u32 bar) {
        if (!box_lane) return;
        const int page = next_page, key = n0 + lane * page_rows;
        next_page = page_index(key + kBlockN);
        const int row = key < pr.seqlen_k ? key % p.page_size : p.page_size;
        const u32 k_dst = k_smem + stage * kKStageBytes + KTile::row_start(lane * page_rows, 0) * kElemBytes;
        const u32 v_dst = v_smem + stage * kVStageBytes + VTile::row_start(lane * page_rows, 0) * kElemBytes;
        if constexpr (kRowGroups) {
            tma_load_5d(k_dst, maps.k, 0, row, 0, map_head, page, bar);
            tma_load_5d(v_dst, maps.v, 0, row, 0, map_head, page, bar);
            return;
        }
#pragma unroll
        for (int blk = 0; blk < kHeadDim / KTile::kBlockCols; ++blk)
            tma_load_4d(k_dst + blk * kBlockN * KTile::kBlockCols * kElemBytes, maps.k, blk * KTile::kBlockCols, row,
                        map_head, page, bar);
#pragma unroll
        for (int blk = 0; blk < kHeadDimV / VTile::kBlockCols; ++blk)
            tma_load_4d(v_dst + blk * kBlockN * VTile::kBlockCols * kElemBytes, maps.v, blk * VTile::kBlockCols, row,
                        map_head, page, bar);
    };
#endif
    if constexpr (kDecode && !kTmaKv) {
        if (p.block_table != nullptr) __trap();  // paged K/V is read through tensor maps only
    }
    if constexpr (kRowGroups) {
        if (p.block_table == nullptr) __trap();  // row-group builds read pages only
    }
    if constexpr (kTmaKv) {
        if (threadIdx.x == 0) {
            for (int s = 0; s < kStages; ++s) mbarrier_init(kv_full + s * kMbarrierBytes, 1);
            mbarrier_init_fence();
        }
        __syncthreads();
    }
    auto load_kv = [&](int tile, int stage) {
        const int n0 = n_begin + tile * kBlockN;
        if constexpr (kTmaKv) {
#if FT_DECODE
            if (p.block_table != nullptr) {
                const u32 bar = kv_full + stage * kMbarrierBytes;
                if (threadIdx.x == 0) mbarrier_arrive_expect_bytes(bar, kKStageBytes + kVStageBytes);
                load_paged_kv(n0, stage, bar);
                return;
            }
#endif
            if (threadIdx.x != 0) return;
            const u32 bar = kv_full + stage * kMbarrierBytes;
            mbarrier_arrive_expect_bytes(bar, kKStageBytes + kVStageBytes);
#pragma unroll
            for (int blk = 0; blk < kHeadDim / KTile::kBlockCols; ++blk)
                tma_load_4d(k_smem + stage * kKStageBytes + blk * KTile::kBlockElems * kElemBytes, maps.k,
                            blk * KTile::kBlockCols, map_row0 + n0, map_head, map_batch, bar);
#pragma unroll
            for (int blk = 0; blk < kHeadDimV / VTile::kBlockCols; ++blk)
                tma_load_4d(v_smem + stage * kVStageBytes + blk * VTile::kBlockElems * kElemBytes, maps.v,
                            blk * VTile::kBlockCols, map_row0 + n0, map_head, map_batch, bar);
        } else {
            k_loader.issue(k_smem + stage * kKStageBytes, n0, pr.seqlen_k);
            v_loader.issue(v_smem + stage * kVStageBytes, n0, pr.seqlen_k);
        }
    };

    // Prologue: Q, then the first STAGES-1 K/V tiles, one commit group each (empty groups keep the count);
    // taking turns, Q and the first K.
    TileLoader<kBlockM, kHeadDim, kThreads, kWide>(static_cast<const elem_t*>(p.q) + pr.q_offset, p.q_row_stride,
                                            p.head_dim).issue(q_smem, m0, pr.seqlen_q);
    cp_async_commit();
    if constexpr (kTakeTurns) {
        if (n_tiles > 0) k_loader.issue(k_smem, n_begin, pr.seqlen_k);
        cp_async_commit();
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_tiles) load_kv(s, s);
        cp_async_commit();
    }

    // Scores enter the softmax as s * log2_factor (base 2). With softcap/ALiBi they are first turned into
    // natural units (scale applied), otherwise the scale rides along in the factor for free.
    constexpr bool kModScores = kSoftcap || kAlibi;
    const float log2_factor = kModScores ? kLog2e : p.scale_log2;
    const float slope = kAlibi ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f;
    const float inv_softcap = kSoftcap ? 1.f / p.softcap : 0.f;
    const int warp_row0 = kKeyWarps > 1 ? 0 : warp * kWarpRows;  // first row of this warp within the tile
    const int warp_key0 = kKeyWarps > 1 ? warp * kWarpKeys : 0;  // first key of this warp within each tile
    // The byte offsets of this warp's keys in the K and V tiles (a multiple of 8 rows: the swizzle is unmoved).
    const u32 k_warp = KTile::row_start(warp_key0, 0) * kElemBytes, v_warp = VTile::row_start(warp_key0, 0) * kElemBytes;
    // Per-lane ldmatrix addresses (tile.cuh): Q as the A operand, K as B, V as B transposed.
    const auto q_lane = QTile::fragment_lane(lane % 16, (lane / 16) * 8);
    const auto k_lane = KTile::fragment_lane(lane % 8 + (lane / 16) * 8, ((lane / 8) % 2) * 8);
    const auto v_lane = VTile::fragment_lane(lane % 8 + ((lane / 8) % 2) * 8, (lane / 16) * 8);

    float o[kSlabs][kOutTiles][4] = {};
    float row_max[kSlabs][2], row_sum[kSlabs][2];  // row_max: the reference point of this row's exponentials
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int half = 0; half < 2; ++half) { row_max[sl][half] = kNegInf; row_sum[sl][half] = 0.f; }

    // `scores_done` runs between Q K^T and the softmax (taking turns: wait for V, then start the next K).
    auto attend = [&](u32 sk, u32 sv, int n0, auto masked, auto scores_done) {
        // S = Q K^T for this warp's rows and keys: kSlabs x 16 rows by kWarpKeys keys.
        float s[kSlabs][kScoreTiles][4] = {};
#pragma unroll
        for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
            u32 a[kSlabs][4];
#pragma unroll
            for (int sl = 0; sl < kSlabs; ++sl)
                ldmatrix_x4(a[sl], q_smem + kElemBytes * QTile::fragment_offset(q_lane, warp_row0 + sl * kMmaM, kk * kMmaK));
#pragma unroll
            for (int np = 0; np < kScoreTiles / 2; ++np) {
                u32 bk[4];
                ldmatrix_x4(bk, sk + k_warp + kElemBytes * KTile::fragment_offset(k_lane, np * 16, kk * kMmaK));
#pragma unroll
                for (int sl = 0; sl < kSlabs; ++sl) {
                    mma_16816(s[sl][2 * np], a[sl], bk[0], bk[1]);
                    mma_16816(s[sl][2 * np + 1], a[sl], bk[2], bk[3]);
                }
            }
        }

        scores_done();

        // Score modifications and the mask (boundary tiles only), then each row's tile maximum.
        float tile_max[kSlabs][2];
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = m0 + warp_row0 + sl * kMmaM + g + 8 * half;
                // Columns relative to this lane's first: the row sees keys [lo, hi) of the tile.
                const int col0 = n0 + warp_key0 + 2 * t;
                const int lo = mask.first_key(row) - col0, hi = mask.end_key(row) - col0;
                float mx = kNegInf;
#pragma unroll
                for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& x = s[sl][j][2 * half + e];
                        const int col = j * kMmaN + e;  // + col0
                        if constexpr (kModScores) {
                            x *= p.softmax_scale;
                            if constexpr (kSoftcap) x = p.softcap * fast_tanh(x * inv_softcap);
                            if constexpr (kAlibi) x -= slope * fabsf((float)(row + mask.offset - col0 - col));
                        }
                        if constexpr (decltype(masked)::value) {
                            if (col < lo || col >= hi) x = kNegInf;
                        }
                        mx = fmaxf(mx, x);
                    }
                tile_max[sl][half] = quad_max(mx);
            }

        // Move a row's reference maximum only when it is exceeded by more than the threshold; the warp
        // rescales its accumulators only when one of its rows moved (a uniform branch).
        bool moved = false;
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                moved |= (tile_max[sl][half] - row_max[sl][half]) * log2_factor > kRescaleThreshold;
        if (__any_sync(kFullWarpMask, moved)) {
#pragma unroll
            for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float m_new = fmaxf(row_max[sl][half], tile_max[sl][half]);
                    const float correction = m_new == kNegInf ? 1.f : fast_exp2((row_max[sl][half] - m_new) * log2_factor);
                    row_max[sl][half] = m_new;
                    row_sum[sl][half] *= correction;
#pragma unroll
                    for (int j = 0; j < kOutTiles; ++j) {
                        o[sl][j][2 * half] *= correction;
                        o[sl][j][2 * half + 1] *= correction;
                    }
                }
        }

        // P = exp2(s * factor - m_ref * factor): one FFMA and one MUFU.EX2 per score.
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float shift = row_max[sl][half] == kNegInf ? 0.f : row_max[sl][half] * log2_factor;
                float tile_sum = 0.f;
#pragma unroll
                for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& x = s[sl][j][2 * half + e];
                        x = fast_exp2(x * log2_factor - shift);
                        tile_sum += x;
                    }
                row_sum[sl][half] += tile_sum;
            }

        // O += P V, P straight from the score registers.
#pragma unroll
        for (int kk = 0; kk < kWarpKeys / kMmaK; ++kk) {
            u32 a[kSlabs][4];
#pragma unroll
            for (int sl = 0; sl < kSlabs; ++sl) accumulators_to_a(a[sl], s[sl][2 * kk], s[sl][2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < kOutTiles / 2; ++dp) {
                u32 bv[4];
                ldmatrix_x4_trans(bv, sv + v_warp + kElemBytes * VTile::fragment_offset(v_lane, kk * kMmaK, dp * 16));
#pragma unroll
                for (int sl = 0; sl < kSlabs; ++sl) {
                    mma_16816(o[sl][2 * dp], a[sl], bv[0], bv[1]);
                    mma_16816(o[sl][2 * dp + 1], a[sl], bv[2], bv[3]);
                }
            }
        }
    };

    // Main loop: wait for tile `it`, refill the buffer tile it-1 used, compute on tile `it`.
    for (int it = 0; it < n_tiles; ++it) {
        if constexpr (kTakeTurns) {
            const int n0 = n_begin + it * kBlockN;
            cp_async_wait<0>();
            __syncthreads();  // K_it is visible to all; every warp has finished with V_{it-1}
            v_loader.issue(v_smem, n0, pr.seqlen_k);
            cp_async_commit();
            auto next_k = [&] {
                cp_async_wait<0>();
                __syncthreads();  // V_it is visible to all; every warp has finished with K_it
                if (it + 1 < n_tiles) k_loader.issue(k_smem, n0 + kBlockN, pr.seqlen_k);
                cp_async_commit();
            };
            if (mask.tile_unmasked(m0, m1, n0, n0 + kBlockN)) attend(k_smem, v_smem, n0, Bool<false>(), next_k);
            else attend(k_smem, v_smem, n0, Bool<true>(), next_k);
        } else {
            cp_async_wait<kRingInFlight>();
            if constexpr (kTmaKv) mbarrier_wait(kv_full + (it % kStages) * kMbarrierBytes, (it / kStages) & 1);
            if constexpr (kDecode && kTmaKv) {
                // A cache's rows past a sequence's keys may hold anything, NaN included, and a masked score's
                // zero probability times NaN is NaN: V's rows past the keys become zeros before P V reads them.
                const int first_past = pr.seqlen_k - (n_begin + it * kBlockN);
                if (first_past < kBlockN) zero_rows_from(smem.v[it % kStages], first_past);
            }
            __syncthreads();  // tile `it` is visible to all; every warp has finished with tile it-1's buffer
            if (it + kStages - 1 < n_tiles) load_kv(it + kStages - 1, (it + kStages - 1) % kStages);
            cp_async_commit();
            const int stage = it % kStages, n0 = n_begin + it * kBlockN;
            const u32 sk = k_smem + stage * kKStageBytes, sv = v_smem + stage * kVStageBytes;
            if (mask.tile_unmasked(m0, m1, n0, n0 + kBlockN)) attend(sk, sv, n0, Bool<false>(), [] {});
            else attend(sk, sv, n0, Bool<true>(), [] {});
        }
    }
    cp_async_wait<0>();  // with no visible key tile, Q may still be in flight ...
    __syncthreads();     // ... from any thread, into rows another warp is about to overwrite with O

    if constexpr (kKeyWarps > 1) {
        static_assert(kMergeFloats * sizeof(float) <= sizeof(SharedStorage::k) + sizeof(SharedStorage::v),
                      "the merge works in the K/V stages");
        merge_key_warps(reinterpret_cast<float*>(smem.k), o, row_max, row_sum, log2_factor, warp, lane);
        if (warp != 0) return;  // warp 0 holds the block's rows now
    }
    if constexpr (kDecode) {
        if (p.num_splits > 1) {  // this part's normalised rows and LSEs, in fp32, for attn_combine
            store_part(p, o, row_max, row_sum, log2_factor, split, b, h, m0 + warp_row0 + g, pr.seqlen_q, t);
            return;
        }
    }

    // Epilogue: normalise, stage this warp's rows of O over its own rows of Q, store 16 bytes at a time.
    elem_t* out = static_cast<elem_t*>(p.o) + pr.o_offset;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int local_row = warp_row0 + sl * kMmaM + g + 8 * half;
            const float l = quad_sum(row_sum[sl][half]);
            const float inv_l = saw_keys(l) ? 1.f / l : 0.f;
#pragma unroll
            for (int j = 0; j < kOutTiles; ++j)
                *reinterpret_cast<u32*>(smem.q + OTile::offset(local_row, j * kMmaN + 2 * t)) =
                    pack2<elem_t>(o[sl][j][2 * half] * inv_l, o[sl][j][2 * half + 1] * inv_l);
            const int row = m0 + local_row;
            if (p.lse != nullptr && t == 0 && row < pr.seqlen_q)
                p.lse[pr.lse_offset + row] =
                    saw_keys(l) ? (row_max[sl][half] * log2_factor + __log2f(l)) / kLog2e : kNegInf;
        }
    __syncwarp();
    constexpr int kVecsPerRow = kHeadDimV / kElemsPerVector;
    for (int idx = lane; idx < kWarpRows * kVecsPerRow; idx += kWarpSize) {
        const int local_row = warp_row0 + idx / kVecsPerRow, col = (idx % kVecsPerRow) * kElemsPerVector;
        const int row = m0 + local_row;
        if (row < pr.seqlen_q && col < p.head_dim_v)
            *reinterpret_cast<uint4*>(out + (i64)row * p.o_row_stride + col) =
                *reinterpret_cast<const uint4*>(smem.q + OTile::offset(local_row, col));
    }
}

#if FT_DECODE
// attn_combine, the decode build's second kernel: the parts of each query row merge by their log-sum-exps,
// lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s; one warp per row, 4 columns per lane. A row whose
// parts saw no key gets zeros and -inf; a NaN in any part's LSE or output reaches the row.
constexpr int kCombineWarps = FT_COMBINE_WARPS;  // query rows per block

extern "C" __global__ void __launch_bounds__(kCombineWarps * kWarpSize)
attn_combine(const __grid_constant__ AttnParams p, const __grid_constant__ KvMaps) {
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const i64 rows = (i64)p.batch * p.heads_q * p.seqlen_q;
    const i64 at = (i64)blockIdx.x * kCombineWarps + warp;
    if (at >= rows) return;
    const int row = at % p.seqlen_q, h = (at / p.seqlen_q) % p.heads_q, b = at / ((i64)p.seqlen_q * p.heads_q);

    float m = kNegInf;
    for (int s = lane; s < p.num_splits; s += kWarpSize) m = fmaxf(m, p.lse_accum[s * rows + at]);
    m = warp_max(m);
    auto weight = [&](int s) {
        const float lse_s = p.lse_accum[s * rows + at];
        return lse_s == kNegInf ? 0.f : __expf(lse_s - m);
    };
    float sum = 0.f;
    for (int s = lane; s < p.num_splits; s += kWarpSize) sum += weight(s);
    sum = warp_sum(sum);
    const float inv_sum = saw_keys(sum) ? 1.f / sum : 0.f;

    elem_t* out = static_cast<elem_t*>(p.o) + b * p.o_batch_stride + row * p.o_row_stride + h * p.o_head_stride;
    for (int col = 4 * lane; col < p.head_dim_v; col += 4 * kWarpSize) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < p.num_splits; ++s) {
            const float w = weight(s) * inv_sum;
            const float4 part = *reinterpret_cast<const float4*>(p.o_accum + (s * rows + at) * p.head_dim_v + col);
            acc.x += w * part.x; acc.y += w * part.y; acc.z += w * part.z; acc.w += w * part.w;
        }
        *reinterpret_cast<uint2*>(out + col) = make_uint2(pack2<elem_t>(acc.x, acc.y), pack2<elem_t>(acc.z, acc.w));
    }
    if (p.lse != nullptr && lane == 0)
        p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + row] = saw_keys(sum) ? m + __logf(sum) : kNegInf;
}
#endif
