// Skinny GEMM for decode: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M <= 8, bf16 in/out, fp32 sums.
// One warp per output column n streams the weight row w[n, :] with 16-byte loads, UNROLL loads
// in flight per lane; x rows are read through L1 (every warp of the block reads the same x).
// Each output is reduced in the same order whatever M is, so a row's result does not depend on
// the other rows of the batch. K must be a multiple of 8.
#include "common.cuh"

#define WARPS_PER_BLOCK 8
#define UNROLL 4

template <int ROWS>
__device__ __forceinline__ void gemv_rows(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          const bf16* __restrict__ bias, bf16* __restrict__ y, int M,
                                          int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * WARPS_PER_BLOCK + warp;
    if (n >= N) return;
    const bf16* wrow = w + (size_t)n * K;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    constexpr int STEP = 32 * 8;
    int k = lane * 8;
    for (; k + (UNROLL - 1) * STEP < K; k += UNROLL * STEP) {
        float wf[UNROLL][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) load8(wrow + k + u * STEP, wf[u]);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < M) {
                    float xf[8];
                    load8(x + (size_t)r * K + k + u * STEP, xf);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r] += xf[i] * wf[u][i];
                }
            }
        }
    }
    for (; k < K; k += STEP) {
        float wf[8];
        load8(wrow + k, wf);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < M) {
                float xf[8];
                load8(x + (size_t)r * K + k, xf);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r] += xf[i] * wf[i];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
        const float b = bias != nullptr ? __bfloat162float(bias[n]) : 0.f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (r < M) y[(size_t)r * N + n] = __float2bfloat16_rn(acc[r] + b);
    }
}

#define DEFINE_GEMV(ROWS)                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)                            \
        gemv_m##ROWS(const bf16* __restrict__ x, const bf16* __restrict__ w,                      \
                     const bf16* __restrict__ bias, bf16* __restrict__ y, int M, int N, int K) {  \
        gemv_rows<ROWS>(x, w, bias, y, M, N, K);                                                   \
    }

DEFINE_GEMV(1)
DEFINE_GEMV(2)
DEFINE_GEMV(4)
DEFINE_GEMV(8)
