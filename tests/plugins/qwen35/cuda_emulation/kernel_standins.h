// What the chunked prefill and fused decode kernels need of CUDA beyond tests/helpers/cuda_host's cuda_bf16.h, for
// the harnesses that run them on the CPU (fast_paths_, fp32_chunked_, operand_format_ and snapshot_walk_harness.cpp).
// Include it first, then the kernel sources, harness.h and chunked_prefill_inputs.h (which defines __syncwarp).
#pragma once
#define MMA_HOST_STANDIN  // core's mma.cuh: no PTX; harness.h defines mma_bf16_16816
#define GDN_DYNAMIC_SHARED(name) alignas(16) static unsigned char name[1 << 18]
#include <cuda_bf16.h>  // the host stand-ins (__threadfence, a variadic __launch_bounds__ among them)
#include <cstring>      // the host stand-ins of bulk and async copies
struct alignas(16) float4 {  // CUDA's vector type (16-byte state and U accesses)
    float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
void __syncwarp(unsigned mask = 0xffffffffu);  // the calling thread's warp meets (chunked_prefill_inputs.h)
