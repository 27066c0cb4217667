// wgmma/bwd.cu — the backward pass on Hopper's warpgroup products (wgmma, sm_90a), head dims 64, 128 and 256.
//
// Idea:     rung 4's backward (mma/bwd.cu: the same frame, the same math, transposed so that rows are keys),
//           with every product on wgmma. A block owns kBlockN keys and two consumer warpgroups; per query tile
//           (a step) they compute
//               S^T  = K Q^T,   dP^T = V dO^T          (SS: K/V and Q/dO both K-major in shared memory)
//               P^T  = exp2(S^T * scale * log2e - LSE * log2e),   dS^T = P^T o (dP^T - D)
//               dV  += P^T dO,  dK  += dS^T Q
//               dQ   = dS K                           (SS, both MN-major: dS^T through shared memory)
//           and adds dQ into the fp32 accumulator. The products read Q, dO, K and V from shared memory
//           themselves, once per warpgroup: rung 4 reads each fragment into every warp with ldmatrix, which
//           made shared-memory bandwidth its bound (docs/notes.md). Two ways to share the work between the
//           warpgroups:
//             split keys (d64, d128; kBlockN = 128): each warpgroup owns 64 keys and all of dK and dV's columns;
//               the softmax of S^T runs while dP^T is still in flight (two commit groups), and dV and dK take
//               P^T and dS^T straight from the accumulators (RS). dQ is split by rows (d64: 128-query steps,
//               64 each) or by columns (d128: 64 each).
//             split columns (d256; kBlockN = 64): dK and dV of 64 keys x 256 do not fit one warpgroup's
//               registers, so each warpgroup owns half their columns. Warpgroup 0 computes S^T and P^T,
//               warpgroup 1 dP^T and, once P^T is in shared memory, dS^T; then dV, dK (SS) and dQ take each
//               warpgroup's half of the columns. (Splitting S^T and dP^T by queries instead, m64n32 products
//               reading all of K and V in both warpgroups, made that phase bound by shared-memory bandwidth.)
//               Where specs.py says (FT_DQ_PASS), this kernel leaves dQ out and a pass of its own computes it
//               (bwd_dq.cuh, included at the end of this file).
//           Every operand starts on a 128-byte column block.
//           Loads: a producer warp (warpgroup 0, its registers given to the consumers by setmaxnreg) brings K and
//           V once and each step's Q and dO by the tensor memory accelerator, and the rows' D and LSE from the
//           scratch through a map the block makes of its own (compute-sanitizer's racecheck follows no mbarrier,
//           and blames a plain bulk copy's writes on the thread that issued it), into a ring of kStages
//           stages with a "full" and an "empty" mbarrier each. The consumers wait only for the stage they need and
//           meet once a step, at a named barrier of their own before dQ (dS^T is shared); dS^T (and P^T) alternate
//           between two buffers, so that barrier is the only one.
//           A varlen block copies through maps of its own whose rows end where its sequence ends (the whole
//           tensor's would bring the next sequence's rows into its last query tile and key block).
//           Epilogue: the consumers stage dK and dV where K and V were, and the producer warp stores both tiles by
//           the copy engine, through maps the block completes from K's and V's (bounded rows: a varlen block's
//           stores leave the next sequence alone).
// Beside:   mma/bwd.cu serves every other head dim, score modifications and GPUs before Hopper; this kernel
//           shares its frame through common/bwd_frame.cuh (deterministic turns, epilogue, the preprocess and
//           dQ-conversion kernels).
// Measured: beside torch's FlashAttention-2 and cuDNN in docs/performance.md (backward rows); against rung 4's
//           kernel in docs/ladder.md; the producer's gain in docs/notes.md.
// Wastes:   the consumers still meet every step (dS^T is shared), so one's softmax does not overlap the other's
//           products, and they wait for their dV/dK products before that barrier (it keeps the d128 build
//           within 240 registers); without the writer (the deterministic d64 build) dQ leaves through fp32
//           atomics from the consumers.
#include "../common/bwd_frame.cuh"
#include "../common/tma.cuh"
#include "wgmma.cuh"

constexpr int kWarpgroupThreads = kWarpgroupWarps * kWarpSize;
constexpr int kWarpgroups = kWarps / kWarpgroupWarps - 1;  // the consumers; warpgroup 0 produces
constexpr int kConsumerThreads = kWarpgroups * kWarpgroupThreads;
constexpr int kConsumerWarps = kWarpgroups * kWarpgroupWarps;
constexpr int kProducerThread = 0;
constexpr int kConsumerBarrier = 1;  // named barrier of the consumers alone (0 is __syncthreads)
#ifndef FT_DQ_WRITER
#define FT_DQ_WRITER 0
#endif
// dQ leaves through writer warps (the producer warpgroup's second, and its third with two staged tiles): the
// consumers stage their fp32 pieces in shared memory and a writer adds the tile to the accumulator with bulk
// reductions; otherwise the consumers add their pieces with atomics. specs.py BWD_WGMMA_TILES says where.
constexpr bool kDqWriter = FT_DQ_WRITER;
#ifndef FT_SCORES_AHEAD
#define FT_SCORES_AHEAD 0
#endif
// A step's S^T is issued by the step before, behind its dQ product, so that it runs while that step's dQ leaves
// (split keys; specs.py says where).
constexpr bool kScoresAhead = FT_SCORES_AHEAD;
#ifndef FT_TURN_KEEPER
#define FT_TURN_KEEPER 0
#endif
// Deterministic mode without the writer: the producer warpgroup's second warp keeps the dQ tiles' turns (it waits
// for a tile's turn, hands it to the consumers, and passes it on once they have issued their atomics), so that no
// consumer waits for the release's fence. specs.py says where.
constexpr bool kTurnKeeper = FT_TURN_KEEPER;
static_assert(!(kDqWriter && kTurnKeeper), "the writer warp keeps its own turns");
constexpr int kWriterWarp = 1;      // the first writer, or the turn keeper
#ifndef FT_DQ_BUFFERS
#define FT_DQ_BUFFERS 1
#endif
// The writer's staged dQ tile, in kDqBuffers buffers: with two, a step's dQ is staged while the writer still adds
// the last one's. Staged as rows (the writer's row reductions), each row is padded by 16 bytes, so that the 8 rows
// of a fragment's float2 stores start 4 banks apart (every row stays 16-byte aligned for its bulk reduction); two
// padded buffers do not fit beside the d128 tiles, so two buffers take the boxes below (no padding, no conflicts).
constexpr int kDqBuffers = FT_DQ_BUFFERS;
// One writer warp per staging buffer, each adding the tiles of its own buffer (every other step with two): one
// tile's adds complete, and in deterministic mode its turn passes on, while the other writer adds the next tile.
constexpr int kDqWriters = kDqBuffers;
static_assert(kWriterWarp + kDqWriters <= kWarpgroupWarps, "the writers are the producer warpgroup's warps");
#ifndef FT_DQ_BOXES
#define FT_DQ_BOXES 0
#endif
// kDqBoxes: the staged tile is instead boxes of kDqBoxCols columns x the tile's rows, one after the other (a
// half-warp's float2 stores, 4 rows x 32 bytes, then fill one 128-byte line: no conflicts, no padding), which the
// writer adds with tensor-map reductions, one per box, through a map it completes on the device (the accumulator's
// address and rows are the call's). Rows past a sequence are zeros there (their dS is 0), so whole boxes are added.
constexpr bool kDqBoxes = FT_DQ_BOXES;
constexpr int kDqBoxCols = 8;
constexpr int kDqBoxFloats = kDqBoxCols * kBlockM;
static_assert(kDqBuffers == 1 || kDqBoxes, "two staged tiles fit as boxes");
constexpr int kDqStageStride = kHeadDim + (kDqBoxes ? 0 : 4);
constexpr int kDqFullBarrier = 2;  // + buffer: the pieces are staged (consumers arrive, the writer waits)
constexpr int kDqEmptyBarrier = kDqFullBarrier + kDqBuffers;  // + buffer: the writer has read the staged tile
constexpr int kTurnTakenBarrier = 2;  // the keeper has the tile's turn (the keeper arrives, consumers wait)
constexpr int kAddsIssuedBarrier = 3; // the consumers have issued their atomics (consumers arrive, the keeper waits)
#ifndef FT_DQ_TURNS
#define FT_DQ_TURNS 0
#endif
// dQ of a step by one consumer warpgroup alone, the two taking turns (with the writer and the keys split):
// warpgroup step % 2 computes dQ = dS K over the whole head dim from the dS^T buffer of its own index,
// so dS^T and K are read once a step instead of once per warpgroup, and the other warpgroup goes on to its next
// step instead of meeting the first.
constexpr bool kDqTurns = FT_DQ_TURNS;
static_assert(!kDqBoxes || (kDqWriter && kDqBoxCols == kMmaN), "boxes are the writer's, an n8 tile each");
// The dQ handoff between the writer and the warpgroups that stage dQ.
constexpr int kDqHandoffThreads = (kDqTurns ? kWarpgroupThreads : kConsumerThreads) + kWarpSize;
// setmaxnreg: the producer keeps what issuing copies needs, the consumers take the rest of the register file
// (specs.py, consumer_registers).
constexpr int kProducerRegisters = FT_PRODUCER_REGISTERS;
constexpr int kConsumerRegisters = FT_CONSUMER_REGISTERS;
static_assert(kWarpgroups == 2, "two consumer warpgroups share a step");
constexpr bool kSplitKeys = kBlockN == kWarpgroups * kWgmmaM;
static_assert(kSplitKeys || kBlockN == kWgmmaM, "64 keys per warpgroup, or 64 keys shared by all");
static_assert(kSplitKeys || !kScoresAhead, "S^T ahead with the keys split");
static_assert(kSplitKeys || !kTurnKeeper, "the turn keeper with the keys split");
static_assert(kHeadDim == kHeadDimV, "one head dim for q, k and v");
static_assert(!kDqPass || (!kSplitKeys && !kDqWriter), "the dQ pass serves the split-columns build, which adds no dQ");
static_assert(kWideBlocks, "wgmma reads the 128-byte swizzled layout");
static_assert(!kSoftcap && !kAlibi, "score modifications run in mma/bwd.cu");

// A warpgroup's share: S^T and dP^T of its 64 keys x the kBlockM queries (split columns: warpgroup 0 S^T, 1 dP^T);
// dK/dV its 64 keys x kGradCols columns; dQ 64 rows x kDqCols.
constexpr int kGradCols = kSplitKeys ? kHeadDim : kHeadDim / kWarpgroups;
constexpr bool kDqByRows = kBlockM == kWarpgroups * kWgmmaM;
constexpr int kDqCols = kDqByRows || kDqTurns ? kHeadDim : kHeadDim / kWarpgroups;
static_assert(!kDqTurns || (kSplitKeys && kDqWriter && !kDqByRows && !kScoresAhead),
              "dQ in turns: keys split, the writer stages, a step's 64 queries in one piece");
static_assert(kGradCols == 64 || kGradCols == 128, "products exist for N = 64, 128");
static_assert(kDqCols == 64 || kDqCols == 128, "products exist for N = 64, 128");
static_assert(kDqByRows || kBlockM == kWgmmaM, "dQ pieces of 64 rows");
static_assert(kSplitKeys || kBlockM == kWgmmaM, "split columns: P^T's queries are one column block");
static_assert(kGradCols % kSwizzleRowElems == 0 && kDqCols % kSwizzleRowElems == 0, "whole column blocks");
constexpr int kScoreAccumulators = kBlockM / 2;
constexpr int kGradAccumulators = kGradCols / 2;
constexpr int kDqAccumulators = kDqCols / 2;
constexpr int kScoreSteps = kBlockM / kWgmmaK;  // k16 steps of dV/dK over the step's queries

using DsTile = SwizzledTile<kBlockN, kBlockM, true>;  // dS^T (and P^T when the columns are split): keys x queries
template <typename Tile>
constexpr u32 kColumnBlockBytes = Tile::kBlockElems * kElemBytes;  // a descriptor's step from block to block

// P^T goes through shared memory only when the columns are split; otherwise the empty base takes no space and
// its null `p` is never used (the code that would is under `if constexpr`, but still has to compile). P^T and
// dS^T alternate between two buffers from step to step: a warpgroup may write the next step's while the other
// still reads this step's, and the step's one consumer barrier (before dQ) keeps them two steps apart.
constexpr int kScoreBuffers = 2;
// dQ by one warpgroup: the handoff of each dS^T buffer between the warpgroups.
constexpr int kDsFullBarrier = kDqEmptyBarrier + kDqBuffers;      // + buffer: the other warpgroup's rows are stored
constexpr int kDsEmptyBarrier = kDsFullBarrier + kScoreBuffers;   // + buffer: dQ's product has read the buffer
constexpr int kDqMapBarrier = kDsEmptyBarrier + kScoreBuffers;  // the first writer has completed the dQ map
constexpr int kEpilogueBarrier = kDqMapBarrier + 1;  // dK and dV are staged (consumers arrive, the producer waits)
static_assert(kEpilogueBarrier < 16, "a block has 16 named barriers");
constexpr int kEpilogueThreads = kConsumerThreads + kWarpSize;
template <bool kShared> struct ProbabilityTile { elem_t p[kScoreBuffers][DsTile::kElems]; };
template <> struct ProbabilityTile<false> { static constexpr elem_t (*p)[DsTile::kElems] = nullptr; };

// The staged dQ tile, only with the writer warp (the empty base takes no space).
template <bool kStaged> struct DqStage { float dq_stage[kDqBuffers][kBlockM * kDqStageStride]; };
template <> struct DqStage<false> { static constexpr float (*dq_stage)[kBlockM * kDqStageStride] = nullptr; };

// The second parameter: with kDqBoxes it carries the accumulator map's template too.
template <bool kTemplate> struct MapsOf { using type = BwdMaps; };
template <> struct MapsOf<true> { using type = BwdMapsDq; };
using Maps = MapsOf<kDqBoxes>::type;

struct __align__(kSwizzleAtomBytes) SharedStorage : ProbabilityTile<!kSplitKeys>, DqStage<kDqWriter> {
    elem_t k[KTile::kElems];     // later the dK tile
    elem_t v[VTile::kElems];     // later the dV tile
    elem_t q[kStages][QTile::kElems];
    elem_t dout[kStages][DoTile::kElems];
    elem_t ds[kScoreBuffers][DsTile::kElems];
    alignas(128) float rows[kStages][2][kBlockM];  // a step's D, then its rows' base-2 LSE: one box of the rows map
    u64 kv_full;                 // K and V have landed
    u64 full[kStages];           // a step's Q, dO, LSE and D have landed (the copy engine)
    u64 empty[kStages];          // every consumer warp is done with the stage
    TensorMap* own_maps;         // the producer warp's: its block's maps (block_maps_of); held in its registers across
                                 // the loop, the place spilled
};

// acc (64 keys x kBlockM queries) = A B^T over the head dim: A = 64 rows of K or V, B = rows of the query
// tile's Q or dO, both K-major; a k16 step is 32 bytes along the rows, every fourth one a column block on.
template <typename ATile, typename BTile>
__device__ __forceinline__ void keys_by_queries(float (&acc)[kScoreAccumulators], u32 a_rows, u32 b_rows) {
#pragma unroll
    for (int kk = 0; kk < kHeadDim / kWgmmaK; ++kk) {
        const int block = kk * kWgmmaK / kSwizzleRowElems;
        const u32 within = (kk * kWgmmaK % kSwizzleRowElems) * kElemBytes;
        wgmma_ss<0, 0>(acc, k_major(a_rows + block * kColumnBlockBytes<ATile> + within),
                       k_major(b_rows + block * kColumnBlockBytes<BTile> + within), kk > 0);
    }
}

// acc (64 keys x kGradCols) += A B over the block's queries, B = kGradCols columns of the query tile's dO or Q,
// MN-major (a k16 step is 16 rows further). A = P^T or dS^T: from the registers (16-bit pairs, split keys) or
// from shared memory, K-major (split columns).
template <typename BTile>
__device__ __forceinline__ void add_keys_by_dim(float (&acc)[kGradAccumulators], const u32 (&a)[kScoreSteps][4],
                                                u32 b_cols) {
#pragma unroll
    for (int kk = 0; kk < kBlockM / kWgmmaK; ++kk)
        wgmma_rs<1>(acc, a[kk], mn_major(b_cols + kk * kWgmmaK * kSwizzleRowBytes, kColumnBlockBytes<BTile>), 1);
}
template <typename BTile>
__device__ __forceinline__ void add_keys_by_dim(float (&acc)[kGradAccumulators], u32 a_tile, u32 b_cols) {
#pragma unroll
    for (int kk = 0; kk < kBlockM / kWgmmaK; ++kk)
        wgmma_ss<0, 1>(acc, k_major(a_tile + kk * kWgmmaK * kElemBytes),
                       mn_major(b_cols + kk * kWgmmaK * kSwizzleRowBytes, kColumnBlockBytes<BTile>), 1);
}

// dq = dS K as one commit group: A = dS, i.e. the rows of dS^T from `ds_rows` read MN-major (a k16 step is 16 keys,
// 16 rows further); B = K's columns from `k_cols`, MN-major the same way.
__device__ __forceinline__ void issue_dq(float (&dq)[kDqAccumulators], u32 ds_rows, u32 k_cols) {
    fence_operands(dq);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / kWgmmaK; ++kk)
        wgmma_ss<1, 1>(dq, mn_major(ds_rows + kk * kWgmmaK * kSwizzleRowBytes, kColumnBlockBytes<DsTile>),
                       mn_major(k_cols + kk * kWgmmaK * kSwizzleRowBytes, kColumnBlockBytes<KTile>), kk > 0);
    wgmma_commit();
}

// This thread's accumulators as 16-bit A fragments, one per k16 step (n8 tiles 2kk and 2kk + 1).
__device__ __forceinline__ void to_fragments(u32 (&a)[kScoreSteps][4], const float (&acc)[kScoreAccumulators]) {
#pragma unroll
    for (int kk = 0; kk < kScoreSteps; ++kk) accumulators_to_a(a[kk], n8_tile(acc, 2 * kk), n8_tile(acc, 2 * kk + 1));
}

// A thread's fragments (its keys x the step's queries, from row key0 and column query0) into and out of a
// keys x queries tile in shared memory.
__device__ __forceinline__ void store_fragments(elem_t* tile, const u32 (&a)[kScoreSteps][4], int key0, int query0) {
#pragma unroll
    for (int kk = 0; kk < kScoreSteps; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = key0 + 8 * (i % 2), query = query0 + kk * kWgmmaK + 8 * (i / 2);
            *reinterpret_cast<u32*>(tile + DsTile::offset(key, query)) = a[kk][i];
        }
}
__device__ __forceinline__ void load_fragments(u32 (&a)[kScoreSteps][4], const elem_t* tile, int key0, int query0) {
#pragma unroll
    for (int kk = 0; kk < kScoreSteps; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = key0 + 8 * (i % 2), query = query0 + kk * kWgmmaK + 8 * (i / 2);
            a[kk][i] = *reinterpret_cast<const u32*>(tile + DsTile::offset(key, query));
        }
}

// A warp's 16 rows of a warpgroup's accumulators as stage_tile takes them (one slab of n8 tiles).
template <int kAccumulators>
__device__ __forceinline__ const float (&as_slab(const float (&acc)[kAccumulators]))[1][kAccumulators / 4][4] {
    return *reinterpret_cast<const float(*)[1][kAccumulators / 4][4]>(&acc[0]);
}

// Rows [row0, row0 + Tile's rows) of a row-major matrix into a tile in shared memory by one warp's cp.async, rows
// from `valid_rows` on and columns past `dim` as zeros (16 bytes a copy, in the 128-byte swizzle the copy engine
// writes). A loop, not unrolled: the producer has few registers, and this serves only a varlen sequence's last tile.
template <typename Tile>
__device__ __forceinline__ void copy_rows(u32 tile, const elem_t* matrix, i64 row_stride, int dim, int valid_rows,
                                          int row0, int lane) {
    constexpr int kChunksPerRow = Tile::kBlockCols / kElemsPerVector, kRowChunks = kChunksPerRow * Tile::kColBlocks;
    constexpr int kTileRows = Tile::kElems / (Tile::kBlockCols * Tile::kColBlocks);
#pragma unroll 1
    for (int idx = lane; idx < kTileRows * kRowChunks; idx += kWarpSize) {
        const int row = idx / kRowChunks, col_chunk = idx % kRowChunks;
        const int blk = col_chunk / kChunksPerRow, chunk = col_chunk % kChunksPerRow;
        const int col = col_chunk * kElemsPerVector;
        const bool valid = row < valid_rows && col < dim;
        const u32 dst = tile + (blk * Tile::kBlockElems + row * Tile::kBlockCols + (chunk ^ (row & 7)) * kElemsPerVector) *
                                   kElemBytes;
        cp_async_16(dst, valid ? matrix + (i64)(row0 + row) * row_stride + col : matrix, valid);
    }
}

// `x` as the compiler cannot see through: what is computed from it is computed where it stands.
__device__ __forceinline__ int opaque(int x) {
    asm volatile("mov.b32 %0, %0;" : "+r"(x));
    return x;
}

__device__ __forceinline__ void bulk_reduce_add(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// Orders this thread's generic accesses to global memory with the async proxy's (the bulk reductions).
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// A writer warp: for each of its steps (those of its buffer), once the consumers have staged the tile's dQ, each
// lane adds whole rows of it to the fp32 accumulator with bulk reductions (rows past the sequence are not added),
// or with kDqBoxes lane 0 adds every box through `dq_map`, and hands the buffer back as soon as the reductions have
// read it.
// Deterministic mode: lane 0 waits for the tile's turn before the adds and passes it on once they have completed
// (bulk reductions are the async proxy's writes: a proxy fence orders them before the release).
__device__ __forceinline__ void write_dq(const BwdParams& p, const Mask& mask, const Problem& pr0, int b, int h_first,
                                      int n_block, int steps, int m_tiles, int m_hi, u32 stage, const TensorMap* dq_map,
                                      int writer, int lane) {
    constexpr u32 kRowBytes = kHeadDim * sizeof(float), kStageRowBytes = kDqStageStride * sizeof(float);
    constexpr u32 kBufferBytes = kBlockM * kStageRowBytes, kBoxBytes = kBlockM * kDqBoxCols * sizeof(float);
    const int buffer = writer;
    if (writer < steps) named_barrier_arrive(kDqEmptyBarrier + buffer, kDqHandoffThreads);  // the buffer starts free
#pragma unroll 1
    for (int step = writer; step < steps; step += kDqWriters) {
        const int head = h_first + step / m_tiles, m_tile = m_hi - 1 - step % m_tiles, m0 = m_tile * kBlockM;
        const DqTurn turn(p, mask, b, head, m_tile, m0, n_block, lane == 0);
        if (turn.turn != nullptr) {  // the other lanes wait for lane 0's turn, the adds come after its acquire
            __syncwarp();
            fence_proxy_async_global();
        }
        named_barrier_sync(kDqFullBarrier + buffer, kDqHandoffThreads);
        if constexpr (kDqBoxes) {  // by lane 0, which completed the map (and alone acquired it)
            const i64 row0 = pr0.scratch_offset + (head - h_first) * p.scratch_head_stride + m0;  // a scratch row
            if (lane == 0) {
#pragma unroll 1
                for (int box = 0; box < kHeadDim / kDqBoxCols; ++box)
                    tma_reduce_add_2d(dq_map, stage + buffer * kBufferBytes + box * kBoxBytes, box * kDqBoxCols,
                                      (int)row0);
            }
        } else {
            const i64 row0 = pr0.scratch_offset + (head - h_first) * p.scratch_head_stride + m0;
            float* accum = p.dq_accum + row0 * kHeadDim;
            const int rows = min(kBlockM, pr0.seqlen_q - m0);
#pragma unroll 1
            for (int r = lane; r < rows; r += kWarpSize)
                bulk_reduce_add(accum + r * kHeadDim, stage + buffer * kBufferBytes + r * kStageRowBytes, kRowBytes);
        }
        bulk_commit();
        bulk_wait_all<true>();
        if constexpr (kDqBoxes) __syncwarp();  // lane 0's reads done before the warp hands the buffer back
        if (step + kDqBuffers < steps) named_barrier_arrive(kDqEmptyBarrier + buffer, kDqHandoffThreads);
        if (turn.turn != nullptr) {
            bulk_wait_all<false>();
            fence_proxy_async_global();
            turn.pass([] { __syncwarp(); }, lane == 0);
        }
    }
}

// The block's own tensor maps, completed on the device in the 128-byte slots the plan leaves in the scratch after
// the dQ accumulator (backward.py, block_maps): the dQ writer's (with kDqBoxes), then dK's and dV's (K's and V's
// maps given dK's and dV's address and strides), then the rows map (the scratch's D and base-2 LSE as two rows of
// fp32: one box is a query tile's D and LSE), then, for a varlen problem, K's, V's, Q's and dO's with their rows
// ending where the block's sequence ends, so that the copy engine reads zeros past it and writes nothing there.
enum BlockMap { kDkMap, kDvMap, kRowsMap, kTailKMap, kTailVMap, kTailQMap, kTailDoMap };  // dO's follows Q's
constexpr int kEpilogueMaps = 2, kRowsMaps = 1, kTailMaps = 4;
static_assert(sizeof(BwdMaps) == 4 * sizeof(TensorMap), "BwdMaps holds K's, V's, Q's and dO's maps in a row");
__device__ __forceinline__ TensorMap* block_maps_of(const BwdParams& p) {
    const i64 accum_floats = kDqPass ? 0 : (i64)(p.lse_log2 - p.dsum) * kHeadDim;  // scratch rows x the head dim
    const int per_block = kDqBoxes + kEpilogueMaps + kRowsMaps + (p.fwd.cu_seqlens_q != nullptr ? kTailMaps : 0);
    const u32 block_index = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    return reinterpret_cast<TensorMap*>(p.dq_accum + accum_floats) + (i64)block_index * per_block;
}

// The writers' map of the accumulator where they add boxes (none otherwise): this block's copy of the template,
// completed by the first writer's lane 0 with the accumulator's address and rows (the scratch rows: D's, which lie
// just before the LSE's in the scratch); the other writers' lanes 0 acquire it after a barrier of the writers.
__device__ __forceinline__ const TensorMap* dq_map_of(const BwdParams&, const BwdMaps&, int, int) { return nullptr; }
__device__ __forceinline__ const TensorMap* dq_map_of(const BwdParams& p, const BwdMapsDq& maps, int writer,
                                                      int lane) {
    const u32 accum_rows = (u32)(p.lse_log2 - p.dsum);
    TensorMap* slot = block_maps_of(p);
    if (writer == 0 && lane == 0) tensormap_complete(slot, maps.dq_template, p.dq_accum, accum_rows);
    if constexpr (kDqWriters > 1) {
        named_barrier_sync(kDqMapBarrier, kDqWriters * kWarpSize);
        if (writer != 0 && lane == 0) tensormap_acquire(slot);
    }
    return slot;
}

// A varlen block's tail maps, one a lane (0-3: K, V, Q, dO, their rows ending where the sequence ends), published to
// lane 0, which issues every copy. (An extent is never 0, which a map may not hold: a block of an empty query
// sequence copies no query tile.)
__device__ __forceinline__ void complete_tail_maps(TensorMap* own, const Maps& maps, const Problem& pr, int lane) {
    if (lane < kTailMaps) {
        TensorMap* slot = own + kTailKMap + lane;
        tensormap_copy(slot, lane == 0 ? maps.k : lane == 1 ? maps.v : lane == 2 ? maps.q : maps.dout);
        // (the rows, 32-bit as the maps' coordinates, worked out after the copy: the producer has few registers)
        const int end = lane < 2 ? (int)pr.k_start + pr.seqlen_k : (int)pr.q_start + pr.seqlen_q;
        tensormap_set_extent<1>(slot, (u32)max(end, 1));
        tensormap_publish(slot);
    }
    __syncwarp();
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < kTailMaps; ++i) tensormap_acquire(own + kTailKMap + i);
    }
}

// The rows map, by the thread that issues its copies: D's and the LSE's scratch rows as the map's two rows, which
// the copies see as `scratch_rows` values wide.
__device__ __forceinline__ void complete_rows_map(TensorMap* slot, const BwdParams& p, const Maps& maps) {
    const u32 scratch_rows = (u32)(p.lse_log2 - p.dsum);  // D's rows lie just before the LSE's
    tensormap_complete_f32_rows(slot, maps.q, p.dsum, scratch_rows, 2, (u64)scratch_rows * sizeof(float), kBlockM);
}

// dK's and dV's maps, one a lane (0, 1): K's and V's given the gradients' address and strides (a zero stride is a
// dimension of one index, which keeps the template's), and for a varlen block the rows of its sequence; published
// to lane 0, which stores both tiles.
__device__ __forceinline__ void complete_epilogue_maps(TensorMap* own, const BwdParams& p, const Maps& maps,
                                                       const Problem& pr, bool varlen, int lane) {
    if (lane < kEpilogueMaps) {
        TensorMap* slot = own + kDkMap + lane;
        const bool dk = lane == kDkMap;
        const i64 strides[3] = {dk ? p.dk_row_stride : p.dv_row_stride, dk ? p.dk_head_stride : p.dv_head_stride,
                                varlen ? 0 : dk ? p.dk_batch_stride : p.dv_batch_stride};
        tensormap_copy(slot, dk ? maps.k : maps.v);
        tensormap_set_address(slot, dk ? p.dk : p.dv);
        if (strides[0] != 0) tensormap_set_stride<1>(slot, (u64)strides[0] * kElemBytes);
        if (strides[1] != 0) tensormap_set_stride<2>(slot, (u64)strides[1] * kElemBytes);
        if (strides[2] != 0) tensormap_set_stride<3>(slot, (u64)strides[2] * kElemBytes);
        if (varlen) tensormap_set_extent<1>(slot, (u32)(pr.k_start + pr.seqlen_k));
        tensormap_publish(slot);
    }
    __syncwarp();
    if (lane == 0) tensormap_acquire(own + kDvMap);
}

// The turn keeper: for each step, lane 0 waits for the dQ tile's turn and the warp hands it to the consumers; once
// they have issued their atomics (a barrier orders them before what follows it), lane 0 passes the turn on with a
// release, which is cumulative: the consumers' adds are visible to whoever acquires the turn next.
__device__ __forceinline__ void keep_turns(const BwdParams& p, const Mask& mask, int b, int h_first, int n_block,
                                           int steps, int m_tiles, int m_hi, int lane) {
#pragma unroll 1
    for (int step = 0; step < steps; ++step) {
        const int head = h_first + step / m_tiles, m_tile = m_hi - 1 - step % m_tiles;
        const DqTurn turn(p, mask, b, head, m_tile, m_tile * kBlockM, n_block, lane == 0);
        __syncwarp();
        named_barrier_arrive(kTurnTakenBarrier, kDqHandoffThreads);
        named_barrier_sync(kAddsIssuedBarrier, kDqHandoffThreads);
        turn.pass([] { __syncwarp(); }, lane == 0);
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1)
attn_bwd(const __grid_constant__ BwdParams p, const __grid_constant__ Maps maps) {
    extern __shared__ __align__(kSwizzleAtomBytes) unsigned char smem_raw[];
    SharedStorage& smem = checked_storage<SharedStorage>(smem_raw);
    const AttnParams& f = p.fwd;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int warpgroup = uniform_warpgroup();

    const KeyBlock block = key_block_of(p);
    const int n_block = block.n_block, h_kv = block.h_kv, b = block.b;
    const int h_first = h_kv * f.group;
    const Problem pr0 = locate_bwd_problem(p, b, h_first);
    const int n0 = n_block * kBlockN;
    if (n0 >= pr0.seqlen_k) return;
    const int n1 = min(n0 + kBlockN, pr0.seqlen_k);
    const Mask mask(f.window_left, f.window_right, pr0.seqlen_q, pr0.seqlen_k);
    const bool varlen = f.cu_seqlens_q != nullptr;

    const QueryTiles visited = visited_query_tiles(f, mask, pr0.seqlen_q, n0, n1);
    const int m_hi = visited.hi, m_tiles = visited.hi - visited.lo;
    const int steps = m_tiles * f.group;  // (query head of the group, query tile) pairs, head-major
    auto m_tile_of = [&](int step) { return m_hi - 1 - step % m_tiles; };  // last to first, as mma/bwd.cu

    const u32 k_smem = smem_addr(smem.k), v_smem = smem_addr(smem.v), ds_smem = smem_addr(smem.ds[0]);
    const u32 q_smem = smem_addr(smem.q[0]), do_smem = smem_addr(smem.dout[0]);
    const u32 rows_smem = smem_addr(smem.rows[0][0]);
    const u32 kv_full = smem_addr(&smem.kv_full), full = smem_addr(&smem.full[0]), empty = smem_addr(&smem.empty[0]);
    constexpr u32 kQStageBytes = QTile::kElems * kElemBytes, kDoStageBytes = DoTile::kElems * kElemBytes;
    constexpr u32 kRowBytes = kBlockM * sizeof(float), kRowsStageBytes = 2 * kRowBytes;  // D's, then the LSE's
    constexpr u32 kDsBufferBytes = DsTile::kElems * kElemBytes;

    if (threadIdx.x == kProducerThread) {
        mbarrier_init(kv_full, 1);
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(full + s * kMbarrierBytes, 1);  // the copy engine's bytes
            mbarrier_init(empty + s * kMbarrierBytes, kConsumerWarps);
        }
        mbarrier_init_fence();
    }
    __syncthreads();  // the last block-wide barrier: from here on the warpgroups meet only at mbarriers

    // The maps see K, V, Q and dO as (head dim, rows, heads, batch), varlen sequences packed along the rows of one
    // batch entry; rows past the tensor read as zeros.
    const int map_batch = varlen ? 0 : blockIdx.z;  // (b itself: only varlen batches run in another order)
    if (warpgroup == 0) {
        // Producer: K and V once, then each step's Q, dO and its rows' LSE (base 2) and D, all by the copy engine
        // (lane 0 issues every copy), into the ring as soon as a stage is free.
        setmaxnreg_dec<kProducerRegisters>();
        if (kDqWriter && warp >= kWriterWarp && warp < kWriterWarp + kDqWriters) {
            const int writer = warp - kWriterWarp;
            write_dq(p, mask, pr0, b, h_first, n_block, steps, m_tiles, m_hi, smem_addr(smem.dq_stage[0]),
                     dq_map_of(p, maps, writer, lane), writer, lane);
            return;
        }
        if (kTurnKeeper && warp == kWriterWarp) {
            keep_turns(p, mask, b, h_first, n_block, steps, m_tiles, m_hi, lane);
            return;
        }
        if (warp != 0) return;
        TensorMap* own_maps = block_maps_of(p) + kDqBoxes;
        if (lane == 0) smem.own_maps = own_maps;
        // A varlen sequence's copies go through the block's tail maps: through the whole tensor's, its last query
        // tile and key block would bring the next sequence's rows.
        if (varlen) complete_tail_maps(own_maps, maps, pr0, lane);
        if (lane == 0) {
            mbarrier_arrive_expect_bytes(kv_full, (KTile::kElems + VTile::kElems) * kElemBytes);
            const TensorMap& k_map = varlen ? own_maps[kTailKMap] : maps.k;
            const TensorMap& v_map = varlen ? own_maps[kTailVMap] : maps.v;
#pragma unroll
            for (int blk = 0; blk < kHeadDim / kSwizzleRowElems; ++blk) {
                tma_load_4d(k_smem + blk * kColumnBlockBytes<KTile>, k_map, blk * kSwizzleRowElems,
                            (int)pr0.k_start + n0, h_kv, map_batch, kv_full);
                tma_load_4d(v_smem + blk * kColumnBlockBytes<VTile>, v_map, blk * kSwizzleRowElems,
                            (int)pr0.k_start + n0, h_kv, map_batch, kv_full);
            }
        }
        const int q_row0 = opaque((int)pr0.q_start);  // held as 32 bits (the maps take 32-bit coordinates)
        // The group's first scratch row and the rows between heads, held as 32 bits too (a scratch of 2^31 rows
        // would stand for q and dO tensors of 2^37 elements at least).
        const int scratch_row1 = opaque((int)pr0.scratch_offset);
        const int scratch_heads = opaque((int)p.scratch_head_stride);
        for (int step = 0; step < steps; ++step) {
            const int stage = step % kStages, round = step / kStages;
            const int head = h_first + step / m_tiles, m0 = m_tile_of(step) * kBlockM;
            const u32 bar = full + stage * kMbarrierBytes;
            if (round > 0) mbarrier_wait(empty + stage * kMbarrierBytes, (round - 1) & 1);
            if (lane == 0) {
                mbarrier_arrive_expect_bytes(bar, kQStageBytes + kDoStageBytes + kRowsStageBytes);
                const TensorMap* const q_and_do = varlen ? smem.own_maps + kTailQMap : &maps.q;  // dO's follows
                const TensorMap& q_map = q_and_do[0];
                const TensorMap& do_map = q_and_do[1];
#pragma unroll
                for (int blk = 0; blk < kHeadDim / kSwizzleRowElems; ++blk) {
                    tma_load_4d(q_smem + stage * kQStageBytes + blk * kColumnBlockBytes<QTile>, q_map,
                                blk * kSwizzleRowElems, q_row0 + m0, head, map_batch, bar);
                    tma_load_4d(do_smem + stage * kDoStageBytes + blk * kColumnBlockBytes<DoTile>, do_map,
                                blk * kSwizzleRowElems, q_row0 + m0, head, map_batch, bar);
                }
                // The rows' D and base-2 LSE: one box, an aligned run of each scratch row, zeros past the sequence.
                // (The map is made while the first copies are in flight.)
                if (step == 0) complete_rows_map(smem.own_maps + kRowsMap, p, maps);
                const int row0 = scratch_row1 + (head - h_first) * scratch_heads + m0;
                tma_load_2d(rows_smem + stage * kRowsStageBytes, smem.own_maps[kRowsMap], row0, 0, bar);
            }
        }

        // The epilogue: dK's and dV's maps while the consumers finish; once they have staged dK and dV where K and
        // V were, lane 0 stores both tiles by the copy engine (column blocks wholly past the head dim are not
        // stored, rows past the sequence are not written) and waits until the copies have read the tiles.
        __syncwarp();
        own_maps = smem.own_maps;
        complete_epilogue_maps(own_maps, p, maps, pr0, varlen, lane);
        named_barrier_sync(kEpilogueBarrier, kEpilogueThreads);
        if (lane == 0) {
#pragma unroll
            for (int blk = 0; blk < kHeadDim / kSwizzleRowElems; ++blk) {
                if (blk * kSwizzleRowElems < f.head_dim)
                    tma_store_4d(own_maps[kDkMap], k_smem + blk * kColumnBlockBytes<KTile>, blk * kSwizzleRowElems,
                                 (int)pr0.k_start + n0, h_kv, map_batch);
                if (blk * kSwizzleRowElems < f.head_dim_v)
                    tma_store_4d(own_maps[kDvMap], v_smem + blk * kColumnBlockBytes<VTile>, blk * kSwizzleRowElems,
                                 (int)pr0.k_start + n0, h_kv, map_batch);
            }
            bulk_commit();
            bulk_wait_all<true>();
        }
        return;
    }

    // Consumers: the two warpgroups share each step (see the top of the file).
    setmaxnreg_inc<kConsumerRegisters>();
    const int group = warpgroup - 1;
    auto consumers_sync = [] { named_barrier_sync(kConsumerBarrier, kConsumerThreads); };

    // This warpgroup's share, as tile offsets: its keys, the columns of its dK/dV, its rows and columns of dQ.
    const int key0 = kSplitKeys ? group * kWgmmaM : 0;
    const int grad_col0 = kSplitKeys ? 0 : group * kGradCols;
    const int dq_row0 = kDqByRows ? group * kWgmmaM : 0, dq_col0 = kDqByRows || kDqTurns ? 0 : group * kDqCols;
    const int row_in_group = (warp % kWarpgroupWarps) * kMmaM + lane / kQuad;  // this lane's rows: +0 and +8
    const u32 k_rows = k_smem + key0 * kSwizzleRowBytes, v_rows = v_smem + key0 * kSwizzleRowBytes;
    const u32 ds_piece = ds_smem + (dq_row0 / kSwizzleRowElems) * kColumnBlockBytes<DsTile>;
    const u32 k_cols = k_smem + (dq_col0 / kSwizzleRowElems) * kColumnBlockBytes<KTile>;
    const u32 grad_block = (grad_col0 / kSwizzleRowElems);  // dO's and Q's first column block for dV and dK
    const float log2_factor = f.scale_log2;

    mbarrier_wait(kv_full, 0);

    float dk[kGradAccumulators] = {};
    float dv[kGradAccumulators] = {};

    // With kScoresAhead a step's S^T is in flight in `s_ahead` when the step begins. Its keys' rows are worked out
    // again where they are used (from an opaque key0): kept across the loop, they spilled.
    float s_ahead[kScoreAccumulators];
    auto rows_of = [&](u32 tile) { return tile + (kScoresAhead ? opaque(key0) : key0) * kSwizzleRowBytes; };
    auto issue_scores = [&](int stage) {
        fence_operands(s_ahead);
        wgmma_fence();
        keys_by_queries<KTile, QTile>(s_ahead, rows_of(k_smem), q_smem + stage * kQStageBytes);
        wgmma_commit();
    };
    auto release = [&](int stage) {
        __syncwarp();  // every lane's reads of the stage (LSE and D) before the warp's release
        if (lane == 0) mbarrier_arrive(empty + stage * kMbarrierBytes);
    };

    // The warpgroup that computes a step's dQ where one does (kDqTurns): the step's dS^T buffer's index.
    auto dq_group_of = [](int step) { return step % kScoreBuffers; };
    // The writer's handoff: wait until the writer has read what it last added from the step's buffer (with two
    // buffers while dQ's product runs, where it seldom waits; with one right before staging), then stage this
    // warpgroup's piece and publish it to the writer's bulk reads.
    auto wait_dq_buffer = [&](int step) { named_barrier_sync(kDqEmptyBarrier + step % kDqBuffers, kDqHandoffThreads); };
    auto stage_dq = [&](const float (&dq)[kDqAccumulators], int step) {
        const int t = lane % kQuad, buffer = step % kDqBuffers;
        if constexpr (kDqBuffers == 1) wait_dq_buffer(step);
        // Rows of the head dim, or (kDqBoxes) each n8 tile's columns in a box of their own.
        constexpr int kTileStep = kDqBoxes ? kDqBoxFloats : kMmaN, kRowStep = kDqBoxes ? kDqBoxCols : kDqStageStride;
        float* const piece = smem.dq_stage[buffer] + (kDqBoxes ? dq_col0 / kDqBoxCols * kDqBoxFloats : dq_col0);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float* const row = piece + (dq_row0 + row_in_group + 8 * half) * kRowStep;
#pragma unroll
            for (int j = 0; j < kDqCols / kMmaN; ++j)
                *reinterpret_cast<float2*>(row + j * kTileStep + 2 * t) =
                    make_float2(dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
        }
        fence_proxy_async();
        named_barrier_arrive(kDqFullBarrier + buffer, kDqHandoffThreads);
    };

    auto step_body = [&](int step, int stage, bool masked) {
        const int head = h_first + step / m_tiles, m_tile = m_tile_of(step), m0 = m_tile * kBlockM;
        const int t = threadIdx.x % kQuad;
        const u32 sq = q_smem + stage * kQStageBytes, sdo = do_smem + stage * kDoStageBytes;
        const u32 dsum_row = rows_smem + stage * kRowsStageBytes + 2 * t * sizeof(float);  // this lane's column 0
        const u32 lse_row = dsum_row + kRowBytes;
        const int buffer = step % kScoreBuffers;
        elem_t* const ds_tile = smem.ds[buffer];
        const u32 ds_buffer = ds_piece + buffer * kDsBufferBytes;

        // P^T = exp2(score * log2_factor - lse_log2[query]) as 16-bit A fragments; masked scores give 0.
        auto probabilities = [&](float (&x)[kScoreAccumulators], u32 (&p16)[kScoreSteps][4]) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int key = n0 + key0 + row_in_group + 8 * half, col0 = m0 + 2 * t;
                const int lo = mask.first_query(key) - col0, hi = mask.end_query(key) - col0;
#pragma unroll
                for (int j = 0; j < kBlockM / kMmaN; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& score = x[4 * j + 2 * half + e];
                        const int col = j * kMmaN + e;  // + col0
                        if (masked && (col < lo || col >= hi)) score = kNegInf;
                        score = fast_exp2(fmaf(score, log2_factor, -ld_shared_in_order(lse_row + col * sizeof(float))));
                    }
            }
            to_fragments(p16, x);
        };
        // dS^T = P^T o (dP^T - D[query]) as 16-bit A fragments, from the 16-bit P^T that dV uses too.
        auto score_gradients = [&](float (&dp)[kScoreAccumulators], const u32 (&p16)[kScoreSteps][4],
                                   u32 (&ds16)[kScoreSteps][4]) {
#pragma unroll
            for (int j = 0; j < kBlockM / kMmaN; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float prob = unpack_probability<elem_t>(p16[j / 2][2 * (j % 2) + i / 2], i % 2);
                    const float dsum = ld_shared_in_order(dsum_row + (j * kMmaN + (i & 1)) * sizeof(float));
                    dp[4 * j + i] = prob * (dp[4 * j + i] - dsum);
                }
            to_fragments(ds16, dp);
        };

        u32 p16[kScoreSteps][4], ds16[kScoreSteps][4];
        const u32 do_cols = sdo + grad_block * kColumnBlockBytes<DoTile>;
        const u32 q_cols = sq + grad_block * kColumnBlockBytes<QTile>;
        if constexpr (kSplitKeys) {
            // S^T and dP^T of this warpgroup's keys, two commit groups: the softmax of S^T runs while dP^T is
            // computed. Then dV += P^T dO and dK += dS^T Q (the softmax scale is applied once, at the end) from
            // the registers, in flight while dS^T goes to shared memory for dQ.
            float s_here[kScoreAccumulators], dp[kScoreAccumulators];
            float (&s)[kScoreAccumulators] = kScoresAhead ? s_ahead : s_here;
            if constexpr (!kScoresAhead) fence_operands(s);
            fence_operands(dp);
            wgmma_fence();
            if constexpr (!kScoresAhead) {
                keys_by_queries<KTile, QTile>(s, k_rows, sq);
                wgmma_commit();
            }
            keys_by_queries<VTile, DoTile>(dp, kScoresAhead ? rows_of(v_smem) : v_rows, sdo);
            wgmma_commit();
            if constexpr (!kScoresAhead) {
                wgmma_wait<1>();
                fence_operands(s);
            }
            probabilities(s, p16);
            wgmma_wait<0>();
            fence_operands(dp);
            score_gradients(dp, p16, ds16);
            fence_operands(dv);
            fence_operands(dk);
            wgmma_fence();
            add_keys_by_dim<DoTile>(dv, p16, do_cols);
            add_keys_by_dim<QTile>(dk, ds16, q_cols);
            wgmma_commit();
            if (kDqTurns && group != dq_group_of(step))  // dQ's product two steps ago has read the buffer
                named_barrier_sync(kDsEmptyBarrier + buffer, kConsumerThreads);
            store_fragments(ds_tile, ds16, key0 + row_in_group, 2 * t);
            if (kDqTurns && group != dq_group_of(step)) {  // hand dS^T over while dV and dK run on
                fence_proxy_async();
                named_barrier_arrive(kDsFullBarrier + buffer, kConsumerThreads);
            }
            wgmma_wait<0>();
            fence_operands(dv);
            fence_operands(dk);
            if constexpr (kScoresAhead || kDqTurns) release(stage);  // the stage's last reader is done
        } else {
            // Warpgroup 0 computes S^T = K Q^T and P^T, warpgroup 1 dP^T = V dO^T (the same product on the other
            // tiles, so no branch around it); P^T meets dP^T in shared memory and warpgroup 1 forms dS^T.
            float sdp[kScoreAccumulators];
            fence_operands(sdp);
            wgmma_fence();
            keys_by_queries<KTile, QTile>(sdp, group == 0 ? k_rows : v_rows, group == 0 ? sq : sdo);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(sdp);
            if (group == 0) {
                probabilities(sdp, p16);
                store_fragments(smem.p[buffer], p16, row_in_group, 2 * t);
                fence_proxy_async();
            }
            consumers_sync();
            if (group == 1) {
                load_fragments(p16, smem.p[buffer], row_in_group, 2 * t);
                score_gradients(sdp, p16, ds16);
                store_fragments(ds_tile, ds16, row_in_group, 2 * t);
            }
        }
        fence_proxy_async();
        if constexpr (kDqTurns) {
            // The other warpgroup has handed its dS^T rows over (above) and goes on; dQ's warpgroup computes
            // dQ = dS K over all 128 keys and the whole head dim, hands the buffer back, and stages dQ for the writer.
            const int buffer_group = dq_group_of(step);
            if (group != buffer_group) return;
            named_barrier_sync(kDsFullBarrier + buffer, kConsumerThreads);
            float dq[kDqAccumulators];
            issue_dq(dq, ds_buffer, k_smem);
            if constexpr (kDqBuffers > 1) wait_dq_buffer(step);
            wgmma_wait<0>();
            fence_operands(dq);
            if (step + kScoreBuffers < steps) named_barrier_arrive(kDsEmptyBarrier + buffer, kConsumerThreads);
            stage_dq(dq, step);
            return;
        }
        // Deterministic mode: wait for this dQ tile's turn (the writer warp waits instead, where there is one).
        // Split keys take it once dQ is in the registers, so that a turn is held for the adds alone; split columns
        // before the step's barrier (after it their dV and dK products are in flight, and the turn's registers
        // would spill).
        auto take_turn = [&](bool wait) {
            return DqTurn(p, mask, b, head, m_tile, m0, n_block,
                          wait && !kDqWriter && !kTurnKeeper && threadIdx.x == kWarpgroupThreads);
        };
        if constexpr (kDqPass) {  // dV and dK alone: dQ is the dQ pass's (bwd_dq.cuh)
            consumers_sync();
            fence_operands(dv);
            fence_operands(dk);
            wgmma_fence();
            add_keys_by_dim<DoTile>(dv, smem_addr(smem.p[buffer]), do_cols);
            add_keys_by_dim<QTile>(dk, smem_addr(ds_tile), q_cols);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(dv);
            fence_operands(dk);
            return;
        }
        const DqTurn early_turn = take_turn(!kSplitKeys);
        consumers_sync();

        // dQ for this warpgroup's piece. With the columns split, dV and dK follow in a second commit group and run on
        // while dQ's reductions issue; either way every product has finished before the step hands its stage back.
        float dq[kDqAccumulators];
        issue_dq(dq, ds_buffer, k_cols);
        if constexpr (kDqWriter && kDqBuffers > 1) wait_dq_buffer(step);
        if constexpr (!kSplitKeys) {
            fence_operands(dv);
            fence_operands(dk);
            add_keys_by_dim<DoTile>(dv, smem_addr(smem.p[buffer]), do_cols);
            add_keys_by_dim<QTile>(dk, smem_addr(ds_tile), q_cols);
            wgmma_commit();
        }
        if constexpr (kScoresAhead) {
            // The next step's S^T goes in behind dQ. (Each path with its own wait: a product under a condition
            // between commits would serialise every product.)
            if (step + 1 < steps) {
                const int next = (step + 1) % kStages;
                mbarrier_wait(full + next * kMbarrierBytes, ((step + 1) / kStages) & 1);
                issue_scores(next);
                wgmma_wait<1>();
            } else {
                wgmma_wait<0>();
            }
        } else {
            wgmma_wait<kSplitKeys ? 0 : 1>();
        }
        fence_operands(dq);
        const DqTurn turn = kSplitKeys ? take_turn(true) : early_turn;
        if constexpr (kTurnKeeper) named_barrier_sync(kTurnTakenBarrier, kDqHandoffThreads);  // the keeper's acquire
        else if (kSplitKeys && !kDqWriter && turn.turn != nullptr) consumers_sync();  // the leader's acquire, for all

        if constexpr (kDqWriter) {
            stage_dq(dq, step);
        } else {
            const i64 row0 = pr0.scratch_offset + (head - h_first) * p.scratch_head_stride + m0;
            float* accum = p.dq_accum + row0 * kHeadDim;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = dq_row0 + row_in_group + 8 * half;
                if (m0 + row >= pr0.seqlen_q) continue;
#pragma unroll
                for (int j = 0; j < kDqCols / kMmaN; ++j)
                    red_add2(accum + row * kHeadDim + dq_col0 + j * kMmaN + 2 * t, dq[4 * j + 2 * half],
                             dq[4 * j + 2 * half + 1]);
            }
        }
        wgmma_wait<0>();
        if constexpr (kScoresAhead) {
            fence_operands(s_ahead);  // the next step's S^T (the loop's own wait: see below)
        } else {
            fence_operands(dv);
            fence_operands(dk);
        }
        if constexpr (kTurnKeeper) named_barrier_arrive(kAddsIssuedBarrier, kDqHandoffThreads);
        else if constexpr (!kDqWriter) turn.pass(consumers_sync, threadIdx.x == kWarpgroupThreads);
    };

    // Main loop over (query head, query tile) steps: wait for the step's stage, run it, hand the stage back. With
    // kScoresAhead the step before waits for the stage and issues its S^T (the first step's is waited for here:
    // ptxas follows the wgmma groups into a loop's body, not around it, and would serialise every product), and
    // the step hands its stage back once it has read it.
    if (kScoresAhead && steps > 0) {
        mbarrier_wait(full, 0);
        issue_scores(0);
        wgmma_wait<0>();
        fence_operands(s_ahead);
    }
    if constexpr (kDqTurns) {  // each dS^T buffer starts free
        for (int buffer = 0; buffer < min(steps, kScoreBuffers); ++buffer)
            if (group == dq_group_of(buffer)) named_barrier_arrive(kDsEmptyBarrier + buffer, kConsumerThreads);
    }
    for (int step = 0; step < steps; ++step) {
        const int stage = step % kStages, m0 = m_tile_of(step) * kBlockM;
        if (!kScoresAhead) mbarrier_wait(full + stage * kMbarrierBytes, (step / kStages) & 1);
        step_body(step, stage, !mask.tile_unmasked(m0, min(m0 + kBlockM, pr0.seqlen_q), n0, n0 + kBlockN));
        if (!kScoresAhead && !kDqTurns) release(stage);
    }

    // Every consumer is past its last product (which read K): K and V's tiles are free to stage dK and dV, which
    // the producer warp stores (above) once every consumer has staged its part.
    consumers_sync();
    const int slab_row0 = key0 + (warp % kWarpgroupWarps) * kMmaM;
    stage_tile<KTile>(smem.k, as_slab(dk), f.softmax_scale, slab_row0, grad_col0);
    stage_tile<VTile>(smem.v, as_slab(dv), 1.f, slab_row0, grad_col0);
    fence_proxy_async();  // this thread's staged elements, before the copy engine reads them
    named_barrier_arrive(kEpilogueBarrier, kEpilogueThreads);
}

#if FT_DQ_PASS
#include "bwd_dq.cuh"
#endif
