// Warp-level tensor-core helpers shared by the mma.sync kernels (sm_80+): the bf16 m16n8k16 MMA,
// bf16x2 operand packing, ldmatrix fragment loads and 16-byte cp.async copies, plus the 64×64
// block tile on 4 warps that moe.cu's and moe_fp4.cu's grouped GEMMs both multiply.
//
// Under the host emulation a harness defines MMA_HOST_STANDIN: tests/helpers/cuda_host/harness.h
// supplies a warp-collective mma_bf16_16816(d, a, b0, b1) and the PTX-only helpers are left out.
#pragma once
#include "common.cuh"

// Two floats rounded to bf16 in one 32-bit register, `lo` in the low half (an mma operand).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#ifdef MMA_HOST_STANDIN  // no type punning on the host
    return (unsigned)__bfloat16_as_ushort(v.x) | ((unsigned)__bfloat16_as_ushort(v.y) << 16);
#else
    return *reinterpret_cast<unsigned*>(&v);
#endif
}

#ifdef MMA_HOST_STANDIN
void mma_bf16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1);
#else
// D = A·B + D for one m16n8k16 bf16 tile; a: 4 regs (row-major A), b0/b1: 2 regs (col-major B).
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    mma_bf16_16816(d, a, b[0], b[1]);
}

#ifndef MMA_HOST_STANDIN
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const bf16* p) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const bf16* p) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned& r0, unsigned& r1, const bf16* p) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

// 16-byte global -> shared copy that bypasses L1 and registers; a false `valid` writes zeros.
__device__ __forceinline__ void cp_async16(bf16* smem, const bf16* gmem, bool valid) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(valid ? 16 : 0));
}
#endif

// ---- 64×64 block tile, 4 warps in a 2×2 grid, each a 32×32 block = 2 (m16) × 4 (n8) mma tiles ----
constexpr int MMA_TILE = 64;
constexpr int MMA_TILE_THREADS = 128;

// The calling thread's place in the tile: its warp's first row / column and its fragment lanes.
struct MmaTileLane {
    int warp_m, warp_n, group, pair;
};

__device__ __forceinline__ MmaTileLane mma_tile_lane() {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    return {(warp >> 1) * 32, (warp & 1) * 32, lane >> 2, (lane & 3) * 2};
}

// A tile of rows a_rows[r] (−1: zeros) of the row-major [*, K] bf16 matrix `a`, columns k0 ...
// k0 + 63, by 16-byte loads (K % 8 == 0 and 16-byte aligned rows).
template <int LD>
__device__ __forceinline__ void load_row_tile_vec(const bf16* __restrict__ a, const int* a_rows, int k0, int K,
                                                  bf16 (*tile)[LD]) {
    for (int i = threadIdx.x; i < MMA_TILE * MMA_TILE / 8; i += MMA_TILE_THREADS) {
        const int r = i / (MMA_TILE / 8), c = (i % (MMA_TILE / 8)) * 8;
        const int src = a_rows[r];
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (src >= 0 && k0 + c < K) v = *reinterpret_cast<const uint4*>(a + (long long)src * K + k0 + c);
        *reinterpret_cast<uint4*>(&tile[r][c]) = v;
    }
}

// acc += a_tile · b_tile^T over the tiles' 64 columns (both [64][LD] bf16 in shared memory,
// b_tile's rows the output columns).
template <int LD>
__device__ __forceinline__ void mma_tile_step(float (&acc)[2][4][4], bf16 (*a_tile)[LD], bf16 (*b_tile)[LD],
                                              MmaTileLane t) {
#pragma unroll
    for (int kk = 0; kk < MMA_TILE; kk += 16) {
        unsigned fa[2][4], fb[4][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = t.warp_m + 16 * i + t.group;
            fa[i][0] = *reinterpret_cast<const unsigned*>(&a_tile[r][kk + t.pair]);
            fa[i][1] = *reinterpret_cast<const unsigned*>(&a_tile[r + 8][kk + t.pair]);
            fa[i][2] = *reinterpret_cast<const unsigned*>(&a_tile[r][kk + t.pair + 8]);
            fa[i][3] = *reinterpret_cast<const unsigned*>(&a_tile[r + 8][kk + t.pair + 8]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = t.warp_n + 8 * j + t.group;
            fb[j][0] = *reinterpret_cast<const unsigned*>(&b_tile[n][kk + t.pair]);
            fb[j][1] = *reinterpret_cast<const unsigned*>(&b_tile[n][kk + t.pair + 8]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], fa[i], fb[j]);
    }
}

// The accumulators into the fp32 [64][LD] c_tile (shared memory), for a coalesced write-out.
template <int LD>
__device__ __forceinline__ void store_mma_tile(float (*c_tile)[LD], const float (&acc)[2][4][4], MmaTileLane t) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = t.warp_m + 16 * i + t.group, c = t.warp_n + 8 * j + t.pair;
            c_tile[r][c] = acc[i][j][0];
            c_tile[r][c + 1] = acc[i][j][1];
            c_tile[r + 8][c] = acc[i][j][2];
            c_tile[r + 8][c + 1] = acc[i][j][3];
        }
}
