// Shared by the Gated DeltaNet kernels (gated_deltanet.cu, gdn_chunked.cu, gdn_decode.cu): bf16
// helpers and the per-token gates, rounded where HF's bf16 model rounds. The bf16 typedef,
// round_bf16 and the warp / block reductions come from core's common.cuh (the loaders put
// openinfer.backend.cuda.kernel_include_dir() on the include path).
#pragma once
#include "common.cuh"

#ifndef DK  // key head dim (compile-time: state rows in registers, mma tiles)
#define DK 128
#endif
#ifndef SPLIT  // threads per value channel in the recurrent kernels (divides 32 and DK)
#define SPLIT 4
#endif
static_assert(DK % SPLIT == 0 && 32 % SPLIT == 0, "SPLIT must divide the key head dim and 32");

#define L2_NORM_EPS 1e-6f

__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + __expf(-x)); }

// beta = sigmoid(b), rounded to bf16 as HF's bf16 model holds it.
__device__ __forceinline__ float gdn_beta(float b) { return round_bf16(sigmoid_f(b)); }

// The log-decay g = -exp(A_log) * softplus(a + dt_bias) <= 0 (torch's softplus: linear above 20).
__device__ __forceinline__ float gdn_log_decay(float a, float neg_rate, float bias) {
    const float x = a + bias;
    return neg_rate * (x > 20.f ? x : log1pf(__expf(x)));
}
