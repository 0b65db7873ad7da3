// Per-request logit adjustments before sampling, one block per logits row [rows, vocab] (bf16),
// in the order of openinfer.sampling.sample_row:
//   1. logit_bias: row r adds bias_values[i] to token bias_ids[i] for i in [bias_start[r], bias_start[r+1])
//      (ids are unique within a row, so no two threads touch one token);
//   2. the structured-output mask: when mask_row[r] >= 0, token t is kept iff bit t % 32 of
//      word t / 32 of bitmask row mask_row[r] is set; the others become -inf.
#include "common.cuh"

extern "C" __global__ void apply_logit_constraints(
    bf16* __restrict__ logits, int vocab, const int* __restrict__ bias_start,
    const int* __restrict__ bias_ids, const float* __restrict__ bias_values,
    const int* __restrict__ bitmask, int words, const int* __restrict__ mask_row) {
    const int r = blockIdx.x;
    bf16* row = logits + (size_t)r * vocab;
    for (int i = bias_start[r] + threadIdx.x; i < bias_start[r + 1]; i += blockDim.x) {
        const int t = bias_ids[i];
        row[t] = __float2bfloat16_rn(__bfloat162float(row[t]) + bias_values[i]);
    }
    __syncthreads();  // a masked token's -inf must land after its bias, which another thread wrote
    const int m = mask_row[r];
    if (m < 0) return;
    const int* bits = bitmask + (size_t)m * words;
    const bf16 minus_inf = __ushort_as_bfloat16((unsigned short)0xFF80);
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
        if (!((bits[t >> 5] >> (t & 31)) & 1)) row[t] = minus_inf;
    }
}

// apply_logit_constraints over a grid (rows, tiles): block (r, y) owns the TOKENS_PER_THREAD *
// blockDim.x tokens of row r starting at y * TOKENS_PER_THREAD * blockDim.x, so a row is spread over
// many SMs (one block per row walks 152k tokens alone: at batch 1 one SM does all of it). The row's
// bias entries inside the tile come first (the list is short: every tile scans it), then each thread
// reads one byte of the bitmask (8 tokens: bit t % 8 of byte t / 8 is bit t % 32 of word t / 32 on a
// little-endian GPU) and writes -inf at the cleared bits only.
#define TOKENS_PER_THREAD 8
extern "C" __global__ void apply_logit_constraints_tiled(
    bf16* __restrict__ logits, int vocab, const int* __restrict__ bias_start,
    const int* __restrict__ bias_ids, const float* __restrict__ bias_values,
    const int* __restrict__ bitmask, int words, const int* __restrict__ mask_row) {
    const int r = blockIdx.x;
    const int tile_begin = blockIdx.y * blockDim.x * TOKENS_PER_THREAD;
    const int tile_end = min(vocab, tile_begin + (int)blockDim.x * TOKENS_PER_THREAD);
    bf16* row = logits + (size_t)r * vocab;
    for (int i = bias_start[r] + threadIdx.x; i < bias_start[r + 1]; i += blockDim.x) {
        const int t = bias_ids[i];
        if (t >= tile_begin && t < tile_end) row[t] = __float2bfloat16_rn(__bfloat162float(row[t]) + bias_values[i]);
    }
    __syncthreads();  // a masked token's -inf must land after its bias, which another thread wrote
    const int m = mask_row[r];
    const int first = tile_begin + threadIdx.x * TOKENS_PER_THREAD;
    if (m < 0 || first >= tile_end) return;
    const unsigned bits = ((const unsigned char*)(bitmask + (size_t)m * words))[first >> 3];
    if (bits == 0xFFu) return;  // all 8 allowed
    const bf16 minus_inf = __ushort_as_bfloat16((unsigned short)0xFF80);
    const int last = min(tile_end, first + TOKENS_PER_THREAD);
    for (int t = first; t < last; ++t) {
        if (!((bits >> (t - first)) & 1u)) row[t] = minus_inf;
    }
}

// the GPU's nanosecond clock
__device__ __forceinline__ unsigned long long global_timer_ns() {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__CUDA_ARCH__)
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
#else  // the host emulation (tests/helpers/cuda_host) compiles this file with g++
    return emulated_globaltimer_ns();
#endif
}

// The device side of a step sampled before its grammar masks exist (the host computes them while
// the forward runs): one thread polls a flag in pinned host memory (mapped: unified addressing)
// until the host wrote ``expected`` there, after copying the step's masks next to it; the copy of
// those masks and the sampling are queued behind this kernel on the same stream. After
// ``timeout_ns`` it gives up and sets ``*timed_out`` (the host then fails the step at read-back)
// rather than hold the GPU forever.
// ``*waited_ns`` (mapped host memory too) gets how long it polled: the time the GPU lost to the masks.
extern "C" __global__ void wait_for_host_flag(const volatile int* flag, int expected,
                                              unsigned long long timeout_ns, volatile int* timed_out,
                                              volatile unsigned long long* waited_ns) {
    const unsigned long long start = global_timer_ns();
    unsigned long long now = start;
    while (*flag != expected) {
        __nanosleep(1000);
        now = global_timer_ns();
        if (now - start > timeout_ns) {
            *timed_out = 1;
            break;
        }
    }
    *waited_ns = now - start;
    __threadfence_system();
}
