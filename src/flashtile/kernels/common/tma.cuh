// tma.cuh — Hopper's tensor memory accelerator (sm_90): whole tiles copied global -> shared by one thread.
//
// A tensor map (CUtensorMap in cuda.h; flashtile/tma.py encodes it with cuTensorMapEncodeTiled) describes a
// 4-D view of a global tensor and a box; one `cp.async.bulk.tensor` instruction copies one box into shared
// memory, zero-filling whatever lies outside the tensor. Completion is counted in bytes on an mbarrier: the
// thread that issues the copies announces the byte count (arrive.expect_tx), the copy engine counts the
// bytes down as they land, and the barrier's phase flips when both are done. Waiting threads then see the
// data (the wait acquires it). Maps reach the kernel as a __grid_constant__ parameter, where the copy engine
// reads them.
//
// The 64-byte swizzle mode of a map writes exactly common/tile.cuh's narrow layout: a box 32 elements (64
// bytes) wide is one column block, and chunk c of row r lands in slot c ^ ((r >> 1) & 3). The pattern
// repeats every 512 bytes, so a box's destination must be 512-byte aligned.
#pragma once
#include "numeric.cuh"

struct alignas(64) TensorMap { unsigned long long opaque[16]; };
struct KvMaps { TensorMap k, v; };  // the forward's second parameter: K and V as (dim, rows, heads, batch)
struct QkvoMaps { TensorMap k, v, q, o; };  // rung 5's: K and V as above, then Q and O as (dim, rows, heads, batch)
struct BwdMaps { TensorMap k, v, q, dout; };  // the Hopper backward's: K, V, Q and dO, each as above (dO's map
                                                // follows Q's: wgmma/bwd.cu takes both through one pointer)
// ... and, where its dQ writer adds boxes, an address-free template of the fp32 dQ accumulator's map as (head dim,
// rows), which the kernel completes in global memory (tensormap_complete below).
struct BwdMapsDq : BwdMaps { TensorMap dq_template; };

constexpr int kMbarrierBytes = 8;
constexpr int kSwizzle64Period = 512;

__device__ __forceinline__ void mbarrier_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(arrivals) : "memory");
}
// Makes initialised mbarriers visible to the copy engine (the async proxy) before any copy names them.
__device__ __forceinline__ void mbarrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// One arrival (of the count the barrier was initialised with) on the barrier's current phase.
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// Blocks until the barrier has completed the phase of the given parity (0, 1, 0, ... for its successive uses).
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    asm volatile("{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}

// One box of a 2-D map at coordinates (c0 innermost, c1) into shared memory at `dst` (128-byte aligned); bytes count
// on `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap& map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(&map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// One box of a 5-D map at coordinates (c0 innermost .. c4).
__device__ __forceinline__ void tma_load_5d(u32 dst, const TensorMap& map, int c0, int c1, int c2, int c3, int c4,
                                            u32 bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
                 :: "r"(dst), "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
}

// One box of a 4-D map at coordinates (c0 innermost .. c3) into shared memory at `dst`; bytes count on `bar`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap& map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 :: "r"(dst), "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}

// The reverse: one box from shared memory at `src` into the tensor at coordinates (c0 innermost .. c3); the part of
// the box that lies outside the tensor is not written (a box wholly outside it is an illegal instruction). The
// copy runs in the background, as the bulk operations below do.
__device__ __forceinline__ void tma_store_4d(const TensorMap& map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
                 :: "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src) : "memory");
}

// One box of shared memory at `src` added (fp32) into a 2-D map's tensor at coordinates (c0 innermost, c1), in the
// background like the stores; rows of the box past the tensor's extent are not added.
__device__ __forceinline__ void tma_reduce_add_2d(const TensorMap* map, u32 src, int c0, int c1) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];"
                 :: "l"(map), "r"(c0), "r"(c1), "r"(src) : "memory");
}

// Orders this thread's copies through a map after its completion by a thread of the block (the completing
// thread's release, then a barrier of the two).
__device__ __forceinline__ void tensormap_acquire(const TensorMap* slot) {
    asm volatile("fence.proxy.tensormap::generic.acquire.cta [%0], 128;" :: "l"(slot) : "memory");
}

// A map whose address, extents or strides are known only on the device: a copy of a map encoded on the host in
// `slot` (global memory, 64-byte aligned, this block's alone), changed field by field there (sm_90a), then
// published by tensormap_publish to this thread's later copies through it, and to another thread's of the block
// after a barrier and its tensormap_acquire. One thread per slot.
__device__ __forceinline__ void tensormap_copy(TensorMap* slot, const TensorMap& from) {
#pragma unroll 4  // a few words in flight: the producer warps that copy maps have few registers
    for (int i = 0; i < 16; ++i) slot->opaque[i] = from.opaque[i];
}
__device__ __forceinline__ void tensormap_set_address(TensorMap* slot, const void* address) {
    asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;" :: "l"(slot), "l"(address)
                 : "memory");
}
// The extent of dimension kDim (0 innermost).
template <int kDim>
__device__ __forceinline__ void tensormap_set_extent(TensorMap* slot, u32 extent) {
    asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], %1, %2;" :: "l"(slot), "n"(kDim),
                 "r"(extent) : "memory");
}
// The stride of dimension kDim (1 or more: the innermost is contiguous), in bytes (a multiple of 16; the PTX of
// CUDA 12.5 and later, which NVRTC 13 is, takes bytes: before, the value without its 4 low bits).
template <int kDim>
__device__ __forceinline__ void tensormap_set_stride(TensorMap* slot, u64 bytes) {
    static_assert(kDim >= 1, "the innermost dimension has no stride");
    asm volatile("tensormap.replace.tile.global_stride.global.b1024.b64 [%0], %1, %2;" :: "l"(slot), "n"(kDim - 1),
                 "l"(bytes) : "memory");
}
// The box's extent along dimension kDim, in elements (1 to 256).
template <int kDim>
__device__ __forceinline__ void tensormap_set_box(TensorMap* slot, u32 elements) {
    asm volatile("tensormap.replace.tile.box_dim.global.b1024.b32 [%0], %1, %2;" :: "l"(slot), "n"(kDim),
                 "r"(elements) : "memory");
}
// The map's rank (1 to 5; the field holds the rank less one), its element type (kTensormapF32) and its swizzle mode
// (kTensormapNoSwizzle), each an immediate of the instruction.
constexpr u32 kTensormapF32 = 7, kTensormapNoSwizzle = 0;
template <u32 kRank>
__device__ __forceinline__ void tensormap_set_rank(TensorMap* slot) {
    asm volatile("tensormap.replace.tile.rank.global.b1024.b32 [%0], %1;" :: "l"(slot), "n"(kRank - 1) : "memory");
}
template <u32 kType>
__device__ __forceinline__ void tensormap_set_elemtype(TensorMap* slot) {
    asm volatile("tensormap.replace.tile.elemtype.global.b1024.b32 [%0], %1;" :: "l"(slot), "n"(kType) : "memory");
}
template <u32 kMode>
__device__ __forceinline__ void tensormap_set_swizzle(TensorMap* slot) {
    asm volatile("tensormap.replace.tile.swizzle_mode.global.b1024.b32 [%0], %1;" :: "l"(slot), "n"(kMode)
                 : "memory");
}
__device__ __forceinline__ void tensormap_publish(const TensorMap* slot) {
    asm volatile("fence.proxy.tensormap::generic.release.cta;" ::: "memory");
    tensormap_acquire(slot);
}

// The common case: the template's address and its dimension 1 (rows) replaced.
__device__ __forceinline__ void tensormap_complete(TensorMap* slot, const TensorMap& from, const void* address,
                                                   u32 rows) {
    tensormap_copy(slot, from);
    tensormap_set_address(slot, address);
    tensormap_set_extent<1>(slot, rows);
    tensormap_publish(slot);
}

// A 2-D map of fp32 values, `rows` of `count` values each at `address`, `row_bytes` apart, boxes of `box` values of
// every row, made from any map encoded on the host: every field that such a map reads is replaced (those of the
// template's other dimensions are not read).
__device__ __forceinline__ void tensormap_complete_f32_rows(TensorMap* slot, const TensorMap& from,
                                                            const float* address, u32 count, u32 rows,
                                                            u64 row_bytes, u32 box) {
    tensormap_copy(slot, from);
    tensormap_set_rank<2>(slot);
    tensormap_set_elemtype<kTensormapF32>(slot);
    tensormap_set_swizzle<kTensormapNoSwizzle>(slot);
    tensormap_set_address(slot, address);
    tensormap_set_extent<0>(slot, count);
    tensormap_set_extent<1>(slot, rows);
    tensormap_set_stride<1>(slot, row_bytes);
    tensormap_set_box<0>(slot, box);
    tensormap_set_box<1>(slot, rows);
    tensormap_publish(slot);
}

// Closes this thread's group of bulk operations (stores and reductions from shared memory) issued since the last.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until this thread's bulk operations have read their sources (kReadOnly) or completed.
template <bool kReadOnly>
__device__ __forceinline__ void bulk_wait_all() {
    if constexpr (kReadOnly) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    else asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
