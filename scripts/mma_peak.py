"""The ceiling of mma.sync itself on this GPU: independent bf16 m16n8k16 products from registers, no memory.

Usage (on the GPU machine, where cupy is installed): python scripts/mma_peak.py — a lab bench; its number is
the denominator of "how busy does rung 4 keep the tensor pipe" in docs/notes.md. Prints TFLOP/s per
(independent accumulators per warp, warps per block, blocks per SM).
"""

import cupy as cp

SOURCE = r"""
extern "C" __global__ void peak(float* out, int iters) {
    unsigned a0 = threadIdx.x, a1 = a0 * 3, a2 = a0 * 5, a3 = a0 * 7, b0 = a0 * 11, b1 = a0 * 13;
    float acc[ACCUMULATORS][4] = {};
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < ACCUMULATORS; ++j)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    float sum = 0.f;
    for (int j = 0; j < ACCUMULATORS; ++j) sum += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}
"""
MMA_FLOPS = 2 * 16 * 8 * 16
ITERATIONS = 2000
WARMUPS = 3


def main():
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for accumulators in (4, 8, 16):
        kernel = cp.RawKernel(SOURCE, "peak", options=(f"-DACCUMULATORS={accumulators}",))
        for warps in (4, 8, 16):
            for blocks_per_sm in (1, 2):
                grid, threads = sms * blocks_per_sm, warps * 32
                out = cp.zeros(grid * threads, cp.float32)
                for _ in range(WARMUPS):
                    kernel((grid,), (threads,), (out, cp.int32(ITERATIONS)))
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                kernel((grid,), (threads,), (out, cp.int32(ITERATIONS)))
                end.record()
                end.synchronize()
                ms = cp.cuda.get_elapsed_time(start, end)
                flops = grid * warps * ITERATIONS * accumulators * MMA_FLOPS
                print(f"{accumulators:2d} accumulators, {warps:2d} warps/block, {blocks_per_sm} blocks/SM: "
                      f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
