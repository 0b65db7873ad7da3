// The new token's latent row and the rotary pairs, shared by mla.cu's latent writes and mla_decode_sm90.cu's
// attention with the write folded in (TMA_FUSED_WRITE): one definition, the same sums and roundings, the same bits.
// Needs KV_LORA, ROPE_DIM and LATENT defined, and common.cuh's block_sum / round_bf16.
#pragma once

// Rotate-half RoPE of one pair (x1 at dim d, x2 at dim d + ROPE_DIM / 2): (x1·c − x2·s, x2·c + x1·s), each an explicit
// fused multiply-add over one rounded product (the compiler's own contraction could differ between kernels).
__device__ __forceinline__ float2 mla_rope_pair(float x1, float x2, float c, float s) {
    float2 r;
    r.x = fmaf(x1, c, -(x2 * s));
    r.y = fmaf(x2, c, x1 * s);
    return r;
}

// The latent row of one new token, RMS-normed c_kv (kv_a_layernorm) and rotated k_pe, into `out` (LATENT bf16: a
// cache slot or shared memory); store false: the norm's barriers only, nothing written. Block-wide: every thread of
// the block calls it (the sum's order depends on blockDim.x: every caller runs 128 threads).
__device__ __forceinline__ void mla_latent_row(const bf16* __restrict__ row, const bf16* __restrict__ norm_weight,
                                               float eps, const float* cos_row, const float* sin_row, bf16* out,
                                               bool store, float* scratch) {
    const int half = ROPE_DIM / 2;
    float sum = 0.f;
    for (int i = threadIdx.x; i < KV_LORA; i += blockDim.x) {
        const float v = __bfloat162float(row[i]);
        sum += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sum, scratch) / KV_LORA + eps);
    for (int i = threadIdx.x; i < KV_LORA && store; i += blockDim.x)
        out[i] = __float2bfloat16_rn(round_bf16(__bfloat162float(row[i]) * inv_rms) * __bfloat162float(norm_weight[i]));
    for (int i = threadIdx.x; i < half && store; i += blockDim.x) {
        const float2 r = mla_rope_pair(__bfloat162float(row[KV_LORA + i]), __bfloat162float(row[KV_LORA + half + i]),
                                       cos_row[i], sin_row[i]);
        out[KV_LORA + i] = __float2bfloat16_rn(r.x);
        out[KV_LORA + half + i] = __float2bfloat16_rn(r.y);
    }
}
