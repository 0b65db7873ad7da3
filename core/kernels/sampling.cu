// Token sampling on the GPU, one block (1024 threads) per logits row [rows, vocab] (bf16).
// Same rules as openinfer.sampling.sample_row (penalties and banned ids excepted, which the
// host applies before calling or handles itself):
//   temperature 0 -> argmax (first index on ties);
//   else weights w = exp((logit - max) / T), then top-k (ties at the k-th value kept),
//   top-p (smallest set of top values whose mass reaches top_p; a tie at the boundary is kept
//   whole), min-p (w >= min_p, as the top weight is 1), and inverse-CDF in vocabulary order with
//   the request's own uniform draw u (drawn on the host from the request's generator).
// logprob_out = the chosen token's raw log-softmax (before temperature and filters).
// Thresholds are found by a two-level radix select on the 16-bit order key of the bf16 logits.
#include "common.cuh"

#define THREADS 1024

__device__ __forceinline__ int order_key(bf16 v) {
    const unsigned short b = __bfloat16_as_ushort(v);
    return (b & 0x8000) ? (~b & 0xFFFF) : (b | 0x8000);
}

// Largest key K with  sum over {key >= K, key >= floor_key} of (count ? 1 : w)  >= target;
// *above gets the sum over keys strictly greater than K.
__device__ int select_threshold(const bf16* __restrict__ x, int vocab, int floor_key, bool by_count,
                                float target, float best, float inv_t, float* hist, int* s_result,
                                float* above_out) {
    int prefix_key = 0;  // high byte found at level 0
    float above = 0.f;
    for (int level = 0; level < 2; ++level) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0.f;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const int key = order_key(x[i]);
            if (key < floor_key) continue;
            if (level == 1 && (key >> 8) != prefix_key) continue;
            const float w = by_count ? 1.f : exp2f((__bfloat162float(x[i]) - best) * inv_t);
            atomicAdd(&hist[level == 0 ? (key >> 8) : (key & 0xFF)], w);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float cum = above;
            int bin = 0;
            for (int b = 255; b >= 0; --b) {
                if (cum + hist[b] >= target) {
                    bin = b;
                    break;
                }
                cum += hist[b];
            }
            s_result[0] = bin;
            reinterpret_cast<float*>(s_result)[1] = cum;
        }
        __syncthreads();
        const int bin = s_result[0];
        above = reinterpret_cast<float*>(s_result)[1];
        if (level == 0) prefix_key = bin;
        else prefix_key = (prefix_key << 8) | bin;
        __syncthreads();
    }
    *above_out = above;
    return max(prefix_key, floor_key);
}

__device__ __forceinline__ float key_value(int key) {
    const unsigned short bits = (key & 0x8000) ? (unsigned short)(key & 0x7FFF) : (unsigned short)(~key & 0xFFFF);
    return __bfloat162float(__ushort_as_bfloat16(bits));
}

// Inclusive prefix sum over the block's THREADS values (Hillis-Steele, in shared memory).
__device__ float block_inclusive_scan(float v, float* buffer) {
    const int tid = threadIdx.x;
    buffer[tid] = v;
    __syncthreads();
    for (int o = 1; o < blockDim.x; o <<= 1) {
        const float add = tid >= o ? buffer[tid - o] : 0.f;
        __syncthreads();
        buffer[tid] += add;
        __syncthreads();
    }
    const float result = buffer[tid];
    __syncthreads();
    return result;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_rows(const bf16* __restrict__ logits, int vocab, const float* __restrict__ temperature,
            const int* __restrict__ top_k, const float* __restrict__ top_p,
            const float* __restrict__ min_p, const float* __restrict__ uniform,
            int* __restrict__ token_out, float* __restrict__ logprob_out) {
    __shared__ float scratch[32];
    __shared__ int scratch_index[32];
    __shared__ float hist[256];
    __shared__ int s_result[2];
    __shared__ float thread_prefix[THREADS];
    __shared__ int s_token;
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bf16* x = logits + (size_t)row * vocab;

    // argmax (first index on ties) and max
    float best = -INFINITY;
    int best_index = vocab;
    for (int i = tid; i < vocab; i += THREADS) {
        const float v = __bfloat162float(x[i]);
        if (v > best) {
            best = v;
            best_index = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_index, o);
        if (ov > best || (ov == best && oi < best_index)) {
            best = ov;
            best_index = oi;
        }
    }
    if (lane == 0) {
        scratch[warp] = best;
        scratch_index[warp] = best_index;
    }
    __syncthreads();
    if (warp == 0) {
        best = scratch[lane];
        best_index = scratch_index[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_index, o);
            if (ov > best || (ov == best && oi < best_index)) {
                best = ov;
                best_index = oi;
            }
        }
        if (lane == 0) {
            s_result[0] = best_index;
            reinterpret_cast<float*>(s_result)[1] = best;
        }
    }
    __syncthreads();
    best_index = s_result[0];
    best = reinterpret_cast<float*>(s_result)[1];
    __syncthreads();

    float sum = 0.f;
    for (int i = tid; i < vocab; i += THREADS) sum += __expf(__bfloat162float(x[i]) - best);
    sum = block_sum(sum, scratch);
    const float log_normalizer = best + logf(sum);

    int token = best_index;
    const float t = temperature[row];
    if (t > 0.f) {
        const float inv_t = 1.4426950408889634f / t;
        int floor_key = 0;
        float above = 0.f;
        const int k = top_k[row];
        if (k > 0 && k < vocab)
            floor_key = select_threshold(x, vocab, floor_key, true, (float)k, best, inv_t, hist, s_result, &above);
        // top-p as the NumPy sampler does it: sort by weight (ties in vocabulary order) and keep the
        // shortest prefix reaching top_p of the mass: every key above the boundary key tie_key, and
        // the first ties_kept tokens (in vocabulary order) holding tie_key itself.
        int tie_key = -1;  // -1: top-p off
        float ties_kept = 0.f;
        const float p = top_p[row];
        if (p > 0.f && p < 1.f) {
            float total = 0.f;
            for (int i = tid; i < vocab; i += THREADS)
                if (order_key(x[i]) >= floor_key) total += exp2f((__bfloat162float(x[i]) - best) * inv_t);
            total = block_sum(total, scratch);
            const float target = p * total;
            tie_key = select_threshold(x, vocab, floor_key, false, target, best, inv_t, hist, s_result, &above);
            const float tie_weight = exp2f((key_value(tie_key) - best) * inv_t);
            ties_kept = fmaxf(1.f, ceilf((target - above) / tie_weight));
        }
        const float min_weight = min_p[row];
        // inverse CDF over contiguous chunks, one per thread
        const int chunk = (vocab + THREADS - 1) / THREADS;
        const int begin = min(vocab, tid * chunk), end = min(vocab, begin + chunk);
        float my_ties = 0.f;
        for (int i = begin; i < end; ++i) my_ties += order_key(x[i]) == tie_key ? 1.f : 0.f;
        const float tie_rank_start = block_inclusive_scan(my_ties, thread_prefix) - my_ties;
        float mine = 0.f, tie_rank = tie_rank_start;
        for (int i = begin; i < end; ++i) {
            const int key = order_key(x[i]);
            const float w = exp2f((__bfloat162float(x[i]) - best) * inv_t);
            bool keep = key >= floor_key && w >= min_weight && key >= tie_key;  // tie_key -1 keeps all
            if (key == tie_key) keep = keep && (tie_rank++ < ties_kept);
            if (keep) mine += w;
        }
        if (tid == 0) s_token = vocab;
        const float inclusive = block_inclusive_scan(mine, thread_prefix);
        if (tid == THREADS - 1) hist[0] = inclusive;  // the total
        __syncthreads();
        const float target = uniform[row] * hist[0];
        float running = inclusive - mine;
        tie_rank = tie_rank_start;
        if (mine > 0.f && running <= target && target < inclusive) {
            for (int i = begin; i < end; ++i) {
                const int key = order_key(x[i]);
                const float w = exp2f((__bfloat162float(x[i]) - best) * inv_t);
                bool keep = key >= floor_key && w >= min_weight && key >= tie_key;  // tie_key -1 keeps all
                if (key == tie_key) keep = keep && (tie_rank++ < ties_kept);
                if (keep) {
                    running += w;
                    if (running > target) {
                        atomicMin(&s_token, i);
                        break;
                    }
                }
            }
        }
        __syncthreads();
        if (s_token < vocab) token = s_token;
    }
    if (tid == 0) {
        token_out[row] = token;
        logprob_out[row] = __bfloat162float(x[token]) - log_normalizer;
    }
}
