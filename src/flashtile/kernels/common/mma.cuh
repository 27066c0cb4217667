// mma.cuh — the tensor-core vocabulary of rungs 3 and up: PTX wrappers for ldmatrix, mma.sync and
// cp.async, and the fragment-level helpers the attention kernels are written in.
//
// Fragment layouts of mma.sync.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), for lane l with
// g = l / 4 (the row group) and t = l % 4 (the thread in the group):
//   A (16x16, row-major), 4 regs of 2 elements:  a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B (16x8, k x n),      2 regs:                b0 = (k 2t..2t+1, n g)  b1 = (k 2t+8.., n g)
//   C (16x8, fp32),       4 floats:              c0,c1 = (g, 2t..2t+1)  c2,c3 = (g+8, 2t..2t+1)
// So the accumulators of two neighbouring n8 tiles are exactly the A operand of one k16 step: attention's
// probabilities P go from the first product straight into the second without leaving registers.
#pragma once
#include "numeric.cuh"

constexpr int kMmaM = 16;
constexpr int kMmaN = 8;
constexpr int kMmaK = 16;
constexpr int kQuad = 4;  // the 4 lanes that share a row of an accumulator fragment

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
    return addr;
}

// Four 8x8 matrices of 16-bit elements; lane i supplies the shared-memory address (a 32-bit shared-window
// address, see smem_addr) of row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row_addr));
}
// The same, each matrix transposed on the way into registers (B operands stored k-major, like V).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row_addr));
}

// D = A * B + D on the tensor cores, fp32 accumulation.
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if FT_DTYPE == FT_DTYPE_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Asynchronous 16-byte global -> shared copy (sm_80+). With `valid` false nothing is read and the
// destination is zero-filled: tile edges need no separate path.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(valid ? kBytesPerVector : 0));
}
// The same for one 4-byte word (per-row fp32 values such as the LSE); invalid rows read as 0.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Hopper (sm_90): shared memory written through the generic proxy (st.shared, cp.async) and read next through
// the async proxy (wgmma, the bulk copy engine) needs this fence in each writing thread before the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(kPending)); }
// Every cp.async this thread has issued, committed to a group or not, has landed (wait_group counts only the
// committed groups: copies issued since the last commit are not waited for).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Reductions over the 4 lanes of a quad (one accumulator row).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(kFullWarpMask, x, 1));
    return fmaxf(x, __shfl_xor_sync(kFullWarpMask, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(kFullWarpMask, x, 1);
    return x + __shfl_xor_sync(kFullWarpMask, x, 2);
}

// The A operand for keys [16 kk, 16 kk + 16) from the fp32 accumulators of n8 tiles 2kk and 2kk+1.
__device__ __forceinline__ void accumulators_to_a(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack2<elem_t>(lo[0], lo[1]);
    a[1] = pack2<elem_t>(lo[2], lo[3]);
    a[2] = pack2<elem_t>(hi[0], hi[1]);
    a[3] = pack2<elem_t>(hi[2], hi[3]);
}
