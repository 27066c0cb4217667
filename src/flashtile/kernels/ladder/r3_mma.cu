// Rung 3 — mma: the tensor cores, with FlashAttention-2's division of work.
//
// Idea:     both products run as bf16/fp16 mma.sync.m16n8k16 with fp32 accumulation, operands fed from
//           shared memory by ldmatrix. Each of the 4 warps owns 16 rows of the 64-row query tile, so a
//           row's softmax statistics live in one quad of lanes and need no shared memory or block-wide
//           barrier (FlashAttention-2's split; FlashAttention-1 split K/V across warps instead). The scores'
//           accumulator fragments are, register for register, the A operand of P V (mma.cuh), so P is
//           rounded to 16 bits in place and never touches shared memory. The warp's Q fragments are loaded
//           once and stay in registers; a row's mask is two key bounds, not a test per score.
// Removes:  rung 2's fp32 CUDA-core arithmetic (tensor cores do ~15x the FLOPs per cycle) and its round
//           trip of P through shared memory.
// Measured: 1.78 ms at b=4 h=16 n=4096 d=64 bf16 on the H200 (154 TFLOP/s): 5.5x rung 2, 193x rung 0.
// Wastes:   loads are synchronous — every warp waits for global memory at each tile, then the memory
//           system idles while the tensor cores work; rows of shared memory are padded (not swizzled);
//           the mask is applied to every tile; 16 rows per warp means each K/V fragment loaded from shared
//           memory feeds only one mma; expf where exp2 with the scale folded in would do.
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/mma.cuh"

constexpr int kHeadDim = FT_HEAD_DIM;  // padded head dim of this build: 64 or 128
constexpr int kBlockM = FT_BLOCK_M;    // query rows per block = 4 warps x 16 rows (specs.py MMA_BLOCK_M)
constexpr int kBlockN = FT_BLOCK_N;    // keys per tile (specs.py MMA_BLOCK_N: 64, or 32 where 64 spills)
constexpr int kWarps = FT_WARPS;
static_assert(kBlockM == kWarps * kMmaM, "each warp owns 16 query rows");
static_assert(kBlockN % kMmaK == 0, "P V takes the keys in k16 steps");
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kRow = kHeadDim + kElemsPerVector;  // one 16-byte vector of padding: 8 consecutive rows start
                                                  // in 8 different bank groups, so ldmatrix is conflict-free
constexpr int kVecsPerRow = kHeadDim / kElemsPerVector;
constexpr int kScoreTiles = kBlockN / kMmaN;      // n8 accumulator tiles of scores per warp
constexpr int kOutTiles = kHeadDim / kMmaN;       // n8 accumulator tiles of output per warp

struct SharedStorage {
    elem_t q[kBlockM][kRow];
    elem_t k[kBlockN][kRow];
    elem_t v[kBlockN][kRow];
};

// Synchronous tile load: 16 bytes per thread per step, zeros past the valid rows and dims.
template <int kRows>
__device__ __forceinline__ void load_tile(elem_t (*tile)[kRow], const elem_t* src, i64 row_stride,
                                          int row0, int valid_rows, int dim) {
    for (int idx = threadIdx.x; idx < kRows * kVecsPerRow; idx += kThreads) {
        const int r = idx / kVecsPerRow, c = (idx % kVecsPerRow) * kElemsPerVector;
        uint4 value = make_uint4(0, 0, 0, 0);
        if (row0 + r < valid_rows && c < dim) value = *reinterpret_cast<const uint4*>(src + (i64)(row0 + r) * row_stride + c);
        *reinterpret_cast<uint4*>(&tile[r][c]) = value;
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
mma_fwd(const __grid_constant__ AttnParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    if (dynamic_smem_bytes() < sizeof(SharedStorage)) __trap();
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int g = lane / kQuad, t = lane % kQuad;
    const int h = blockIdx.y, b = blockIdx.z;
    const Problem pr = locate_problem(p, b, h);
    const int m0 = blockIdx.x * kBlockM;
    if (m0 >= pr.seqlen_q) return;
    const Mask mask(p.window_left, p.window_right, pr.seqlen_q, pr.seqlen_k);
    const int m1 = min(m0 + kBlockM, pr.seqlen_q);

    const elem_t* q = static_cast<const elem_t*>(p.q) + pr.q_offset;
    const elem_t* k = static_cast<const elem_t*>(p.k) + pr.k_offset;
    const elem_t* v = static_cast<const elem_t*>(p.v) + pr.v_offset;
    load_tile<kBlockM>(smem.q, q, p.q_row_stride, m0, pr.seqlen_q, p.head_dim);

    // This lane's two rows of the warp's 16: row_lo = g and row_hi = g + 8. Index 0 = lo, 1 = hi.
    const int row[2] = {m0 + warp * kMmaM + g, m0 + warp * kMmaM + g + 8};
    float o[kOutTiles][4] = {};
    float row_max[2] = {kNegInf, kNegInf}, row_sum[2] = {0.f, 0.f};

    // The warp's 16 rows of Q, as A fragments for every k16 slice, stay in registers for the whole loop.
    __syncthreads();
    u32 q_frag[kHeadDim / kMmaK][4];
#pragma unroll
    for (int kk = 0; kk < kHeadDim / kMmaK; ++kk)
        ldmatrix_x4(q_frag[kk], smem_addr(&smem.q[warp * kMmaM + lane % 16][kk * kMmaK + (lane / 16) * 8]));

    const int n_begin = mask.key_begin(m0) / kBlockN * kBlockN;
    const int n_end = mask.key_end(m1);
    for (int n0 = n_begin; n0 < n_end; n0 += kBlockN) {
        __syncthreads();  // every warp is done with the previous K and V
        load_tile<kBlockN>(smem.k, k, p.k_row_stride, n0, pr.seqlen_k, p.head_dim);
        load_tile<kBlockN>(smem.v, v, p.v_row_stride, n0, pr.seqlen_k, p.head_dim_v);
        __syncthreads();

        // S = Q K^T: 16 rows x 64 keys per warp, one k16 slice of the head dim at a time.
        float s[kScoreTiles][4] = {};
#pragma unroll
        for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
#pragma unroll
            for (int np = 0; np < kScoreTiles / 2; ++np) {
                u32 bk[4];  // n8 tile 2np: bk[0], bk[1]; n8 tile 2np+1: bk[2], bk[3]
                ldmatrix_x4(bk, smem_addr(&smem.k[np * 16 + lane % 8 + (lane / 16) * 8][kk * kMmaK + ((lane / 8) % 2) * 8]));
                mma_16816(s[2 * np], q_frag[kk], bk[0], bk[1]);
                mma_16816(s[2 * np + 1], q_frag[kk], bk[2], bk[3]);
            }
        }

        // Scale, mask, and the online softmax of each of this lane's two rows.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // This row sees keys [lo, hi) counted from this lane's first column of the tile.
            const int col0 = n0 + 2 * t;
            const int lo = mask.first_key(row[half]) - col0, hi = mask.end_key(row[half]) - col0;
            float tile_max = kNegInf;
#pragma unroll
            for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[j][2 * half + e];
                    const int col = j * kMmaN + e;
                    x = col >= lo && col < hi ? x * p.softmax_scale : kNegInf;
                    tile_max = fmaxf(tile_max, x);
                }
            const float m_new = fmaxf(row_max[half], quad_max(tile_max));
            const float shift = m_new == kNegInf ? 0.f : m_new;
            const float correction = __expf(row_max[half] - shift);
            row_max[half] = m_new;
            float tile_sum = 0.f;
#pragma unroll
            for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[j][2 * half + e];
                    x = __expf(x - shift);
                    tile_sum += x;
                }
            row_sum[half] = row_sum[half] * correction + tile_sum;
#pragma unroll
            for (int j = 0; j < kOutTiles; ++j) {
                o[j][2 * half] *= correction;
                o[j][2 * half + 1] *= correction;
            }
        }

        // O += P V, P straight from the score registers.
#pragma unroll
        for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
            u32 a[4];
            accumulators_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < kOutTiles / 2; ++dp) {
                u32 bv[4];  // d tile 2dp: bv[0], bv[1]; d tile 2dp+1: bv[2], bv[3]
                ldmatrix_x4_trans(bv, smem_addr(&smem.v[kk * kMmaK + lane % 8 + ((lane / 8) % 2) * 8][dp * 16 + (lane / 16) * 8]));
                mma_16816(o[2 * dp], a, bv[0], bv[1]);
                mma_16816(o[2 * dp + 1], a, bv[2], bv[3]);
            }
        }
    }

    // Normalise and write two elements per store; rows that saw no key get 0 and log-sum-exp -inf.
    elem_t* out = static_cast<elem_t*>(p.o) + pr.o_offset;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float l = quad_sum(row_sum[half]);
        if (row[half] >= pr.seqlen_q) continue;
        const float inv_l = saw_keys(l) ? 1.f / l : 0.f;
#pragma unroll
        for (int j = 0; j < kOutTiles; ++j) {
            const int col = j * kMmaN + 2 * t;
            if (col < p.head_dim_v)
                *reinterpret_cast<u32*>(out + (i64)row[half] * p.o_row_stride + col) =
                    pack2<elem_t>(o[j][2 * half] * inv_l, o[j][2 * half + 1] * inv_l);
        }
        if (p.lse != nullptr && t == 0) p.lse[pr.lse_offset + row[half]] = saw_keys(l) ? row_max[half] + __logf(l) : kNegInf;
    }
}
