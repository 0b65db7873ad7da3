// One row's RMSNorm by the calling block, fp32 statistics: normalize in fp32, round to bf16, multiply by the
// bf16 weight, round again (a bf16 PyTorch RMSNorm). Shared by rms_norm.cu's block kernels and moe_routing.cu's
// fused add_rms_norm + router, so both give the same bits.
#pragma once
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
