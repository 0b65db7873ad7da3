// The host side of an emulated kernel run, shared by every harness.cpp that drives .cu sources
// through cuda_bf16.h: the CUDA built-in variables, __syncthreads / __shfl_xor_sync, a launch that
// runs a grid block by block (each block's threads as std::threads), and the raw array files the
// Python driver (tests/helpers/cuda_emulation.py) writes and reads, and (with MMA_HOST_STANDIN
// defined before the kernels) the warp-collective stand-in for mma.cuh's mma_bf16_16816. Include
// it once per harness, after the kernel sources. Test-only.
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

// Integer shuffles (block scans): lane - delta's value (a lane below delta keeps its own), lane src_lane's.
static int shuffle_int_slots[1024];
static int exchange_int(int value) {
    const unsigned t = threadIdx.x;
    std::barrier<>& warp = *warp_barriers[t / 32];
    warp.arrive_and_wait();
    shuffle_int_slots[t] = value;
    warp.arrive_and_wait();
    return value;
}
int __shfl_up_sync(unsigned, int value, unsigned delta) {
    exchange_int(value);
    const unsigned t = threadIdx.x;
    return (t & 31u) >= delta ? shuffle_int_slots[t - delta] : value;
}
int __shfl_sync(unsigned, int value, int src_lane) {
    exchange_int(value);
    return shuffle_int_slots[(threadIdx.x & ~31u) | static_cast<unsigned>(src_lane & 31)];
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

#ifdef MMA_HOST_STANDIN
// core's mma.cuh under the host emulation: mma.sync m16n8k16 (bf16 in, fp32 accumulate) for one
// warp. Every lane posts its fragment registers at the warp's barrier, then computes its own four
// outputs from the 16x16 A and 16x8 B they describe (PTX layout: lane = 4 g + q; A regs {row g,
// row g+8} x {cols 2q.., 2q+8..}; B regs rows 2q.., 2q+8.. of column g; C rows g and g+8, columns
// 2q, 2q+1) — so the fragment layouts the kernels assume are checked too.
static unsigned mma_fragment_a[1024][4], mma_fragment_b[1024][2];

static float mma_bf16_half(unsigned packed, int high) {
    return __bfloat162float(__nv_bfloat16{static_cast<uint16_t>(high ? packed >> 16 : packed & 0xFFFFu)});
}

void mma_bf16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    const unsigned t = threadIdx.x, base = t & ~31u, lane = t & 31u;
    std::barrier<>& warp = *warp_barriers[t / 32];
    for (int e = 0; e < 4; ++e) mma_fragment_a[t][e] = a[e];
    mma_fragment_b[t][0] = b0;
    mma_fragment_b[t][1] = b1;
    warp.arrive_and_wait();
    auto a_at = [&](int row, int col) {  // A[row][col]: lane 4 (row % 8) + (col % 8) / 2
        const unsigned owner = base + 4 * (row % 8) + (col % 8) / 2;
        return mma_bf16_half(mma_fragment_a[owner][(row >= 8) + 2 * (col >= 8)], col & 1);
    };
    auto b_at = [&](int k, int n) {  // B[k][n]: lane 4 n + (k % 8) / 2
        const unsigned owner = base + 4 * n + (k % 8) / 2;
        return mma_bf16_half(mma_fragment_b[owner][k >= 8], k & 1);
    };
    const int g = static_cast<int>(lane >> 2), q = static_cast<int>(lane & 3);
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * q, 2 * q + 1, 2 * q, 2 * q + 1};
    float out[4];
    for (int e = 0; e < 4; ++e) {
        float acc = d[e];
        for (int k = 0; k < 16; ++k) acc += a_at(rows[e], k) * b_at(k, cols[e]);
        out[e] = acc;
    }
    warp.arrive_and_wait();  // every lane has read the fragments before any call overwrites them
    for (int e = 0; e < 4; ++e) d[e] = out[e];
}
#endif
