"""Does racecheck follow the d128 backward's epilogue after the warpgroups' turns? Two consumer groups (one warp
each here), a writer-free copy of the turns' handovers (dS^T full: bar.arrive by the group without the step's dQ,
bar.sync by the other; dS^T empty: the reverse), then the epilogue: bar.sync 1 (both groups), every thread
stores its part of a tile, bar.sync 1, every thread reads another thread's part. Correct by the PTX model.

    compute-sanitizer --tool racecheck python3 scripts/racecheck_turns.py STEPS [BLOCKS [sync]]

`sync`: the group that stores dS^T hands it over with bar.sync instead of bar.arrive (the control: both sides
wait). A hazard reported here, where nothing else runs, is the tool's reading of the handovers, not a race
(docs/notes.md, sessions twenty-seven and twenty-eight: with bar.arrive, 1 to 3 steps report the dS^T store
against the other group's load).
"""
import sys

import cupy

SOURCE = r"""
constexpr int kGroupThreads = 32, kThreads = 2 * kGroupThreads, kTile = 1024;
constexpr int kConsumerBarrier = 1, kDsFull = 6, kDsEmpty = 8;
__device__ void arrive(int id) { asm volatile("bar.arrive %0, %1;" :: "r"(id), "n"(kThreads) : "memory"); }
__device__ void sync(int id) { asm volatile("bar.sync %0, %1;" :: "r"(id), "n"(kThreads) : "memory"); }

extern "C" __global__ void turns(float* out, int steps, int sync_handover) {
    __shared__ __align__(16) float ds[2][kGroupThreads];
    __shared__ __align__(16) float tile[kTile];
    const int group = threadIdx.x / kGroupThreads, lane = threadIdx.x % kGroupThreads;
    float acc = 0.f;
    for (int b = 0; b < min(steps, 2); ++b)
        if (group == b % 2) arrive(kDsEmpty + b);
    for (int step = 0; step < steps; ++step) {
        const int buffer = step % 2, dq_group = step % 2;
        acc += step * 0.5f + lane;
        if (group != dq_group) {
            sync(kDsEmpty + buffer);
            ds[buffer][lane] = acc;
            if (sync_handover) sync(kDsFull + buffer);
            else arrive(kDsFull + buffer);
            continue;
        }
        sync(kDsFull + buffer);
        acc += ds[buffer][(lane + 1) % kGroupThreads];
        if (step + 2 < steps) arrive(kDsEmpty + buffer);
    }
    sync(kConsumerBarrier);
    for (int i = threadIdx.x; i < kTile; i += kThreads) tile[i] = acc + i;
    sync(kConsumerBarrier);
    float sum = 0.f;
    for (int i = (threadIdx.x + 7) % kThreads; i < kTile; i += kThreads) sum += tile[i];
    out[blockIdx.x * kThreads + threadIdx.x] = sum;
}
"""


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    sync_handover = len(sys.argv) > 3 and sys.argv[3] == "sync"
    kernel = cupy.RawKernel(SOURCE, "turns", options=("-arch=sm_90a", "-std=c++17"))
    out = cupy.zeros(blocks * 64, dtype=cupy.float32)
    kernel((blocks,), (64,), (out, cupy.int32(steps), cupy.int32(sync_handover)))
    cupy.cuda.runtime.deviceSynchronize()
    print("steps", steps, "blocks", blocks, "sync" if sync_handover else "arrive", "ran; out[0]", float(out[0]))


if __name__ == "__main__":
    main()
