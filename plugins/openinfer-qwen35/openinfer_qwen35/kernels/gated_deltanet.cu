// Gated DeltaNet on the GPU: the varlen causal conv, the conv-window update, the delta rule
// (gates + l2 norm + recurrence, fused), the gated RMSNorm and the attention output gate.
//
// Activations are bf16; math is fp32 and rounds to bf16 where HF's bf16 model does. Layouts:
//   proj       [T, conv_dim | value_dim (z) | nv (b) | nv (a)]   bf16, row stride proj_stride
//   conv_out   [T, conv_dim] = [q (nk*DK) | k (nk*DK) | v (nv*dv)]  bf16
//   conv_state [num_slots, K-1, conv_dim] bf16   the last K-1 conv inputs of each slot, oldest first
//   ssm_state  [num_slots, nv, DK, dv]     fp32  the delta-rule state S of each value head
//   seqs: query_start [B+1], slots [B], fresh [B] (1: the step starts at position 0, so the
//   sequence's initial conv window and state read as zeros), token_seq [T] (sequence of each row).
// DK (key head dim) and SPLIT are compile-time defines: SPLIT threads keep one state column S[:, j]
// in registers, DK / SPLIT rows each.
#include "gdn_common.cuh"

// conv_out[t, c] = silu(sum_j w[c, j] * x[t - (K-1) + j, c]), reaching back into the slot's conv
// window for the first K-1 rows of a sequence. One thread per (token, channel).
extern "C" __global__ void gdn_conv1d(const bf16* __restrict__ proj, int proj_stride,
                                      const bf16* __restrict__ weight, const bf16* __restrict__ conv_state,
                                      const int* __restrict__ query_start, const int* __restrict__ slots,
                                      const int* __restrict__ fresh, const int* __restrict__ token_seq,
                                      bf16* __restrict__ conv_out, int num_tokens, int conv_dim, int width) {
    const long long n = (long long)num_tokens * conv_dim;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(i / conv_dim), c = (int)(i - (long long)t * conv_dim);
        const int s = token_seq[t], first = query_start[s], pos = t - first;
        const bf16* window = conv_state + (size_t)slots[s] * (width - 1) * conv_dim;
        float acc = 0.f;
        for (int j = 0; j < width; ++j) {
            const int m = pos - (width - 1) + j;  // row within this step's tokens of the sequence
            float x;
            if (m >= 0) x = to_f(proj[(size_t)(first + m) * proj_stride + c]);
            else x = fresh[s] ? 0.f : to_f(window[(size_t)(width - 1 + m) * conv_dim + c]);
            acc += to_f(weight[(size_t)c * width + j]) * x;
        }
        conv_out[(size_t)t * conv_dim + c] = __float2bfloat16_rn(silu_f(round_bf16(acc)));
    }
}

// gdn_conv1d with 8 adjacent channels and CONV_TOKENS consecutive tokens a thread
// (OPENINFER_QWEN35_GDN_PREFILL=staged | split | split_rows): grid (ceil(T / CONV_TOKENS),
// ceil(conv_dim / 1024)), 128 threads. The 8 channels' weights are read once (16-byte loads) and
// kept as floats; each tap of a token is one 16-byte load (the taps the previous token read hit
// L1), the 8 outputs one 16-byte store. Per output element gdn_conv1d made 2 width scalar loads,
// its weight loads 64 bytes apart across a warp: 0.56 ms for 8 x 1k tokens at the 4B shape on
// the H200, as a first 8-channel version that still read its weights per token (E2). The same
// sums in the same order: the same bits. The launcher takes it when conv_dim and proj_stride are
// multiples of 8 and the arrays 16-byte aligned; CONV_WIDTH compiled in (else read at run time).
// (A version reading each input row once — the span's 16 rows loaded first, the window sliding in
// registers, 157 registers — measured slower on the H200, E1 2026-11-24: 0.142 -> 0.180 ms at
// 8 x 1k tokens; removed.)
#define CONV_TOKENS 16
#define CONV_MAX_WIDTH 9
// ROWS (gdn_conv1d_vec_rows): only the listed token rows, rows[0 .. num_tokens) (a step whose chunked
// rows are convolved inside gdn_chunk_prepare_grouped_conv: its one-token rows)
template <bool ROWS>
__device__ __forceinline__ void conv1d_vec(const bf16* __restrict__ proj, int proj_stride,
                                           const bf16* __restrict__ weight, const bf16* __restrict__ conv_state,
                                           const int* __restrict__ query_start, const int* __restrict__ slots,
                                           const int* __restrict__ fresh, const int* __restrict__ token_seq,
                                           bf16* __restrict__ conv_out, int num_tokens, int conv_dim, int conv_width,
                                           const int* __restrict__ rows) {
#ifdef CONV_WIDTH
    constexpr int width = CONV_WIDTH;
#else
    const int width = conv_width;
#endif
    const int c0 = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c0 >= conv_dim) return;
    float w[8][CONV_MAX_WIDTH];  // w[e][j] = weight[c0 + e, j]: 8 width contiguous bf16
    {
        const uint4* src = reinterpret_cast<const uint4*>(weight + (size_t)c0 * width);
#pragma unroll
        for (int v = 0; v < CONV_MAX_WIDTH; ++v) {
            if (v < width) {  // 8 width bf16 = width 16-byte vectors
                const uint4 raw = src[v];
                const bf16* x = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const int flat = 8 * v + k;
                    w[flat / width][flat % width] = to_f(x[k]);
                }
            }
        }
    }
    const int t_end = min(num_tokens, (int)(blockIdx.x + 1) * CONV_TOKENS);
    for (int k = blockIdx.x * CONV_TOKENS; k < t_end; ++k) {
        const int t = ROWS ? rows[k] : k;
        const int s = token_seq[t], first = query_start[s], pos = t - first;
        const bool is_fresh = fresh[s] != 0;
        const bf16* window = conv_state + (size_t)slots[s] * (width - 1) * conv_dim;
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
        for (int j = 0; j < CONV_MAX_WIDTH; ++j) {
            if (j < width) {
                const int m = pos - (width - 1) + j;  // row within this step's tokens of the sequence
                uint4 xv = make_uint4(0, 0, 0, 0);    // a fresh sequence's window reads as zeros
                if (m >= 0) xv = *reinterpret_cast<const uint4*>(proj + (size_t)(first + m) * proj_stride + c0);
                else if (!is_fresh)
                    xv = *reinterpret_cast<const uint4*>(window + (size_t)(width - 1 + m) * conv_dim + c0);
                const bf16* x = reinterpret_cast<const bf16*>(&xv);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] += w[e][j] * to_f(x[e]);
            }
        }
        uint4 yv;
        bf16* y = reinterpret_cast<bf16*>(&yv);
#pragma unroll
        for (int e = 0; e < 8; ++e) y[e] = __float2bfloat16_rn(silu_f(round_bf16(acc[e])));
        *reinterpret_cast<uint4*>(conv_out + (size_t)t * conv_dim + c0) = yv;
    }
}

extern "C" __global__ void __launch_bounds__(128)
gdn_conv1d_vec(const bf16* __restrict__ proj, int proj_stride, const bf16* __restrict__ weight,
               const bf16* __restrict__ conv_state, const int* __restrict__ query_start,
               const int* __restrict__ slots, const int* __restrict__ fresh, const int* __restrict__ token_seq,
               bf16* __restrict__ conv_out, int num_tokens, int conv_dim, int conv_width) {
    conv1d_vec<false>(proj, proj_stride, weight, conv_state, query_start, slots, fresh, token_seq, conv_out, num_tokens,
                      conv_dim, conv_width, nullptr);
}

// gdn_conv1d_vec over the listed token rows (grid (ceil(num_rows / CONV_TOKENS), ceil(conv_dim / 1024)))
extern "C" __global__ void __launch_bounds__(128)
gdn_conv1d_vec_rows(const bf16* __restrict__ proj, int proj_stride, const bf16* __restrict__ weight,
                    const bf16* __restrict__ conv_state, const int* __restrict__ query_start,
                    const int* __restrict__ slots, const int* __restrict__ fresh, const int* __restrict__ token_seq,
                    bf16* __restrict__ conv_out, int num_rows, int conv_dim, int conv_width,
                    const int* __restrict__ rows) {
    conv1d_vec<true>(proj, proj_stride, weight, conv_state, query_start, slots, fresh, token_seq, conv_out, num_rows,
                     conv_dim, conv_width, rows);
}

// After gdn_conv1d: each sequence's slot keeps the last K-1 conv inputs. One thread per
// (sequence, channel), which reads its old window before writing it.
extern "C" __global__ void gdn_conv_state(const bf16* __restrict__ proj, int proj_stride,
                                          bf16* __restrict__ conv_state, const int* __restrict__ query_start,
                                          const int* __restrict__ slots, const int* __restrict__ fresh,
                                          int num_seqs, int conv_dim, int width) {
    const long long n = (long long)num_seqs * conv_dim;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int s = (int)(i / conv_dim), c = (int)(i - (long long)s * conv_dim);
        const int first = query_start[s], length = query_start[s + 1] - first;
        if (length == 0) continue;
        bf16* window = conv_state + (size_t)slots[s] * (width - 1) * conv_dim;
        float old[8];  // width - 1 <= 8
        for (int j = 0; j < width - 1; ++j) old[j] = fresh[s] ? 0.f : to_f(window[(size_t)j * conv_dim + c]);
        for (int j = 0; j < width - 1; ++j) {
            const int from = j + length;  // index into [old window | new rows]
            const float x = from < width - 1 ? old[from]
                                             : to_f(proj[(size_t)(first + from - (width - 1)) * proj_stride + c]);
            window[(size_t)j * conv_dim + c] = __float2bfloat16_rn(x);
        }
    }
}

// A prefix-cache snapshot inside a step (the state after `rows` of a sequence's rows of this step):
// the conv window there, the K-1 conv inputs before the boundary, into the snapshot slot — rows
// before the step from the live slot's window as it was (so this runs before gdn_conv_state
// rewrites it), zeros for a fresh sequence. snapshots [S][3]: (sequence, rows before the boundary,
// snapshot slot), as ForwardBatch.state_snapshots. One thread per (snapshot, channel).
extern "C" __global__ void gdn_conv_snapshot(const bf16* __restrict__ proj, int proj_stride,
                                             bf16* __restrict__ conv_state, const int* __restrict__ query_start,
                                             const int* __restrict__ slots, const int* __restrict__ fresh,
                                             const int* __restrict__ snapshots, int num_snapshots, int conv_dim,
                                             int width) {
    const long long n = (long long)num_snapshots * conv_dim;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int k = (int)(i / conv_dim), c = (int)(i - (long long)k * conv_dim);
        const int s = snapshots[3 * k], rows = snapshots[3 * k + 1], first = query_start[s];
        const bf16* live = conv_state + (size_t)slots[s] * (width - 1) * conv_dim;
        bf16* window = conv_state + (size_t)snapshots[3 * k + 2] * (width - 1) * conv_dim;
        for (int j = 0; j < width - 1; ++j) {
            const int from = j + rows;  // index into [old window | the step's rows]
            window[(size_t)j * conv_dim + c] =
                from >= width - 1 ? proj[(size_t)(first + from - (width - 1)) * proj_stride + c]
                : fresh[s]        ? __float2bfloat16_rn(0.f)
                                  : live[(size_t)from * conv_dim + c];
        }
    }
}

// The delta rule of one (sequence, value head, tile of value channels) over the sequence's tokens
// of this step, with its gates and the q/k l2 norm. Grid (num_seqs, nv, ceil(dv / tile_dv)):
// tiling the value channels puts a single long prompt (or a batch of one) on several SMs per
// head. SPLIT threads share a value channel j: thread t owns rows [part * DK/SPLIT, (part+1) *
// DK/SPLIT) of the state column S[:, j] in registers (part = t % SPLIT), and the SPLIT partial
// dot products meet by shuffles — a short serial chain per token, which bounds prefill speed.
// Writes the core output o (bf16, as HF hands it to the norm) for gdn_gated_norm.
#define DELTA_RULE_PARAMS                                                                                    \
    const bf16 *__restrict__ proj, int proj_stride, const bf16 *__restrict__ conv_out,                         \
        float *__restrict__ ssm_state, const float *__restrict__ neg_decay_rate, const float *__restrict__ dt_bias, \
        const int *__restrict__ query_start, const int *__restrict__ slots, const int *__restrict__ fresh,        \
        bf16 *__restrict__ core, int num_key_heads, int num_value_heads, int dv, int tile_dv
#define DELTA_RULE_ARGS                                                                                      \
    proj, proj_stride, conv_out, ssm_state, neg_decay_rate, dt_bias, query_start, slots, fresh, core,          \
        num_key_heads, num_value_heads, dv, tile_dv
__device__ __forceinline__ void delta_rule_sequence(int s, DELTA_RULE_PARAMS) {
    constexpr int ROWS = DK / SPLIT;
    __shared__ float q[DK], k[DK], scratch[32];
    const int h = blockIdx.y;
    const int local = threadIdx.x / SPLIT, part = threadIdx.x % SPLIT, row0 = part * ROWS;
    const int j = blockIdx.z * tile_dv + local;
    const bool active = local < tile_dv && j < dv;
    const int first = query_start[s], last = query_start[s + 1];
    const int key_head = h / (num_value_heads / num_key_heads);
    const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv;
    const int conv_dim = 2 * key_dim + value_dim;
    float* state = ssm_state + ((size_t)slots[s] * num_value_heads + h) * DK * dv;
    float column[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) column[i] = (active && !fresh[s]) ? state[(size_t)(row0 + i) * dv + j] : 0.f;
    const float rate = neg_decay_rate[h], bias = dt_bias[h];
    const float scale = rsqrtf((float)DK);

    for (int t = first; t < last; ++t) {
        const bf16* row = conv_out + (size_t)t * conv_dim;
        float q_sq = 0.f, k_sq = 0.f;
        for (int i = threadIdx.x; i < DK; i += blockDim.x) {
            const float qi = to_f(row[key_head * DK + i]), ki = to_f(row[key_dim + key_head * DK + i]);
            q[i] = qi;
            k[i] = ki;
            q_sq += qi * qi;
            k_sq += ki * ki;
        }
        q_sq = block_sum(q_sq, scratch);
        k_sq = block_sum(k_sq, scratch);  // block_sum's barriers also publish q[] and k[]
        const float q_norm = rsqrtf(q_sq + L2_NORM_EPS) * scale, k_norm = rsqrtf(k_sq + L2_NORM_EPS);
        const bf16* p = proj + (size_t)t * proj_stride;
        const float beta = gdn_beta(to_f(p[conv_dim + value_dim + h]));
        const float decay = __expf(gdn_log_decay(to_f(p[conv_dim + value_dim + num_value_heads + h]), rate, bias));
        const float o = gdn_delta_step(column, q + row0, q_norm, k + row0, k_norm,
                                       [&] { return active ? to_f(row[2 * key_dim + h * dv + j]) : 0.f; }, beta, decay);
        if (active && part == 0) core[(size_t)t * value_dim + h * dv + j] = __float2bfloat16_rn(o);
        __syncthreads();  // q[] and k[] are rewritten by the next token
    }
    if (active) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) state[(size_t)(row0 + i) * dv + j] = column[i];
    }
}

extern "C" __global__ void gdn_delta_rule(DELTA_RULE_PARAMS) { delta_rule_sequence(blockIdx.x, DELTA_RULE_ARGS); }

// gdn_delta_rule over the sequences seq_ids[blockIdx.x] of the step (OPENINFER_QWEN35_GDN_PREFILL=
// split_rows: a mixed step's one-token rows, while its prompts take the chunked kernels).
extern "C" __global__ void gdn_delta_rule_rows(DELTA_RULE_PARAMS, const int* __restrict__ seq_ids) {
    delta_rule_sequence(seq_ids[blockIdx.x], DELTA_RULE_ARGS);
}

// out[t, h, :] = RMSNorm(o[t, h, :]) * w * silu(z[t, h, :]), rounding as HF's bf16 RMSNormGated.
// Grid (num_tokens, nv); blockDim.x a multiple of 32.
extern "C" __global__ void gdn_gated_norm(const bf16* __restrict__ core, const bf16* __restrict__ proj,
                                          int proj_stride, const bf16* __restrict__ norm_weight,
                                          bf16* __restrict__ out, int conv_dim, int value_dim, int dv, float eps) {
    __shared__ float scratch[32];
    const int t = blockIdx.x, h = blockIdx.y;
    const bf16* o = core + (size_t)t * value_dim + (size_t)h * dv;
    const bf16* z = proj + (size_t)t * proj_stride + conv_dim + (size_t)h * dv;
    float sq = 0.f;
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        const float x = to_f(o[c]);
        sq += x * x;
    }
    const float inv_rms = rsqrtf(block_sum(sq, scratch) / (float)dv + eps);
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        const float normed = round_bf16(to_f(o[c]) * inv_rms);
        out[(size_t)t * value_dim + (size_t)h * dv + c] =
            __float2bfloat16_rn(round_bf16(to_f(norm_weight[c]) * normed) * silu_f(to_f(z[c])));
    }
}

// gdn_gated_norm with one warp per (token, head) and 4 heads a block (OPENINFER_QWEN35_GDN_PREFILL=
// staged | split): grid (T, ceil(nv / 4)), 128 threads, no barrier; a lane reads its dv / 32
// elements of o, z and the weight up front (one global round trip where the block kernel makes
// two, with two barriers between). For dv a multiple of 32 up to 256, where gdn_gated_norm's
// block is dv threads: lane l's element 32 e + l is that block's warp e, lane l, so summing each
// e over the warp and then the dv / 32 warp sums by a 32-lane butterfly (block_sum's order) gives
// the same bits.
#define GATED_NORM_MAX_WARPS 8  // dv <= 256
__device__ __forceinline__ void gated_norm_warp(int t, const bf16* __restrict__ core, const bf16* __restrict__ proj,
                                                int proj_stride, const bf16* __restrict__ norm_weight,
                                                bf16* __restrict__ out, int conv_dim, int value_dim,
                                                int num_value_heads, int dv, float eps) {
    const int h = blockIdx.y * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (h >= num_value_heads) return;  // a whole warp
    const int warps = dv / 32;
    const bf16* o = core + (size_t)t * value_dim + (size_t)h * dv;
    const bf16* z = proj + (size_t)t * proj_stride + conv_dim + (size_t)h * dv;
    float ov[GATED_NORM_MAX_WARPS], zv[GATED_NORM_MAX_WARPS], wv[GATED_NORM_MAX_WARPS];
#pragma unroll
    for (int e = 0; e < GATED_NORM_MAX_WARPS; ++e) {
        ov[e] = zv[e] = wv[e] = 0.f;
        if (e < warps) {
            ov[e] = to_f(o[32 * e + lane]);
            zv[e] = to_f(z[32 * e + lane]);
            wv[e] = to_f(norm_weight[32 * e + lane]);
        }
    }
    float total = 0.f;
#pragma unroll
    for (int e = 0; e < GATED_NORM_MAX_WARPS; ++e) {
        if (e < warps) {
            const float warp_total = warp_sum(ov[e] * ov[e]);
            if (lane == e) total = warp_total;
        }
    }
    const float inv_rms = rsqrtf(warp_sum(total) / (float)dv + eps);
    bf16* dst = out + (size_t)t * value_dim + (size_t)h * dv;
#pragma unroll
    for (int e = 0; e < GATED_NORM_MAX_WARPS; ++e) {
        if (e < warps) {
            const float normed = round_bf16(ov[e] * inv_rms);
            dst[32 * e + lane] = __float2bfloat16_rn(round_bf16(wv[e] * normed) * silu_f(zv[e]));
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
gdn_gated_norm_warp(const bf16* __restrict__ core, const bf16* __restrict__ proj, int proj_stride,
                    const bf16* __restrict__ norm_weight, bf16* __restrict__ out, int conv_dim, int value_dim,
                    int num_value_heads, int dv, float eps) {
    gated_norm_warp(blockIdx.x, core, proj, proj_stride, norm_weight, out, conv_dim, value_dim, num_value_heads, dv,
                    eps);
}

// gdn_gated_norm_warp with 8 adjacent channels a thread (OPENINFER_QWEN35_GDN_PREFILL=grouped |
// grouped_mma): o, z and the weight by 16-byte loads, the output by one 16-byte store; a head's dv / 8
// lanes meet their sums of squares by shuffles. grid (T, ceil(nv dv / 1024)), 128 threads (1024
// channels a block); dv / 8 a power of two up to 32 (the launcher checks). The norm's sum in another
// order than gdn_gated_norm_warp's (fp32 rounding apart), the same arithmetic per element.
extern "C" __global__ void __launch_bounds__(128)
gdn_gated_norm_vec(const bf16* __restrict__ core, const bf16* __restrict__ proj, int proj_stride,
                   const bf16* __restrict__ norm_weight, bf16* __restrict__ out, int conv_dim, int value_dim,
                   int num_value_heads, int dv, float eps) {
    const int t = blockIdx.x, c0 = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    const int head_lanes = dv / 8;
    // whole heads per warp (head_lanes divides 32): a warp's lanes past value_dim skip the loads only
    const bool active = c0 < value_dim;
    uint4 ov = make_uint4(0, 0, 0, 0), zv = ov, wv = ov;
    if (active) {
        ov = *reinterpret_cast<const uint4*>(core + (size_t)t * value_dim + c0);
        zv = *reinterpret_cast<const uint4*>(proj + (size_t)t * proj_stride + conv_dim + c0);
        wv = *reinterpret_cast<const uint4*>(norm_weight + c0 % dv);
    }
    const bf16* o = reinterpret_cast<const bf16*>(&ov);
    const bf16* z = reinterpret_cast<const bf16*>(&zv);
    const bf16* w = reinterpret_cast<const bf16*>(&wv);
    float sq = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) sq += to_f(o[e]) * to_f(o[e]);
    for (int offset = 1; offset < head_lanes; offset <<= 1) sq += __shfl_xor_sync(0xffffffffu, sq, offset);
    const float inv_rms = rsqrtf(sq / (float)dv + eps);
    uint4 yv;
    bf16* y = reinterpret_cast<bf16*>(&yv);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float normed = round_bf16(to_f(o[e]) * inv_rms);
        y[e] = __float2bfloat16_rn(round_bf16(to_f(w[e]) * normed) * silu_f(to_f(z[e])));
    }
    if (active) *reinterpret_cast<uint4*>(out + (size_t)t * value_dim + c0) = yv;
}

// gdn_gated_norm_warp over the listed token rows only (grid (len(rows), ceil(nv / 4))): a fused-norm
// prefill step's one-token rows (gdn_chunk_output_norm norms the chunked rows itself)
extern "C" __global__ void __launch_bounds__(128)
gdn_gated_norm_rows(const bf16* __restrict__ core, const bf16* __restrict__ proj, int proj_stride,
                    const bf16* __restrict__ norm_weight, bf16* __restrict__ out, int conv_dim, int value_dim,
                    int num_value_heads, int dv, float eps, const int* __restrict__ rows) {
    gated_norm_warp(rows[blockIdx.x], core, proj, proj_stride, norm_weight, out, conv_dim, value_dim, num_value_heads,
                    dv, eps);
}

// out[t, c] = x[t, c] * sigmoid(gate[t, c]); gate rows are gate_stride apart (a column slice).
extern "C" __global__ void sigmoid_mul(const bf16* __restrict__ x, const bf16* __restrict__ gate, int gate_stride,
                                       bf16* __restrict__ out, long long rows, int features) {
    const long long n = rows * features;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / features;
        const int c = (int)(i - r * features);
        const float g = round_bf16(sigmoid_f(to_f(gate[r * gate_stride + c])));
        out[i] = __float2bfloat16_rn(to_f(x[i]) * g);
    }
}

// Qwen3.5's zero-centred RMSNorm as HF computes it in bf16: normalize in fp32, multiply by the
// fp32 weight (1 + w), round once. (The Llama-style core kernel rounds the normalized row and
// takes a bf16 weight, which would round 1 + w.) One block per row; blockDim.x a multiple of 32.
//
// A row of at most ROW_REGS * blockDim.x features (every Qwen3.5 width at the launchers' 1,024
// threads) stays in registers between its two passes: one global read per element instead of
// two (three for the add, whose second pass re-read the sum it had just written), the same sums
// in the same order. Wider rows take the loop that re-reads.
#define ROW_REGS 8

// Pass 2 of a row held in registers: this thread's elements c = threadIdx.x + k blockDim.x.
__device__ __forceinline__ void zero_centred_row_from_registers(const float (&v)[ROW_REGS], float sq,
                                                                const float* __restrict__ weight,
                                                                bf16* __restrict__ out, int features, float eps,
                                                                float* scratch) {
    const float inv_rms = rsqrtf(block_sum(sq, scratch) / (float)features + eps);
#pragma unroll
    for (int k = 0; k < ROW_REGS; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < features) out[c] = __float2bfloat16_rn(v[k] * inv_rms * weight[c]);
    }
}

__device__ __forceinline__ void zero_centred_row(const bf16* __restrict__ x, const float* __restrict__ weight,
                                                 bf16* __restrict__ out, int features, float eps, float* scratch) {
    float sq = 0.f;
    for (int c = threadIdx.x; c < features; c += blockDim.x) {
        const float v = to_f(x[c]);
        sq += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sq, scratch) / (float)features + eps);
    for (int c = threadIdx.x; c < features; c += blockDim.x) out[c] = __float2bfloat16_rn(to_f(x[c]) * inv_rms * weight[c]);
}

// At most 32 registers (launch bounds): two 1,024-thread rows per SM, as before the registers held a row.
extern "C" __global__ void __launch_bounds__(1024, 2)
zero_centred_rms_norm(const bf16* __restrict__ x, const float* __restrict__ weight, bf16* __restrict__ out,
                      int features, float eps) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    x += row * features;
    out += row * features;
    if (features > ROW_REGS * (int)blockDim.x) {
        zero_centred_row(x, weight, out, features, eps, scratch);
        return;
    }
    float v[ROW_REGS], sq = 0.f;
#pragma unroll
    for (int k = 0; k < ROW_REGS; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        v[k] = c < features ? to_f(x[c]) : 0.f;
        if (c < features) sq += v[k] * v[k];
    }
    zero_centred_row_from_registers(v, sq, weight, out, features, eps, scratch);
}

// residual_out = x + residual (bf16, as HF's residual add); out = zero_centred_rms_norm(residual_out).
extern "C" __global__ void __launch_bounds__(1024, 2)
zero_centred_add_rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ residual,
                          const float* __restrict__ weight, bf16* __restrict__ out, bf16* __restrict__ residual_out,
                          int features, float eps) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    x += row * features;
    residual += row * features;
    bf16* summed = residual_out + row * features;
    out += row * features;
    if (features > ROW_REGS * (int)blockDim.x) {
        for (int c = threadIdx.x; c < features; c += blockDim.x)
            summed[c] = __float2bfloat16_rn(to_f(x[c]) + to_f(residual[c]));
        __syncthreads();
        zero_centred_row(summed, weight, out, features, eps, scratch);
        return;
    }
    float v[ROW_REGS], sq = 0.f;
#pragma unroll
    for (int k = 0; k < ROW_REGS; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        v[k] = 0.f;
        if (c < features) {
            const bf16 sum = __float2bfloat16_rn(to_f(x[c]) + to_f(residual[c]));
            summed[c] = sum;
            v[k] = to_f(sum);
            sq += v[k] * v[k];
        }
    }
    zero_centred_row_from_registers(v, sq, weight, out, features, eps, scratch);
}

// OPENINFER_QWEN35_ROW_KERNELS=vec: the attention gate and the add + zero-centred RMSNorm with 8
// adjacent features a thread, 16-byte loads and stores (the kernels above read 2 bytes a thread
// per instruction: 26 % and 40 % of the H200's copy bandwidth in a 1k prefill, E1 ledger).
// sigmoid_mul_vec: the same bits. zero_centred_add_rms_norm_vec: the same residual sum; the
// sum of squares adds a thread's 8 features in turn, then block_sum (another order than the
// strided kernel's), so the norm may differ by a bf16 rounding. One block of features / 8
// threads a row (the launcher: features % 8 == 0, features / 8 a multiple of 32 up to 1,024, the
// arrays 16-byte aligned).
extern "C" __global__ void sigmoid_mul_vec(const bf16* __restrict__ x, const bf16* __restrict__ gate,
                                           int gate_stride, bf16* __restrict__ out, long long rows, int features) {
    const int vecs = features / 8;
    const long long n = rows * vecs;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / vecs;
        const int c = (int)(i - r * vecs) * 8;
        const uint4 xv = *reinterpret_cast<const uint4*>(x + r * features + c);
        const uint4 gv = *reinterpret_cast<const uint4*>(gate + r * gate_stride + c);
        const bf16* xe = reinterpret_cast<const bf16*>(&xv);
        const bf16* ge = reinterpret_cast<const bf16*>(&gv);
        uint4 ov;
        bf16* oe = reinterpret_cast<bf16*>(&ov);
#pragma unroll
        for (int e = 0; e < 8; ++e) oe[e] = __float2bfloat16_rn(to_f(xe[e]) * round_bf16(sigmoid_f(to_f(ge[e]))));
        *reinterpret_cast<uint4*>(out + r * features + c) = ov;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
zero_centred_add_rms_norm_vec(const bf16* __restrict__ x, const bf16* __restrict__ residual,
                              const float* __restrict__ weight, bf16* __restrict__ out,
                              bf16* __restrict__ residual_out, int features, float eps) {
    __shared__ float scratch[32];
    const size_t base = (size_t)blockIdx.x * features;
    const int c = threadIdx.x * 8;
    const uint4 xv = *reinterpret_cast<const uint4*>(x + base + c);
    const uint4 rv = *reinterpret_cast<const uint4*>(residual + base + c);
    // the fp32 weights by two 16-byte loads (uint4: the host emulation has no float4)
    const uint4 w0 = *reinterpret_cast<const uint4*>(weight + c), w1 = *reinterpret_cast<const uint4*>(weight + c + 4);
    const bf16* xe = reinterpret_cast<const bf16*>(&xv);
    const bf16* re = reinterpret_cast<const bf16*>(&rv);
    float v[8], sq = 0.f;
    uint4 sv;
    bf16* se = reinterpret_cast<bf16*>(&sv);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        se[e] = __float2bfloat16_rn(to_f(xe[e]) + to_f(re[e]));
        v[e] = to_f(se[e]);
        sq += v[e] * v[e];
    }
    *reinterpret_cast<uint4*>(residual_out + base + c) = sv;
    const float inv_rms = rsqrtf(block_sum(sq, scratch) / (float)features + eps);
    const float w[8] = {__int_as_float((int)w0.x), __int_as_float((int)w0.y), __int_as_float((int)w0.z),
                        __int_as_float((int)w0.w), __int_as_float((int)w1.x), __int_as_float((int)w1.y),
                        __int_as_float((int)w1.z), __int_as_float((int)w1.w)};
    uint4 ov;
    bf16* oe = reinterpret_cast<bf16*>(&ov);
#pragma unroll
    for (int e = 0; e < 8; ++e) oe[e] = __float2bfloat16_rn(v[e] * inv_rms * w[e]);
    *reinterpret_cast<uint4*>(out + base + c) = ov;
}
