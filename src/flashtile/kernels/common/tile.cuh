// tile.cuh — shared-memory tiles for the tensor-core kernels: a swizzled layout and asynchronous loads.
//
// A (kRows x kCols) tile of 16-bit elements is stored as kCols/32 column blocks; each block is kRows rows
// of 64 bytes (four 16-byte chunks). Chunk c of row r sits at position c ^ ((r >> 1) & 3): two rows fill
// one 128-byte line and the XOR rotates which 16-byte slot a chunk takes, so the 8 row addresses of any
// ldmatrix phase (8 consecutive rows, one chunk) land in 8 different bank groups, and the 8 threads of a
// cp.async phase (2 rows x 4 chunks) write one contiguous 128-byte line. No padding is needed, and every
// head dim that is a multiple of 32 (64, 96, 128, 192, 256) uses the same layout.
#pragma once
#include "mma.cuh"

constexpr int kBlockCols = 32;                                // elements per column block (64 bytes)
constexpr int kChunksPerBlockRow = kBlockCols / 8;            // 16-byte chunks per block row

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
    struct LaneOffsets { int parity[2]; };
    __device__ static __forceinline__ LaneOffsets fragment_lane(int lane_row, int lane_col) {
        LaneOffsets lo;
#pragma unroll
        for (int p = 0; p < 2; ++p)
            lo.parity[p] = lane_row * kBlockCols + (((2 * p + lane_col / 8) ^ ((lane_row >> 1) & 3)) * 8);
        return lo;
    }
    __device__ static __forceinline__ int fragment_offset(const LaneOffsets& lo, int row0, int col0) {
        return ((col0 / kBlockCols) * kRows + row0) * kBlockCols + lo.parity[(col0 / 16) % 2];
    }

    // Issue cp.async for rows [row0, row0 + kRows) of a (rows, dim) matrix with the given row stride.
    // Rows at or past `valid_rows` and columns at or past `dim` are zero-filled. A pass of the block
    // copies kThreads/4 rows of one column block (4 chunks per row); a thread keeps one chunk position for
    // all its passes, so its addresses differ only by compile-time offsets and a multiple of row_stride.
    template <int kThreads>
    __device__ static __forceinline__ void load_async(elem_t* tile, const elem_t* src, i64 row_stride,
                                                      int row0, int valid_rows, int dim) {
        constexpr int kRowsPerPass = kThreads / kChunksPerBlockRow;
        static_assert(kRows % kRowsPerPass == 0, "a pass must not straddle two column blocks");
        const int chunk = threadIdx.x % kChunksPerBlockRow;
        const int row = threadIdx.x / kChunksPerBlockRow;
        const elem_t* from = src + (i64)(row0 + row) * row_stride + chunk * 8;
        elem_t* to = tile + offset(row, chunk * 8);  // the swizzle depends on row % 8 only: same every pass
#pragma unroll
        for (int block = 0; block < kCols / kBlockCols; ++block)
#pragma unroll
            for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
                const int r = pass * kRowsPerPass;
                const bool valid = row0 + row + r < valid_rows && block * kBlockCols + chunk * 8 < dim;
                cp_async_16(to + (block * kRows + r) * kBlockCols,
                            valid ? from + r * row_stride + block * kBlockCols : src, valid);
            }
    }
};
