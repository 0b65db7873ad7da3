// Shared by the Gated DeltaNet kernels (gated_deltanet.cu, gdn_chunked.cu, gdn_decode.cu): bf16
// helpers, the per-token gates (rounded where HF's bf16 model rounds) and the delta-rule step of
// the token-by-token kernels on a register-resident state column. The bf16 typedef,
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

// One token of the gated delta rule in the token-by-token kernels (gdn_delta_rule, gdn_decode_step),
// which keep one state column S[:, j] per SPLIT adjacent threads in registers — `column`: this
// thread's ROWS rows of it, row0 = its place among the SPLIT lanes x ROWS:
//   S <- decay S;  S += k (beta (v_j - S^T k));  returns o_j = S^T q
// with q = q_rows * q_scale and k = k_rows * k_scale (l2 norms applied on the fly; q_rows / k_rows
// point at this thread's first row of the token's q and k in shared memory) and v_j = value(),
// read only once S^T k is summed (fewer live registers across the first loop). The SPLIT partial
// dot products meet by shuffles, so every lane of the column gets the whole o_j; all 32 lanes of
// the warp must call it.
template <int ROWS, class Value>
__device__ __forceinline__ float gdn_delta_step(float (&column)[ROWS], const float* q_rows, float q_scale,
                                                const float* k_rows, float k_scale, Value value, float beta,
                                                float decay) {
    float predicted = 0.f;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        column[i] *= decay;
        predicted += column[i] * (k_rows[i] * k_scale);
    }
#pragma unroll
    for (int lane = 1; lane < SPLIT; lane <<= 1) predicted += __shfl_xor_sync(0xffffffffu, predicted, lane);
    const float delta = (value() - predicted) * beta;
    float o = 0.f;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        column[i] += (k_rows[i] * k_scale) * delta;
        o += column[i] * (q_rows[i] * q_scale);
    }
#pragma unroll
    for (int lane = 1; lane < SPLIT; lane <<= 1) o += __shfl_xor_sync(0xffffffffu, o, lane);
    return o;
}
