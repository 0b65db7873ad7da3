// Row gathers and elementwise bf16 ops. Rows are contiguous [rows, features].
#include "common.cuh"

// out[i, :] = table[ids[i], :]   (embedding lookup and gather_rows; ids are int32)
extern "C" __global__ void gather_rows(const bf16* __restrict__ table, const int* __restrict__ ids,
                                       bf16* __restrict__ out, int num_rows, int features) {
    const int row = blockIdx.x;
    if (row >= num_rows) return;
    const bf16* src = table + (size_t)ids[row] * features;
    bf16* dst = out + (size_t)row * features;
    if ((features & 7) == 0) {
        for (int c = threadIdx.x * 8; c < features; c += blockDim.x * 8)
            *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
    } else {
        for (int c = threadIdx.x; c < features; c += blockDim.x) dst[c] = src[c];
    }
}

// out = a + b, rounded to bf16 (n elements).
extern "C" __global__ void add_bf16(const bf16* __restrict__ a, const bf16* __restrict__ b,
                                    bf16* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

// x[r, :] += bias (in place), x is [rows, features].
extern "C" __global__ void add_bias_bf16(bf16* __restrict__ x, const bf16* __restrict__ bias,
                                         long long rows, int features) {
    const long long n = rows * features;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16_rn(__bfloat162float(x[i]) + __bfloat162float(bias[i % features]));
}

// gate_up is [rows, 2 * half] = [gate | up]; out[r, i] = silu(gate[r, i]) * up[r, i].
// silu is rounded to bf16 before the product, as a bf16 PyTorch model computes it.
extern "C" __global__ void silu_mul(const bf16* __restrict__ gate_up, bf16* __restrict__ out,
                                    long long rows, int half) {
    const long long n = rows * half;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / half;
        const int c = (int)(i - r * half);
        const float g = __bfloat162float(gate_up[r * 2 * half + c]);
        const float u = __bfloat162float(gate_up[r * 2 * half + half + c]);
        const float s = round_bf16(g / (1.f + __expf(-g)));
        out[i] = __float2bfloat16_rn(s * u);
    }
}

// silu_mul for a half that is a multiple of 8 (num_vectors = rows * half / 8 < 2^30): each thread
// takes 8 consecutive outputs of one row with 16-byte loads and stores and 32-bit index math (the
// kernel above divides a 64-bit index per element); the same arithmetic per element, so the same bits.
extern "C" __global__ void silu_mul_vec8(const bf16* __restrict__ gate_up, bf16* __restrict__ out,
                                         int num_vectors, int vectors_per_row) {
    const size_t half = (size_t)vectors_per_row * 8;
    for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < num_vectors; v += gridDim.x * blockDim.x) {
        const int r = v / vectors_per_row, c = (v - r * vectors_per_row) * 8;
        const bf16* row = gate_up + (size_t)r * 2 * half;
        float g[8], u[8], o[8];
        load8(row + c, g);
        load8(row + half + c, u);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = round_bf16(g[i] / (1.f + __expf(-g[i]))) * u[i];
        store8(out + (size_t)r * half + c, o);
    }
}

// bf16 -> fp32 (for copies to the host).
extern "C" __global__ void bf16_to_float(const bf16* __restrict__ x, float* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = __bfloat162float(x[i]);
}

// fp32 -> bf16, round to nearest even (weights uploaded as fp32 are narrowed on the GPU).
extern "C" __global__ void float_to_bf16(const float* __restrict__ x, bf16* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(x[i]);
}

// silu_mul_vec8 over a 2-D grid for many rows (prefill): blockIdx.x is the row, blockIdx.y a chunk of
// 2 * blockDim.x vectors of it; each thread issues its two 16-byte gate loads and two up loads before
// any math, and there is no grid-stride loop or index division. The same arithmetic per element as
// silu_mul, so the same bits.
extern "C" __global__ void silu_mul_rows(const bf16* __restrict__ gate_up, bf16* __restrict__ out,
                                         int vectors_per_row) {
    const size_t half = (size_t)vectors_per_row * 8;
    const bf16* row = gate_up + (size_t)blockIdx.x * 2 * half;
    bf16* out_row = out + (size_t)blockIdx.x * half;
    const int first = blockIdx.y * 2 * blockDim.x + threadIdx.x;
    float g[2][8], u[2][8];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int v = first + k * blockDim.x;
        if (v < vectors_per_row) {
            load8(row + 8 * v, g[k]);
            load8(row + half + 8 * v, u[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int v = first + k * blockDim.x;
        if (v < vectors_per_row) {
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = round_bf16(g[k][i] / (1.f + __expf(-g[k][i]))) * u[k][i];
            store8(out_row + 8 * v, o);
        }
    }
}
