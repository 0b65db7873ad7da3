// One decode token per sequence through a Gated DeltaNet layer's core in ONE kernel: causal conv
// (+ the conv-window update), SiLU, q/k l2 norm, gates, the delta-rule step on the fp32 state and
// the gated RMSNorm (RMSNorm(o) * w * silu(z)) — where the separate path launches gdn_conv1d,
// gdn_conv_state, gdn_delta_rule and gdn_gated_norm. Reads only device arrays, so it is captured
// in the decode CUDA graphs. Layouts as gated_deltanet.cu (proj, conv_state, ssm_state, seqs).
//
// Grid (num_seqs, nv): one block per (sequence, value head), SPLIT threads per value channel j,
// each holding DK / SPLIT rows of the state column S[:, j] in registers (blockDim.x =
// round_up(max(dv * SPLIT, 2 DK + dv), 32) <= 512). A whole head per block lets the gated norm
// reduce over dv in the block.
//
// The conv window of a key head's q and k channels is read by the nv / nk blocks of its value
// heads, so it may only be overwritten after all of them have read it: each block counts itself
// in arrivals[s * nk + key_head] once its reads are done, and the last to arrive writes the new
// window and resets the counter to 0 for the next step (or graph replay). The v channels of a
// head belong to one block, which updates them itself.
//
// The conv width is compiled in when the loader defines CONV_WIDTH (openinfer_qwen35.cuda_ops
// always does, from the config; the conv_width argument must then equal it): the window loops
// unroll and the old window stays in registers instead of a local-memory array (nvcc 13, sm_90a,
// DK 128, width 4: stack frame 96 -> 24 bytes, 126 -> 9 local loads/stores, 2,496 -> 1,296 SASS
// instructions). Without it (a plain compile) the width is read at run time.
//
// gdn_decode_step_pipelined does the same per (sequence, value head) with a persistent grid
// (blocks_per_head, nv): each block walks the sequences blockIdx.x, + gridDim.x, ... of its value
// head and loads the next sequence's state column into registers before it works on the current
// one. The plain kernel's 2,048 blocks at 64 rows move their state in bursts (all of a block's
// loads first, its stores last, the conv / barriers / norms in between with the memory idle
// unless the SM's other block is in another phase: ~52 % of copy bandwidth on an H100); here the
// next column's loads are in flight through the current sequence's serial phases and stores.
#include "gdn_common.cuh"

#define MAX_WINDOW 8  // conv width - 1
#ifdef CONV_WIDTH
static_assert(CONV_WIDTH >= 2 && CONV_WIDTH - 1 <= MAX_WINDOW, "conv width 2..9");
#endif

constexpr int STATE_ROWS = DK / SPLIT;  // state rows of a column per thread

// This thread's STATE_ROWS rows (from row0) of column j of one head's state (`state`: that
// head's [DK, dv] matrix), or zeros when `load` is false (a fresh sequence's state starts at zero).
__device__ __forceinline__ void load_state_column(float (&column)[STATE_ROWS], const float* __restrict__ state,
                                                  int row0, int j, int dv, bool load) {
#pragma unroll
    for (int i = 0; i < STATE_ROWS; ++i) column[i] = load ? state[(size_t)(row0 + i) * dv + j] : 0.f;
}

// A block's shared memory for one (sequence, value head) step: the conv outputs q, k, v, the
// reduction scratch and whether the block was the last of its key head to read the conv window.
#define DECODE_SHARED __shared__ float q[DK], k[DK], v[256], scratch[32]; __shared__ int last_to_arrive
// One decode token of sequence s through value head h; every thread of the block calls it.
// PRELOADED: `column` already holds this thread's rows of the head's state column (else they are
// loaded here, first, so their loads are in flight while the conv runs).
template <bool PRELOADED>
__device__ __forceinline__ void decode_sequence_head(int s, int h, float (&column)[STATE_ROWS], float* q, float* k,
                                                     float* v, float* scratch, int& last_to_arrive,
                                                     const bf16* __restrict__ proj, int proj_stride,
                                                     const bf16* __restrict__ conv_weight, bf16* __restrict__ conv_state,
                                                     float* __restrict__ ssm_state,
                                                     const float* __restrict__ neg_decay_rate,
                                                     const float* __restrict__ dt_bias,
                                                     const bf16* __restrict__ norm_weight,
                                                     const int* __restrict__ query_start, const int* __restrict__ slots,
                                                     const int* __restrict__ fresh, int* __restrict__ arrivals,
                                                     bf16* __restrict__ out, int num_key_heads, int num_value_heads,
                                                     int dv, int conv_width, float eps) {
#ifdef CONV_WIDTH
    constexpr int width = CONV_WIDTH;
#else
    const int width = conv_width;
#endif
    constexpr int ROWS = STATE_ROWS;
    const int t = query_start[s];
    if (query_start[s + 1] == t) return;  // no token: every block of this sequence leaves alike
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv;
    const int conv_dim = 2 * key_dim + value_dim;
    const int slot = slots[s];
    const bool is_fresh = fresh[s] != 0;
    const int local = threadIdx.x / SPLIT, part = threadIdx.x % SPLIT, row0 = part * ROWS;
    const bool active = local < dv;
    const int j = active ? local : 0;
    float* state = ssm_state + ((size_t)slot * num_value_heads + h) * DK * dv;
    if (!PRELOADED) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) column[i] = (active && !is_fresh) ? state[(size_t)(row0 + i) * dv + j] : 0.f;
    }

    // conv over this block's channels: c < DK → q, c < 2 DK → k, else v (one channel a thread)
    const bf16* row = proj + (size_t)t * proj_stride;
    bf16* window = conv_state + (size_t)slot * (width - 1) * conv_dim;
    const int c = threadIdx.x;
    int channel = -1;
    if (c < DK) channel = key_head * DK + c;
    else if (c < 2 * DK) channel = key_dim + key_head * DK + (c - DK);
    else if (c < 2 * DK + dv) channel = 2 * key_dim + h * dv + (c - 2 * DK);
    float old[MAX_WINDOW];
    float x_new = 0.f;
    if (channel >= 0) {
        x_new = to_f(row[channel]);
        float acc = to_f(conv_weight[(size_t)channel * width + width - 1]) * x_new;
        for (int m = 0; m < width - 1; ++m) {
            old[m] = is_fresh ? 0.f : to_f(window[(size_t)m * conv_dim + channel]);
            acc += to_f(conv_weight[(size_t)channel * width + m]) * old[m];
        }
        const float y = round_bf16(silu_f(round_bf16(acc)));  // conv output is bf16 in HF
        if (c < DK) q[c] = y;
        else if (c < 2 * DK) k[c - DK] = y;
        else {
            v[c - 2 * DK] = y;
            // a value channel is this block's alone: shift its window now
            for (int m = 0; m < width - 1; ++m)
                window[(size_t)m * conv_dim + channel] = __float2bfloat16_rn(m + 1 < width - 1 ? old[m + 1] : x_new);
        }
    }
    __syncthreads();  // q, k, v published; this block's window reads are done
    if (threadIdx.x == 0) {
        __threadfence();
        const int arrived = atomicAdd(arrivals + s * num_key_heads + key_head, 1);
        last_to_arrive = arrived == ratio - 1;
        if (last_to_arrive) arrivals[s * num_key_heads + key_head] = 0;
    }
    __syncthreads();
    if (last_to_arrive && c < 2 * DK) {
        for (int m = 0; m < width - 1; ++m)
            window[(size_t)m * conv_dim + channel] = __float2bfloat16_rn(m + 1 < width - 1 ? old[m + 1] : x_new);
    }

    // l2 norms of q and k; gates
    float q_sq = 0.f, k_sq = 0.f;
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
        q_sq += q[i] * q[i];
        k_sq += k[i] * k[i];
    }
    q_sq = block_sum(q_sq, scratch);
    k_sq = block_sum(k_sq, scratch);
    const float q_scale = rsqrtf(q_sq + L2_NORM_EPS) * rsqrtf((float)DK), k_scale = rsqrtf(k_sq + L2_NORM_EPS);
    const float beta = gdn_beta(to_f(row[conv_dim + value_dim + h]));
    const float decay = __expf(gdn_log_decay(to_f(row[conv_dim + value_dim + num_value_heads + h]),
                                             neg_decay_rate[h], dt_bias[h]));

    // the delta rule on column j
    float o = gdn_delta_step(column, q + row0, q_scale, k + row0, k_scale, [&] { return active ? v[j] : 0.f; },
                             beta, decay);
    if (active) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) state[(size_t)(row0 + i) * dv + j] = column[i];
    }

    // gated RMSNorm over the head's dv outputs (o rounded to bf16 first, as HF hands it over)
    o = round_bf16(o);
    const float inv_rms = rsqrtf(block_sum(active && part == 0 ? o * o : 0.f, scratch) / (float)dv + eps);
    if (active && part == 0) {
        const float z = to_f(row[conv_dim + h * dv + j]);
        const float normed = round_bf16(o * inv_rms);
        out[(size_t)t * value_dim + (size_t)h * dv + j] =
            __float2bfloat16_rn(round_bf16(to_f(norm_weight[j]) * normed) * silu_f(z));
    }
}

// At most 512 threads, two blocks per SM: a block's serial phases (conv, barriers, the norm)
// leave its SM idle unless another block streams its state meanwhile. Grid (num_seqs, nv).
extern "C" __global__ void __launch_bounds__(512, 2) gdn_decode_step(const bf16* __restrict__ proj, int proj_stride,
                                           const bf16* __restrict__ conv_weight, bf16* __restrict__ conv_state,
                                           float* __restrict__ ssm_state, const float* __restrict__ neg_decay_rate,
                                           const float* __restrict__ dt_bias, const bf16* __restrict__ norm_weight,
                                           const int* __restrict__ query_start, const int* __restrict__ slots,
                                           const int* __restrict__ fresh, int* __restrict__ arrivals,
                                           bf16* __restrict__ out, int num_key_heads, int num_value_heads, int dv,
                                           int conv_width, float eps) {
    DECODE_SHARED;
    float column[STATE_ROWS];
    decode_sequence_head<false>(blockIdx.x, blockIdx.y, column, q, k, v, scratch, last_to_arrive, proj, proj_stride, conv_weight, conv_state,
                                ssm_state, neg_decay_rate, dt_bias, norm_weight, query_start, slots, fresh, arrivals,
                                out, num_key_heads, num_value_heads, dv, conv_width, eps);
}

// The same step on a persistent grid (blocks_per_head, nv): block (b, h) takes sequences b,
// b + gridDim.x, ... of value head h, the next one's state column loading while it works on the
// current one (two columns in registers: one block of 512 threads per SM).
extern "C" __global__ void __launch_bounds__(512, 1)
gdn_decode_step_pipelined(const bf16* __restrict__ proj, int proj_stride, const bf16* __restrict__ conv_weight,
                          bf16* __restrict__ conv_state, float* __restrict__ ssm_state,
                          const float* __restrict__ neg_decay_rate, const float* __restrict__ dt_bias,
                          const bf16* __restrict__ norm_weight, const int* __restrict__ query_start,
                          const int* __restrict__ slots, const int* __restrict__ fresh, int* __restrict__ arrivals,
                          bf16* __restrict__ out, int num_key_heads, int num_value_heads, int dv, int conv_width,
                          float eps, int num_seqs) {
    DECODE_SHARED;
    const int h = blockIdx.y;
    const int local = threadIdx.x / SPLIT, row0 = (threadIdx.x % SPLIT) * STATE_ROWS;
    const bool active = local < dv;
    const int j = active ? local : 0;
    // sequence s's rows of this head's state column, when it has a token and continues a state
    auto prefetch = [&](float (&column)[STATE_ROWS], int s) {
        const float* state = ssm_state + ((size_t)slots[s] * num_value_heads + h) * DK * dv;
        load_state_column(column, state, row0, j, dv,
                          active && query_start[s + 1] != query_start[s] && fresh[s] == 0);
    };
    int s = blockIdx.x;
    float next[STATE_ROWS];
    if (s < num_seqs) prefetch(next, s);
    for (; s < num_seqs; s += gridDim.x) {
        float column[STATE_ROWS];
#pragma unroll
        for (int i = 0; i < STATE_ROWS; ++i) column[i] = next[i];
        // the next sequence's column (another slot: live slots are distinct, padding rows read none)
        if (s + gridDim.x < num_seqs) prefetch(next, s + gridDim.x);
        decode_sequence_head<true>(s, h, column, q, k, v, scratch, last_to_arrive, proj, proj_stride, conv_weight, conv_state, ssm_state,
                                   neg_decay_rate, dt_bias, norm_weight, query_start, slots, fresh, arrivals, out,
                                   num_key_heads, num_value_heads, dv, conv_width, eps);
        __syncthreads();  // this sequence's q / k / v are read by all before the next one's conv writes them
    }
}
