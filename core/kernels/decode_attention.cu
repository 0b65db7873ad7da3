// Paged decode attention (one new query per sequence), split-KV flash decoding, GQA-aware.
//
// Grid (num_splits, num_kv_heads, num_seqs), 4 warps. A block owns one KV head of one sequence
// and one contiguous slice of its context; every key it loads serves all GROUP query heads of
// that KV head, so each KV byte is read once. Inside a warp, LANES_PER_KEY lanes hold one key
// (16 bytes each), so a warp works on KEYS_PER_WARP keys at once, UNROLL deep.
// Output: unnormalized partial sums per split, merged by `decode_attention_combine`.
//   partial_out [num_seqs, num_heads, num_splits, HEAD_DIM]   (fp32)
//   partial_ml  [num_seqs, num_heads, num_splits, 2]          (running max (log2 domain), sum)
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#define NUM_WARPS 4
constexpr int LANES_PER_KEY = HEAD_DIM / 8;
constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
// Measured on an H200 (Qwen3-4B, bs 64/256, context 512; benchmarks/gpu_kernel_variants.py):
// occupancy wins over loads in flight: UNROLL 2 with 4 resident blocks reads KV at 1.6-1.9 TB/s,
// UNROLL 4 with 1 block at 1.1-1.2 TB/s.
#ifndef UNROLL  // keys per sub-group in flight
#define UNROLL 2
#endif
#ifndef MIN_BLOCKS  // resident blocks per SM the compiler must allow (caps registers)
#define MIN_BLOCKS (GROUP <= 4 ? 4 : 2)
#endif
constexpr float NEG_BIG = -1e30f;
static_assert(LANES_PER_KEY <= 32 && 32 % LANES_PER_KEY == 0, "HEAD_DIM must be 32, 64, 128 or 256");

__device__ __forceinline__ void merge_state(float& m, float& l, float* acc, float m_o, float l_o,
                                            const float* acc_o) {
    const float m_new = fmaxf(m, m_o);
    const float a = exp2f(m - m_new), b = exp2f(m_o - m_new);
    l = l * a + l_o * b;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * a + acc_o[i] * b;
    m = m_new;
}

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS)
decode_attention_split(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                       const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
                       int max_blocks_per_seq, const int* __restrict__ context_lens,
                       float* __restrict__ partial_out, float* __restrict__ partial_ml,
                       int num_kv_heads, int block_size, int num_splits, float scale_log2) {
    __shared__ float merge_acc[NUM_WARPS][GROUP][HEAD_DIM];
    __shared__ float merge_ml[NUM_WARPS][GROUP][2];
    const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = lane / LANES_PER_KEY, sub_lane = lane % LANES_PER_KEY;
    const int num_heads = num_kv_heads * GROUP;
    const int length = context_lens[seq];
    const int chunk = (length + num_splits - 1) / num_splits;
    const int start = split * chunk, end = min(length, start + chunk);
    const int* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const size_t token_stride = (size_t)num_kv_heads * HEAD_DIM;

    float qf[GROUP][8], acc[GROUP][8], m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        load8(q + ((size_t)seq * num_heads + kv_head * GROUP + g) * HEAD_DIM + sub_lane * 8, qf[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            qf[g][i] *= scale_log2;
            acc[g][i] = 0.f;
        }
        m[g] = NEG_BIG;
        l[g] = 0.f;
    }
    constexpr int STRIDE = NUM_WARPS * KEYS_PER_WARP;
    // Loop bounds are uniform across the warp (shuffles below need every lane).
    for (int base = start + warp * KEYS_PER_WARP; base < end; base += STRIDE * UNROLL) {
        float kf[UNROLL][8], vf[UNROLL][8];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = base + sub + u * STRIDE;
            valid[u] = t < end;
            if (valid[u]) {
                const size_t off = ((size_t)table[t / block_size] * block_size + t % block_size) * token_stride +
                                   (size_t)kv_head * HEAD_DIM + sub_lane * 8;
                load8(k_cache + off, kf[u]);
                load8(v_cache + off, vf[u]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) kf[u][i] = vf[u][i] = 0.f;
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float s[UNROLL];
            float m_new = m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) d += qf[g][i] * kf[u][i];
#pragma unroll
                for (int o = LANES_PER_KEY / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                s[u] = d;
                if (valid[u]) m_new = fmaxf(m_new, d);
            }
            const float correction = exp2f(m[g] - m_new);
            l[g] *= correction;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] *= correction;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const float p = valid[u] ? exp2f(s[u] - m_new) : 0.f;
                l[g] += p;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] += p * vf[u][i];
            }
            m[g] = m_new;
        }
    }
    // Merge the KEYS_PER_WARP sub-groups of the warp (lanes with equal sub_lane hold equal dims).
#pragma unroll
    for (int o = LANES_PER_KEY; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float acc_o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc_o[i] = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
            const float m_o = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float l_o = __shfl_xor_sync(0xffffffffu, l[g], o);
            merge_state(m[g], l[g], acc[g], m_o, l_o, acc_o);
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int i = 0; i < 8; ++i) merge_acc[warp][g][sub_lane * 8 + i] = acc[g][i];
            if (sub_lane == 0) {
                merge_ml[warp][g][0] = m[g];
                merge_ml[warp][g][1] = l[g];
            }
        }
    }
    __syncthreads();
    // Merge the warps: thread i handles (head g, dim d) pairs i, i + blockDim, ...
    for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += blockDim.x) {
        const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
        float mm = NEG_BIG;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) mm = fmaxf(mm, merge_ml[w][g][0]);
        float ll = 0.f, aa = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float f = exp2f(merge_ml[w][g][0] - mm);
            ll += merge_ml[w][g][1] * f;
            aa += merge_acc[w][g][d] * f;
        }
        const size_t row = ((size_t)seq * num_heads + kv_head * GROUP + g) * num_splits + split;
        partial_out[row * HEAD_DIM + d] = aa;
        if (d == 0) {
            partial_ml[row * 2] = mm;
            partial_ml[row * 2 + 1] = ll;
        }
    }
}

// out[seq, head, :] = merge over splits; a sequence with no keys gets zeros. Grid (num_heads, num_seqs).
extern "C" __global__ void decode_attention_combine(const float* __restrict__ partial_out,
                                                    const float* __restrict__ partial_ml,
                                                    bf16* __restrict__ out, int num_heads, int num_splits) {
    const int head = blockIdx.x, seq = blockIdx.y;
    const size_t row0 = ((size_t)seq * num_heads + head) * num_splits;
    float mm = NEG_BIG;
    for (int s = 0; s < num_splits; ++s) mm = fmaxf(mm, partial_ml[(row0 + s) * 2]);
    float ll = 0.f;
    for (int s = 0; s < num_splits; ++s) ll += partial_ml[(row0 + s) * 2 + 1] * exp2f(partial_ml[(row0 + s) * 2] - mm);
    const float inv = ll > 0.f ? 1.f / ll : 0.f;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < num_splits; ++s)
            a += partial_out[(row0 + s) * HEAD_DIM + d] * exp2f(partial_ml[(row0 + s) * 2] - mm);
        out[((size_t)seq * num_heads + head) * HEAD_DIM + d] = __float2bfloat16_rn(a * inv);
    }
}
