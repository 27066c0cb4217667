"""Which shared-memory handovers does compute-sanitizer's racecheck follow? A two-warp kernel with one handover
of the Hopper backward's kinds and nothing else, each correct by the PTX memory model. A producer warp fills a
slot four times; a consumer warp waits, reads it, and hands it back (after the last round it overwrites the slot,
as the dK/dV epilogue overwrites K and V):

    store   each producer lane stores, then arrives on a "full" mbarrier; the consumer hands back on an "empty"
            mbarrier (one arrival after __syncwarp), which the producer waits for
    copy    each lane fills its part by cp.async, waits for its copies, fences the async proxy; lane 0 arrives
    arrive  each lane's cp.async arrives on the full mbarrier itself when done (cp.async.mbarrier.arrive.noinc)
    bulk    lane 0 fills the slot with one bulk copy that completes the full mbarrier's transaction bytes
    named   store as above, but both handovers are named barriers (bar.arrive by one side, bar.sync by the other)

    compute-sanitizer --tool racecheck python3 scripts/racecheck_mbarrier.py MODE

A hazard reported here, where nothing else runs, is the tool's reading of a handover, not a race (docs/notes.md).
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
enum Mode { kStore, kCopy, kArrive, kBulk, kNamed };

__device__ void expect_bytes(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ void named_arrive(int id) { asm volatile("bar.arrive %0, 64;" :: "r"(id) : "memory"); }
__device__ void named_sync(int id) { asm volatile("bar.sync %0, 64;" :: "r"(id) : "memory"); }
constexpr int kFullBarrier = 1, kEmptyBarrier = 2;

extern "C" __global__ void handover(const float* src, float* out, int mode) {
    __shared__ __align__(16) float slot[kSlots];
    __shared__ __align__(8) unsigned long long full, empty;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned full_bar = smem_u32(&full), empty_bar = smem_u32(&empty);
    if (threadIdx.x == 0) {
        mbar_init(full_bar, mode == kStore || mode == kArrive ? 32 : 1);
        mbar_init(empty_bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) {  // producer
        for (int round = 0; round < kRounds; ++round) {
            const float* from = src + round * kSlots;
            if (round > 0) {
                if (mode == kNamed) named_sync(kEmptyBarrier);
                else mbar_wait(empty_bar, (round - 1) & 1);
            }
            if (mode == kCopy || mode == kArrive) {
                for (int i = lane; i < kSlots; i += 32)
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(smem_u32(&slot[i])),
                                 "l"(from + i) : "memory");
                if (mode == kArrive) {
                    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(full_bar) : "memory");
                } else {
                    asm volatile("cp.async.wait_all;" ::: "memory");
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                    __syncwarp();
                    if (lane == 0) mbar_arrive(full_bar);
                }
            } else if (mode == kBulk) {
                if (lane == 0) {
                    expect_bytes(full_bar, sizeof(slot));
                    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                                 :: "r"(smem_u32(slot)), "l"(from), "r"((unsigned)sizeof(slot)), "r"(full_bar)
                                 : "memory");
                }
            } else {
                for (int i = lane; i < kSlots; i += 32) slot[i] = from[i];
                if (mode == kNamed) named_arrive(kFullBarrier);
                else mbar_arrive(full_bar);
            }
        }
    } else {  // consumer
        float sum = 0.f;
        for (int round = 0; round < kRounds; ++round) {
            if (mode == kNamed) named_sync(kFullBarrier);
            else mbar_wait(full_bar, round & 1);
            for (int i = lane; i < kSlots; i += 32) sum += slot[i];
            if (round == kRounds - 1)
                for (int i = lane; i < kSlots; i += 32) slot[i] = sum;  // the epilogue over the last tile
            __syncwarp();
            if (mode != kNamed) {
                if (lane == 0) mbar_arrive(empty_bar);
            } else if (round + 1 < kRounds) {
                named_arrive(kEmptyBarrier);  // (after the last round nobody waits for it)
            }
        }
        out[lane] = sum;
    }
}
"""


MODES = ("store", "copy", "arrive", "bulk", "named")  # the kernel's Mode, in order


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "store"
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    kernel = cupy.RawKernel(SOURCE, "handover", options=("-arch=sm_90a", "-std=c++17"))
    src = cupy.arange(4 * 64, dtype=cupy.float32)
    out = cupy.zeros(32, dtype=cupy.float32)
    kernel((1,), (64,), (src, out, cupy.int32(MODES.index(mode))))
    cupy.cuda.runtime.deviceSynchronize()
    expected = sum(float(src[r * 64 + i]) for r in range(4) for i in range(0, 64, 32))
    print(mode, "ran; lane 0's sum", float(out[0]), "expected", expected)


if __name__ == "__main__":
    main()
