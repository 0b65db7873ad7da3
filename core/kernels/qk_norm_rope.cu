// Fused per-head q/k RMSNorm + NeoX RoPE + paged KV write. One warp per (token, head) over
// the qkv row [ q heads | k heads | v heads ] (each head HEAD_DIM wide):
//   q heads -> q_out [T, num_heads, HEAD_DIM]           (normed, rotated)
//   k heads -> k_cache[slot, kv_head, :]                (normed, rotated)
//   v heads -> v_cache[slot, kv_head, :]                (copied)
// slot = slot_mapping[t] (block * block_size + offset); a negative slot (padding) writes no KV.
// The cache layout is [num_blocks, block_size, num_kv_heads, HEAD_DIM], so slot indexes it flat.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define WARPS_PER_BLOCK 4
static_assert(HEAD_DIM % 32 == 0, "HEAD_DIM must be a multiple of 32");
constexpr int PER_LANE = HEAD_DIM / 32;

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
qk_norm_rope_write_kv(const bf16* __restrict__ qkv, bf16* __restrict__ q_out,
                      bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                      const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm, float eps,
                      const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                      int rotary_dim, const int* __restrict__ positions,
                      const int* __restrict__ slot_mapping, int num_tokens, int num_heads,
                      int num_kv_heads) {
    __shared__ float rotated[WARPS_PER_BLOCK][HEAD_DIM];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int heads_per_token = num_heads + 2 * num_kv_heads;
    const long long task = (long long)blockIdx.x * WARPS_PER_BLOCK + warp;
    if (task >= (long long)num_tokens * heads_per_token) return;
    const int t = (int)(task / heads_per_token), head = (int)(task % heads_per_token);
    const bf16* src = qkv + (size_t)t * heads_per_token * HEAD_DIM + (size_t)head * HEAD_DIM;
    const int slot = slot_mapping[t];

    float x[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) x[i] = __bfloat162float(src[lane + 32 * i]);

    if (head >= num_heads + num_kv_heads) {  // v head: plain copy into the cache
        if (slot < 0) return;
        bf16* dst = v_cache + ((size_t)slot * num_kv_heads + (head - num_heads - num_kv_heads)) * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) dst[lane + 32 * i] = src[lane + 32 * i];
        return;
    }
    const bool is_q = head < num_heads;
    const bf16* norm = is_q ? q_norm : k_norm;
    if (norm != nullptr) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) ss += x[i] * x[i];
        const float inv = rsqrtf(warp_sum(ss) / HEAD_DIM + eps);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            x[i] = round_bf16(round_bf16(x[i] * inv) * __bfloat162float(norm[lane + 32 * i]));
    }
    bf16* dst;
    if (is_q) {
        dst = q_out + ((size_t)t * num_heads + head) * HEAD_DIM;
    } else {
        if (slot < 0) return;
        dst = k_cache + ((size_t)slot * num_kv_heads + (head - num_heads)) * HEAD_DIM;
    }
    if (cos_table == nullptr || rotary_dim == 0) {
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) dst[lane + 32 * i] = __float2bfloat16_rn(x[i]);
        return;
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) rotated[warp][lane + 32 * i] = x[i];
    __syncwarp();
    const int half = rotary_dim / 2;
    const float* cos_row = cos_table + (size_t)positions[t] * half;
    const float* sin_row = sin_table + (size_t)positions[t] * half;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int e = lane + 32 * i;
        float y = x[i];
        if (e < half) {
            y = x[i] * cos_row[e] - rotated[warp][e + half] * sin_row[e];
        } else if (e < rotary_dim) {
            y = x[i] * cos_row[e - half] + rotated[warp][e - half] * sin_row[e - half];
        }
        dst[e] = __float2bfloat16_rn(y);
    }
}

// --- The same op with 16-byte accesses (qk_norm_rope_write_kv_vec) -------------------------------
// HEAD_DIM / 8 lanes per head, each lane 8 consecutive elements: one 16-byte load of the qkv row and
// one 16-byte store into q_out / the K or V page per lane and token. Grid (ceil(num_tokens /
// QKV_TOKENS_PER_THREAD), head chunks), any multiple of 32 threads per block: lane g of a token's
// chunk runs head g / LANES_PER_HEAD, so a head's lanes sit in one warp and the norm sums and the
// RoPE partner exchange are warp shuffles (xor within a head's lanes). Each thread takes the same
// lane of QKV_TOKENS_PER_THREAD consecutive tokens, all their loads issued before any math (more
// bytes in flight per thread). NeoX pairs element e with e + rotary_dim / 2, i.e. lane j with lane
// j ^ (rotary_dim / 16): the launcher takes this kernel only where rotary_dim / 16 is a power of two
// (or no rotation). Same arithmetic per element as above; the head's sum of squares is taken in
// another order (per lane, then xor over its lanes), so q / k can differ in the last bit.
#ifndef QKV_TOKENS_PER_THREAD
#define QKV_TOKENS_PER_THREAD 1
#endif
#ifndef QKV_PREFETCH_ROPE  // 1: cos / sin loaded with the row (more registers, one wait for memory)
#define QKV_PREFETCH_ROPE 0
#endif
#ifndef QKV_SCALAR_ROPE  // 1: cos / sin read per element inside the rotation (fewer registers)
#define QKV_SCALAR_ROPE 0
#endif
constexpr int LANES_PER_HEAD = HEAD_DIM / 8;
static_assert(32 % LANES_PER_HEAD == 0, "qk_norm_rope_write_kv_vec: HEAD_DIM / 8 must divide a warp");

// 8 floats from a 16-byte aligned address, as two 16-byte loads.
__device__ __forceinline__ void load_floats8(const float* p, float* f) {
    const uint4 a = *reinterpret_cast<const uint4*>(p), b = *reinterpret_cast<const uint4*>(p + 4);
    const unsigned words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __int_as_float(static_cast<int>(words[i]));
}

extern "C" __global__ void __launch_bounds__(256)
qk_norm_rope_write_kv_vec(const bf16* __restrict__ qkv, bf16* __restrict__ q_out, bf16* __restrict__ k_cache,
                          bf16* __restrict__ v_cache, const bf16* __restrict__ q_norm,
                          const bf16* __restrict__ k_norm, float eps, const float* __restrict__ cos_table,
                          const float* __restrict__ sin_table, int rotary_dim, const int* __restrict__ positions,
                          const int* __restrict__ slot_mapping, int num_tokens, int num_heads, int num_kv_heads) {
    const int heads_per_token = num_heads + 2 * num_kv_heads;
    const int g = blockIdx.y * blockDim.x + threadIdx.x;
    const int head = g / LANES_PER_HEAD, e0 = (g % LANES_PER_HEAD) * 8;
    const bool valid_head = head < heads_per_token;
    const bool is_q = head < num_heads, is_v = head >= num_heads + num_kv_heads;
    const bf16* norm = is_q ? q_norm : k_norm;
    const int first_token = blockIdx.x * QKV_TOKENS_PER_THREAD;
    const bool rotate = cos_table != nullptr && rotary_dim > 0;  // the same for the whole grid
    const int half = rotary_dim / 2;
    const bool rotates_lane = valid_head && !is_v && rotate && e0 < rotary_dim;
    const int table_column = e0 < half ? e0 : e0 - half;
    // loads that do not depend on the row's values go out with the row: the qkv vectors, the norm
    // weight, the tokens' slots and (QKV_PREFETCH_ROPE) cos / sin, 16-byte loads (rows of half
    // floats, e0 a multiple of 8); else cos / sin are loaded after the norm, as the rotation needs them
    float x[QKV_TOKENS_PER_THREAD][8], c[QKV_TOKENS_PER_THREAD][8], sn[QKV_TOKENS_PER_THREAD][8];
    int slot[QKV_TOKENS_PER_THREAD];
#pragma unroll
    for (int k = 0; k < QKV_TOKENS_PER_THREAD; ++k) {
        const int t = first_token + k;
        if (valid_head && t < num_tokens) {
            load8(qkv + (size_t)t * heads_per_token * HEAD_DIM + (size_t)head * HEAD_DIM + e0, x[k]);
            slot[k] = is_q ? 0 : slot_mapping[t];
            if (QKV_PREFETCH_ROPE && rotates_lane) {
                const size_t at = (size_t)positions[t] * half + table_column;
                load_floats8(cos_table + at, c[k]);
                load_floats8(sin_table + at, sn[k]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) x[k][i] = 0.f;
            slot[k] = -1;
        }
    }
    float w[8];
    if (valid_head && !is_v && norm != nullptr) load8(norm + e0, w);

#pragma unroll
    for (int k = 0; k < QKV_TOKENS_PER_THREAD; ++k) {
        const int t = first_token + k;
        const bool valid = valid_head && t < num_tokens;
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += x[k][i] * x[k][i];
#pragma unroll
        for (int o = LANES_PER_HEAD / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (valid && !is_v && norm != nullptr) {
            const float inv = rsqrtf(ss / HEAD_DIM + eps);
#pragma unroll
            for (int i = 0; i < 8; ++i) x[k][i] = round_bf16(round_bf16(x[k][i] * inv) * w[i]);
        }
        if (rotate) {
            float partner[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) partner[i] = __shfl_xor_sync(0xffffffffu, x[k][i], half / 8);
            if (valid && rotates_lane) {
                const bool first = e0 < half;
                if (QKV_SCALAR_ROPE && !QKV_PREFETCH_ROPE) {
                    // cos / sin read element by element as the rotation consumes them: no 16 floats
                    // live at once (32 registers instead of 40-48 at one token per thread)
                    const size_t at = (size_t)positions[t] * half + table_column;
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        x[k][i] = first ? x[k][i] * cos_table[at + i] - partner[i] * sin_table[at + i]
                                        : x[k][i] * cos_table[at + i] + partner[i] * sin_table[at + i];
                } else {
                    if (!QKV_PREFETCH_ROPE) {
                        const size_t at = (size_t)positions[t] * half + table_column;
                        load_floats8(cos_table + at, c[k]);
                        load_floats8(sin_table + at, sn[k]);
                    }
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        x[k][i] = first ? x[k][i] * c[k][i] - partner[i] * sn[k][i]
                                        : x[k][i] * c[k][i] + partner[i] * sn[k][i];
                }
            }
        }
        if (!valid) continue;
        bf16* dst;
        if (is_q) {
            dst = q_out + ((size_t)t * num_heads + head) * HEAD_DIM;
        } else {
            if (slot[k] < 0) continue;  // padding: no KV write
            dst = (is_v ? v_cache : k_cache) +
                  ((size_t)slot[k] * num_kv_heads + (head - num_heads - (is_v ? num_kv_heads : 0))) * HEAD_DIM;
        }
        store8(dst + e0, x[k]);
    }
}
