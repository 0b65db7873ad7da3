// Skinny GEMM for decode: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M <= 8, bf16 in/out, fp32 sums.
// One warp owns COLS consecutive output columns: per 16-byte step it loads each weight row's
// chunk once and each x row's chunk once, and reuses every x chunk for COLS columns (x is read
// through L1; every warp of the block reads the same x). UNROLL steps of loads are in flight
// before their FMAs (in the last, partial pass all of its steps). Each output is summed in the same
// order whatever M is, so a row's result does not depend on the other rows of the batch. K must be
// a multiple of 8.
#include "common.cuh"

#define WARPS_PER_BLOCK 8
#ifndef GEMV_BATCHED_TAIL
// 1 (default since E1 of 2026-11-24, H200, benchmarks/results/dense_gemv_s8e1.json; same bits): the last
// partial pass issues all its loads first; 0: one load at a time, as before. Kimi-K2 qkv_a / q_b (fused
// norm) / o_proj 10.8 -> 9.4 / 22.2 -> 20.8 / 32.9 -> 29.2 us, Moonlight o_proj 4.8 -> 4.1, Qwen3-4B qkv
// (fused norm) / o_proj / gate_up 23.7 -> 22.1 / 8.1 -> 7.4 / 42.9 -> 41.6; slower: Moonlight shared gate_up
// 7.6 -> 7.9, its dense silu+down 34.1 -> 35.1, Qwen3-4B silu+down 32.5 -> 32.7 (11 of 15 shapes faster; sm_90a
// ptxas: gemv_m1 34 -> 48 registers, fused 44 / 50 -> 58).
#define GEMV_BATCHED_TAIL 1
#endif

// 8 bf16 values of a 16-byte word -> 8 floats (load8's conversion, for words loaded earlier).
__device__ __forceinline__ void words_to_floats8(const uint4& u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

// A pass of UNROLL 16-byte steps from k (those below K) of each weight row: the raw words, loaded (few registers).
template <int COLS, int UNROLL>
__device__ __forceinline__ void gemv_raw_issue(const bf16* const (&wrow)[COLS], uint4 (&raw)[UNROLL][COLS], int K,
                                               int k) {
    constexpr int STEP = 32 * 8;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
        if (k + u * STEP < K)
#pragma unroll
            for (int c = 0; c < COLS; ++c)
                raw[u][c] = *reinterpret_cast<const uint4*>(wrow[c] + k + u * STEP);
}

// The pass's FMAs: each step's x (those below K) times its words, in k order.
template <int ROWS, int COLS, int UNROLL>
__device__ __forceinline__ void gemv_raw_consume(const bf16* __restrict__ x, const uint4 (&raw)[UNROLL][COLS],
                                                 float (&acc)[ROWS][COLS], int M, int K, int k) {
    constexpr int STEP = 32 * 8;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        if (k + u * STEP >= K) break;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < M) {
                float xf[8];
                load8(x + (size_t)r * K + k + u * STEP, xf);
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    float wf[8];
                    words_to_floats8(raw[u][c], wf);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][c] += xf[i] * wf[i];
                }
            }
        }
    }
}

// One pass: every weight word loaded first, then the FMAs.
template <int ROWS, int COLS, int UNROLL>
__device__ __forceinline__ void gemv_raw_pass(const bf16* __restrict__ x, const bf16* const (&wrow)[COLS],
                                              float (&acc)[ROWS][COLS], int M, int K, int k) {
    uint4 raw[UNROLL][COLS];
    gemv_raw_issue<COLS, UNROLL>(wrow, raw, K, k);
    gemv_raw_consume<ROWS, COLS, UNROLL>(x, raw, acc, M, K, k);
}

// Tile `tile` of the output: columns [tile * WARPS_PER_BLOCK * COLS, +WARPS_PER_BLOCK * COLS).
template <int ROWS, int COLS, int UNROLL>
__device__ __forceinline__ void gemv_tile(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          const bf16* __restrict__ bias, bf16* __restrict__ y, int M,
                                          int N, int K, int tile) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (tile * WARPS_PER_BLOCK + warp) * COLS;
    if (n0 >= N) return;
    const bf16* wrow[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) wrow[c] = w + (size_t)min(n0 + c, N - 1) * K;
    float acc[ROWS][COLS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[r][c] = 0.f;
    constexpr int STEP = 32 * 8;
    int k = lane * 8;
    for (; k + (UNROLL - 1) * STEP < K; k += UNROLL * STEP) {
        float wf[UNROLL][COLS][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int c = 0; c < COLS; ++c) load8(wrow[c] + k + u * STEP, wf[u][c]);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < M) {
                    float xf[8];
                    load8(x + (size_t)r * K + k + u * STEP, xf);
#pragma unroll
                    for (int c = 0; c < COLS; ++c)
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc[r][c] += xf[i] * wf[u][c][i];
                }
            }
        }
    }
#if GEMV_BATCHED_TAIL
    // the last, partial pass (at most UNROLL - 1 steps): its loads too all in flight first (one step at a time left
    // short rows latency-bound: a q_b projection's K = 1536 is less than one pass, 6 loads in turn). Raw 16-byte
    // words, unpacked at use: few registers. Each lane still sums its k in increasing order: the same bits.
    if (k < K) gemv_raw_pass<ROWS, COLS, (UNROLL > 1 ? UNROLL - 1 : 1)>(x, wrow, acc, M, K, k);
#else
    for (; k < K; k += STEP) {
        float wf[COLS][8];
#pragma unroll
        for (int c = 0; c < COLS; ++c) load8(wrow[c] + k, wf[c]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < M) {
                float xf[8];
                load8(x + (size_t)r * K + k, xf);
#pragma unroll
                for (int c = 0; c < COLS; ++c)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][c] += xf[i] * wf[c][i];
            }
        }
    }
#endif
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[r][c] = warp_sum(acc[r][c]);
    if (lane == 0) {
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int n = n0 + c;
            if (n >= N) break;
            const float b = bias != nullptr ? __bfloat162float(bias[n]) : 0.f;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                if (r < M) y[(size_t)r * N + n] = __float2bfloat16_rn(acc[r][c] + b);
        }
    }
}

// gemv_m{ROWS}: a warp owns COLS columns (grid = ceil(N / (WARPS_PER_BLOCK * COLS))). Written out, not
// made by a macro: the start-up compile cuts single kernels out of this file (loader.kernel_subset), and
// it finds only kernels whose definitions it can read.
#ifndef GEMV_M1_UNROLL
#define GEMV_M1_UNROLL 8  // measured: 8 is 0-4% faster than 4 on Qwen3-4B projections (H200)
#endif
#define GEMV_ARGS                                                                                  \
    const bf16 *__restrict__ x, const bf16 *__restrict__ w, const bf16 *__restrict__ bias,        \
        bf16 *__restrict__ y, int M, int N, int K

// GEMV_M1_COLS (core's $OPENINFER_GEMV_M1_COLS; 1 unless set): the columns a warp of gemv_m1 owns, its passes
// GEMV_M1_UNROLL / GEMV_M1_COLS steps long (the same 8 weight words in flight a lane, the same registers): a grid
// GEMV_M1_COLS times narrower (Kimi-K2's q_b, K = 1536: 1,536 blocks in 2.3 waves of 5 an SM -> 768), each warp's x
// chunk reused for its columns. Each column's sum keeps its order: the same bits.
#ifndef GEMV_M1_COLS
#define GEMV_M1_COLS 1
#endif
extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32) gemv_m1(GEMV_ARGS) {
    gemv_tile<1, GEMV_M1_COLS, GEMV_M1_UNROLL / GEMV_M1_COLS>(x, w, bias, y, M, N, K, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32) gemv_m2(GEMV_ARGS) {
    gemv_tile<2, 2, 2>(x, w, bias, y, M, N, K, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32) gemv_m4(GEMV_ARGS) {
    gemv_tile<4, 4, 2>(x, w, bias, y, M, N, K, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32) gemv_m8(GEMV_ARGS) {
    gemv_tile<8, 4, 1>(x, w, bias, y, M, N, K, blockIdx.x);
}

// gemv_m1_rms_scaled's FMAs for a pass of raw weight words from k0 (those below K): Σ x² and Σ x·g·w, in k order.
template <int UNROLL>
__device__ __forceinline__ void rms_scaled_consume(const bf16* __restrict__ x, const bf16* __restrict__ norm_weight,
                                                   const uint4 (&raw)[UNROLL][1], float& acc, float& ss, int K,
                                                   int k0) {
    constexpr int STEP = 32 * 8;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int k = k0 + u * STEP;
        if (k >= K) break;
        float xf[8], gf[8], wf[8];
        load8(x + k, xf);
        load8(norm_weight + k, gf);
        words_to_floats8(raw[u][0], wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            ss += xf[i] * xf[i];
            acc += xf[i] * gf[i] * wf[i];
        }
    }
}

// gemv_m1_rms_scaled: y = rms_norm(x) @ w^T (+ bias) for one row with no normalised row in between (Kimi-K2's
// q_a_norm + q_b: the norm a launch of its own before gemv_m1, ~5 us at batch 1 for a 3 KB row). A warp's
// lanes walk the whole x row (16-byte chunks 8·lane + 256·j), so each warp sums x² itself, beside its column's
// Σ x·g·w (fp32); the column's sum is scaled by rsqrt(Σx²/K + eps) at the end. The weight row's loads issue
// first, as gemv_m1's (passes of RMS_SCALED_UNROLL, the partial last pass all at once). Not the bits of rms_norm
// then gemv_m1 (that rounds the normalised row to bf16 twice): fp32 throughout, within bf16 rounding.
#ifndef RMS_SCALED_UNROLL
#define RMS_SCALED_UNROLL 6  // a pass of 6 loads (Kimi-K2's q_b: K = 1536 in one): 48 registers, 5 blocks an SM as gemv_m1
#endif
extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32, 5)
gemv_m1_rms_scaled(const bf16* __restrict__ x, const bf16* __restrict__ norm_weight, float eps,
                   const bf16* __restrict__ w, const bf16* __restrict__ bias, bf16* __restrict__ y, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * WARPS_PER_BLOCK + warp;
    if (n >= N) return;
    const bf16* const wrow[1] = {w + (size_t)n * K};  // gemv_raw_issue's rows of one column
    constexpr int STEP = 32 * 8, UNROLL = RMS_SCALED_UNROLL;
    float acc = 0.f, ss = 0.f;
    for (int k0 = lane * 8; k0 < K; k0 += UNROLL * STEP) {
        uint4 raw[UNROLL][1];
        gemv_raw_issue<1, UNROLL>(wrow, raw, K, k0);
        rms_scaled_consume<UNROLL>(x, norm_weight, raw, acc, ss, K, k0);
    }
    acc = warp_sum(acc);
    ss = warp_sum(ss);
    if (lane == 0) {
        const float b = bias != nullptr ? __bfloat162float(bias[n]) : 0.f;
        y[n] = __float2bfloat16_rn(acc * rsqrtf(ss / K + eps) + b);
    }
}

// --- fused decode GEMVs (M = 1) ------------------------------------------------------------------
// The block first builds the GEMV's input row in shared memory, bit-identical to what the unfused
// kernels write to global memory, then runs the same gemv_tile over it: one launch instead of two,
// the same result. Dynamic shared memory: K bf16 values (K <= 24576 in 48 KB).
// The first design (one tile per block, the prologue before any weight load) was slower than the
// two launches it replaced: every block's weight stream waited on its own prologue. So a block
// now (1) asks L2 for its first tile's weight rows before the prologue, so HBM streams them while
// it builds the row, (2) builds the row once and then loops over tiles blockIdx.x, + gridDim.x, ...
// (the host sizes the grid to what stays resident), prefetching each next tile before computing
// the current one. Per column the arithmetic is unchanged, so results do not depend on the grid.

#ifndef GEMV_DYNAMIC_SHARED  // the host emulation supplies a static buffer
#define GEMV_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else  // host emulation: no cache to warm
    (void)p;
#endif
}

// The first `bytes` of this warp's weight row of tile `tile` (M = 1: one column per warp), in
// 128-byte lines, into L2. Whole rows of every resident block can exceed L2 (down-proj: 320
// blocks x 155 KB) and evict each other before use, so the host picks how much (0: none).
__device__ __forceinline__ void prefetch_tile_l2(const bf16* __restrict__ w, int N, int K, int tile, int bytes) {
    const int n = tile * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    if (n >= N) return;
    const char* row = reinterpret_cast<const char*>(w + (size_t)n * K);
    const int end = min(bytes, K * 2);
    for (int offset = (threadIdx.x & 31) * 128; offset < end; offset += 32 * 128) prefetch_l2(row + offset);
}

// The tiles after the prologue: blockIdx.x, blockIdx.x + gridDim.x, ... of ceil(N / WARPS_PER_BLOCK).
__device__ __forceinline__ void gemv_m1_tiles(const bf16* __restrict__ xs, const bf16* __restrict__ w,
                                              const bf16* __restrict__ bias, bf16* __restrict__ y, int N, int K,
                                              int prefetch_bytes) {
    const int tiles = (N + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        if (tile + gridDim.x < tiles) prefetch_tile_l2(w, N, K, tile + gridDim.x, prefetch_bytes);
        gemv_tile<1, 1, GEMV_M1_UNROLL>(xs, w, bias, y, 1, N, K, tile);
    }
}

// y = rms_norm(x + residual) @ w^T (+ bias); residual_out = x + residual, written by block 0.
// residual may be null (y = rms_norm(x) @ w^T; residual_out unused). The sum of squares follows
// rms_norm.cu's order exactly: a virtual block of norm_threads threads (the unfused launch's
// block size), each summing features t, t + norm_threads, ...; warp sums; then a sum over warps.
extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    gemv_m1_add_rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ residual,
                         const bf16* __restrict__ norm_weight, float eps, int norm_threads,
                         const bf16* __restrict__ w, const bf16* __restrict__ bias, bf16* __restrict__ y,
                         bf16* __restrict__ residual_out, int N, int K, int prefetch_bytes) {
    GEMV_DYNAMIC_SHARED(fused_smem);
    bf16* xs = reinterpret_cast<bf16*>(fused_smem);
    __shared__ float warp_sums[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    prefetch_tile_l2(w, N, K, blockIdx.x, prefetch_bytes);
    for (int c = threadIdx.x; c < K; c += blockDim.x) {
        const float h = residual != nullptr ? __bfloat162float(x[c]) + __bfloat162float(residual[c])
                                            : __bfloat162float(x[c]);
        const bf16 hb = __float2bfloat16_rn(h);
        xs[c] = hb;
        if (blockIdx.x == 0 && residual != nullptr) residual_out[c] = hb;
    }
    __syncthreads();
    const int num_vwarps = norm_threads >> 5;
    for (int vw = warp; vw < num_vwarps; vw += WARPS_PER_BLOCK) {
        float ss = 0.f;
        for (int c = vw * 32 + lane; c < K; c += norm_threads) {
            const float v = __bfloat162float(xs[c]);
            ss += v * v;
        }
        ss = warp_sum(ss);
        if (lane == 0) warp_sums[vw] = ss;
    }
    __syncthreads();
    const float total = warp_sum(lane < num_vwarps ? warp_sums[lane] : 0.f);
    const float inv = rsqrtf(total / K + eps);
    __syncthreads();  // every warp has read warp_sums before xs is rewritten below
    for (int c = threadIdx.x; c < K; c += blockDim.x) {
        const float v = round_bf16(__bfloat162float(xs[c]) * inv);
        xs[c] = __float2bfloat16_rn(v * __bfloat162float(norm_weight[c]));
    }
    __syncthreads();
    gemv_m1_tiles(xs, w, bias, y, N, K, prefetch_bytes);
}

// y = (silu(gate) * up) @ w^T (+ bias), gate_up = [gate | up] of 2K values (elementwise.cu's silu_mul).
extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    gemv_m1_silu_mul(const bf16* __restrict__ gate_up, const bf16* __restrict__ w,
                     const bf16* __restrict__ bias, bf16* __restrict__ y, int N, int K,
                     int prefetch_bytes) {
    GEMV_DYNAMIC_SHARED(fused_smem);
    bf16* xs = reinterpret_cast<bf16*>(fused_smem);
    prefetch_tile_l2(w, N, K, blockIdx.x, prefetch_bytes);
    for (int c = threadIdx.x; c < K; c += blockDim.x) {
        const float g = __bfloat162float(gate_up[c]);
        const float u = __bfloat162float(gate_up[K + c]);
        const float s = round_bf16(g / (1.f + __expf(-g)));
        xs[c] = __float2bfloat16_rn(s * u);
    }
    __syncthreads();
    gemv_m1_tiles(xs, w, bias, y, N, K, prefetch_bytes);
}
