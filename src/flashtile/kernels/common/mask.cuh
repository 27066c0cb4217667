// mask.cuh — which keys a query may see: causal and sliding-window masks, bottom-right aligned.
//
// Query i sees key j when  i + offset - left <= j <= i + offset + right,  offset = seqlen_k - seqlen_q
// (the FlashAttention >= 2.1 convention: the last query row lines up with the last key). A negative
// bound is unbounded; causal attention is right = 0.
#pragma once
#include "numeric.cuh"

struct Mask {
    int left, right, offset, seqlen_k;

    __device__ __forceinline__ Mask(int left_, int right_, int seqlen_q, int seqlen_k_)
        : left(left_), right(right_), offset(seqlen_k_ - seqlen_q), seqlen_k(seqlen_k_) {}

    __device__ __forceinline__ bool allowed(int i, int j) const {
        const int diag = i + offset;
        return j < seqlen_k && (left < 0 || j >= diag - left) && (right < 0 || j <= diag + right);
    }
    // The keys row i sees are exactly [first_key(i), last_key(i)] — one pair of bounds per row instead of
    // three tests per (row, key).
    __device__ __forceinline__ int first_key(int i) const { return left < 0 ? 0 : i + offset - left; }
    __device__ __forceinline__ int end_key(int i) const { return right < 0 ? seqlen_k : min(seqlen_k, i + offset + right + 1); }

    // The transpose, for kernels whose rows are keys: the queries that see key j are exactly
    // [first_query(j), end_query(j)) — empty for a key past seqlen_k.
    static constexpr int kUnbounded = 1 << 30;
    __device__ __forceinline__ int first_query(int j) const { return right < 0 ? -kUnbounded : j - offset - right; }
    __device__ __forceinline__ int end_query(int j) const {
        return j >= seqlen_k ? first_query(j) : (left < 0 ? kUnbounded : j - offset + left + 1);
    }

    // Keys [key_begin, key_end) hold every key that any query row in [row_begin, row_end) may see.
    __device__ __forceinline__ int key_begin(int row_begin) const {
        return left < 0 ? 0 : max(0, row_begin + offset - left);
    }
    __device__ __forceinline__ int key_end(int row_end) const {
        return right < 0 ? seqlen_k : min(seqlen_k, max(0, row_end - 1 + offset + right + 1));
    }
    // The key tiles a block of query rows [row_begin, row_end) visits: `count` tiles of kBlockN keys from key
    // `begin` (a multiple of kBlockN), covering every key any of its rows may see.
    struct Tiles { int begin, count; };
    template <int kBlockN>
    __device__ __forceinline__ Tiles key_tiles(int row_begin, int row_end) const {
        const int begin = key_begin(row_begin) / kBlockN * kBlockN;
        const int end = key_end(row_end);
        return {begin, end > begin ? ceil_div(end - begin, kBlockN) : 0};
    }
    // True when every (row, key) pair of the tile is allowed, so the tile needs no masking at all.
    __device__ __forceinline__ bool tile_unmasked(int row_begin, int row_end, int key0, int key1) const {
        const bool lo_ok = left < 0 || key0 >= row_end - 1 + offset - left;
        const bool hi_ok = right < 0 || key1 - 1 <= row_begin + offset + right;
        return key1 <= seqlen_k && lo_ok && hi_ok;
    }
};
