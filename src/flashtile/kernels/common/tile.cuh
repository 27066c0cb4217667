// tile.cuh — shared-memory tiles for the tensor-core kernels: a swizzled layout and asynchronous loads.
//
// A (kRows x kCols) tile of 16-bit elements is stored as kCols/32 column blocks; each block is kRows rows
// of 64 bytes (four 16-byte chunks). Chunk c of row r sits at position c ^ ((r >> 1) & 3): two rows fill
// one 128-byte line and the XOR rotates which 16-byte slot a chunk takes, so the 8 row addresses of any
// ldmatrix phase (8 consecutive rows, one chunk) land in 8 different bank groups, and the 8 threads of a
// cp.async phase (2 rows x 4 chunks) write one contiguous 128-byte line. No padding is needed, and every
// head dim that is a multiple of 32 (64, 96, 128, 192, 256) uses the same layout. TileLoader streams tiles
// of a global matrix into that layout with cp.async.
#pragma once
#include "mma.cuh"

constexpr int kBlockCols = 32;                                // elements per column block (64 bytes)
constexpr int kChunksPerBlockRow = kBlockCols / 8;            // 16-byte chunks per block row

// Per-lane part of an ldmatrix address (see SwizzledTile::fragment_lane); the same for every tile height.
struct LaneOffsets { int parity[2]; };

template <int kRows, int kCols>
struct SwizzledTile {
    static_assert(kCols % kBlockCols == 0, "tile width must be a multiple of 32 elements");
    static constexpr int kElems = kRows * kCols;

    // Element offset of (row, col); col must be a multiple of 8 when the address feeds ldmatrix/cp.async.
    __device__ static __forceinline__ int offset(int row, int col) {
        const int block = col / kBlockCols, chunk = (col % kBlockCols) / 8;
        return (block * kRows + row) * kBlockCols + ((chunk ^ ((row >> 1) & 3)) * 8) + col % 8;
    }

    // ldmatrix addressing. A lane supplies row R + lane_row, column C + lane_col of an 8x8 matrix, with R a
    // multiple of 8, C a multiple of 16 and lane_col 0 or 8. Then the swizzle term depends only on the lane and
    // on the parity of C / 16, so `fragment_lane` computes it once per lane and `fragment_offset` adds the
    // compile-time part: in an unrolled loop every ldmatrix address is one register plus an immediate.
    __device__ static __forceinline__ LaneOffsets fragment_lane(int lane_row, int lane_col) {
        LaneOffsets lo;
#pragma unroll
        for (int p = 0; p < 2; ++p)
            lo.parity[p] = lane_row * kBlockCols + (((2 * p + lane_col / 8) ^ ((lane_row >> 1) & 3)) * 8);
        return lo;
    }
    __device__ static __forceinline__ int fragment_offset(const LaneOffsets& lo, int row0, int col0) {
        // A select, not an index: with a run-time col0 an indexed register array would go to local memory.
        return ((col0 / kBlockCols) * kRows + row0) * kBlockCols + ((col0 / 16) % 2 ? lo.parity[1] : lo.parity[0]);
    }
};

// Streams (kRows x kCols) tiles of a row-major global matrix into SwizzledTile shared memory with cp.async.
// Everything that does not change from tile to tile — this thread's source column, its swizzled destination,
// which column blocks lie inside the real head dim — is computed once, so issuing a tile costs one 64-bit
// multiply-add plus, per 16-byte copy, an address add and (only on the last, partial tile) a row test.
// A pass of the block copies kThreads/4 rows of one column block (4 chunks of 16 bytes per row).
template <int kRows, int kCols, int kThreads>
struct TileLoader {
    using Tile = SwizzledTile<kRows, kCols>;
    // A pass covers kThreads / 4 rows, or the whole tile when it is shorter (the other threads sit out).
    static constexpr int kRowsPerPass = kThreads / kChunksPerBlockRow < kRows ? kThreads / kChunksPerBlockRow : kRows;
    static constexpr bool kAllThreads = kRowsPerPass * kChunksPerBlockRow == kThreads;
    static constexpr int kBlocks = kCols / kBlockCols;
    static_assert(kRows % kRowsPerPass == 0, "a pass must not straddle two column blocks");

    const elem_t* src;   // this thread's chunk in row `row` of the matrix
    i64 row_stride;
    u32 dst;             // byte offset of this thread's chunk in a tile
    int row;             // this thread's row within each pass
    unsigned blocks_in_dim;  // bit b set: column block b starts inside the real head dim

    __device__ __forceinline__ TileLoader(const elem_t* matrix, i64 stride, int dim) : row_stride(stride) {
        const int chunk = threadIdx.x % kChunksPerBlockRow;
        row = threadIdx.x / kChunksPerBlockRow;
        src = matrix + (i64)row * stride + chunk * 8;
        dst = Tile::offset(row, chunk * 8) * (u32)sizeof(elem_t);  // the swizzle depends on row % 8 only
        blocks_in_dim = 0;
#pragma unroll
        for (int b = 0; b < kBlocks; ++b)
            if (b * kBlockCols + chunk * 8 < dim) blocks_in_dim |= 1u << b;
    }

    // Copy rows [row0, row0 + kRows) to the tile at shared address `tile`; rows >= valid_rows become zeros,
    // and so do the columns past the real head dim. Interior tiles take the unguarded path.
    // `base` moves the whole matrix (e.g. to another head) without rebuilding the loader.
    __device__ __forceinline__ void issue(u32 tile, int row0, int valid_rows, i64 base = 0) const {
        if (!kAllThreads && threadIdx.x >= kRowsPerPass * kChunksPerBlockRow) return;
        const elem_t* from = src + base + (i64)row0 * row_stride;
        if (row0 + kRows <= valid_rows && blocks_in_dim == (1u << kBlocks) - 1) {
#pragma unroll
            for (int b = 0; b < kBlocks; ++b)
#pragma unroll
                for (int pass = 0; pass < kRows / kRowsPerPass; ++pass)
                    cp_async_16(tile + dst + chunk_bytes(b, pass), from + pass * kRowsPerPass * row_stride + b * kBlockCols, true);
            return;
        }
#pragma unroll
        for (int b = 0; b < kBlocks; ++b)
#pragma unroll
            for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
                const int r = pass * kRowsPerPass;
                const bool valid = ((blocks_in_dim >> b) & 1u) && row0 + row + r < valid_rows;
                cp_async_16(tile + dst + chunk_bytes(b, pass), valid ? from + r * row_stride + b * kBlockCols : src, valid);
            }
    }

  private:
    __device__ static constexpr u32 chunk_bytes(int block, int pass) {
        return (block * kRows + pass * kRowsPerPass) * kBlockCols * (u32)sizeof(elem_t);
    }
};
