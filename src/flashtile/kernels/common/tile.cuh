// tile.cuh — shared-memory tiles for the tensor-core kernels: a swizzled layout and asynchronous loads.
//
// A (kRows x kCols) tile of 16-bit elements is stored as column blocks of kBlockCols columns; each block is
// kRows rows of kBlockCols * 2 bytes, made of 16-byte chunks whose order is XOR-swizzled by the row.
//   * Wide tiles (kWide, width a multiple of 64) use 128-byte blocks (8 chunks): chunk c of row r sits at slot
//     c ^ (r & 7). A row fills one 128-byte line, so the 8 threads of a cp.async phase copy one 128-byte
//     line of global memory into one line of shared memory (one wavefront each side), and the 8 row
//     addresses of an ldmatrix phase (8 consecutive rows, one chunk) land in 8 different slots.
//   * The others use 64-byte blocks (4 chunks): chunk c of row r sits at slot c ^ ((r >> 1) & 3); two rows
//     share a line, ldmatrix is conflict-free as above, but a cp.async phase reads two half lines of global
//     memory (two wavefronts), and 16-byte reads along a row meet 2-way bank conflicts.
// At d256 those two extras are a large share of the forward's shared-memory traffic (ncu: docs/notes.md).
// Wide blocks cost registers instead: a lane's ldmatrix offset takes 4 values per tile instead of 2, which
// tips the kernels already at 255 registers into spills, so a kernel opts in per build (specs.py says where).
// TileLoader streams tiles of a global matrix into either layout with cp.async.
#pragma once
#include "mma.cuh"

constexpr int kChunkElems = 8;  // elements per 16-byte chunk

template <bool B, typename T, typename F> struct Select { using type = T; };
template <typename T, typename F> struct Select<false, T, F> { using type = F; };

// Per-lane part of an ldmatrix address (see SwizzledTile::fragment_lane), the same for every tile height: one
// value per 16-column position within a column block — 2 for 64-byte blocks, 4 for 128-byte ones.
struct LaneOffsets { int parity[2]; };
struct WideLaneOffsets { int at[4]; };

//
// Row groups (kGroupRows < kRows): the tile is kRows / kGroupRows groups of rows stored one after the other, each
// laid out as above (its column blocks of kGroupRows rows). A tensor-map box of one page's rows by the whole width
// then lands in one piece (the decode build's small pages, kernels/mma/fwd.cu). Fragments must not straddle two
// groups: kGroupRows is a multiple of 16.
template <int kRows, int kCols, bool kWide = false, int kGroupRows = kRows>
struct SwizzledTile {
    static_assert(kCols % 32 == 0, "tile width must be a multiple of 32 elements");
    static_assert(!kWide || kCols % 64 == 0, "wide blocks need a width that is a multiple of 64");
    static_assert(kRows % kGroupRows == 0 && (kGroupRows == kRows || kGroupRows % 16 == 0),
                  "row groups divide the tile and hold whole fragments");
    static constexpr int kBlockCols = kWide ? 64 : 32;             // elements per column block
    static constexpr int kChunks = kBlockCols / kChunkElems;       // 16-byte chunks per block row
    static constexpr int kElems = kRows * kCols;
    static constexpr int kBlockElems = kRows * kBlockCols;         // one column block (without row groups)
    static constexpr int kColBlocks = kCols / kBlockCols;
    using Lane = typename Select<kWide, WideLaneOffsets, LaneOffsets>::type;

    __device__ static __forceinline__ int swizzle(int row) { return kWide ? (row & 7) : ((row >> 1) & 3); }

    // Element offset of the start of `row`'s row in column block `block` (no swizzle term).
    __device__ static __forceinline__ int row_start(int row, int block) {
        if constexpr (kGroupRows == kRows) return (block * kRows + row) * kBlockCols;
        else return ((row / kGroupRows * kColBlocks + block) * kGroupRows + row % kGroupRows) * kBlockCols;
    }

    // Element offset of (row, col); col must be a multiple of 8 when the address feeds ldmatrix/cp.async.
    __device__ static __forceinline__ int offset(int row, int col) {
        const int block = col / kBlockCols, chunk = (col % kBlockCols) / kChunkElems;
        if constexpr (kGroupRows == kRows)
            return (block * kRows + row) * kBlockCols + ((chunk ^ swizzle(row)) * kChunkElems) + col % kChunkElems;
        else return row_start(row, block) + ((chunk ^ swizzle(row)) * kChunkElems) + col % kChunkElems;
    }

    // ldmatrix addressing. A lane supplies row R + lane_row, column C + lane_col of an 8x8 matrix, with R a
    // multiple of 8, C a multiple of 16 and lane_col 0 or 8. Then the swizzle term depends only on the lane and
    // on C's 16-column position within its block, so `fragment_lane` computes it once per lane and position and
    // `fragment_offset` adds the compile-time part: in an unrolled loop every ldmatrix address is one register
    // plus an immediate.
    __device__ static __forceinline__ Lane fragment_lane(int lane_row, int lane_col) {
        Lane lo;
        if constexpr (kWide) {
#pragma unroll
            for (int p = 0; p < 4; ++p)
                lo.at[p] = lane_row * kBlockCols + (((2 * p + lane_col / kChunkElems) ^ swizzle(lane_row)) * kChunkElems);
        } else {
#pragma unroll
            for (int p = 0; p < 2; ++p)
                lo.parity[p] = lane_row * kBlockCols + (((2 * p + lane_col / kChunkElems) ^ swizzle(lane_row)) * kChunkElems);
        }
        return lo;
    }
    // Selects, not an index: with a run-time col0 an indexed register array would go to local memory.
    __device__ static __forceinline__ int fragment_offset(const Lane& lo, int row0, int col0) {
        if constexpr (kWide) {
            const int position = (col0 / 16) % 4;
            const int lane = position == 0 ? lo.at[0] : position == 1 ? lo.at[1] : position == 2 ? lo.at[2] : lo.at[3];
            if constexpr (kGroupRows == kRows) return ((col0 / kBlockCols) * kRows + row0) * kBlockCols + lane;
            else return row_start(row0, col0 / kBlockCols) + lane;
        } else {
            if constexpr (kGroupRows == kRows)
                return ((col0 / kBlockCols) * kRows + row0) * kBlockCols + ((col0 / 16) % 2 ? lo.parity[1] : lo.parity[0]);
            else return row_start(row0, col0 / kBlockCols) + ((col0 / 16) % 2 ? lo.parity[1] : lo.parity[0]);
        }
    }
};

// Streams (kRows x kCols) tiles of a row-major global matrix into SwizzledTile shared memory with cp.async.
// Everything that does not change from tile to tile — this thread's source column, its swizzled destination,
// which column blocks lie inside the real head dim — is computed once, so issuing a tile costs one 64-bit
// multiply-add plus, per 16-byte copy, an address add and (only on the last, partial tile) a row test.
// A pass of the block copies kThreads / kChunks rows of one column block (kChunks 16-byte chunks per row).
template <int kRows, int kCols, int kThreads, bool kWide = false>
struct TileLoader {
    using Tile = SwizzledTile<kRows, kCols, kWide>;
    // A pass covers kThreads / kChunks rows, or the whole tile when it is shorter (the other threads sit out).
    static constexpr int kChunks = Tile::kChunks, kBlockCols = Tile::kBlockCols;
    static constexpr int kRowsPerPass = kThreads / kChunks < kRows ? kThreads / kChunks : kRows;
    static constexpr bool kAllThreads = kRowsPerPass * kChunks == kThreads;
    static constexpr int kBlocks = kCols / kBlockCols;
    static_assert(kRows % kRowsPerPass == 0, "a pass must not straddle two column blocks");

    const elem_t* src;   // this thread's chunk in row `row` of the matrix
    i64 row_stride;
    u32 dst;             // byte offset of this thread's chunk in a tile
    int row;             // this thread's row within each pass
    unsigned blocks_in_dim;  // bit b set: column block b starts inside the real head dim

    __device__ __forceinline__ TileLoader(const elem_t* matrix, i64 stride, int dim) : row_stride(stride) {
        const int chunk = threadIdx.x % kChunks;
        row = threadIdx.x / kChunks;
        place(matrix, stride, dim, chunk);
    }
    // The same for kThreads that are a part of the block (a warpgroup): `thread` is this thread's index among them.
    __device__ __forceinline__ TileLoader(const elem_t* matrix, i64 stride, int dim, int thread) : row_stride(stride) {
        const int chunk = thread % kChunks;
        row = thread / kChunks;
        place(matrix, stride, dim, chunk);
    }

    // Copy rows [row0, row0 + kRows) to the tile at shared address `tile`; rows >= valid_rows become zeros,
    // and so do the columns past the real head dim. Interior tiles take the unguarded path.
    // `base` moves the whole matrix (e.g. to another head) without rebuilding the loader.
    __device__ __forceinline__ void issue(u32 tile, int row0, int valid_rows, i64 base = 0) const {
        if (!kAllThreads && threadIdx.x >= kRowsPerPass * kChunks) return;
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
    __device__ __forceinline__ void place(const elem_t* matrix, i64 stride, int dim, int chunk) {
        src = matrix + (i64)row * stride + chunk * kChunkElems;
        dst = Tile::offset(row, chunk * kChunkElems) * (u32)sizeof(elem_t);  // the swizzle depends on row % 8 only
        blocks_in_dim = 0;
#pragma unroll
        for (int b = 0; b < kBlocks; ++b)
            if (b * kBlockCols + chunk * kChunkElems < dim) blocks_in_dim |= 1u << b;
    }

    __device__ static constexpr u32 chunk_bytes(int block, int pass) {
        return (block * kRows + pass * kRowsPerPass) * kBlockCols * (u32)sizeof(elem_t);
    }
};
