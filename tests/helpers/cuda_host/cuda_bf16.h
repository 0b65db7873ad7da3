// Host stand-in for <cuda_bf16.h> and the CUDA built-ins that our kernels use (core's moe.cu with
// USE_MMA=0 and mla.cu, qwen35's gated_deltanet.cu, deepseek-v4's dsv4.cu), so the very .cu sources
// compile with g++ and run on the CPU: one block at a time, its threads as std::threads;
// __syncthreads is a block barrier, warp shuffles meet at a per-warp barrier; __shared__ variables
// are function statics (blocks run one by one). The launch/load/save side is harness.h.
// Test-only: lets CI check the kernels' indexing and arithmetic without a GPU.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <thread>
#include <cmath>
#include <math.h>
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
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct __nv_bfloat16 {
    uint16_t bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
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

struct float2 {
    float x, y;
};
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return {bits}; }

inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::min;

inline int atomicAdd(int* address, int value) { return std::atomic_ref<int>(*address).fetch_add(value); }
inline unsigned atomicAdd(unsigned* address, unsigned value) {
    return std::atomic_ref<unsigned>(*address).fetch_add(value);
}
// last-block patterns (moe_sm90.cu's split-K): a device fence, loads from L2 (one memory here)
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T>
inline T __ldcg(const T* address) { return *address; }
// the host-wait kernel's built-ins (logit_constraints.cu): a sleep, a full fence, the global timer
inline void __nanosleep(unsigned ns) { std::this_thread::sleep_for(std::chrono::nanoseconds(ns)); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned long long emulated_globaltimer_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}
void __syncthreads();
float __shfl_xor_sync(unsigned mask, float value, int lane_mask);
int __shfl_up_sync(unsigned mask, int value, unsigned delta);
int __shfl_sync(unsigned mask, int value, int src_lane);
