// wgmma/wgmma.cuh — Hopper's warpgroup matrix products (wgmma.mma_async, sm_90a) and what they need around them.
//
// A warpgroup (4 consecutive warps, 128 threads) issues one m64nNk16 product asynchronously; its fp32
// accumulators live in registers, per warp 16 rows in mma.sync's C layout (element 4j + e of a thread: row
// g + 8 * (e / 2), column 8j + 2t + e % 2), so rung 4's fragment helpers (accumulators_to_a) carry over.
// Operands in shared memory are named by a 64-bit descriptor and stored in 128-byte swizzled rows — exactly
// common/tile.cuh's wide SwizzledTile: column blocks of 64 elements, row r of a block at r * 128 bytes, its
// 16-byte chunk c at slot c ^ (r % 8) (8-row atoms of 1024 bytes; tiles must start on a 1024-byte boundary).
//   K-major operand (its rows run along K, e.g. Q or K in S = Q K^T): a k16 step is 32 bytes along the rows;
//     the leading byte offset is unused, the stride byte offset is one 8-row atom.
//   MN-major operand (its rows run along K but its elements along M or N, e.g. dO in dV = P^T dO): set the
//     transpose flag; a k16 step is 16 rows further, the leading byte offset goes from one 64-element column
//     block to the next along M/N, the stride byte offset from one 8-row atom to the next along K.
// Ordering: registers written by ordinary instructions (accumulators, A fragments) need wgmma_fence() before
// the product that reads them; shared memory written through the generic proxy (st.shared, cp.async) needs
// fence_proxy_async() in each writing thread before the barrier that publishes it to the products.
#pragma once
#include "../common/mma.cuh"

constexpr int kWarpgroupWarps = 4;
constexpr int kWgmmaM = 64;                                   // rows of every product
constexpr int kWgmmaK = 16;                                   // K of one product for 16-bit inputs
constexpr u32 kSwizzleRowBytes = 128;                         // one row of a column block
constexpr u32 kSwizzleRowElems = kSwizzleRowBytes / 2;        // 64 16-bit elements
constexpr u32 kSwizzleAtomBytes = 8 * kSwizzleRowBytes;       // 8 rows: the swizzle pattern's period
constexpr u32 kUnusedLeadingBytes = 16;                       // K-major operands: one 16-byte unit, ignored

// A shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride
// byte offsets (14 bits each, in 16-byte units) and the swizzle mode in bits 62-63 (1 = 128 bytes).
constexpr u64 kDescriptorSwizzle128 = 1ull << 62;
constexpr u32 kDescriptorFieldMask = 0x3fff;
constexpr int kDescriptorUnitShift = 4;
__device__ __forceinline__ u64 smem_descriptor(u32 smem_address, u32 leading_bytes, u32 stride_bytes) {
    return kDescriptorSwizzle128 |
           ((u64)((stride_bytes >> kDescriptorUnitShift) & kDescriptorFieldMask) << 32) |
           ((u64)((leading_bytes >> kDescriptorUnitShift) & kDescriptorFieldMask) << 16) |
           (u64)((smem_address >> kDescriptorUnitShift) & kDescriptorFieldMask);
}
// A K-major operand's descriptor, and an MN-major one's whose column blocks are `block_bytes` apart.
__device__ __forceinline__ u64 k_major(u32 smem_address) {
    return smem_descriptor(smem_address, kUnusedLeadingBytes, kSwizzleAtomBytes);
}
__device__ __forceinline__ u64 mn_major(u32 smem_address, u32 block_bytes) {
    return smem_descriptor(smem_address, block_bytes, kSwizzleAtomBytes);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most kPending committed groups of this warpgroup's products are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(kPending) : "memory");
}

// Warp specialisation: a warpgroup gives registers back (a producer holding no data) or takes them (the consumers);
// every warp of the warpgroup executes it. The counts are per thread, multiples of 8 between 24 and 256.
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(kRegisters)); }
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(kRegisters)); }
// The block's dynamic shared memory as a kernel's storage. Traps where the launch gave less than the storage needs,
// or where the base is not on a swizzle atom (the 128-byte swizzle pattern is anchored to 1024 bytes).
template <typename Storage>
__device__ __forceinline__ Storage& checked_storage(unsigned char* smem_raw) {
    if (dynamic_smem_bytes() < sizeof(Storage)) __trap();
    if (smem_addr(smem_raw) % kSwizzleAtomBytes != 0) __trap();
    return *reinterpret_cast<Storage*>(smem_raw);
}
// A barrier among `threads` threads (whole warps) of the block, by id; 0 is __syncthreads' own.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
// Counts this warp's threads towards the barrier's `threads` without waiting for the others.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
// A value the warp holds alike (read from shared memory, or a barrier's result), shown to the compiler as the
// same in every lane: code that branches on a value the compiler thinks may differ between lanes loses the warp's
// convergence, and every shuffle and warpgroup product after it pays for a WARPSYNC.
template <typename T> __device__ __forceinline__ T uniform(T value) { return __shfl_sync(kFullWarpMask, value, 0); }
// This thread's warpgroup, as a value the compiler sees is the same across the warp (wgmma on a path it thinks
// divergent is serialized, ptxas info C7520).
__device__ __forceinline__ int uniform_warpgroup() {
    return (int)uniform(threadIdx.x / (unsigned)(kWarpgroupWarps * kWarpSize));
}
// A barrier that also returns to every thread whether any of them passed `value` true.
__device__ __forceinline__ bool named_barrier_any(int id, int threads, bool value) {
    int any;
    asm volatile("{\n .reg .pred in, out;\n setp.ne.s32 in, %1, 0;\n bar.red.or.pred out, %2, %3, in;\n"
                 " selp.s32 %0, 1, 0, out;\n}" : "=r"(any) : "r"((int)value), "r"(id), "r"(threads) : "memory");
    return any != 0;
}

// Pins accumulator registers at this point of the program for the compiler: without it, registers that
// ordinary code wrote before a product let ptxas insert its own warpgroup waits and serialize every product
// (ptxas info C7520).
template <int kAccumulators>
__device__ __forceinline__ void fence_operands(float (&d)[kAccumulators]) {
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 4 accumulators of n8 tile j of a flat accumulator array, as mma.sync's fragment helpers take them.
template <int kAccumulators>
__device__ __forceinline__ const float (&n8_tile(const float (&d)[kAccumulators], int j))[4] {
    return *reinterpret_cast<const float(*)[4]>(&d[4 * j]);
}

#if FT_DTYPE == FT_DTYPE_BF16
#define FT_WGMMA_TYPES ".f32.bf16.bf16 "
#else
#define FT_WGMMA_TYPES ".f32.f16.f16 "
#endif
// The accumulators of m64n64 (32 per thread) and m64n128 (64) as asm operands %0.. and their register list.
#define FT_WGMMA_ACC32 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
    "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
    "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
    "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FT_WGMMA_ACC64 \
    FT_WGMMA_ACC32, \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), \
    "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), \
    "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), \
    "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
    "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FT_WGMMA_REGS32 \
    "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FT_WGMMA_REGS64 \
    "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, " \
    "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
    "%62, %63}"

// The products, overloaded on the accumulator array: m64nN keeps N / 2 fp32 values per thread. `accumulate`
// 0 overwrites d. SS: A and B from shared memory (descriptors); RS: A from registers (per warp 16 rows, the
// m16n8k16 A-fragment layout), B from shared memory. kTransA / kTransB 1: that operand is MN-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16" FT_WGMMA_TYPES FT_WGMMA_REGS32
                 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : FT_WGMMA_ACC32
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}
template <int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const u32 (&a)[4], u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16" FT_WGMMA_TYPES FT_WGMMA_REGS32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : FT_WGMMA_ACC32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB));
}
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16" FT_WGMMA_TYPES FT_WGMMA_REGS64
                 ", %64, %65, p, 1, 1, %67, %68;\n}\n"
                 : FT_WGMMA_ACC64
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}
template <int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const u32 (&a)[4], u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16" FT_WGMMA_TYPES FT_WGMMA_REGS64
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                 : FT_WGMMA_ACC64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB));
}

// acc (64 rows x kProducts * 2 kAccumulators columns, one accumulator array per product) += A B: A from the
// registers as 16-bit fragments, one per k16 step; B MN-major in shared memory (a k16 step is 16 rows further, a
// product's columns its width / 64 column blocks on, column blocks `b_block_bytes` apart).
template <int kSteps, int kProducts, int kAccumulators>
__device__ __forceinline__ void add_products_rs(float (&acc)[kProducts][kAccumulators], const u32 (&a)[kSteps][4],
                                                u32 b_tile, u32 b_block_bytes) {
    constexpr int kBlocksPerProduct = 2 * kAccumulators / kSwizzleRowElems;
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
        for (int n = 0; n < kProducts; ++n)
            wgmma_rs<1>(acc[n], a[kk],
                        mn_major(b_tile + n * kBlocksPerProduct * b_block_bytes + kk * kWgmmaK * kSwizzleRowBytes,
                                 b_block_bytes),
                        1);
}
