// RMSNorm over the last dim, one block per row, fp32 statistics. Matches a bf16 PyTorch
// RMSNorm: normalize in fp32, round to bf16, multiply by the bf16 weight, round again.
#include "common.cuh"

__device__ __forceinline__ void normalize_row(const bf16* __restrict__ x, const bf16* __restrict__ weight,
                                              bf16* __restrict__ out, int features, float eps) {
    __shared__ float scratch[32];
    float ss = 0.f;
    for (int c = threadIdx.x; c < features; c += blockDim.x) {
        const float v = __bfloat162float(x[c]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / features + eps);
    for (int c = threadIdx.x; c < features; c += blockDim.x) {
        const float v = round_bf16(__bfloat162float(x[c]) * inv);
        out[c] = __float2bfloat16_rn(v * __bfloat162float(weight[c]));
    }
}

extern "C" __global__ void rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ weight,
                                    bf16* __restrict__ out, int features, float eps) {
    const size_t row = blockIdx.x;
    normalize_row(x + row * features, weight, out + row * features, features, eps);
}

// residual_out = x + residual (bf16); out = rms_norm(residual_out).
extern "C" __global__ void add_rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ residual,
                                        const bf16* __restrict__ weight, bf16* __restrict__ out,
                                        bf16* __restrict__ residual_out, int features, float eps) {
    const size_t row = blockIdx.x;
    const bf16* xr = x + row * features;
    const bf16* rr = residual + row * features;
    bf16* ro = residual_out + row * features;
    for (int c = threadIdx.x; c < features; c += blockDim.x)
        ro[c] = __float2bfloat16_rn(__bfloat162float(xr[c]) + __bfloat162float(rr[c]));
    __syncthreads();  // each thread re-reads only what it wrote, but keep the row consistent
    normalize_row(ro, weight, out + row * features, features, eps);
}
