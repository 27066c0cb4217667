// wgmma/fwd.cu — rung 5 "hopper": the forward on Hopper's warpgroup products, fed by the copy engine.
//
// Idea:     rung 4's algorithm with each resource given to the unit built for it:
//           * warp specialisation: one producer warp issues the tensor memory accelerator's copies (each work
//             tile's Q into one of FT_Q_BUFFERS buffers, K and V tiles through a ring of FT_STAGES stages, each
//             slot with a "full" mbarrier the copy engine completes and an "empty" one the consumers release it
//             with), while kConsumers warpgroups of 64 query rows each compute. Nobody waits at a block-wide
//             barrier inside the loop: a consumer waits only for the tile it needs, the producer only for the
//             slot it refills;
//           * setmaxnreg moves registers from the producer warpgroup (which holds no data) to the consumers,
//             whose scores, probabilities and output accumulators all live in registers;
//           * both products on wgmma: S = Q K^T reads Q and K from shared memory (SS), O += P V takes P
//             straight from the score registers as 16-bit A fragments (RS) and V from shared memory. A
//             warpgroup's 64 x kBlockN product is one instruction stream the tensor cores run asynchronously,
//             reading each operand from shared memory once per warpgroup, where rung 4 read every fragment
//             into every warp with ldmatrix;
//           * the softmax as rung 4's: base 2 with the scale folded in, O rescaled only when a row's
//             reference maximum moves by more than 2^8, masks only on tiles that cut the mask's boundary;
//           Features: GQA/MQA, causal and sliding-window masks (bottom-right aligned), the LSE, any strides.
//           Varlen, softcap, ALiBi and head dims other than 64, 128 and 256 run on rung 4 (the registry says so).
// Removes:  rung 4's mma.sync (about two thirds of wgmma's rate), its ldmatrix traffic (every warp read every
//           K/V fragment) and its block-wide barrier per tile.
// Measured: against rung 4 in docs/ladder.md; against cuDNN and FlashAttention in docs/performance.md.
//           * overlap: a warpgroup issues S_i = Q K_i^T and O += P_{i-1} V_{i-1} together and runs the softmax
//             of S_i while P V is still on the tensor cores (O is rescaled once it lands); with ping-pong
//             (FT_PINGPONG) the consumers also take turns issuing their products, so one warpgroup's
//             exponentials run while another's products do.
//           * persistent blocks (one per SM without a mask) take the work tiles (query block, head, batch) in
//             turn; the producer loads a block's next tile (its Q into the other buffer, its first K and V) while
//             the consumers finish the last one.
//           * O leaves by the copy engine: each warp stages its 16 rows in shared memory and one lane issues their
//             tensor store, so no warp waits for another at the epilogue, and the store runs on while the warp
//             starts its next tile (persistent blocks stage O apart from Q, so Q's buffer goes back to the producer
//             as soon as the last product has read it).
//           * a consumer warpgroup computes only the key tiles its own 64 rows see: under a causal mask the
//             block's first rows stop a tile or more before its last, and rows past the sequence see none.
//           * the tail split: without a mask, the units left over after the blocks' last full round are cut by
//             key tiles and shared out evenly (TailSplit), so the last round's SMs are not idle while a few
//             blocks run whole units; the last piece of a unit to finish merges the others' partial rows.
// Wastes:   a work tile's first S and last P V run without a partner product in the same warpgroup.
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/tile.cuh"
#include "../common/tma.cuh"
#include "wgmma.cuh"

constexpr int kHeadDim = FT_HEAD_DIM;      // padded q/k head dim of this build
constexpr int kHeadDimV = FT_HEAD_DIM_V;   // padded v head dim
constexpr int kBlockM = FT_BLOCK_M;        // query rows per block: 64 per consumer warpgroup } specs.py
constexpr int kBlockN = FT_BLOCK_N;        // keys per tile                                 } HOPPER_FWD_TILES
constexpr int kStages = FT_STAGES;         // K/V stages in the ring                        } says why
constexpr bool kPingPong = FT_PINGPONG;    // consumers take turns on the tensor cores
constexpr bool kPersistent = FT_PERSISTENT;  // a block loops over work tiles; otherwise it takes one
constexpr int kQBuffers = FT_Q_BUFFERS;      // persistent blocks: the next tile's Q lands while this one runs
constexpr bool kTailSplit = FT_TAIL_SPLIT;   // persistent blocks may share the last round's units (TailSplit)
constexpr int kProducerRegisters = FT_PRODUCER_REGISTERS;  // per thread, after setmaxnreg
constexpr int kConsumerRegisters = FT_CONSUMER_REGISTERS;

constexpr int kConsumers = kBlockM / kWgmmaM;                   // consumer warpgroups
constexpr int kWarpgroupThreads = kWarpgroupWarps * kWarpSize;
constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;  // warpgroup 0 produces
static_assert(kBlockM == kConsumers * kWgmmaM, "64 query rows per consumer warpgroup");
static_assert(kHeadDim == kHeadDimV, "one head dim for q, k and v");
static_assert(kHeadDim % kSwizzleRowElems == 0, "whole 128-byte column blocks");
static_assert(kBlockN == 64 || kBlockN == 128, "score products exist for N = 64, 128");
static_assert(kStages >= 2, "the producer refills one stage while the consumers read another");

// O's columns in products of at most 128 (the widest product wgmma.cuh has), each with its own accumulators.
constexpr int kOutN = kHeadDimV < 128 ? kHeadDimV : 128;
constexpr int kOutProducts = kHeadDimV / kOutN;
constexpr int kScoreAccumulators = kBlockN / 2;   // per thread: 64 rows x kBlockN over 128 threads
constexpr int kOutAccumulators = kOutN / 2;
constexpr int kScoreSteps = kBlockN / kWgmmaK;    // k16 steps of O += P V

using QTile = SwizzledTile<kWgmmaM, kHeadDim, true>;  // one consumer's rows of Q (and of O where O has no buffer)
using OTile = SwizzledTile<kWgmmaM, kHeadDimV, true>; // one consumer's rows of O
using KTile = SwizzledTile<kBlockN, kHeadDim, true>;
using VTile = SwizzledTile<kBlockN, kHeadDimV, true>;
template <typename Tile>
constexpr u32 kColumnBlockBytes = Tile::kBlockElems * sizeof(elem_t);  // a descriptor's step from block to block
constexpr u32 kKStageBytes = KTile::kElems * sizeof(elem_t), kVStageBytes = VTile::kElems * sizeof(elem_t);
constexpr u32 kQTileBytes = QTile::kElems * sizeof(elem_t), kQBufferBytes = kConsumers * kQTileBytes;

// Persistent blocks stage O in a buffer of its own, so that the next tile's Q can land while O's store still
// reads it; a block of one tile stages O over its Q (the empty base takes no space, and its null `o` is never
// used: the code that would is under `if constexpr`, but still has to compile).
constexpr bool kOBuffer = kPersistent;
template <bool kOwn> struct OBuffer { elem_t o[kConsumers][OTile::kElems]; };
template <> struct OBuffer<false> { static constexpr elem_t (*o)[OTile::kElems] = nullptr; };

struct __align__(kSwizzleAtomBytes) SharedStorage : OBuffer<kOBuffer> {
    elem_t q[kQBuffers][kConsumers][QTile::kElems];
    elem_t k[kStages][KTile::kElems];
    elem_t v[kStages][VTile::kElems];
    unsigned long long q_full[kQBuffers];  // complete when a work tile's Q has landed in buffer b
    unsigned long long q_empty[kQBuffers]; // complete when every consumer warp is done with b
    unsigned long long k_full[kStages];    // complete when stage s's K tile has landed
    unsigned long long v_full[kStages];    // ... its V tile
    unsigned long long k_empty[kStages];   // complete when every consumer warp's S = Q K^T has read stage s's K
    unsigned long long v_empty[kStages];   // ... its O += P V has read stage s's V
    int tile_at[kQBuffers];                // persistent blocks: the place in the schedule of the tile whose Q is
    int tile_kv_base[kQBuffers];           // in buffer b (-1: the block's tiles are done), and its ring position
};

constexpr float kRescaleThreshold = 8.f;  // as rung 4 (mma/fwd.cu): O is rescaled only past 2^8
constexpr int kProducerThread = 0;
constexpr int kTurnBarrierBase = 1;  // named barrier 1 + c: consumer c's turn on the tensor cores (0 is __syncthreads)
constexpr int kTailBarrierBase = kTurnBarrierBase + kConsumers;  // kTailBarrierBase + c: consumer c's warpgroup alone
constexpr int kTailOGroups = kOutProducts * kOutAccumulators / 4;  // a thread's partial O in fours; then its row
constexpr int kTailGroups = kTailOGroups + 1;                        // maxima and row sums, four more

// The tail split (p.tail_tiles > 0: persistent blocks without a mask, where every unit has the same key tiles;
// the plan in flashtile/ladder.py turns it on). The units past the blocks' last full round ("the tail") are laid
// end to end by key tiles and dealt out in runs of p.tail_tiles, block b taking run b. A run may end inside one
// unit and go on into the next, so a block takes one or two pieces, and a unit's pieces belong to consecutive
// blocks. Each piece of a unit that more than one block shares leaves its partial rows in a slot of p.scores: a
// piece that starts a run in block b's slot, one that starts a unit inside a run in the unit's own (after the
// blocks'). A counter per tail unit and consumer, after the slots (zeroed by the plan), counts the pieces done.
struct TailSplit {
    int unit0;       // the first unit of the tail
    int units;       // units in the tail
    int unit_tiles;  // key tiles per unit
    int run;         // key tiles per block
    int blocks;

    __device__ static TailSplit of(const AttnParams& p) {
        TailSplit split;
        const int all = ceil_div(p.seqlen_q, kBlockM) * p.heads_q * p.batch;
        split.blocks = gridDim.x;
        split.unit0 = all - all % split.blocks;
        split.units = all - split.unit0;
        split.unit_tiles = ceil_div(p.seqlen_k, kBlockN);
        split.run = p.tail_tiles;
        return split;
    }
    // The tail unit of the piece at `at` in the schedule (the kernel's `settle`), or -1 outside the tail.
    __device__ int unit_at(int at) const {
        const int t = at - 2 * (unit0 + units);
        return t < 0 ? -1 : t / unit_tiles;
    }
    // Tail unit u's pieces lie in blocks first_block(u) .. last_block(u).
    __device__ int first_block(int u) const { return u * unit_tiles / run; }
    __device__ int last_block(int u) const { return ((u + 1) * unit_tiles - 1) / run; }
    __device__ int slot(int u, int block) const {
        return u * unit_tiles <= block * run ? block : blocks + u;
    }
    // Consumer c's values in a slot: four-value group i of warpgroup thread tid at [i][tid], so that a warp's
    // loads coalesce.
    __device__ float4* values(const AttnParams& p, int slot, int consumer) const {
        return reinterpret_cast<float4*>(p.scores) + (i64)(slot * kConsumers + consumer) * kTailGroups * kWarpgroupThreads;
    }
    __device__ int* counter(const AttnParams& p, int u, int consumer) const {
        return reinterpret_cast<int*>(values(p, blocks + units, 0)) + u * kConsumers + consumer;
    }
};

template <bool B> struct Bool { static constexpr bool value = B; };

// A number the producer handed over in shared memory (tile_at, tile_kv_base), read once a warp. The Q buffer's
// mbarrier orders the store before the read; the pair is stored and read by atomics all the same, because
// compute-sanitizer's racecheck follows no mbarrier handover of plain stores and would report every one.
__device__ __forceinline__ void hand_over(int* place, int value) { atomicExch(place, value); }

__device__ __forceinline__ int handed(int* place, int lane) {
    int value = 0;
    if (lane == 0) value = atomicAdd(place, 0);
    return __shfl_sync(kFullWarpMask, value, 0);
}

// S (64 rows x kBlockN keys) = Q K^T over the head dim, both K-major: a k16 step is 32 bytes along the rows,
// every fourth one a column block on.
__device__ __forceinline__ void scores(float (&s)[kScoreAccumulators], u32 q_tile, u32 k_tile) {
#pragma unroll
    for (int kk = 0; kk < kHeadDim / kWgmmaK; ++kk) {
        const int block = kk * kWgmmaK / kSwizzleRowElems;
        const u32 within = (kk * kWgmmaK % kSwizzleRowElems) * sizeof(elem_t);
        wgmma_ss<0, 0>(s, k_major(q_tile + block * kColumnBlockBytes<QTile> + within),
                       k_major(k_tile + block * kColumnBlockBytes<KTile> + within), kk > 0);
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1)
attn_fwd(const __grid_constant__ AttnParams p, const __grid_constant__ QkvoMaps maps) {
    extern __shared__ __align__(kSwizzleAtomBytes) unsigned char smem_raw[];
    SharedStorage& smem = checked_storage<SharedStorage>(smem_raw);
    const int warpgroup = uniform_warpgroup();

    // Persistent blocks (FT_PERSISTENT): block i takes the work units i, i + gridDim.x, ... (then, with a tail
    // split, its run of the last round's key tiles; the plan launches
    // one block per SM where units cost the same, one block per work tile under other masks). A unit is one work
    // tile (query block, head, batch), or under a causal mask two of one head, the heaviest and the lightest query
    // block not yet paired, so that every unit costs about the same (m_blocks + 1 key tiles). The query blocks of
    // one head are numbered together, so the blocks running at once share that head's K and V in L2. The producer
    // runs ahead into a block's next tile while its consumers finish the last one, so a tile's first K/V loads
    // overlap the previous tile's epilogue. The ring's stages and phases run on across tiles: `kv_base` counts the
    // K/V tiles a block has gone through before the current work tile.
    // Otherwise a block takes the one work tile its place in the (query blocks, heads, batch) grid names.
    struct Work {
        int m0, m1, h, b;
        Problem pr;
        Mask::Tiles tiles;
    };
    auto work_at = [&](int m_block, int h, int b) {
        const int m_blocks = ceil_div(p.seqlen_q, kBlockM);
        const int m_shift = (m_blocks * kBlockM - p.seqlen_q) / kWgmmaM * kWgmmaM;
        Work w;
        w.h = h;
        w.b = b;
        w.pr = locate_problem(p, b, h);
        w.m0 = m_block * kBlockM - m_shift;
        w.m1 = min(w.m0 + kBlockM, w.pr.seqlen_q);
        const Mask mask(p.window_left, p.window_right, w.pr.seqlen_q, w.pr.seqlen_k);
        const int first_row = max(w.m0, 0);
        w.tiles = first_row < w.m1 ? mask.key_tiles<kBlockN>(first_row, w.m1) : Mask::Tiles{0, 0};
        return w;
    };
    // One tile: heaviest first (under a causal mask the last query block sees the most keys).
    const Work single = kPersistent ? Work{} : work_at(gridDim.x - 1 - blockIdx.x, blockIdx.y, blockIdx.z);
    if (!kPersistent && single.m0 >= single.pr.seqlen_q) return;
    // The persistent schedule. A block's place in it is one number, `at`: 2 unit + part over the whole units (a
    // causal unit's second work tile is part 1), then, with a tail split, 2 units + t over the tail's key tiles
    // (TailSplit). Whole units: all of them, or with a tail split the rounds in which every block has one; then the
    // block's run of the tail, a piece per unit it crosses. The producer walks the schedule and leaves each tile's
    // place beside its Q (tile_at), so that the consumers keep no schedule of their own through their loop.
    auto settle = [&](int at) {  // `at`, or where the schedule goes on from it; -1 past the block's last tile
        const int m_blocks = ceil_div(p.seqlen_q, kBlockM);
        const bool paired = p.window_left < 0 && p.window_right == 0;
        const int units = (paired ? ceil_div(m_blocks, 2) : m_blocks) * p.heads_q * p.batch;
        const int run = p.tail_tiles;  // (a tail split is never paired)
        if (at < 2 * units && (run == 0 || at / 2 - (int)blockIdx.x + (int)gridDim.x <= units)) return at;
        if (run == 0) return -1;
        const int unit0 = units - units % gridDim.x, unit_tiles = ceil_div(p.seqlen_k, kBlockN);
        if (at <= 2 * units) at = 2 * units + blockIdx.x * run;  // past the whole rounds: on to the block's run
        return at - 2 * units < min((int)(blockIdx.x + 1) * run, (units - unit0) * unit_tiles) ? at : -1;
    };
    // The work tile at `at` (settled), and the place after it. Round r's units go to the blocks rotated by r: where
    // the blocks are a multiple of the units per head, dealing units out in turn would give each block the same
    // unit of every head it takes, and the units that cost less (without a mask, a sequence that is not a multiple
    // of kBlockM leaves each head one short query block; under a causal mask, an odd count of query blocks leaves
    // the middle one unpaired, at half a pair's cost) would all go to the same few blocks. The same units still run
    // together (L2 sharing is unchanged). Causal units of an even count cost alike and are dealt out in turn
    // (rotated, they measured slower: docs/notes.md, session thirty-four).
    auto work_of = [&](int at, int& next) {
        const int m_blocks = ceil_div(p.seqlen_q, kBlockM);
        const bool paired = p.window_left < 0 && p.window_right == 0;
        const int unit_blocks = paired ? ceil_div(m_blocks, 2) : m_blocks;  // query blocks' units per head
        const int units = unit_blocks * p.heads_q * p.batch;
        if (at < 2 * units) {
            const int unit = at / 2, part = at % 2;
            const int round = unit / (int)gridDim.x, first = round * (int)gridDim.x;
            const int width = min((int)gridDim.x, units - first);
            const bool rotated = !paired || m_blocks % 2 == 1;
            const int tile_unit = rotated ? first + (unit - first + round) % width : unit;
            const int j = tile_unit % unit_blocks, hb = tile_unit / unit_blocks;
            // A causal unit's second tile, unless the first was the middle query block of an odd count.
            // (Past the last unit, the place is 2 units, which settle reads as the start of the block's run.)
            next = settle(part == 0 && paired && 2 * j + 1 != m_blocks ? at + 1 : 2 * min(unit + (int)gridDim.x, units));
            return work_at(part == 0 ? m_blocks - 1 - j : j, hb % p.heads_q, hb / p.heads_q);
        }
        const int unit0 = units - units % gridDim.x, unit_tiles = ceil_div(p.seqlen_k, kBlockN);
        const int t = at - 2 * units, end = min((int)(blockIdx.x + 1) * p.tail_tiles, (units - unit0) * unit_tiles);
        const int u = t / unit_tiles, first = t - u * unit_tiles, hb = (unit0 + u) / unit_blocks;
        Work w = work_at(m_blocks - 1 - (unit0 + u) % unit_blocks, hb % p.heads_q, hb / p.heads_q);
        w.tiles.begin += first * kBlockN;
        w.tiles.count = min(end - t, unit_tiles - first);
        next = settle(at + w.tiles.count);
        return w;
    };

    const u32 q_smem = smem_addr(smem.q[0][0]), k_smem = smem_addr(smem.k[0]), v_smem = smem_addr(smem.v[0]);
    const u32 q_full = smem_addr(smem.q_full), q_empty = smem_addr(smem.q_empty);
    const u32 k_full = smem_addr(smem.k_full), v_full = smem_addr(smem.v_full);
    const u32 k_empty = smem_addr(smem.k_empty), v_empty = smem_addr(smem.v_empty);
    if (threadIdx.x == kProducerThread) {
        for (int b = 0; b < kQBuffers; ++b) {
            mbarrier_init(q_full + b * kMbarrierBytes, 1);
            mbarrier_init(q_empty + b * kMbarrierBytes, kConsumers * kWarpgroupWarps);
        }
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(k_full + s * kMbarrierBytes, 1);
            mbarrier_init(v_full + s * kMbarrierBytes, 1);
            mbarrier_init(k_empty + s * kMbarrierBytes, kConsumers * kWarpgroupWarps);
            mbarrier_init(v_empty + s * kMbarrierBytes, kConsumers * kWarpgroupWarps);
        }
        mbarrier_init_fence();
    }
    __syncthreads();  // the last block-wide barrier: from here on the warpgroups meet only at mbarriers

    if (warpgroup == 0) {
        // Producer: each work tile's Q into a Q buffer, once the tile that used the buffer before has stored its
        // O from there; then K and V tiles into the ring, in the consumers' order, each as soon as its slot is
        // free (a K slot frees a round before its V slot: S = Q K^T reads it first). The maps see Q, K and V as
        // (head dim, rows, heads, batch); rows past the sequence read as zeros. A persistent block's producer
        // reaches a tile's Q while the consumers still run the tile before, so that Q is there when they start.
        setmaxnreg_dec<kProducerRegisters>();
        if (threadIdx.x != kProducerThread) return;
        auto produce = [&](const Work& w, int kv_base, int n, int at) {
            const int buffer = n % kQBuffers, use = n / kQBuffers;
            const u32 q_bar = q_full + buffer * kMbarrierBytes;
            if (use > 0) mbarrier_wait(q_empty + buffer * kMbarrierBytes, (use - 1) & 1);
            if constexpr (kPersistent) {  // published by the arrival below
                hand_over(&smem.tile_at[buffer], at);
                hand_over(&smem.tile_kv_base[buffer], kv_base);
            }
            mbarrier_arrive_expect_bytes(q_bar, kQBufferBytes);
#pragma unroll
            for (int c = 0; c < kConsumers; ++c)
#pragma unroll
                for (int blk = 0; blk < kHeadDim / kSwizzleRowElems; ++blk)
                    tma_load_4d(q_smem + (buffer * kConsumers + c) * kQTileBytes + blk * kColumnBlockBytes<QTile>,
                                maps.q, blk * kSwizzleRowElems, (int)w.pr.q_start + w.m0 + c * kWgmmaM, w.h, w.b,
                                q_bar);
            const int map_row0 = (int)w.pr.k_start, map_head = w.h / p.group, map_batch = w.b;
            for (int it = 0; it < w.tiles.count; ++it) {
                const int ring = kv_base + it, stage = ring % kStages, round = ring / kStages;
                const int n0 = w.tiles.begin + it * kBlockN;
                const u32 k_bar = k_full + stage * kMbarrierBytes, v_bar = v_full + stage * kMbarrierBytes;
                if (round > 0) mbarrier_wait(k_empty + stage * kMbarrierBytes, (round - 1) & 1);
                mbarrier_arrive_expect_bytes(k_bar, kKStageBytes);
#pragma unroll
                for (int blk = 0; blk < kHeadDim / kSwizzleRowElems; ++blk)
                    tma_load_4d(k_smem + stage * kKStageBytes + blk * kColumnBlockBytes<KTile>, maps.k,
                                blk * kSwizzleRowElems, map_row0 + n0, map_head, map_batch, k_bar);
                if (round > 0) mbarrier_wait(v_empty + stage * kMbarrierBytes, (round - 1) & 1);
                mbarrier_arrive_expect_bytes(v_bar, kVStageBytes);
#pragma unroll
                for (int blk = 0; blk < kHeadDimV / kSwizzleRowElems; ++blk)
                    tma_load_4d(v_smem + stage * kVStageBytes + blk * kColumnBlockBytes<VTile>, maps.v,
                                blk * kSwizzleRowElems, map_row0 + n0, map_head, map_batch, v_bar);
            }
        };
        if constexpr (kPersistent) {
            int n = 0, kv_base = 0;
            for (int at = settle(2 * blockIdx.x), next; at >= 0; at = next, ++n) {
                const Work w = work_of(at, next);
                const int next_base = kv_base + w.tiles.count;
                produce(w, kv_base, n, at);
                kv_base = next_base;
            }
            // The end, for the consumers: a place of -1 beside the next Q buffer, once that buffer is free.
            const int buffer = n % kQBuffers, use = n / kQBuffers;
            if (use > 0) mbarrier_wait(q_empty + buffer * kMbarrierBytes, (use - 1) & 1);
            hand_over(&smem.tile_at[buffer], -1);
            mbarrier_arrive(q_full + buffer * kMbarrierBytes);
        } else {
            produce(single, 0, 0, 0);
        }
        return;
    }

    // Consumers: warpgroup c owns query rows [64 (c - 1), 64 c) of each work tile.
    setmaxnreg_inc<kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const int tid = threadIdx.x % kWarpgroupThreads, warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int g = lane / kQuad, t = lane % kQuad;
    const float log2_factor = p.scale_log2;
    // Ping-pong: the consumers take turns issuing their products (named barriers in a ring), so that while one
    // warpgroup's products run on the tensor cores the others compute their softmax. Each round of products is
    // bracketed by waiting for this warpgroup's turn and passing the turn on. A work tile with keys takes every
    // consumer the same number of rounds, and the ring runs on from tile to tile: a consumer starts its next
    // tile's products while the others finish the last one. The last consumer hands out the first turn before the
    // block's first round; consumer 0 takes the last round's pass after the block's last tile.
    auto turn_begin = [&] {
        if constexpr (kPingPong) named_barrier_sync(kTurnBarrierBase + consumer, 2 * kWarpgroupThreads);
    };
    auto turn_end = [&] {
        if constexpr (kPingPong) named_barrier_arrive(kTurnBarrierBase + (consumer + 1) % kConsumers, 2 * kWarpgroupThreads);
    };
    bool took_turns = false;  // this block has had a round of products (the same for every consumer)
    auto consume = [&](const Work& w, int kv_base, int n) {
        const Problem& pr = w.pr;
        const int m0 = w.m0, n_begin = w.tiles.begin, n_tiles = w.tiles.count;
        const Mask mask(p.window_left, p.window_right, pr.seqlen_q, pr.seqlen_k);
        const int row0 = m0 + consumer * kWgmmaM;         // this warpgroup's first query row
        const int warp_row0 = row0 + warp * kMmaM;        // this warp's; a lane has rows g and g + 8 from it

        // Q: this warpgroup's rows in the tile's Q buffer (rows past the sequence and columns past the real head
        // dim read as zeros).
        const int buffer = n % kQBuffers;
        const u32 q_tile = q_smem + (buffer * kConsumers + consumer) * kQTileBytes;
        mbarrier_wait(q_full + buffer * kMbarrierBytes, (n / kQBuffers) & 1);

        float o[kOutProducts][kOutAccumulators] = {};
        float row_max[2] = {kNegInf, kNegInf}, row_sum[2] = {0.f, 0.f};  // rows g and g + 8 of this warp
        float s[kScoreAccumulators];   // the scores of the tile being softmaxed, then its probabilities
        u32 p16[kScoreSteps][4];       // the probabilities of the tile whose O += P V is in flight

        // The softmax of tile `it`'s scores in s: the mask (boundary tiles only), the rows' reference maxima (moved
        // only when a score passes them by more than the threshold), P = exp2(s * factor - m_ref * factor) in place,
        // the row sums. Returns whether O must be rescaled, by `correction` per row, before P V is added.
        float correction[2];
        auto softmax = [&](int it, auto masked) {
            const int n0 = n_begin + it * kBlockN;
            float tile_max[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = warp_row0 + g + 8 * half;
                const int col0 = n0 + 2 * t;  // columns relative to this lane's first: the row sees keys [lo, hi)
                const int lo = mask.first_key(row) - col0, hi = mask.end_key(row) - col0;
                float mx = kNegInf;
#pragma unroll
                for (int j = 0; j < kBlockN / kMmaN; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& x = s[4 * j + 2 * half + e];
                        if constexpr (decltype(masked)::value) {
                            const int col = j * kMmaN + e;
                            if (col < lo || col >= hi) x = kNegInf;
                        }
                        mx = fmaxf(mx, x);
                    }
                tile_max[half] = quad_max(mx);
            }
            bool moved = false;
#pragma unroll
            for (int half = 0; half < 2; ++half)
                moved |= (tile_max[half] - row_max[half]) * log2_factor > kRescaleThreshold;
            const bool rescale = __any_sync(kFullWarpMask, moved);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                correction[half] = 1.f;
                if (rescale) {
                    const float m_new = fmaxf(row_max[half], tile_max[half]);
                    correction[half] = m_new == kNegInf ? 1.f : fast_exp2((row_max[half] - m_new) * log2_factor);
                    row_max[half] = m_new;
                    row_sum[half] *= correction[half];
                }
                const float shift = row_max[half] == kNegInf ? 0.f : row_max[half] * log2_factor;
                float tile_sum = 0.f;
#pragma unroll
                for (int j = 0; j < kBlockN / kMmaN; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& x = s[4 * j + 2 * half + e];
                        x = fast_exp2(x * log2_factor - shift);
                        tile_sum += x;
                    }
                row_sum[half] += tile_sum;
            }
            return rescale;
        };
        auto softmax_of = [&](int it) {
            const int n0 = n_begin + it * kBlockN;
            return mask.tile_unmasked(row0, min(row0 + kWgmmaM, pr.seqlen_q), n0, n0 + kBlockN)
                       ? softmax(it, Bool<false>()) : softmax(it, Bool<true>());
        };
        auto to_p16 = [&] {
#pragma unroll
            for (int kk = 0; kk < kScoreSteps; ++kk)
                accumulators_to_a(p16[kk], n8_tile(s, 2 * kk), n8_tile(s, 2 * kk + 1));
        };
        auto fence_o = [&] {
#pragma unroll
            for (int n = 0; n < kOutProducts; ++n) fence_operands(o[n]);
        };
        // Tile `it`'s K or V slot back to the producer, once this warp's products have read it; its place in the ring.
        auto stage_of = [&](int it) { return (kv_base + it) % kStages; };
        auto phase_of = [&](int it) { return ((kv_base + it) / kStages) & 1; };
        auto release_k = [&](int it) { if (lane == 0) mbarrier_arrive(k_empty + stage_of(it) * kMbarrierBytes); };
        auto release_v = [&](int it) { if (lane == 0) mbarrier_arrive(v_empty + stage_of(it) * kMbarrierBytes); };
        auto wait_k = [&](int it) { mbarrier_wait(k_full + stage_of(it) * kMbarrierBytes, phase_of(it)); };
        auto wait_v = [&](int it) { mbarrier_wait(v_full + stage_of(it) * kMbarrierBytes, phase_of(it)); };
        auto k_tile = [&](int it) { return k_smem + stage_of(it) * kKStageBytes; };
        auto v_tile = [&](int it) { return v_smem + stage_of(it) * kVStageBytes; };

        if (kPingPong && n_tiles > 0 && !took_turns && consumer == kConsumers - 1)
            named_barrier_arrive(kTurnBarrierBase, 2 * kWarpgroupThreads);  // the ring's first turn is consumer 0's
        took_turns |= n_tiles > 0;

        // This warpgroup's own tiles [lo, hi) of the block's: its rows may see fewer keys than the block's (under a
        // causal mask the first rows stop a tile or more early; rows past the sequence see none). The others it
        // passes on: it hands their ring slots back once they have landed (an early release would count toward the
        // slot's previous round) and takes its turns without products, so the turns keep their order.
        const int row1 = min(row0 + kWgmmaM, pr.seqlen_q);
        const Mask::Tiles own = 0 <= row0 && row0 < row1 ? mask.key_tiles<kBlockN>(row0, row1) : Mask::Tiles{0, 0};
        // (A tail piece's tiles are a part of the unit's: its rows' own tiles are clipped to them.)
        const int lo = own.count > 0 ? max((own.begin - n_begin) / kBlockN, 0) : n_tiles;
        const int hi = own.count > 0 ? min((own.begin - n_begin) / kBlockN + own.count, n_tiles) : n_tiles;
        auto pass = [&](int it) {
            wait_k(it);
            release_k(it);
            wait_v(it);
            release_v(it);
            turn_begin();
            turn_end();
        };
        for (int it = 0; it < lo; ++it) pass(it);
        if (lo == hi && n_tiles > 0) {  // no tile of its own: one round without products, for the last one
            turn_begin();
            turn_end();
        }

        // The loop keeps two products in flight: round `it` issues S_it = Q K_it^T and O += P_{it-1} V_{it-1}, then
        // runs the softmax of S_it while P V still runs; O is rescaled once P V has landed.
        if (lo < hi) {
            wait_k(lo);
            turn_begin();
            fence_operands(s);
            wgmma_fence();
            scores(s, q_tile, k_tile(lo));
            wgmma_commit();
            turn_end();
            wgmma_wait<0>();
            fence_operands(s);
            release_k(lo);
            softmax_of(lo);  // O is still zero: nothing to rescale
            to_p16();
        }
        for (int it = lo + 1; it < hi; ++it) {
            wait_k(it);
            wait_v(it - 1);
            turn_begin();
            fence_operands(s);
            fence_o();
            wgmma_fence();
            scores(s, q_tile, k_tile(it));
            wgmma_commit();
            add_products_rs(o, p16, v_tile(it - 1), kColumnBlockBytes<VTile>);  // O += P V
            wgmma_commit();
            turn_end();
            wgmma_wait<1>();
            fence_operands(s);
            release_k(it);
            const bool rescale = softmax_of(it);
            wgmma_wait<0>();
            fence_o();
            release_v(it - 1);
            if (rescale) {
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int n = 0; n < kOutProducts; ++n)
#pragma unroll
                        for (int j = 0; j < kOutN / kMmaN; ++j) {
                            o[n][4 * j + 2 * half] *= correction[half];
                            o[n][4 * j + 2 * half + 1] *= correction[half];
                        }
            }
            to_p16();
        }
        if (lo < hi) {
            wait_v(hi - 1);
            turn_begin();
            fence_o();
            wgmma_fence();
            add_products_rs(o, p16, v_tile(hi - 1), kColumnBlockBytes<VTile>);
            wgmma_commit();
            turn_end();
            wgmma_wait<0>();
            fence_o();
            release_v(hi - 1);
        }
        for (int it = hi; it < n_tiles; ++it) pass(it);

        // The epilogue works its offsets (and its Q buffer's mbarrier address) out again rather than keep them live
        // through the loop (as the consumers take their schedule from shared memory): the loop keeps those registers.
        const Problem late = locate_problem(p, w.b, w.h);
        const int at = kTailSplit ? handed(&smem.tile_at[buffer], lane) : 0;  // read before the buffer goes back
        if constexpr (kOBuffer) {  // the last product that reads Q has landed in this warp
            __syncwarp();
            if (lane == 0) mbarrier_arrive(smem_addr(&smem.q_empty[buffer]));
        }
        // The end of a tail piece (TailSplit). A piece of a unit that other blocks share leaves its rows' partial O,
        // row maxima and row sums in its slot and counts itself done; the last of the unit's pieces to finish merges
        // every piece's, in block order (the same bits whichever finishes last), into o, row_max and row_sum and runs
        // the epilogue; the others end here. (Written out here, not in a function: o passed by reference went to
        // local memory.)
        if constexpr (kPersistent && kTailSplit) {
            if (p.tail_tiles > 0) {
                const TailSplit split = TailSplit::of(p);
                const int u = split.unit_at(at);
                if (u >= 0 && split.first_block(u) != split.last_block(u)) {
                    const int first = split.first_block(u), last = split.last_block(u);
                    float4* mine = split.values(p, split.slot(u, blockIdx.x), consumer) + tid;
#pragma unroll
                    for (int i = 0; i < kTailOGroups; ++i) {
                        const float* four = &o[4 * i / kOutAccumulators][4 * i % kOutAccumulators];
                        __stcg(mine + i * kWarpgroupThreads, make_float4(four[0], four[1], four[2], four[3]));
                    }
                    __stcg(mine + kTailOGroups * kWarpgroupThreads,
                           make_float4(row_max[0], row_max[1], row_sum[0], row_sum[1]));
                    __threadfence();  // this thread's values, before the count that publishes them
                    named_barrier_sync(kTailBarrierBase + consumer, kWarpgroupThreads);
                    bool finished = false;
                    if (tid == 0) finished = atomicAdd(split.counter(p, u, consumer), 1) == last - first;
                    if (!uniform(named_barrier_any(kTailBarrierBase + consumer, kWarpgroupThreads, finished))) return;
                    __threadfence();  // every piece's values, after the count that saw them all

#pragma unroll
                    for (int n = 0; n < kOutProducts; ++n)
#pragma unroll
                        for (int j = 0; j < kOutAccumulators; ++j) o[n][j] = 0.f;
#pragma unroll
                    for (int half = 0; half < 2; ++half) row_max[half] = kNegInf, row_sum[half] = 0.f;
#pragma unroll 1
                    for (int b = first; b <= last; ++b) {
                        const float4* part = split.values(p, split.slot(u, b), consumer) + tid;
                        const float4 rows = __ldcg(part + kTailOGroups * kWarpgroupThreads);
                        float keep[2], take[2];  // the factors of the rows merged so far and of this piece's
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const float part_max = half == 0 ? rows.x : rows.y;
                            const float part_sum = half == 0 ? rows.z : rows.w;
                            const float m = fmaxf(row_max[half], part_max);
                            keep[half] = row_max[half] == kNegInf ? 0.f : fast_exp2((row_max[half] - m) * log2_factor);
                            take[half] = part_max == kNegInf ? 0.f : fast_exp2((part_max - m) * log2_factor);
                            row_max[half] = m;
                            row_sum[half] = row_sum[half] * keep[half] + part_sum * take[half];
                        }
#pragma unroll
                        for (int i = 0; i < kTailOGroups; ++i) {  // a group holds e = 0, 1 of rows g and g + 8
                            const float4 x = __ldcg(part + i * kWarpgroupThreads);
                            float* four = &o[4 * i / kOutAccumulators][4 * i % kOutAccumulators];
                            four[0] = four[0] * keep[0] + x.x * take[0];
                            four[1] = four[1] * keep[0] + x.y * take[0];
                            four[2] = four[2] * keep[1] + x.z * take[1];
                            four[3] = four[3] * keep[1] + x.w * take[1];
                        }
                    }
                }
            }
        }
        // Epilogue: normalise; stage this warp's 16 rows of O (once its last store has read them), with the LSE
        // beside it; one lane stores them, a column block at a time, if any of them lies in the sequence (a box
        // wholly outside the tensor is not a legal store); the map leaves out rows past the sequence and columns
        // past the real head dim.
        elem_t* o_rows = kOBuffer ? smem.o[consumer] : smem.q[buffer][consumer];
        if (kOBuffer && lane == 0) bulk_wait_all<true>();
        __syncwarp();
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int local_row = warp * kMmaM + g + 8 * half;
            const float l = quad_sum(row_sum[half]);
            const float inv_l = saw_keys(l) ? 1.f / l : 0.f;
#pragma unroll
            for (int n = 0; n < kOutProducts; ++n)
#pragma unroll
                for (int j = 0; j < kOutN / kMmaN; ++j)
                    *reinterpret_cast<u32*>(o_rows + OTile::offset(local_row, n * kOutN + j * kMmaN + 2 * t)) =
                        pack2<elem_t>(o[n][4 * j + 2 * half] * inv_l, o[n][4 * j + 2 * half + 1] * inv_l);
            const int row = row0 + local_row;
            if (p.lse != nullptr && t == 0 && 0 <= row && row < late.seqlen_q)
                p.lse[late.lse_offset + row] =
                    saw_keys(l) ? (row_max[half] * log2_factor + __log2f(l)) / kLog2e : kNegInf;
        }
        fence_proxy_async();  // the staged rows, visible to the copy engine
        __syncwarp();
        if (lane == 0 && warp_row0 + kMmaM > 0 && warp_row0 < late.seqlen_q) {
            const u32 warp_rows = smem_addr(o_rows) + warp * kMmaM * kSwizzleRowBytes;
#pragma unroll
            for (int blk = 0; blk < kHeadDimV / kSwizzleRowElems; ++blk)
                tma_store_4d(maps.o, warp_rows + blk * kColumnBlockBytes<OTile>, blk * kSwizzleRowElems,
                             (int)late.q_start + warp_row0, w.h, w.b);
            bulk_commit();
        }
    };
    if constexpr (kPersistent) {
        for (int n = 0;; ++n) {  // the tiles the producer names beside their Q, until it names none
            const int buffer = n % kQBuffers;
            mbarrier_wait(q_full + buffer * kMbarrierBytes, (n / kQBuffers) & 1);
            const int at = handed(&smem.tile_at[buffer], lane);
            if (at < 0) break;
            int next;
            consume(work_of(at, next), handed(&smem.tile_kv_base[buffer], lane), n);
        }
    } else {
        consume(single, 0, 0);
    }
    if (kPingPong && took_turns && consumer == 0) turn_begin();  // the last round's pass, which nobody else takes
    if (lane == 0) bulk_wait_all<true>();  // the last stores have read shared memory before the block leaves it
}
