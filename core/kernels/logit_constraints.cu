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
extern "C" __global__ void wait_for_host_flag(const volatile int* flag, int expected,
                                              unsigned long long timeout_ns, volatile int* timed_out) {
    const unsigned long long start = global_timer_ns();
    while (*flag != expected) {
        __nanosleep(1000);
        if (global_timer_ns() - start > timeout_ns) {
            *timed_out = 1;
            return;
        }
    }
    __threadfence_system();
}
