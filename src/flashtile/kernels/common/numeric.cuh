// numeric.cuh — element types, conversions and named constants shared by every kernel.
//
// The kernels include no CUDA toolkit header (NVRTC ships none), so the 16-bit float types are plain
// 16-bit payloads converted with PTX `cvt` instructions. Every kernel is compiled with FT_DTYPE set to
// one of FT_DTYPE_F32 / FT_DTYPE_F16 / FT_DTYPE_BF16, which selects `elem_t`.
#pragma once

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define FT_DTYPE_F32 0
#define FT_DTYPE_F16 1
#define FT_DTYPE_BF16 2

// log2(e): exp(x) == exp2(x * kLog2e). The softmax runs in base 2 because `ex2.approx` is one instruction.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -(1.0f / 0.0f);  // IEEE 754: 1/0 = +inf, folded at compile time
constexpr int kWarpSize = 32;
constexpr unsigned kFullWarpMask = 0xffffffffu;
constexpr int kBytesPerVector = 16;  // one 16-byte global or shared access (ld.global.v4.u32)

// Whether a row's softmax sum makes a log-sum-exp: 0 when the row saw no key (its LSE is -inf), NaN when it read
// a NaN (its LSE must be NaN as its output is, so NaN counts as seen).
__device__ __forceinline__ bool saw_keys(float row_sum) { return !(row_sum <= 0.f); }

struct f16_t { u16 bits; };
struct bf16_t { u16 bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
// bf16 is the top half of an fp32, so widening is a shift.
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float(((u32)x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ f16_t from_float<f16_t>(float x) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}
// fp32 -> bf16 rounded to nearest even in integer arithmetic, for Turing, which has no bf16 instruction (cvt to
// .bf16 needs sm_80): adding 0x7fff plus the lowest kept bit carries into the kept half exactly when the dropped
// half is over one half, or is one half and the kept half is odd; infinities stay, finite values past bf16's
// range round to infinity. Every NaN becomes the canonical NaN, as cvt.rn.bf16.f32 makes it.
// The constants are local: a namespace-scope constant is a symbol of every cubin, and sm_80+ builds stay as they were.
__device__ __forceinline__ u16 bf16_bits_rn(float x) {
    constexpr u32 kF32AbsMask = 0x7fffffffu, kF32Infinity = 0x7f800000u;
    constexpr u16 kBf16CanonicalNan = 0x7fff;
    const u32 bits = __float_as_uint(x);
    if ((bits & kF32AbsMask) > kF32Infinity) return kBf16CanonicalNan;
    return (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
    bf16_t h;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#else
    h.bits = bf16_bits_rn(x);
#endif
    return h;
}

// Two fp32 values packed into one 32-bit register of two 16-bit floats (lo in the low half), the
// operand format of mma.sync.
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<f16_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 pack2<bf16_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#if FT_DTYPE == FT_DTYPE_F32
typedef float elem_t;
#elif FT_DTYPE == FT_DTYPE_F16
typedef f16_t elem_t;
#elif FT_DTYPE == FT_DTYPE_BF16
typedef bf16_t elem_t;
#else
#error "FT_DTYPE must be FT_DTYPE_F32, FT_DTYPE_F16 or FT_DTYPE_BF16"
#endif

// Elements in one 16-byte vector: 8 for 16-bit types, 4 for fp32.
constexpr int kElemsPerVector = kBytesPerVector / (int)sizeof(elem_t);

// Widen one 16-byte vector of elem_t into kElemsPerVector floats.
__device__ __forceinline__ void widen_vector(const uint4& raw, float* out) {
    const elem_t* e = reinterpret_cast<const elem_t*>(&raw);
#pragma unroll
    for (int i = 0; i < kElemsPerVector; ++i) out[i] = to_float(e[i]);
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullWarpMask, x, offset));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullWarpMask, x, offset);
    return x;
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Dynamic shared memory this launch was given. Kernels trap when the host asked for less than their
// SharedStorage needs: a loud launch failure instead of a silent overrun.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// tanh from one ex2.approx and one fast division: 1 - 2 / (1 + e^(2x)). Absolute error ~1e-7 (what a
// softcap needs: softcap * tanh(.) is then off by ~softcap * 1e-7); saturates cleanly to +-1.
__device__ __forceinline__ float fast_tanh(float x) {
    return 1.f - __fdividef(2.f, fast_exp2(x * (2.f * kLog2e)) + 1.f);
}
