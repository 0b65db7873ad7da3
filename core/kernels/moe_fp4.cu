// FP4 (e2m1) routed experts and the clamped SwiGLU of DeepSeek-V4, beside moe.cu's formats.
//
//   weights  [E, N, K/2] uint8: two e2m1 codes per byte, the low nibble the even k
//            (values 0 .5 1 1.5 2 3 4 6, bit 3 the sign)
//   scales   [E, N, K/32] uint8: e8m0, 2^(s − 127), one per 32 inputs of a row
//
// moe_fp4_grouped_gemm reads the routing of moe.cu's moe_sort (sorted_slots, tile_expert,
// tile_row, num_tiles, offsets) and writes rows in the same sorted order, so moe_combine
// finishes the layer unchanged. A 64×64 output tile per block: each 64-wide K step decodes the
// weight tile to bf16 in shared memory (a scale per 32 codes) and multiplies it with tensor
// cores (mma.sync m16n8k16, bf16 in, fp32 accumulate; the tile steps of mma.cuh, as moe.cu's
// grouped GEMM). K must be a multiple of 32.
//
// swiglu_clamp: out = silu(min(gate, limit)) · clamp(up, −limit, limit) of fused [rows, 2I] rows
// (gate first); limit ≤ 0 means no clamp.
#include "mma.cuh"

#define TILE MMA_TILE  // mma.cuh's 64×64 block tile on 4 warps
#define PAD 8
#define THREADS MMA_TILE_THREADS

__device__ __forceinline__ float e2m1_value(unsigned code) {
    const float magnitude[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    return (code & 8u) ? -magnitude[code & 7u] : magnitude[code & 7u];
}

extern "C" __global__ void __launch_bounds__(THREADS)
moe_fp4_grouped_gemm(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                     const unsigned char* __restrict__ weight, const unsigned char* __restrict__ scale,
                     const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                     const int* __restrict__ num_tiles, const int* __restrict__ offsets,
                     bf16* __restrict__ out, int N, int K) {
    __shared__ __align__(16) bf16 a_tile[TILE][TILE + PAD];
    __shared__ __align__(16) bf16 b_tile[TILE][TILE + PAD];
    __shared__ float c_tile[TILE][TILE + 4];
    __shared__ int a_rows[TILE];
    if ((int)blockIdx.x >= *num_tiles) return;
    const int expert = tile_expert[blockIdx.x], row_begin = tile_row[blockIdx.x];
    const int rows = min(TILE, offsets[expert + 1] - row_begin), n0 = blockIdx.y * TILE;
    for (int r = threadIdx.x; r < TILE; r += THREADS)
        a_rows[r] = r < rows ? (sorted_slots ? sorted_slots[row_begin + r] / top_k : row_begin + r) : -1;
    const MmaTileLane lane = mma_tile_lane();
    float acc[2][4][4] = {};
    const long long expert_rows = (long long)expert * N;
    __syncthreads();
    for (int k0 = 0; k0 < K; k0 += TILE) {
        load_row_tile_vec(a, a_rows, k0, K, a_tile);
        for (int i = threadIdx.x; i < TILE * TILE / 8; i += THREADS) {  // 8 codes = one 4-byte word
            const int r = i / (TILE / 8), c = (i % (TILE / 8)) * 8, n = n0 + r, k = k0 + c;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (n < N && k < K) {
                const long long row = expert_rows + n;
                const unsigned word = *reinterpret_cast<const unsigned*>(weight + row * (K / 2) + k / 2);
                const float s = ldexpf(1.f, (int)scale[row * (K / 32) + k / 32] - 127);
                float f[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) f[j] = e2m1_value((word >> (4 * j)) & 15u) * s;
                v = make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                               pack_bf16x2(f[6], f[7]));
            }
            *reinterpret_cast<uint4*>(&b_tile[r][c]) = v;
        }
        __syncthreads();
        mma_tile_step(acc, a_tile, b_tile, lane);
        __syncthreads();
    }
    store_mma_tile(c_tile, acc, lane);
    __syncthreads();
    for (int i = threadIdx.x; i < TILE * TILE; i += THREADS) {
        const int r = i / TILE, c = i % TILE;
        if (r < rows && n0 + c < N) out[(long long)(row_begin + r) * N + n0 + c] = __float2bfloat16_rn(c_tile[r][c]);
    }
}

extern "C" __global__ void swiglu_clamp(const bf16* __restrict__ gate_up, bf16* __restrict__ out, long long rows,
                                        int half, float limit) {
    const long long total = rows * half;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / half;
        const int c = (int)(i % half);
        float gate = __bfloat162float(gate_up[r * 2 * half + c]), up = __bfloat162float(gate_up[r * 2 * half + half + c]);
        if (limit > 0.f) {
            gate = fminf(gate, limit);
            up = fminf(fmaxf(up, -limit), limit);
        }
        out[i] = __float2bfloat16_rn(gate / (1.f + __expf(-gate)) * up);
    }
}
