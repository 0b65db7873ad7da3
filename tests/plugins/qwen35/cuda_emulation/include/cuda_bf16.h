// Host stand-in for <cuda_bf16.h> and the CUDA built-ins the Gated DeltaNet kernels use, so the
// very .cu source compiles with g++ and runs on the CPU: one block at a time, its threads as
// std::threads meeting at a std::barrier (__syncthreads), __shared__ as function statics.
// Test-only: lets CI check the kernels' indexing and arithmetic without a GPU.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>

struct EmulatedDim3 {
    unsigned x = 0, y = 0, z = 0;
};
extern thread_local EmulatedDim3 threadIdx, blockIdx;
extern EmulatedDim3 blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static

struct __nv_bfloat16 {
    uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 x) {
    uint32_t u = static_cast<uint32_t>(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {  // round to nearest even (finite inputs)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return {static_cast<uint16_t>(u >> 16)};
}

inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
void __syncthreads();
float __shfl_xor_sync(unsigned mask, float value, int lane_mask);
