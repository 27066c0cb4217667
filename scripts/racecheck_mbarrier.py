"""Does compute-sanitizer's racecheck follow mbarriers for plain shared-memory stores? A two-warp kernel with the
Hopper backward's handovers and nothing else, each correct by the PTX memory model:

    store   each producer lane stores a value and arrives on a "full" mbarrier (the LSE and D rows);
            the consumer warp waits, loads, and hands the slot back on an "empty" mbarrier (one arrival per
            warp after __syncwarp); the producer waits for it before storing again
    copy    each producer lane fills its part with cp.async, waits for its copies, fences the async proxy;
            after __syncwarp lane 0 alone arrives (a varlen tail tile); the consumer then overwrites the slot
            with plain stores (the dK/dV epilogue over K and V)

    compute-sanitizer --tool racecheck python3 scripts/racecheck_mbarrier.py [store|copy]

Hazards reported here, where nothing else runs, are the tool's reading of the handover, not a race in
wgmma/bwd.cu (docs/notes.md, session seventeen).
"""

import sys

import cupy

SOURCE = r"""
__device__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}
constexpr int kRounds = 4, kSlots = 64;

extern "C" __global__ void handover(const float* src, float* out, int copy) {
    __shared__ __align__(16) float slot[kSlots];
    __shared__ __align__(8) unsigned long long full, empty;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (threadIdx.x == 0) {
        mbar_init(smem_u32(&full), copy ? 1 : 32);
        mbar_init(smem_u32(&empty), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) {  // producer
        for (int round = 0; round < kRounds; ++round) {
            if (round > 0) mbar_wait(smem_u32(&empty), (round - 1) & 1);
            if (copy) {
                for (int i = lane; i < kSlots; i += 32)
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(smem_u32(&slot[i])),
                                 "l"(src + round * kSlots + i) : "memory");
                asm volatile("cp.async.wait_all;" ::: "memory");
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                __syncwarp();
                if (lane == 0) mbar_arrive(smem_u32(&full));
            } else {
                for (int i = lane; i < kSlots; i += 32) slot[i] = src[round * kSlots + i];
                mbar_arrive(smem_u32(&full));
            }
        }
    } else {  // consumer
        float sum = 0.f;
        for (int round = 0; round < kRounds; ++round) {
            mbar_wait(smem_u32(&full), round & 1);
            for (int i = lane; i < kSlots; i += 32) sum += slot[i];
            if (copy && round == kRounds - 1)
                for (int i = lane; i < kSlots; i += 32) slot[i] = sum;  // the epilogue over the last tile
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_u32(&empty));
        }
        out[lane] = sum;
    }
}
"""


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "store"
    kernel = cupy.RawKernel(SOURCE, "handover", options=("-arch=sm_90a", "-std=c++17"))
    src = cupy.arange(4 * 64, dtype=cupy.float32)
    out = cupy.zeros(32, dtype=cupy.float32)
    kernel((1,), (64,), (src, out, cupy.int32(mode == "copy")))
    cupy.cuda.runtime.deviceSynchronize()
    expected = sum(float(src[r * 64 + i]) for r in range(4) for i in range(0, 64, 32))
    print(mode, "ran; lane 0's sum", float(out[0]), "expected", expected)


if __name__ == "__main__":
    main()
