// Multi-head latent attention (DeepSeek-V3 / Kimi-K2) over a paged latent cache, absorbed form.
//
//   cache [num_blocks, block_size, KV_LORA + ROPE_DIM] bf16     one latent row per token:
//         [ c_kv (RMS-normed, KV_LORA) | k_pe (RoPE'd, ROPE_DIM) ]
//
// mla_write_latent: per new token, RMS-norm c_kv (kv_a_layernorm), rotate k_pe, store the row at
//   the token's slot; rotate every head's q_pe in place (rotate-half on de-interleaved dims).
// mla_attention: per (token, chunk of HEADS_PER_BLOCK heads): scores over the token's causal
//   context (positions 0 ..= its own) = (q_latent · c_kv + q_pe · k_pe) · scale, online softmax,
//   o_latent = Σ p · c_kv. W_UK (into q_latent) and W_UV (out of o_latent) are batched GEMMs
//   outside. Every latent tile is read once for all heads of the block.
#include "common.cuh"

#ifndef KV_LORA
#define KV_LORA 512
#endif
#ifndef ROPE_DIM
#define ROPE_DIM 64
#endif
#define LATENT (KV_LORA + ROPE_DIM)
#define HEADS_PER_BLOCK 16
#define TOKENS_PER_TILE 16
#define MLA_THREADS (HEADS_PER_BLOCK * TOKENS_PER_TILE)
#define DIMS_PER_THREAD (KV_LORA / TOKENS_PER_TILE)

// One block per new token; q [T, num_heads, q_stride] with q_pe at q_pe_offset of each head.
extern "C" __global__ void mla_write_latent(const bf16* __restrict__ kv_a /* [T, kv_a_stride] */, int kv_a_stride,
                                            const bf16* __restrict__ norm_weight, float eps,
                                            bf16* __restrict__ q, int num_heads, int q_stride, int q_pe_offset,
                                            const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                                            const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                                            bf16* __restrict__ cache) {
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    const bf16* row = kv_a + (long long)t * kv_a_stride;
    float sum = 0.f;
    for (int i = threadIdx.x; i < KV_LORA; i += blockDim.x) {
        const float v = __bfloat162float(row[i]);
        sum += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sum, scratch) / KV_LORA + eps);
    const int slot = slot_mapping[t];  // -1: a padding row of a captured batch, nothing to store
    bf16* out = cache + (long long)(slot < 0 ? 0 : slot) * LATENT;
    for (int i = threadIdx.x; i < KV_LORA && slot >= 0; i += blockDim.x)
        out[i] = __float2bfloat16_rn(round_bf16(__bfloat162float(row[i]) * inv_rms) * __bfloat162float(norm_weight[i]));
    const int half = ROPE_DIM / 2;
    const float* cos_row = cos_table + (long long)positions[t] * half;
    const float* sin_row = sin_table + (long long)positions[t] * half;
    for (int i = threadIdx.x; i < half && slot >= 0; i += blockDim.x) {
        const float x1 = __bfloat162float(row[KV_LORA + i]), x2 = __bfloat162float(row[KV_LORA + half + i]);
        out[KV_LORA + i] = __float2bfloat16_rn(x1 * cos_row[i] - x2 * sin_row[i]);
        out[KV_LORA + half + i] = __float2bfloat16_rn(x2 * cos_row[i] + x1 * sin_row[i]);
    }
    for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
        const int h = i / half, d = i % half;
        bf16* pe = q + ((long long)t * num_heads + h) * q_stride + q_pe_offset;
        const float x1 = __bfloat162float(pe[d]), x2 = __bfloat162float(pe[half + d]);
        pe[d] = __float2bfloat16_rn(x1 * cos_row[d] - x2 * sin_row[d]);
        pe[half + d] = __float2bfloat16_rn(x2 * cos_row[d] + x1 * sin_row[d]);
    }
}

// grid (T, ceil(num_heads / HEADS_PER_BLOCK), num_splits), MLA_THREADS threads.
// q_latent [T, num_heads, KV_LORA]; q_pe at q + (t·num_heads + h)·q_stride + q_pe_offset;
// out [T, num_heads, KV_LORA]. A token's sequence is found in query_start (binary search); its
// context is positions[t] + 1 tokens of that sequence's block table. With num_splits > 1 (few
// tokens, long contexts: more blocks than tokens × head chunks) split z covers one slice of the
// context and leaves its normalised partial output and (max, sum) in partial_o / partial_ml for
// mla_combine_splits.
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
mla_attention(const bf16* __restrict__ q_latent, const bf16* __restrict__ q, int q_stride, int q_pe_offset,
              const bf16* __restrict__ cache, const int* __restrict__ block_tables, int max_blocks_per_seq,
              int block_size, const int* __restrict__ query_start, int num_seqs,
              const int* __restrict__ positions, int num_heads, float scale, bf16* __restrict__ out,
              int num_splits, float* __restrict__ partial_o, float* __restrict__ partial_ml) {
    __shared__ __align__(16) bf16 q_tile[HEADS_PER_BLOCK][LATENT];
    // rows padded by one bf16 pair: the 16 tokens a warp scores at once sit in 16 different banks
    __shared__ __align__(16) bf16 kv_tile[TOKENS_PER_TILE][LATENT + 2];
    __shared__ float scores[HEADS_PER_BLOCK][TOKENS_PER_TILE];
    const int t = blockIdx.x, head0 = blockIdx.y * HEADS_PER_BLOCK;
    const int heads = min(HEADS_PER_BLOCK, num_heads - head0);
    int lo = 0, hi = num_seqs - 1;  // the sequence s with query_start[s] <= t < query_start[s + 1]
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (query_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int* table = block_tables + (long long)lo * max_blocks_per_seq;
    const int context = positions[t] + 1, split = blockIdx.z;
    const int per_split = ((context + num_splits - 1) / num_splits + TOKENS_PER_TILE - 1) / TOKENS_PER_TILE * TOKENS_PER_TILE;
    const int begin = split * per_split, end = min(context, begin + per_split);
    for (int i = threadIdx.x; i < HEADS_PER_BLOCK * LATENT; i += MLA_THREADS) {
        const int h = i / LATENT, d = i % LATENT;
        bf16 v = __float2bfloat16_rn(0.f);
        if (h < heads) {
            const long long head = (long long)t * num_heads + head0 + h;
            v = d < KV_LORA ? q_latent[head * KV_LORA + d] : q[head * q_stride + q_pe_offset + d - KV_LORA];
        }
        q_tile[h][d] = v;
    }
    const int my_head = threadIdx.x / TOKENS_PER_TILE, my_token = threadIdx.x % TOKENS_PER_TILE;
    // output dims of this thread: my_token, my_token + 16, ... (neighbouring threads, neighbouring dims)
    float acc[DIMS_PER_THREAD];
    for (int i = 0; i < DIMS_PER_THREAD; ++i) acc[i] = 0.f;
    float running_max = -INFINITY, running_sum = 0.f;
    for (int start = begin; start < end; start += TOKENS_PER_TILE) {
        __syncthreads();
        for (int i = threadIdx.x; i < TOKENS_PER_TILE * LATENT; i += MLA_THREADS) {
            const int r = i / LATENT, d = i % LATENT, pos = start + r;
            bf16 v = __float2bfloat16_rn(0.f);
            if (pos < end) v = cache[((long long)table[pos / block_size] * block_size + pos % block_size) * LATENT + d];
            kv_tile[r][d] = v;
        }
        __syncthreads();
        float s = -INFINITY;
        if (start + my_token < end && my_head < heads) {
            float dot = 0.f;
            for (int d = 0; d < LATENT; ++d) dot += __bfloat162float(q_tile[my_head][d]) * __bfloat162float(kv_tile[my_token][d]);
            s = dot * scale;
        }
        scores[my_head][my_token] = s;
        __syncthreads();
        float tile_max = -INFINITY;
        for (int j = 0; j < TOKENS_PER_TILE; ++j) tile_max = fmaxf(tile_max, scores[my_head][j]);
        const float new_max = fmaxf(running_max, tile_max);
        const float correction = running_max == -INFINITY ? 0.f : __expf(running_max - new_max);
        running_sum *= correction;
        for (int i = 0; i < DIMS_PER_THREAD; ++i) acc[i] *= correction;
        for (int j = 0; j < TOKENS_PER_TILE; ++j) {
            const float p = scores[my_head][j] == -INFINITY ? 0.f : __expf(scores[my_head][j] - new_max);
            running_sum += p;
            for (int i = 0; i < DIMS_PER_THREAD; ++i)
                acc[i] += p * __bfloat162float(kv_tile[j][my_token + TOKENS_PER_TILE * i]);
        }
        running_max = new_max;
    }
    if (my_head < heads) {
        const float inv = running_sum > 0.f ? 1.f / running_sum : 0.f;
        const long long head = (long long)t * num_heads + head0 + my_head;
        if (num_splits == 1) {
            bf16* dst = out + head * KV_LORA + my_token;
            for (int i = 0; i < DIMS_PER_THREAD; ++i) dst[TOKENS_PER_TILE * i] = __float2bfloat16_rn(acc[i] * inv);
        } else {
            float* dst = partial_o + (head * num_splits + split) * KV_LORA + my_token;
            for (int i = 0; i < DIMS_PER_THREAD; ++i) dst[TOKENS_PER_TILE * i] = acc[i] * inv;
            if (my_token == 0) {
                partial_ml[(head * num_splits + split) * 2] = running_max;
                partial_ml[(head * num_splits + split) * 2 + 1] = running_sum;
            }
        }
    }
}

// One block per (token, head): out = Σ_z w_z · o_z with w_z ∝ e^(m_z − m) · l_z (empty splits: l_z = 0).
extern "C" __global__ void mla_combine_splits(const float* __restrict__ partial_o, const float* __restrict__ partial_ml,
                                              int num_splits, bf16* __restrict__ out) {
    const long long head = blockIdx.x;
    const float* ml = partial_ml + head * num_splits * 2;
    float m = -INFINITY;
    for (int z = 0; z < num_splits; ++z)
        if (ml[2 * z + 1] > 0.f) m = fmaxf(m, ml[2 * z]);
    float total = 0.f;
    for (int z = 0; z < num_splits; ++z)
        if (ml[2 * z + 1] > 0.f) total += __expf(ml[2 * z] - m) * ml[2 * z + 1];
    for (int d = threadIdx.x; d < KV_LORA; d += blockDim.x) {
        float sum = 0.f;
        for (int z = 0; z < num_splits; ++z)
            if (ml[2 * z + 1] > 0.f)
                sum += __expf(ml[2 * z] - m) * ml[2 * z + 1] * partial_o[(head * num_splits + z) * KV_LORA + d];
        out[head * KV_LORA + d] = __float2bfloat16_rn(total > 0.f ? sum / total : 0.f);
    }
}
