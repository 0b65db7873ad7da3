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
//
// gdn_decode_step_early_loads (the default; OPENINFER_QWEN35_GDN_DECODE=plain for the other) is the same step
// with the token's gate inputs (b, a), its decay parameters, the norm weight and z read at the
// start, beside the state column, instead of after the block sums (the b / a loads) and after the
// norm's reduction (z, the norm weight): two dependent global-memory round trips fewer on each
// block's serial path: 1.03-1.06x at 1-256 rows on the H200. (A persistent variant that loaded the next row's state during the current
// one measured 0.77x of this kernel at 64 rows on the H200, 1.56 vs 2.02 TB/s: removed.)
#include "gdn_common.cuh"

#define MAX_WINDOW 8  // conv width - 1
#ifdef CONV_WIDTH
static_assert(CONV_WIDTH >= 2 && CONV_WIDTH - 1 <= MAX_WINDOW, "conv width 2..9");
#endif

constexpr int STATE_ROWS = DK / SPLIT;  // state rows of a column per thread

// A block's shared memory for one (sequence, value head) step: the conv outputs q, k, v, the
// reduction scratch and whether the block was the last of its key head to read the conv window.
#define DECODE_SHARED __shared__ float q[DK], k[DK], v[256], scratch[32]; __shared__ int last_to_arrive
// One decode token of sequence s through value head h; every thread of the block calls it.
// `column`: this thread's rows of the head's state column (loaded here, first, so their loads are
// in flight while the conv runs). EARLY_LOADS: the token's scalars read beside them (see above).
template <bool EARLY_LOADS>
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
#pragma unroll
    for (int i = 0; i < ROWS; ++i) column[i] = (active && !is_fresh) ? state[(size_t)(row0 + i) * dv + j] : 0.f;

    // conv over this block's channels: c < DK → q, c < 2 DK → k, else v (one channel a thread)
    const bf16* row = proj + (size_t)t * proj_stride;
    bf16* window = conv_state + (size_t)slot * (width - 1) * conv_dim;
    float b_in = 0.f, a_in = 0.f, rate = 0.f, bias = 0.f, z_in = 0.f, weight_j = 0.f;
    if (EARLY_LOADS) {
        b_in = to_f(row[conv_dim + value_dim + h]);
        a_in = to_f(row[conv_dim + value_dim + num_value_heads + h]);
        rate = neg_decay_rate[h];
        bias = dt_bias[h];
        if (active && part == 0) {
            z_in = to_f(row[conv_dim + h * dv + j]);
            weight_j = to_f(norm_weight[j]);
        }
    }
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
    const float beta = gdn_beta(EARLY_LOADS ? b_in : to_f(row[conv_dim + value_dim + h]));
    const float decay = EARLY_LOADS ? __expf(gdn_log_decay(a_in, rate, bias))
                                    : __expf(gdn_log_decay(to_f(row[conv_dim + value_dim + num_value_heads + h]),
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
        const float z = EARLY_LOADS ? z_in : to_f(row[conv_dim + h * dv + j]);
        const float normed = round_bf16(o * inv_rms);
        out[(size_t)t * value_dim + (size_t)h * dv + j] =
            __float2bfloat16_rn(round_bf16((EARLY_LOADS ? weight_j : to_f(norm_weight[j])) * normed) * silu_f(z));
    }
}

// At most 512 threads, two blocks per SM: a block's serial phases (conv, barriers, the norm)
// leave its SM idle unless another block streams its state meanwhile. Grid (num_seqs, nv).
#define GDN_DECODE_PARAMS                                                                                     \
    const bf16 *__restrict__ proj, int proj_stride, const bf16 *__restrict__ conv_weight,                     \
        bf16 *__restrict__ conv_state, float *__restrict__ ssm_state, const float *__restrict__ neg_decay_rate, \
        const float *__restrict__ dt_bias, const bf16 *__restrict__ norm_weight,                              \
        const int *__restrict__ query_start, const int *__restrict__ slots, const int *__restrict__ fresh,     \
        int *__restrict__ arrivals, bf16 *__restrict__ out, int num_key_heads, int num_value_heads, int dv,    \
        int conv_width, float eps
#define GDN_DECODE_ARGS                                                                                        \
    proj, proj_stride, conv_weight, conv_state, ssm_state, neg_decay_rate, dt_bias, norm_weight, query_start,  \
        slots, fresh, arrivals, out, num_key_heads, num_value_heads, dv, conv_width, eps

extern "C" __global__ void __launch_bounds__(512, 2) gdn_decode_step(GDN_DECODE_PARAMS) {
    DECODE_SHARED;
    float column[STATE_ROWS];
    decode_sequence_head<false>(blockIdx.x, blockIdx.y, column, q, k, v, scratch, last_to_arrive, GDN_DECODE_ARGS);
}

extern "C" __global__ void __launch_bounds__(512, 2) gdn_decode_step_early_loads(GDN_DECODE_PARAMS) {
    DECODE_SHARED;
    float column[STATE_ROWS];
    decode_sequence_head<true>(blockIdx.x, blockIdx.y, column, q, k, v, scratch, last_to_arrive, GDN_DECODE_ARGS);
}

// ---------------------------------------------------------------------------------------------
// gdn_decode_step_split32 / _split64 (OPENINFER_QWEN35_GDN_DECODE=split32 | split64): the same
// step with a value head's dv state columns spread over dv / TILE blocks of TILE SPLIT threads
// (grid (num_seqs, nv, dv / TILE)): each column's delta-rule update is independent, so a block
// needs only q, k and its TILE values. At 64 rows the plain grid has 2 blocks of 512 threads per
// SM, whose serial phases (conv, barriers, norm, the store of 64 KiB) leave the SM's memory pipe
// idle; small blocks let up to 8 per SM overlap one another's phases.
//
// Each block convolves the key head's q and k channels itself (an L2-resident window: cheap), so
// the q / k window may be overwritten only by the last of the key head's ratio x tiles blocks
// (arrivals as above, counted per (sequence, key head)); it shifts the window in place from
// global memory (no other block writes those channels). The gated norm reduces over the whole
// head: every block writes its columns' bf16 o (o is rounded to bf16 before the norm anyway) to
// `out`, and the last of the head's tiles to arrive (head_arrivals[s * nv + h]) reads the dv
// values back, sums their squares in the fused kernel's order (groups of 8 columns, then the
// groups by a 32-lane butterfly: the same bits) and writes the gated output in place.
template <int TILE>
__device__ __forceinline__ void decode_sequence_head_tile(GDN_DECODE_PARAMS, int* __restrict__ head_arrivals) {
#ifdef CONV_WIDTH
    constexpr int width = CONV_WIDTH;
#else
    const int width = conv_width;
#endif
    constexpr int ROWS = STATE_ROWS, THREADS = TILE * SPLIT;
    __shared__ float q[DK], k[DK], v[TILE], scratch[32];
    __shared__ int last_of_key_head, last_of_head;
    const int s = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * TILE;
    const int t = query_start[s];
    if (query_start[s + 1] == t) return;  // no token: every block of this sequence leaves alike
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio, tiles = dv / TILE;
    const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv;
    const int conv_dim = 2 * key_dim + value_dim;
    const int slot = slots[s];
    const bool is_fresh = fresh[s] != 0;
    const int local = threadIdx.x / SPLIT, part = threadIdx.x % SPLIT, row0 = part * ROWS, j = j0 + local;
    float* state = ssm_state + ((size_t)slot * num_value_heads + h) * DK * dv;

    const bf16* row = proj + (size_t)t * proj_stride;
    bf16* window = conv_state + (size_t)slot * (width - 1) * conv_dim;
    const float b_in = to_f(row[conv_dim + value_dim + h]);
    const float a_in = to_f(row[conv_dim + value_dim + num_value_heads + h]);
    const float rate = neg_decay_rate[h], bias = dt_bias[h];

    // conv over q (c < DK), k (c < 2 DK) and this tile's v channels (blockDim.x == THREADS)
#pragma unroll 1
    for (int c = threadIdx.x; c < 2 * DK + TILE; c += THREADS) {
        const int channel = c < DK       ? key_head * DK + c
                            : c < 2 * DK ? key_dim + key_head * DK + (c - DK)
                                         : 2 * key_dim + h * dv + j0 + (c - 2 * DK);
        float old[MAX_WINDOW];
        const float x_new = to_f(row[channel]);
        float acc = to_f(conv_weight[(size_t)channel * width + width - 1]) * x_new;
#pragma unroll
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
#pragma unroll
            for (int m = 0; m < width - 1; ++m)
                window[(size_t)m * conv_dim + channel] = __float2bfloat16_rn(m + 1 < width - 1 ? old[m + 1] : x_new);
        }
    }
    __syncthreads();  // q, k, v published; this block's window reads are done
    // the state column now: its loads fly through the arrival, the window shift and the l2 norms
    // (loaded before the conv, it would be live across it: 64 registers spill)
    float column[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) column[i] = is_fresh ? 0.f : state[(size_t)(row0 + i) * dv + j];
    if (threadIdx.x == 0) {
        __threadfence();
        const int arrived = atomicAdd(arrivals + s * num_key_heads + key_head, 1);
        last_of_key_head = arrived == ratio * tiles - 1;
        if (last_of_key_head) arrivals[s * num_key_heads + key_head] = 0;
    }
    __syncthreads();
    if (last_of_key_head) {  // every reader is done: shift the key head's q / k windows
        for (int c = threadIdx.x; c < 2 * DK; c += THREADS) {
            const int channel = c < DK ? key_head * DK + c : key_dim + key_head * DK + (c - DK);
#pragma unroll
            for (int m = 0; m < width - 1; ++m) {
                const bf16 shifted = m + 1 < width - 1
                                         ? (is_fresh ? __float2bfloat16_rn(0.f) : window[(size_t)(m + 1) * conv_dim + channel])
                                         : row[channel];
                window[(size_t)m * conv_dim + channel] = shifted;
            }
        }
    }

    // l2 norms of q and k (warps past the first DK threads add zeros: the fused kernel's sums); gates
    float q_sq = 0.f, k_sq = 0.f;
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
        q_sq += q[i] * q[i];
        k_sq += k[i] * k[i];
    }
    q_sq = block_sum(q_sq, scratch);
    k_sq = block_sum(k_sq, scratch);
    const float q_scale = rsqrtf(q_sq + L2_NORM_EPS) * rsqrtf((float)DK), k_scale = rsqrtf(k_sq + L2_NORM_EPS);
    const float beta = gdn_beta(b_in);
    const float decay = __expf(gdn_log_decay(a_in, rate, bias));

    float o = gdn_delta_step(column, q + row0, q_scale, k + row0, k_scale, [&] { return v[local]; }, beta, decay);
#pragma unroll
    for (int i = 0; i < ROWS; ++i) state[(size_t)(row0 + i) * dv + j] = column[i];

    // o (bf16, as HF hands it to the norm) to out; the head's last tile block norms all dv columns
    bf16* head_out = out + (size_t)t * value_dim + (size_t)h * dv;
    if (part == 0) head_out[j] = __float2bfloat16_rn(o);
    __threadfence();  // each writer's o before the head's arrival count (read by another block)
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const int arrived = atomicAdd(head_arrivals + s * num_value_heads + h, 1);
        last_of_head = arrived == tiles - 1;
        if (last_of_head) head_arrivals[s * num_value_heads + h] = 0;
    }
    __syncthreads();
    if (!last_of_head) return;
    __threadfence();
    // the sum of squares as block_sum over the fused kernel's block (column c on lane 4 (c % 8)
    // of warp c / 8): groups of 8 columns by xor 4, 2, 1, then the dv / 8 group sums by warp_sum
    const volatile unsigned short* outs = reinterpret_cast<const volatile unsigned short*>(head_out);
    for (int base = 0; base < dv; base += blockDim.x) {  // blockDim.x is a multiple of 32
        const int c = base + threadIdx.x;
        const float oc = c < dv ? to_f(__ushort_as_bfloat16(outs[c])) : 0.f;
        float group = oc * oc;
#pragma unroll
        for (int lane = 4; lane > 0; lane >>= 1) group += __shfl_xor_sync(0xffffffffu, group, lane);
        if (c < dv && c % 8 == 0) scratch[c / 8] = group;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float total = threadIdx.x < dv / 8 ? scratch[threadIdx.x] : 0.f;
        total = warp_sum(total);
        if (threadIdx.x == 0) scratch[0] = total;
    }
    __syncthreads();
    const float inv_rms = rsqrtf(scratch[0] / (float)dv + eps);
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        const float oc = to_f(__ushort_as_bfloat16(outs[c]));
        const float z = to_f(row[conv_dim + h * dv + c]);
        const float normed = round_bf16(oc * inv_rms);
        head_out[c] = __float2bfloat16_rn(round_bf16(to_f(norm_weight[c]) * normed) * silu_f(z));
    }
}

// 768 threads per SM: 80 registers a thread (at 64, nvcc 13 spills ~150 bytes a thread).
extern "C" __global__ void __launch_bounds__(32 * SPLIT, 6)
    gdn_decode_step_split32(GDN_DECODE_PARAMS, int* __restrict__ head_arrivals) {
    decode_sequence_head_tile<32>(GDN_DECODE_ARGS, head_arrivals);
}

extern "C" __global__ void __launch_bounds__(64 * SPLIT, 3)
    gdn_decode_step_split64(GDN_DECODE_PARAMS, int* __restrict__ head_arrivals) {
    decode_sequence_head_tile<64>(GDN_DECODE_ARGS, head_arrivals);
}
