// Shared by the Gated DeltaNet kernels (gated_deltanet.cu, gdn_chunked.cu, gdn_decode.cu): bf16
// helpers, reductions and the per-token gates, rounded where HF's bf16 model rounds.
#pragma once
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

#ifndef DK  // key head dim (compile-time: state rows in registers, mma tiles)
#define DK 128
#endif
#ifndef SPLIT  // threads per value channel in the recurrent kernels (divides 32 and DK)
#define SPLIT 4
#endif
static_assert(DK % SPLIT == 0 && 32 % SPLIT == 0, "SPLIT must divide the key head dim and 32");

#define L2_NORM_EPS 1e-6f

__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + __expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* [32] */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

// beta = sigmoid(b), rounded to bf16 as HF's bf16 model holds it.
__device__ __forceinline__ float gdn_beta(float b) { return round_bf16(sigmoid_f(b)); }

// The log-decay g = -exp(A_log) * softplus(a + dt_bias) <= 0 (torch's softplus: linear above 20).
__device__ __forceinline__ float gdn_log_decay(float a, float neg_rate, float bias) {
    const float x = a + bias;
    return neg_rate * (x > 20.f ? x : log1pf(__expf(x)));
}
