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
// the block calls it, and every caller runs MLA_ROW_THREADS threads (the sum's order depends on it). Every global load
// (the row, the norm weights, the rope pair and its cos / sin) is issued first, in one round, before the sum.
#define MLA_ROW_THREADS 128
#define MLA_ROW_ITEMS ((KV_LORA + MLA_ROW_THREADS - 1) / MLA_ROW_THREADS)
__device__ __forceinline__ void mla_latent_row(const bf16* __restrict__ row, const bf16* __restrict__ norm_weight,
                                               float eps, const float* cos_row, const float* sin_row, bf16* out,
                                               bool store, float* scratch) {
    const int half = ROPE_DIM / 2;
    float value[MLA_ROW_ITEMS], weight[MLA_ROW_ITEMS];
#pragma unroll
    for (int k = 0; k < MLA_ROW_ITEMS; ++k) {
        const int i = threadIdx.x + k * MLA_ROW_THREADS;
        value[k] = i < KV_LORA ? __bfloat162float(row[i]) : 0.f;
        weight[k] = i < KV_LORA ? __bfloat162float(norm_weight[i]) : 0.f;
    }
    const bool pe = threadIdx.x < half;
    const float x1 = pe ? __bfloat162float(row[KV_LORA + threadIdx.x]) : 0.f;
    const float x2 = pe ? __bfloat162float(row[KV_LORA + half + threadIdx.x]) : 0.f;
    const float c = pe ? cos_row[threadIdx.x] : 0.f, s = pe ? sin_row[threadIdx.x] : 0.f;
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < MLA_ROW_ITEMS; ++k)
        if (threadIdx.x + k * MLA_ROW_THREADS < KV_LORA) sum += value[k] * value[k];
    const float inv_rms = rsqrtf(block_sum(sum, scratch) / KV_LORA + eps);
    if (!store) return;
#pragma unroll
    for (int k = 0; k < MLA_ROW_ITEMS; ++k) {
        const int i = threadIdx.x + k * MLA_ROW_THREADS;
        if (i < KV_LORA) out[i] = __float2bfloat16_rn(round_bf16(value[k] * inv_rms) * weight[k]);
    }
    if (pe) {
        const float2 r = mla_rope_pair(x1, x2, c, s);
        out[KV_LORA + threadIdx.x] = __float2bfloat16_rn(r.x);
        out[KV_LORA + half + threadIdx.x] = __float2bfloat16_rn(r.y);
    }
}
