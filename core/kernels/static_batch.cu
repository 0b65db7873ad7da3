// Updates of a CUDA graph's static batch in place (openinfer/backend/cuda/batch.py).
#include "common.cuh"

// dst[index[i]] = values[i] for i < count: the block-table entries that changed since the last step.
extern "C" __global__ void scatter_int32(int* __restrict__ dst, const int* __restrict__ index,
                                         const int* __restrict__ values, int count) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
        dst[index[i]] = values[i];
}
