// Rung 0 — naive: standard attention, the way the formula reads.
//
// Idea:     S = scale * Q K^T is written to an N x N fp32 buffer in global memory (kernel 1), each row of
//           S is turned into probabilities in place (kernel 2), and O = P V is read back out of it
//           (kernel 3). One thread per output element, no shared memory.
// Removes:  nothing — this is the baseline every other rung is measured against.
// Measured: 345 ms at b=4 h=16 n=4096 d=64 bf16 on the H200 (0.8 TFLOP/s): the baseline of `bench ladder`.
// Wastes:   everything. The N x N buffer costs 4 * N^2 bytes per head of memory and traffic (written
//           once, read twice, written again); every score re-reads a whole row of K straight from
//           global memory, uncoalesced across the warp; three launches; fp32 math on CUDA cores.
#include "../common/params.cuh"
#include "../common/mask.cuh"

constexpr int kThreadsPerBlock = FT_THREADS;  // specs.py NAIVE_THREADS

// Kernel 1: one thread per score S[b, h, i, j] = scale * q_i . k_j, or -inf where the mask hides j.
extern "C" __global__ void __launch_bounds__(kThreadsPerBlock)
naive_scores(const __grid_constant__ AttnParams p) {
    const i64 n_scores = (i64)p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
    const elem_t* q = static_cast<const elem_t*>(p.q);
    const elem_t* k = static_cast<const elem_t*>(p.k);
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < n_scores; idx += (i64)gridDim.x * blockDim.x) {
        const int j = (int)(idx % p.seqlen_k);
        const int i = (int)((idx / p.seqlen_k) % p.seqlen_q);
        const int bh = (int)(idx / ((i64)p.seqlen_k * p.seqlen_q));
        const Problem pr = locate_problem(p, bh / p.heads_q, bh % p.heads_q);
        const Mask mask(p.window_left, p.window_right, pr.seqlen_q, pr.seqlen_k);
        float s = kNegInf;
        if (mask.allowed(i, j)) {
            const elem_t* qi = q + pr.q_offset + i * p.q_row_stride;
            const elem_t* kj = k + pr.k_offset + j * p.k_row_stride;
            float dot = 0.f;
            for (int d = 0; d < p.head_dim; ++d) dot += to_float(qi[d]) * to_float(kj[d]);
            s = dot * p.softmax_scale;
        }
        p.scores[idx] = s;
    }
}

// Kernel 2: one thread per row of S: max, sum of exponentials, then the probabilities in place.
// A row with no visible key becomes all zeros with log-sum-exp -inf.
extern "C" __global__ void __launch_bounds__(kThreadsPerBlock)
naive_softmax(const __grid_constant__ AttnParams p) {
    const i64 n_rows = (i64)p.batch * p.heads_q * p.seqlen_q;
    const i64 row = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= n_rows) return;
    float* s = p.scores + row * p.seqlen_k;
    float row_max = kNegInf;
    for (int j = 0; j < p.seqlen_k; ++j) row_max = fmaxf(row_max, s[j]);
    const float shift = row_max == kNegInf ? 0.f : row_max;
    float row_sum = 0.f;
    for (int j = 0; j < p.seqlen_k; ++j) row_sum += __expf(s[j] - shift);
    const float inv_sum = saw_keys(row_sum) ? 1.f / row_sum : 0.f;
    for (int j = 0; j < p.seqlen_k; ++j) s[j] = __expf(s[j] - shift) * inv_sum;
    if (p.lse != nullptr) {
        const int i = (int)(row % p.seqlen_q);
        const int bh = (int)(row / p.seqlen_q);
        const Problem pr = locate_problem(p, bh / p.heads_q, bh % p.heads_q);
        p.lse[pr.lse_offset + i] = saw_keys(row_sum) ? shift + __logf(row_sum) : kNegInf;
    }
}

// Kernel 3: one thread per output element O[b, i, h, d] = sum_j P[b, h, i, j] * V[b, j, h, d].
extern "C" __global__ void __launch_bounds__(kThreadsPerBlock)
naive_pv(const __grid_constant__ AttnParams p) {
    const i64 n_out = (i64)p.batch * p.heads_q * p.seqlen_q * p.head_dim_v;
    const elem_t* v = static_cast<const elem_t*>(p.v);
    elem_t* o = static_cast<elem_t*>(p.o);
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < n_out; idx += (i64)gridDim.x * blockDim.x) {
        const int d = (int)(idx % p.head_dim_v);
        const i64 row = idx / p.head_dim_v;
        const int i = (int)(row % p.seqlen_q);
        const int bh = (int)(row / p.seqlen_q);
        const Problem pr = locate_problem(p, bh / p.heads_q, bh % p.heads_q);
        const float* prob = p.scores + row * p.seqlen_k;
        const elem_t* vd = v + pr.v_offset + d;
        float acc = 0.f;
        for (int j = 0; j < p.seqlen_k; ++j) acc += prob[j] * to_float(vd[j * p.v_row_stride]);
        o[pr.o_offset + i * p.o_row_stride + d] = from_float<elem_t>(acc);
    }
}
