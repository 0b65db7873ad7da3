// RMSNorm over the last dim, one block per row, fp32 statistics. Matches a bf16 PyTorch
// RMSNorm: normalize in fp32, round to bf16, multiply by the bf16 weight, round again.
#include "rms_norm.cuh"  // normalize_row

extern "C" __global__ void rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ weight,
                                    bf16* __restrict__ out, int features, float eps) {
    const size_t row = blockIdx.x;
    normalize_row(x + row * features, weight, out + row * features, features, eps);
}

// residual_out = x + residual (bf16); out = rms_norm(residual_out).
extern "C" __global__ void add_rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ residual,
                                        const bf16* __restrict__ weight, bf16* __restrict__ out,
                                        bf16* __restrict__ residual_out, int features, float eps) {
    const size_t row = blockIdx.x;
    const bf16* xr = x + row * features;
    const bf16* rr = residual + row * features;
    bf16* ro = residual_out + row * features;
    for (int c = threadIdx.x; c < features; c += blockDim.x)
        ro[c] = __float2bfloat16_rn(__bfloat162float(xr[c]) + __bfloat162float(rr[c]));
    __syncthreads();  // each thread re-reads only what it wrote, but keep the row consistent
    normalize_row(ro, weight, out + row * features, features, eps);
}

// MoE combine + the next layer's add_rms_norm in one launch (decode steps: one block per token; the
// combine's launch and its [T, hidden] round trip go). moe = moe.cu moe_combine's sum (the same fp32 order:
// j ascending from 0; shared: the routed sum rounded to bf16, then + shared), rounded to bf16; then
// add_rms_norm(moe, residual): residual_out = bf16(moe + residual), out = rms_norm(residual_out) * weight.
// The same bits as moe_combine followed by add_rms_norm (the block kernel above).
#define COMBINE_NORM_MAX_TOPK 16  // k (+ fused shared experts) per token: core's MAX_TOPK
extern "C" __global__ void moe_combine_add_rms_norm(const bf16* __restrict__ y, const int* __restrict__ slot_pos,
                                                    const float* __restrict__ weights,
                                                    const bf16* __restrict__ shared, int top_k,
                                                    const bf16* __restrict__ residual, const bf16* __restrict__ weight,
                                                    bf16* __restrict__ out, bf16* __restrict__ residual_out,
                                                    int features, float eps) {
    const size_t t = blockIdx.x;
    const bf16* rr = residual + t * features;
    bf16* ro = residual_out + t * features;
    for (int c = threadIdx.x; c < features; c += blockDim.x) {
        float rows[COMBINE_NORM_MAX_TOPK];  // every slot's value in flight before the sum (a lone block: latency)
#pragma unroll
        for (int j = 0; j < COMBINE_NORM_MAX_TOPK; ++j)
            if (j < top_k) rows[j] = __bfloat162float(y[(long long)slot_pos[t * top_k + j] * features + c]);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < COMBINE_NORM_MAX_TOPK; ++j)
            if (j < top_k) sum += weights[t * top_k + j] * rows[j];
        if (shared) sum = round_bf16(sum) + __bfloat162float(shared[t * features + c]);
        ro[c] = __float2bfloat16_rn(round_bf16(sum) + __bfloat162float(rr[c]));
    }
    __syncthreads();
    normalize_row(ro, weight, out + t * features, features, eps);
}

// --- Row-per-warp variants for many rows (prefill, mixed steps) ---------------------------------
// One warp per row, NORM_ROWS_PER_BLOCK rows per block, 16-byte loads and stores, the row held in
// registers (VECS_PER_LANE 16-byte vectors per lane, so features <= 256 * VECS_PER_LANE and a
// multiple of 8; rows 16-byte aligned; 151-208 registers at 10-12 vectors, no spills): add_rms_norm reads x and residual once and writes each
// output once (the block kernels above re-read the sum and move 2 bytes per access). Same
// arithmetic per element; the fp32 sum of squares is taken in another order (per lane, then the
// warp), so a result can differ from the block kernels' in the last bit.
#ifndef VECS_PER_LANE
#define VECS_PER_LANE 10
#endif
#define NORM_ROWS_PER_BLOCK 4
// rms_norm_rows (E1 s8, H200, 8k x 2560 rows: 69 % of copy bandwidth against add_rms_norm_rows' 101 %)
// holds the row and the norm weight in registers from the first load: 177 registers at 10 vectors per
// lane, so 2 blocks (8 warps) an SM and half the row bytes in flight of the add kernel (151 registers,
// 3 blocks). RMS_NORM_ROWS_LATE_WEIGHT=1 loads each weight vector where the normalization uses it
// (an L1 / L2 hit after the first rows) instead; RMS_NORM_ROWS_MIN_BLOCKS sets __launch_bounds__'
// minimum blocks per SM. The same arithmetic either way, so the same bits. For measuring.
#ifndef RMS_NORM_ROWS_LATE_WEIGHT
#define RMS_NORM_ROWS_LATE_WEIGHT 0
#endif
#ifndef RMS_NORM_ROWS_MIN_BLOCKS
#define RMS_NORM_ROWS_MIN_BLOCKS 1
#endif

__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return u;
}

// row[] / weight[] hold this lane's vectors (lane + 32 i) of one row and of the norm weight;
// writes rms_norm(row) * weight to out. The weight is loaded with the row, before the warp's sum, so
// a lone row (decode) waits for memory once.
__device__ __forceinline__ void normalize_row_in_registers(const uint4* row, const uint4* weight, float ss,
                                                           bf16* __restrict__ out, int num_vectors, int features,
                                                           float eps) {
    const int lane = threadIdx.x & 31;
    const float inv = rsqrtf(warp_sum(ss) / features + eps);
#pragma unroll
    for (int i = 0; i < VECS_PER_LANE; ++i) {
        const int v = lane + 32 * i;
        if (v < num_vectors) {
            float x[8], w[8];
            unpack8(row[i], x);
            unpack8(weight[i], w);
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] = round_bf16(x[e] * inv) * w[e];
            *reinterpret_cast<uint4*>(out + 8 * v) = pack8(x);
        }
    }
}

extern "C" __global__ void __launch_bounds__(NORM_ROWS_PER_BLOCK * 32, RMS_NORM_ROWS_MIN_BLOCKS)
rms_norm_rows(const bf16* __restrict__ x, const bf16* __restrict__ weight, bf16* __restrict__ out, int num_rows,
              int features, float eps) {
    const size_t row = (size_t)blockIdx.x * NORM_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= (size_t)num_rows) return;  // a whole warp leaves together
    const int lane = threadIdx.x & 31, num_vectors = features >> 3;
    const bf16* xr = x + row * features;
    uint4 v[VECS_PER_LANE];
#if !RMS_NORM_ROWS_LATE_WEIGHT
    uint4 w[VECS_PER_LANE];
#endif
#pragma unroll
    for (int i = 0; i < VECS_PER_LANE; ++i) {
        const int c = lane + 32 * i;
        if (c < num_vectors) {
            v[i] = *reinterpret_cast<const uint4*>(xr + 8 * c);
#if !RMS_NORM_ROWS_LATE_WEIGHT
            w[i] = *reinterpret_cast<const uint4*>(weight + 8 * c);
#endif
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < VECS_PER_LANE; ++i) {
        if (lane + 32 * i < num_vectors) {
            float f[8];
            unpack8(v[i], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
        }
    }
#if RMS_NORM_ROWS_LATE_WEIGHT
    const float inv = rsqrtf(warp_sum(ss) / features + eps);
    bf16* out_row = out + row * features;
#pragma unroll
    for (int i = 0; i < VECS_PER_LANE; ++i) {
        const int c = lane + 32 * i;
        if (c < num_vectors) {
            float f[8], g[8];
            unpack8(v[i], f);
            unpack8(*reinterpret_cast<const uint4*>(weight + 8 * c), g);
#pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = round_bf16(f[e] * inv) * g[e];
            *reinterpret_cast<uint4*>(out_row + 8 * c) = pack8(f);
        }
    }
#else
    normalize_row_in_registers(v, w, ss, out + row * features, num_vectors, features, eps);
#endif
}

// residual_out = x + residual (bf16); out = rms_norm(residual_out), each row by one warp.
extern "C" __global__ void __launch_bounds__(NORM_ROWS_PER_BLOCK * 32)
add_rms_norm_rows(const bf16* __restrict__ x, const bf16* __restrict__ residual, const bf16* __restrict__ weight,
                  bf16* __restrict__ out, bf16* __restrict__ residual_out, int num_rows, int features, float eps) {
    const size_t row = (size_t)blockIdx.x * NORM_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= (size_t)num_rows) return;
    const int lane = threadIdx.x & 31, num_vectors = features >> 3;
    const bf16* xr = x + row * features;
    const bf16* rr = residual + row * features;
    bf16* ro = residual_out + row * features;
    uint4 a[VECS_PER_LANE], b[VECS_PER_LANE], w[VECS_PER_LANE];
#pragma unroll
    for (int i = 0; i < VECS_PER_LANE; ++i) {  // every load issued before the first use
        const int v = lane + 32 * i;
        if (v < num_vectors) {
            a[i] = *reinterpret_cast<const uint4*>(xr + 8 * v);
            b[i] = *reinterpret_cast<const uint4*>(rr + 8 * v);
            w[i] = *reinterpret_cast<const uint4*>(weight + 8 * v);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < VECS_PER_LANE; ++i) {
        const int v = lane + 32 * i;
        if (v < num_vectors) {
            float fa[8], fb[8];
            unpack8(a[i], fa);
            unpack8(b[i], fb);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                fa[e] = round_bf16(fa[e] + fb[e]);
                ss += fa[e] * fa[e];
            }
            a[i] = pack8(fa);
            *reinterpret_cast<uint4*>(ro + 8 * v) = a[i];
        }
    }
    normalize_row_in_registers(a, w, ss, out + row * features, num_vectors, features, eps);
}
