// Updates of a CUDA graph's static batch in place (openinfer/backend/cuda/batch.py).
#include "common.cuh"

// dst[index[i]] = values[i] for i < count: the block-table entries that changed since the last step.
extern "C" __global__ void scatter_int32(int* __restrict__ dst, const int* __restrict__ index,
                                         const int* __restrict__ values, int count) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
        dst[index[i]] = values[i];
}

// dst[pairs[2i]] = src[pairs[2i + 1]]: a step's input tokens sampled by the step before, still on the device
// (CuPy's fancy indexing did it with two kernels CuPy compiled at the first such step, mid-serving)
extern "C" __global__ void copy_token_sources(int* __restrict__ dst, const int* __restrict__ src,
                                              const int* __restrict__ pairs, int count) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
        dst[pairs[2 * i]] = src[pairs[2 * i + 1]];
}
