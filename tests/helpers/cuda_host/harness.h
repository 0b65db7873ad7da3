// The host side of an emulated kernel run, shared by every harness.cpp that drives .cu sources
// through cuda_bf16.h: the CUDA built-in variables, __syncthreads / __shfl_xor_sync, a launch that
// runs a grid block by block (each block's threads as std::threads), and the raw array files the
// Python driver (tests/helpers/cuda_emulation.py) writes and reads. Include it once per harness,
// after the kernel sources. Test-only.
#pragma once
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

thread_local EmulatedDim3 threadIdx, blockIdx;
EmulatedDim3 blockDim, gridDim;
static std::barrier<>* block_barrier = nullptr;
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
static float shuffle_slots[1024];

void __syncthreads() { block_barrier->arrive_and_wait(); }

// All 32 lanes of a warp call this together (warp_sum / warp_max); they meet at their warp's barrier.
float __shfl_xor_sync(unsigned, float value, int lane_mask) {
    const unsigned t = threadIdx.x;
    std::barrier<>& warp = *warp_barriers[t / 32];
    warp.arrive_and_wait();
    shuffle_slots[t] = value;
    warp.arrive_and_wait();
    return shuffle_slots[(t & ~31u) | ((t & 31u) ^ static_cast<unsigned>(lane_mask))];
}

// kernel<<<dim3(grid_x, grid_y, grid_z), threads>>>: blocks one after another (so __shared__
// statics are private to the running block), a block's threads concurrently.
template <class Kernel>
static void launch(unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned threads, Kernel kernel) {
    gridDim = {grid_x, grid_y, grid_z};
    blockDim = {threads, 1, 1};
    for (unsigned bz = 0; bz < grid_z; ++bz)
        for (unsigned by = 0; by < grid_y; ++by)
            for (unsigned bx = 0; bx < grid_x; ++bx) {
                std::barrier<> barrier(threads);
                block_barrier = &barrier;
                warp_barriers.clear();
                for (unsigned w = 0; w < (threads + 31) / 32; ++w)
                    warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - 32 * w)));
                std::vector<std::thread> pool;
                for (unsigned t = 0; t < threads; ++t)
                    pool.emplace_back([=] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {bx, by, bz};
                        kernel();
                    });
                for (auto& th : pool) th.join();
            }
}

// DIR/NAME as an array of T (exactly the file's elements). Its data() is never null, even for an
// empty file, so it can be handed to a kernel argument that must not be null.
template <class T>
static std::vector<T> load(const std::string& dir, const char* name) {
    FILE* f = std::fopen((dir + "/" + name).c_str(), "rb");
    if (!f) { std::fprintf(stderr, "missing %s\n", name); std::exit(2); }
    std::fseek(f, 0, SEEK_END);
    const long bytes = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    std::vector<T> data(bytes / sizeof(T));
    data.reserve(data.size() + 1);
    if (std::fread(data.data(), 1, bytes, f) != static_cast<size_t>(bytes)) std::exit(3);
    std::fclose(f);
    return data;
}

template <class T>
static void save(const std::string& dir, const char* name, const T* data, size_t count) {
    FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
    std::fwrite(data, sizeof(T), count, f);
    std::fclose(f);
}

template <class T>
static void save(const std::string& dir, const char* name, const std::vector<T>& data) {
    save(dir, name, data.data(), data.size());
}
