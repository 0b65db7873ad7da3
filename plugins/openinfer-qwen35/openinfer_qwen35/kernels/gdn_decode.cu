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
// gdn_decode_step_early_loads (OPENINFER_QWEN35_GDN_DECODE=early_loads) is the same step
// with the token's gate inputs (b, a), its decay parameters, the norm weight and z read at the
// start, beside the state column, instead of after the block sums (the b / a loads) and after the
// norm's reduction (z, the norm weight): two dependent global-memory round trips fewer on each
// block's serial path: 1.03-1.06x at 1-256 rows on the H200. (A persistent variant that loaded the next row's state during the current
// one measured 0.77x of this kernel at 64 rows on the H200, 1.56 vs 2.02 TB/s: removed. So was a
// split of a head's state columns over dv / 32 or dv / 64 blocks of 128 / 256 threads, each
// convolving q / k itself, the head's last tile block norming it (the same bits): 0.91 / 1.04 /
// 0.99x plain at 16 / 64 / 256 rows, no better than this kernel (H200, E2 2026-11-23); the state
// moves at ~2.1 TB/s however the columns are spread over blocks.)
#include "gdn_common.cuh"

#define MAX_WINDOW 8  // conv width - 1
#ifndef GDN_DYNAMIC_SHARED
#define GDN_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif
#ifdef CONV_WIDTH
static_assert(CONV_WIDTH >= 2 && CONV_WIDTH - 1 <= MAX_WINDOW, "conv width 2..9");
#endif

constexpr int STATE_ROWS = DK / SPLIT;  // state rows of a column per thread

// A block's shared memory for one (sequence, value head) step: the conv outputs q, k, v, the
// reduction scratch and whether the block was the last of its key head to read the conv window.
#define DECODE_SHARED __shared__ float q[DK], k[DK], v[256], scratch[32]; __shared__ int last_to_arrive
// The conv of one decode token over a block's channels (thread c: c < DK → q, c < 2 DK → k,
// c < 2 DK + dv → v, one channel a thread), SiLU, into q / k / v in shared memory, and the conv
// window's update: a v channel's by its own block, a key head's q / k channels by the last of its
// value heads' blocks to arrive (see above). Every thread of the block calls it.
// `window`: the sequence's conv window (width - 1 rows of conv_dim).
__device__ __forceinline__ void decode_conv(int s, int h, bool is_fresh, const bf16* row, bf16* window, float* q,
                                            float* k, float* v, int& last_to_arrive, const bf16* __restrict__ conv_weight,
                                            int* __restrict__ arrivals, int num_key_heads, int ratio, int key_head,
                                            int key_dim, int conv_dim, int dv, int conv_width) {
#ifdef CONV_WIDTH
    constexpr int width = CONV_WIDTH;
#else
    const int width = conv_width;
#endif
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
}

// The l2-norm scales of the token's q (times 1 / sqrt(DK)) and k in shared memory; every thread
// of the block calls it and gets both.
__device__ __forceinline__ void decode_l2_scales(const float* q, const float* k, float* scratch, float& q_scale,
                                                 float& k_scale) {
    float q_sq = 0.f, k_sq = 0.f;
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
        q_sq += q[i] * q[i];
        k_sq += k[i] * k[i];
    }
    q_sq = block_sum(q_sq, scratch);
    k_sq = block_sum(k_sq, scratch);
    q_scale = rsqrtf(q_sq + L2_NORM_EPS) * rsqrtf((float)DK);
    k_scale = rsqrtf(k_sq + L2_NORM_EPS);
}

// One decode token of sequence s through value head h; every thread of the block calls it.
// `column`: this thread's rows of the head's state column (loaded here, first, so their loads are
// in flight while the conv runs). EARLY_LOADS: the token's scalars read beside them (see above).
template <bool EARLY_LOADS, bool COALESCED = false>
__device__ __forceinline__ void decode_sequence_head(int s, int h, float (&column)[STATE_ROWS], float* q, float* k,
                                                     float* v, float* scratch, int& last_to_arrive, float* partials,
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
    // SPLIT threads per column j: adjacent lanes (their partial sums meet by shuffles), or, COALESCED,
    // thread part * dv + j (a warp's loads of a state row are 128 contiguous bytes; the partial sums
    // meet in shared memory, `partials` [2][SPLIT][256], in the shuffles' order: the same bits)
    const bool beyond = COALESCED && threadIdx.x >= (unsigned)(dv * SPLIT);  // conv-only threads
    const int local = COALESCED ? threadIdx.x % (unsigned)dv : threadIdx.x / SPLIT;
    const int part = COALESCED ? (beyond ? 0 : threadIdx.x / (unsigned)dv) : threadIdx.x % SPLIT, row0 = part * ROWS;
    const bool active = COALESCED ? !beyond : local < dv;
    const int j = active ? local : 0;
    float* state = ssm_state + ((size_t)slot * num_value_heads + h) * DK * dv;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) column[i] = (active && !is_fresh) ? state[(size_t)(row0 + i) * dv + j] : 0.f;

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
    decode_conv(s, h, is_fresh, row, window, q, k, v, last_to_arrive, conv_weight, arrivals, num_key_heads, ratio,
                key_head, key_dim, conv_dim, dv, width);

    // l2 norms of q and k; gates
    float q_scale, k_scale;
    decode_l2_scales(q, k, scratch, q_scale, k_scale);
    const float beta = gdn_beta(EARLY_LOADS ? b_in : to_f(row[conv_dim + value_dim + h]));
    const float decay = EARLY_LOADS ? __expf(gdn_log_decay(a_in, rate, bias))
                                    : __expf(gdn_log_decay(to_f(row[conv_dim + value_dim + num_value_heads + h]),
                                                           neg_decay_rate[h], dt_bias[h]));

    // the delta rule on column j
    float o;
    if (COALESCED) {
        // gdn_delta_step with its SPLIT-lane shuffle sums as a tree over shared memory: ((p0 + p1) + (p2 + p3))
        auto tree = [&](float* slots_of_j) {
            float x[SPLIT];
#pragma unroll
            for (int p = 0; p < SPLIT; ++p) x[p] = slots_of_j[p * 256];
#pragma unroll
            for (int w = 1; w < SPLIT; w <<= 1)
#pragma unroll
                for (int p = 0; p < SPLIT; p += 2 * w) x[p] = x[p] + x[p + w];
            return x[0];
        };
        float predicted = 0.f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            column[i] *= decay;
            predicted += column[i] * (k[row0 + i] * k_scale);
        }
        if (active) partials[part * 256 + j] = predicted;
        __syncthreads();
        const float delta = ((active ? v[j] : 0.f) - tree(partials + j)) * beta;
        float o_part = 0.f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            column[i] += (k[row0 + i] * k_scale) * delta;
            o_part += column[i] * (q[row0 + i] * q_scale);
        }
        if (active) partials[SPLIT * 256 + part * 256 + j] = o_part;
        __syncthreads();
        o = tree(partials + SPLIT * 256 + j);
    } else {
        o = gdn_delta_step(column, q + row0, q_scale, k + row0, k_scale, [&] { return active ? v[j] : 0.f; },
                           beta, decay);
    }
    if (active) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) state[(size_t)(row0 + i) * dv + j] = column[i];
    }

    // gated RMSNorm over the head's dv outputs (o rounded to bf16 first, as HF hands it over)
    o = round_bf16(o);
    float inv_rms;
    if (COALESCED) {
        // block_sum's order over the adjacent-lane layout (column c on lane 4 (c % 8) of warp c / 8):
        // 8 columns by xor 4, 2, 1, then the dv / 8 group sums by a 32-lane butterfly
        float group = active && part == 0 ? o * o : 0.f;
#pragma unroll
        for (int lane = 4; lane > 0; lane >>= 1) group += __shfl_xor_sync(0xffffffffu, group, lane);
        __syncthreads();  // the l2 norms' block_sum reads of scratch are done
        if (active && part == 0 && j % 8 == 0) scratch[j / 8] = group;
        __syncthreads();
        float total = 0.f;
        if (threadIdx.x < 32) {
            total = warp_sum((int)threadIdx.x < dv / 8 ? scratch[threadIdx.x] : 0.f);
        }
        __syncthreads();
        if (threadIdx.x == 0) scratch[0] = total;
        __syncthreads();
        inv_rms = rsqrtf(scratch[0] / (float)dv + eps);
    } else {
        inv_rms = rsqrtf(block_sum(active && part == 0 ? o * o : 0.f, scratch) / (float)dv + eps);
    }
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
    decode_sequence_head<false>(blockIdx.x, blockIdx.y, column, q, k, v, scratch, last_to_arrive, nullptr,
                                GDN_DECODE_ARGS);
}

extern "C" __global__ void __launch_bounds__(512, 2) gdn_decode_step_early_loads(GDN_DECODE_PARAMS) {
    DECODE_SHARED;
    float column[STATE_ROWS];
    decode_sequence_head<true>(blockIdx.x, blockIdx.y, column, q, k, v, scratch, last_to_arrive, nullptr,
                               GDN_DECODE_ARGS);
}

// gdn_decode_step_coalesced (the default from E3 to E1 2026-11-24: 1.23x plain at 64 rows): the early-loads step with a
// column's SPLIT threads dv apart instead of adjacent, so that a warp's load or store of the
// state covers 128 contiguous bytes of one row (adjacent lanes covered 32 bytes of 4 rows 32
// rows apart); the state moved at ~2.1 TB/s whatever the block shapes (E2). The partial sums
// meet in shared memory in the shuffles' order: the same bits (dv a multiple of 32, dv <= 256).
extern "C" __global__ void __launch_bounds__(512, 2) gdn_decode_step_coalesced(GDN_DECODE_PARAMS) {
    DECODE_SHARED;
    __shared__ float partials[2 * SPLIT * 256];
    float column[STATE_ROWS];
    decode_sequence_head<true, true>(blockIdx.x, blockIdx.y, column, q, k, v, scratch, last_to_arrive, partials,
                                     GDN_DECODE_ARGS);
}


// gdn_decode_step_vec4 (the default since E1 2026-11-24: 1.22x coalesced at 64 rows, 3.0 TB/s of
// state on the H200): the coalesced step with the state
// moved by 16-byte loads and stores. Thread g + part * dv/4 holds columns 4g..4g+3 of rows
// part * DK/16 .. +DK/16 (as float4s: DK/4 registers, as many as the other kernels' one column of
// DK/4 rows), so a warp's load covers 512 contiguous bytes of a state row (128 before) in a
// quarter of the instructions. A column's 16 partial sums meet in shared memory, summed in part
// order by one thread per column (not the SPLIT-lane order of the others: the state and the
// outputs agree with theirs to fp32 rounding, not bit for bit). Needs dv a multiple of 32 up to
// 256, DK a multiple of 16 up to 128 and a 16-byte aligned state.
// Bulk copies of a state tile (gdn_decode_step_bulk). The load: thread 0 arms the mbarrier with the
// byte count and issues the copy; every thread waits on phase 0 (after a __syncthreads has published
// the barrier's init). The store: every writer fences its tile writes to the async proxy, a
// barrier, then thread 0 issues the copy and, before the block exits, waits until it has read the tile.
#ifdef MMA_HOST_STANDIN
#include <cstring>
__device__ inline void bulk_load_state(float4* tile, const float4* state, unsigned bytes, unsigned long long*) {
    std::memcpy(tile, state, bytes);
}
__device__ inline void wait_bulk_load(unsigned long long*) {}
__device__ inline void bulk_store_fence() {}
__device__ inline void bulk_store_state(float4* state, const float4* tile, unsigned bytes) {
    std::memcpy(state, tile, bytes);
}
__device__ inline void wait_bulk_store() {}
#else
__device__ __forceinline__ void bulk_load_state(float4* tile, const float4* state, unsigned bytes,
                                                unsigned long long* loaded) {
    const unsigned bar = (unsigned)__cvta_generic_to_shared(loaded), dst = (unsigned)__cvta_generic_to_shared(tile);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(state), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void wait_bulk_load(unsigned long long* loaded) {
    const unsigned bar = (unsigned)__cvta_generic_to_shared(loaded);
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_store_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_store_state(float4* state, const float4* tile, unsigned bytes) {
    const unsigned src = (unsigned)__cvta_generic_to_shared(tile);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(state), "r"(src), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void wait_bulk_store() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
#endif

constexpr int VEC_PARTS = 16;                 // threads sharing a group of 4 columns
constexpr int VEC_ROWS = DK >= VEC_PARTS ? DK / VEC_PARTS : 1;  // float4 rows a thread holds
static_assert(VEC_PARTS == 4 * SPLIT, "gdn_decode_step_vec4 fills the dv * SPLIT state threads of the block");

// BULK (gdn_decode_step_bulk, OPENINFER_QWEN35_GDN_DECODE=bulk): the head's state [DK][dv] moves
// between global and shared memory (`tile`) by one bulk copy each way (the Hopper copy engine,
// cp.async.bulk + an mbarrier): the load issued by one thread at the block's start, in flight
// through the conv; the store issued once the tile is updated and drained while the block norms
// its outputs. The state is no longer held in registers between the two passes (each pass reads
// its float4s from the tile, the first writes them back decayed), so three blocks fit an SM
// (64 KiB of tile each) instead of two. The same arithmetic in the same order as vec4: its bits.
template <bool BULK = false>
__device__ __forceinline__ void decode_sequence_head_vec4(int s, int h, float* q, float* k, float* v, float* scratch,
                                                          int& last_to_arrive, float* partials, float* deltas,
                                                          float4* tile, unsigned long long* loaded,
                                                          GDN_DECODE_PARAMS) {
#ifdef CONV_WIDTH
    constexpr int width = CONV_WIDTH;
#else
    const int width = conv_width;
#endif
    const int t = query_start[s];
    if (query_start[s + 1] == t) return;  // no token: every block of this sequence leaves alike
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv, conv_dim = 2 * key_dim + value_dim;
    const int slot = slots[s];
    const bool is_fresh = fresh[s] != 0;
    const int groups = dv / 4, g = threadIdx.x % (unsigned)groups, part = threadIdx.x / (unsigned)groups;
    const bool active = part < VEC_PARTS;  // the threads beyond dv * SPLIT only convolve
    const int row0 = (active ? part : 0) * VEC_ROWS;
    const float4 zero = {0.f, 0.f, 0.f, 0.f};
    float4* state = reinterpret_cast<float4*>(ssm_state + ((size_t)slot * num_value_heads + h) * DK * dv);
    const unsigned state_bytes = (unsigned)(DK * dv * sizeof(float));
    float4 column[BULK ? 1 : VEC_ROWS];
    if (BULK) {
        if (threadIdx.x == 0 && !is_fresh) bulk_load_state(tile, state, state_bytes, loaded);
    } else {
#pragma unroll
        for (int i = 0; i < VEC_ROWS; ++i)
            column[BULK ? 0 : i] = (active && !is_fresh) ? state[(size_t)(row0 + i) * groups + g] : zero;
    }

    // the token's scalars beside the state (as early_loads); thread j < dv finishes column j
    const bf16* row = proj + (size_t)t * proj_stride;
    bf16* window = conv_state + (size_t)slot * (width - 1) * conv_dim;
    const int j = threadIdx.x;
    const float b_in = to_f(row[conv_dim + value_dim + h]);
    const float a_in = to_f(row[conv_dim + value_dim + num_value_heads + h]);
    const float rate = neg_decay_rate[h], bias = dt_bias[h];
    float z_in = 0.f, weight_j = 0.f;
    if (j < dv) {
        z_in = to_f(row[conv_dim + h * dv + j]);
        weight_j = to_f(norm_weight[j]);
    }
    decode_conv(s, h, is_fresh, row, window, q, k, v, last_to_arrive, conv_weight, arrivals, num_key_heads, ratio,
                key_head, key_dim, conv_dim, dv, width);
    // the l2 norms' two block sums in one pass (decode_l2_scales' sums, in its order, with one
    // barrier pair instead of two: the second sum's warp totals go to the not yet used deltas)
    float q_sq = 0.f, k_sq = 0.f;
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
        q_sq += q[i] * q[i];
        k_sq += k[i] * k[i];
    }
    q_sq = warp_sum(q_sq);
    k_sq = warp_sum(k_sq);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    if (lane == 0) {
        scratch[warp] = q_sq;
        deltas[warp] = k_sq;
    }
    __syncthreads();
    q_sq = warp_sum(lane < num_warps ? scratch[lane] : 0.f);
    k_sq = warp_sum(lane < num_warps ? deltas[lane] : 0.f);
    const float q_scale = rsqrtf(q_sq + L2_NORM_EPS) * rsqrtf((float)DK), k_scale = rsqrtf(k_sq + L2_NORM_EPS);
    const float beta = gdn_beta(b_in), decay = __expf(gdn_log_decay(a_in, rate, bias));

    // S <- decay S; predicted_j = S[:, j]^T k: 16 partials a column, summed by thread j
    float4 predicted = zero;
    if (BULK && !is_fresh) wait_bulk_load(loaded);
#pragma unroll
    for (int i = 0; i < VEC_ROWS; ++i) {
        const float key = k[row0 + i] * k_scale;
        float4& c = column[BULK ? 0 : i];
        if (BULK) c = (active && !is_fresh) ? tile[(row0 + i) * groups + g] : zero;
        c.x *= decay;
        c.y *= decay;
        c.z *= decay;
        c.w *= decay;
        predicted.x += c.x * key;
        predicted.y += c.y * key;
        predicted.z += c.z * key;
        predicted.w += c.w * key;
        if (BULK && active) tile[(row0 + i) * groups + g] = c;
    }
    float4* partials4 = reinterpret_cast<float4*>(partials);  // [VEC_PARTS][dv]
    if (active) partials4[part * groups + g] = predicted;
    __syncthreads();  // also: every read of the l2 sums' warp totals in deltas is done
    if (j < dv) {
        float total = 0.f;
#pragma unroll
        for (int p = 0; p < VEC_PARTS; ++p) total += partials[p * dv + j];
        deltas[j] = (v[j] - total) * beta;
    }
    __syncthreads();  // deltas published; the partials' reads are done

    // S += k delta^T; o_j = S[:, j]^T q
    const float4 delta = active ? reinterpret_cast<const float4*>(deltas)[g] : zero;
    float4 o = zero;
#pragma unroll
    for (int i = 0; i < VEC_ROWS; ++i) {
        const float key = k[row0 + i] * k_scale, query = q[row0 + i] * q_scale;
        float4& c = column[BULK ? 0 : i];
        if (BULK) c = active ? tile[(row0 + i) * groups + g] : zero;
        c.x += key * delta.x;
        c.y += key * delta.y;
        c.z += key * delta.z;
        c.w += key * delta.w;
        o.x += c.x * query;
        o.y += c.y * query;
        o.z += c.z * query;
        o.w += c.w * query;
        if (BULK && active) tile[(row0 + i) * groups + g] = c;
    }
    if (active) {
        if (!BULK) {
#pragma unroll
            for (int i = 0; i < VEC_ROWS; ++i) state[(size_t)(row0 + i) * groups + g] = column[BULK ? 0 : i];
        }
        partials4[part * groups + g] = o;
    }
    if (BULK) bulk_store_fence();  // this thread's tile writes, visible to the copy engine after the barrier
    __syncthreads();
    if (BULK && threadIdx.x == 0) bulk_store_state(state, tile, state_bytes);
    float o_j = 0.f;
    if (j < dv) {
#pragma unroll
        for (int p = 0; p < VEC_PARTS; ++p) o_j += partials[p * dv + j];
        o_j = round_bf16(o_j);  // o is bf16 when HF hands it to the norm
    }

    // gated RMSNorm over the head's dv outputs
    const float inv_rms = rsqrtf(block_sum(j < dv ? o_j * o_j : 0.f, scratch) / (float)dv + eps);
    if (j < dv) {
        const float normed = round_bf16(o_j * inv_rms);
        out[(size_t)t * value_dim + (size_t)h * dv + j] =
            __float2bfloat16_rn(round_bf16(weight_j * normed) * silu_f(z_in));
    }
    if (BULK && threadIdx.x == 0) wait_bulk_store();  // the tile is read before the block's memory goes
}

extern "C" __global__ void __launch_bounds__(512, 2) gdn_decode_step_vec4(GDN_DECODE_PARAMS) {
    DECODE_SHARED;
    __shared__ __align__(16) float partials[VEC_PARTS * 256];
    __shared__ __align__(16) float deltas[256];
    decode_sequence_head_vec4(blockIdx.x, blockIdx.y, q, k, v, scratch, last_to_arrive, partials, deltas, nullptr,
                              nullptr, GDN_DECODE_ARGS);
}

// gdn_decode_step_bulk: dynamic shared memory gdn_decode_bulk_smem(dv) bytes (the launcher computes
// the same): the state tile [DK][dv] fp32, the partials [VEC_PARTS][dv], deltas, q, k, v.
extern "C" __global__ void __launch_bounds__(512, 3) gdn_decode_step_bulk(GDN_DECODE_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    __shared__ float scratch[32];
    __shared__ int last_to_arrive;
    __shared__ __align__(8) unsigned long long loaded;
    float4* tile = reinterpret_cast<float4*>(smem);
    float* partials = reinterpret_cast<float*>(smem) + DK * dv;
    float* deltas = partials + VEC_PARTS * dv;
    float* q = deltas + dv;
    float* k = q + DK;
    float* v = k + DK;
    decode_sequence_head_vec4<true>(blockIdx.x, blockIdx.y, q, k, v, scratch, last_to_arrive, partials, deltas, tile,
                                    &loaded, GDN_DECODE_ARGS);
}
