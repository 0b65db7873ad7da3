// Grouped expert GEMM for bf16 experts with a cp.async multi-stage pipeline (moe.cu's
// moe_grouped_gemm loads a tile, waits, multiplies, waits: one weight tile in flight per block).
// Same arguments and tile list as moe_grouped_gemm (moe_sort's 64-row tiles of one expert):
//   out[p, n] = Σ_k A[row(p), k] · W_e[n, k],  row(p) = sorted_slots[p] / top_k (gather) or p.
// A block: 4 warps, one 64-row tile × PIPE_TILE_N weight rows; each warp owns 8·PIPE_WARP_N8
// weight rows (4 n8 tiles: 128 per block; 8: 256, fewer shared-memory fragment reads per mma for
// prefill-sized tiles) and all the tile's rows, so a decode tile of 6-24 rows multiplies only its 1-2 used
// m16 slices (warp-uniform skip) and the block streams its weight rows from HBM PIPE_STAGES - 1
// k-tiles ahead. Unused rows of a used m16 slice are zero-filled (cp.async source size 0).
//
// PIPE_FUSE_SILU=1 (gate_up only, W = [gate; up] with N = 2I): warp w's 8·PIPE_WARP_N8 weight rows
// are gate rows c0 + h·w .. + h and the up rows I + c0 + h·w .. + h (h = 4·PIPE_WARP_N8), so each lane holds gate and up of the
// same output columns in registers and writes silu(gate)·up ([T·k, I]) directly: the same
// roundings as grouped_gemm → silu_mul (gate and up rounded to bf16, silu rounded, product rounded).
//
// Needs K % 8 == 0 and 16-byte aligned rows of A and W (the caller checks).
#include "mma.cuh"

#ifndef PIPE_STAGES
#define PIPE_STAGES 4
#endif
#ifndef PIPE_FUSE_SILU
#define PIPE_FUSE_SILU 0
#endif
#ifndef PIPE_WARP_N8
#define PIPE_WARP_N8 4  // n8 mma tiles per warp (2, 4 or 8): 16, 32 or 64 weight rows
#endif
#ifndef PIPE_TILE_K
#define PIPE_TILE_K 64  // 64 or 32
#endif
#define PIPE_WARPS 4
#define PIPE_TILE_M 64                               // moe_sort's tile (BM in moe.cu)
#define PIPE_TILE_N (PIPE_WARPS * PIPE_WARP_N8 * 8)  // 64, 128 or 256 weight rows per block
#define PIPE_PITCH (PIPE_TILE_K + 8)  // 144- / 80-byte rows: ldmatrix's 8 row addresses hit distinct banks
#define PIPE_STAGE_ELEMS ((PIPE_TILE_M + PIPE_TILE_N) * PIPE_PITCH)
#if PIPE_FUSE_SILU
#define PIPE_OUT_N (PIPE_TILE_N / 2)  // output columns per block
#else
#define PIPE_OUT_N PIPE_TILE_N
#endif

#ifndef PIPE_DYNAMIC_SHARED  // a host harness defines it as a static array
#define PIPE_DYNAMIC_SHARED(name) extern __shared__ __align__(16) bf16 name[]
#endif

#ifdef MMA_HOST_STANDIN  // the host emulation copies at once
__device__ __forceinline__ void pipe_copy16(bf16* smem, const bf16* gmem, bool valid) {
    if (valid) std::memcpy(smem, gmem, 16);
    else std::memset(smem, 0, 16);
}
__device__ __forceinline__ void pipe_commit() {}
__device__ __forceinline__ void pipe_wait() {}
// A (16×16 from row r0, column k) and B (two n8 tiles from weight row n0, column k) fragments read
// element-wise in mma's register layout (lane = 4g + q)
__device__ __forceinline__ void pipe_a_fragment(unsigned* r, const bf16* tile, int r0, int k, int lane) {
    const int g = lane >> 2, q = (lane & 3) * 2;
    r[0] = *reinterpret_cast<const unsigned*>(tile + (r0 + g) * PIPE_PITCH + k + q);
    r[1] = *reinterpret_cast<const unsigned*>(tile + (r0 + g + 8) * PIPE_PITCH + k + q);
    r[2] = *reinterpret_cast<const unsigned*>(tile + (r0 + g) * PIPE_PITCH + k + q + 8);
    r[3] = *reinterpret_cast<const unsigned*>(tile + (r0 + g + 8) * PIPE_PITCH + k + q + 8);
}
__device__ __forceinline__ void pipe_b_fragments(unsigned* r, const bf16* tile, int n0, int k, int lane) {
    const int g = lane >> 2, q = (lane & 3) * 2;
    r[0] = *reinterpret_cast<const unsigned*>(tile + (n0 + g) * PIPE_PITCH + k + q);
    r[1] = *reinterpret_cast<const unsigned*>(tile + (n0 + g) * PIPE_PITCH + k + q + 8);
    r[2] = *reinterpret_cast<const unsigned*>(tile + (n0 + 8 + g) * PIPE_PITCH + k + q);
    r[3] = *reinterpret_cast<const unsigned*>(tile + (n0 + 8 + g) * PIPE_PITCH + k + q + 8);
}
#else
__device__ __forceinline__ void pipe_copy16(bf16* smem, const bf16* gmem, bool valid) { cp_async16(smem, gmem, valid); }
__device__ __forceinline__ void pipe_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// this thread's copies of all but the PIPE_STAGES - 2 newest groups landed
__device__ __forceinline__ void pipe_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PIPE_STAGES - 2)); }
// ldmatrix x4: lanes 0-15 address rows r0.., columns k; lanes 16-31 the same rows, columns k + 8
__device__ __forceinline__ void pipe_a_fragment(unsigned* r, const bf16* tile, int r0, int k, int lane) {
    ldmatrix_x4(r, tile + (r0 + (lane & 15)) * PIPE_PITCH + k + (lane >> 4) * 8);
}
// ldmatrix x4 over weight rows n0 .. n0 + 15: {b0, b1} of the first n8 tile, then of the second
__device__ __forceinline__ void pipe_b_fragments(unsigned* r, const bf16* tile, int n0, int k, int lane) {
    ldmatrix_x4(r, tile + (n0 + (lane >> 4) * 8 + (lane & 7)) * PIPE_PITCH + k + ((lane >> 3) & 1) * 8);
}
#endif

// The weight row (of N) behind row r of the block's B tile, or -1 past the weight.
__device__ __forceinline__ int pipe_weight_row(int r, int N) {
#if PIPE_FUSE_SILU
    constexpr int WARP_ROWS = 8 * PIPE_WARP_N8, WARP_COLUMNS = WARP_ROWS / 2;
    const int half = N / 2, within = r % WARP_ROWS;
    const int column = blockIdx.y * PIPE_OUT_N + (r / WARP_ROWS) * WARP_COLUMNS + within % WARP_COLUMNS;
    return column < half ? column + (within >= WARP_COLUMNS ? half : 0) : -1;
#else
    const int n = blockIdx.y * PIPE_TILE_N + r;
    return n < N ? n : -1;
#endif
}

// k-tile `kt` of the used rows (m_rows, a multiple of 16) of A and of the block's weight rows.
__device__ __forceinline__ void pipe_issue(bf16* stage, const bf16* __restrict__ a, const int* a_rows,
                                           const bf16* __restrict__ w, const int* w_rows, int m_rows, int kt, int K) {
    constexpr int PIECES = PIPE_TILE_K / 8;  // 16-byte pieces per row
    const int k0 = kt * PIPE_TILE_K;
    for (int i = threadIdx.x; i < m_rows * PIECES; i += PIPE_WARPS * 32) {
        const int r = i / PIECES, k = k0 + (i % PIECES) * 8, src = a_rows[r];
        const bool valid = src >= 0 && k < K;
        pipe_copy16(stage + r * PIPE_PITCH + (i % PIECES) * 8, valid ? a + (long long)src * K + k : a, valid);
    }
    bf16* b = stage + PIPE_TILE_M * PIPE_PITCH;
#pragma unroll
    for (int j = 0; j < PIPE_TILE_N * PIECES / (PIPE_WARPS * 32); ++j) {
        const int i = j * PIPE_WARPS * 32 + threadIdx.x;
        const int r = i / PIECES, k = k0 + (i % PIECES) * 8, n = w_rows[r];
        const bool valid = n >= 0 && k < K;
        pipe_copy16(b + r * PIPE_PITCH + (i % PIECES) * 8, valid ? w + (long long)n * K + k : w, valid);
    }
}

extern "C" __global__ void __launch_bounds__(PIPE_WARPS * 32)
moe_grouped_gemm_pipelined(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                           const bf16* __restrict__ weight, const int* __restrict__ tile_expert,
                           const int* __restrict__ tile_row, const int* __restrict__ num_tiles,
                           const int* __restrict__ offsets, int dense_rows, bf16* __restrict__ out, int N, int K) {
    PIPE_DYNAMIC_SHARED(pipe_smem);  // PIPE_STAGES x PIPE_STAGE_ELEMS
    __shared__ int a_rows[PIPE_TILE_M], w_rows[PIPE_TILE_N];
    int expert, row_begin, row_end;
    if (tile_expert) {
        if ((int)blockIdx.x >= *num_tiles) return;
        expert = tile_expert[blockIdx.x];
        row_begin = tile_row[blockIdx.x];
        row_end = min(row_begin + PIPE_TILE_M, offsets[expert + 1]);
    } else {
        expert = 0;
        row_begin = blockIdx.x * PIPE_TILE_M;
        if (row_begin >= dense_rows) return;
        row_end = min(row_begin + PIPE_TILE_M, dense_rows);
    }
    const int rows = row_end - row_begin, m_tiles = (rows + 15) / 16;  // block-uniform
    for (int r = threadIdx.x; r < PIPE_TILE_M; r += PIPE_WARPS * 32)
        a_rows[r] = r < rows ? (sorted_slots ? sorted_slots[row_begin + r] / top_k : row_begin + r) : -1;
    for (int r = threadIdx.x; r < PIPE_TILE_N; r += PIPE_WARPS * 32) w_rows[r] = pipe_weight_row(r, N);
    __syncthreads();
    const bf16* w = weight + (long long)expert * N * K;
    const int k_tiles = (K + PIPE_TILE_K - 1) / PIPE_TILE_K;
#pragma unroll
    for (int s = 0; s + 1 < PIPE_STAGES; ++s) {  // every turn commits a group, empty or not
        if (s < k_tiles) pipe_issue(pipe_smem + s * PIPE_STAGE_ELEMS, a, a_rows, w, w_rows, 16 * m_tiles, s, K);
        pipe_commit();
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float acc[4][PIPE_WARP_N8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < PIPE_WARP_N8; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
    for (int kt = 0; kt < k_tiles; ++kt) {
        pipe_wait();
        __syncthreads();  // stage kt landed for every thread; stage kt - 1 read by every warp
        const int ahead = kt + PIPE_STAGES - 1;  // refills the stage computed last turn
        if (ahead < k_tiles)
            pipe_issue(pipe_smem + (ahead % PIPE_STAGES) * PIPE_STAGE_ELEMS, a, a_rows, w, w_rows, 16 * m_tiles,
                       ahead, K);
        pipe_commit();
        const bf16* a_tile = pipe_smem + (kt % PIPE_STAGES) * PIPE_STAGE_ELEMS;
        const bf16* b_tile = a_tile + PIPE_TILE_M * PIPE_PITCH;
#pragma unroll
        for (int kk = 0; kk < PIPE_TILE_K; kk += 16) {
            unsigned fb[PIPE_WARP_N8 / 2][4];
#pragma unroll
            for (int j = 0; j < PIPE_WARP_N8 / 2; ++j)
                pipe_b_fragments(fb[j], b_tile, warp * PIPE_WARP_N8 * 8 + 16 * j, kk, lane);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (i >= m_tiles) break;
                unsigned fa[4];
                pipe_a_fragment(fa, a_tile, 16 * i, kk, lane);
#pragma unroll
                for (int j = 0; j < PIPE_WARP_N8; ++j) mma_bf16_16816(acc[i][j], fa, fb[j / 2][2 * (j & 1)], fb[j / 2][2 * (j & 1) + 1]);
            }
        }
    }
    // lane (g, q) holds rows 16i + g (v 0, 1) and + 8 (v 2, 3), columns 2q, 2q + 1 of n8 tile j
    const int g = lane >> 2, q = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (i >= m_tiles) break;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = 16 * i + g + 8 * half;
            if (r >= rows) continue;
            bf16* out_row = out + (long long)(row_begin + r) * (PIPE_FUSE_SILU ? N / 2 : N);
#if PIPE_FUSE_SILU
#pragma unroll
            for (int j = 0; j < PIPE_WARP_N8 / 2; ++j) {  // gate tile j, up tile j + PIPE_WARP_N8 / 2
                const int c = blockIdx.y * PIPE_OUT_N + warp * 4 * PIPE_WARP_N8 + 8 * j + q;
                float o[2];
#pragma unroll
                for (int v = 0; v < 2; ++v) {
                    const float gate = round_bf16(acc[i][j][2 * half + v]);
                    const float up = round_bf16(acc[i][j + PIPE_WARP_N8 / 2][2 * half + v]);
                    o[v] = round_bf16(gate / (1.f + __expf(-gate))) * up;
                }
                if (c + 1 < N / 2) {
                    *reinterpret_cast<unsigned*>(out_row + c) = pack_bf16x2(o[0], o[1]);
                } else if (c < N / 2) {
                    out_row[c] = __float2bfloat16_rn(o[0]);
                }
            }
#else
#pragma unroll
            for (int j = 0; j < PIPE_WARP_N8; ++j) {
                const int c = blockIdx.y * PIPE_OUT_N + warp * PIPE_WARP_N8 * 8 + 8 * j + q;
                if (c + 1 < N) {
                    *reinterpret_cast<unsigned*>(out_row + c) = pack_bf16x2(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
                } else if (c < N) {
                    out_row[c] = __float2bfloat16_rn(acc[i][j][2 * half]);
                }
            }
#endif
        }
    }
}
