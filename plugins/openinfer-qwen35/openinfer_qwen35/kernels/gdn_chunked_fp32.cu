// The chunked gated delta rule in fp32 on CUDA cores (OPENINFER_QWEN35_GDN_PREFILL=chunked_fp32, opt-in;
// issue #17): gdn_chunked.cu's chunk algorithm (chunks of 64, the UT transform, the state carried between
// chunks; see its header for the equations) with every intermediate and product in fp32 — no 16-bit
// tensor-core operand anywhere, so the layer's output O rounds to the same bf16 as the token-by-token
// kernels' (and HF's fp32 chunked rule's) nearly everywhere. The teacher-forced test's model turns any
// 16-bit operand rounding of the chain into a ~2x larger error against HF (tests/plugins/qwen35/
// gdn_teacher_forced_emulation.py); this path is the accuracy reference of the chunked form and what it
// costs without tensor cores.
//
// gdn_chunk_prepare_fp32: grid (chunks, value heads), 256 threads: q / k l2-normed (q x DK^-1/2) and V
// of the chunk in shared memory, the gates, c (fp64 sums), A and P, T = (I + A)^-1 by forward
// substitution (a column a thread), U = T diag(beta) V and W = T diag(beta exp(c)) K; writes qn / kn
// (the key head's first value head only), U, W, P, c.
// gdn_chunk_walk_fp32: grid (sequences, value heads, dv / 32), 256 threads: the state's 32 columns in
// shared memory (fp32), per chunk V' = U - W S, O = diag(exp(c)) Q S + P V' (to `core`, bf16) and
// S <- exp(c_C) S + K^T diag(exp(c_C - c)) V'; the final state back to the slot.
//
// Layouts (T tokens, N chunks): conv_out / proj as gdn_chunked.cu; qn, kn [T, nk, DK], w [T, nv, DK],
// u [T, nv, dv] fp32; p [N, nv, 64, 64] fp32; cum [T, nv] fp32; core [T, nv * dv] bf16.
#include "gdn_common.cuh"

#define FP32_CHUNK 64
#define FP32_THREADS 256
#define FP32_TILE 32  // value channels a walk block
#define FP32_LD (DK + 1)  // fp32 row padding of the [64][DK] tiles: conflict-free column walks
#define FP32_LDC (FP32_CHUNK + 1)

#ifndef GDN_DYNAMIC_SHARED
#define GDN_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

extern "C" __global__ void __launch_bounds__(FP32_THREADS)
gdn_chunk_prepare_fp32(const bf16* __restrict__ conv_out, const bf16* __restrict__ proj, int proj_stride,
                       const float* __restrict__ neg_decay_rate, const float* __restrict__ dt_bias,
                       const int* __restrict__ chunk_start, const int* __restrict__ chunk_len, float* __restrict__ qn,
                       float* __restrict__ kn, float* __restrict__ w_out, float* __restrict__ u_out,
                       float* __restrict__ p_out, float* __restrict__ cum_out, int num_key_heads, int num_value_heads,
                       int dv) {
    GDN_DYNAMIC_SHARED(smem);
    const int c = blockIdx.x, h = blockIdx.y, t0 = chunk_start[c], n = chunk_len[c];
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv, conv_dim = 2 * key_dim + value_dim;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, ldv = dv + 1;
    float* qs = reinterpret_cast<float*>(smem);  // [64][FP32_LD]
    float* ks = qs + FP32_CHUNK * FP32_LD;       // [64][FP32_LD]
    float* vs = ks + FP32_CHUNK * FP32_LD;       // [64][dv + 1]
    float* amat = vs + FP32_CHUNK * ldv;         // [64][65] A, strictly lower
    float* tinv = amat + FP32_CHUNK * FP32_LDC;  // [64][65] T, lower
    float* beta = tinv + FP32_CHUNK * FP32_LDC;  // [64]
    float* beta_decay = beta + FP32_CHUNK;       // [64] beta exp(c)
    double* cum = reinterpret_cast<double*>(beta_decay + FP32_CHUNK);  // [64] (8-byte aligned: even float count)

    // q, k rows: a warp per row, normed in fp32 (rows past the chunk: zeros)
    for (int r = warp; r < FP32_CHUNK; r += FP32_THREADS / 32) {
        for (int tensor = 0; tensor < 2; ++tensor) {
            float x[DK / 32];
            float sq = 0.f;
#pragma unroll
            for (int e = 0; e < DK / 32; ++e) {
                const int i = lane + 32 * e;
                x[e] = r < n ? to_f(conv_out[(size_t)(t0 + r) * conv_dim + tensor * key_dim + key_head * DK + i]) : 0.f;
                sq += x[e] * x[e];
            }
            sq = warp_sum(sq);
            const float scale = rsqrtf(sq + L2_NORM_EPS) * (tensor == 0 ? rsqrtf((float)DK) : 1.f);
            float* tile = tensor == 0 ? qs : ks;
            float* normed = tensor == 0 ? qn : kn;
#pragma unroll
            for (int e = 0; e < DK / 32; ++e) {
                const int i = lane + 32 * e;
                tile[r * FP32_LD + i] = x[e] * scale;
                if (r < n && h % ratio == 0) normed[((size_t)(t0 + r) * num_key_heads + key_head) * DK + i] = x[e] * scale;
            }
        }
    }
    for (int e = threadIdx.x; e < FP32_CHUNK * dv; e += FP32_THREADS) {
        const int r = e / dv, j = e % dv;
        vs[r * ldv + j] = r < n ? to_f(conv_out[(size_t)(t0 + r) * conv_dim + 2 * key_dim + h * dv + j]) : 0.f;
    }
    if (threadIdx.x == 0) {  // gates and the cumulative log-decay (fp64: c reaches -1000 for fast heads)
        double sum = 0.0;
        for (int r = 0; r < FP32_CHUNK; ++r) {
            float b = 0.f, lg = 0.f;
            if (r < n) {
                const bf16* row = proj + (size_t)(t0 + r) * proj_stride + conv_dim + value_dim + h;
                b = gdn_beta(to_f(row[0]));
                lg = gdn_log_decay(to_f(row[num_value_heads]), neg_decay_rate[h], dt_bias[h]);
            }
            sum += (double)lg;
            cum[r] = sum;
            beta[r] = b;
            beta_decay[r] = b * expf((float)sum);
            if (r < n) cum_out[(size_t)(t0 + r) * num_value_heads + h] = (float)sum;
        }
    }
    __syncthreads();

    // A[i][j] = beta_i (k_i . k_j) exp(c_i - c_j) (j < i), P[i][j] = (q_i . k_j) exp(c_i - c_j) (j <= i): a
    // thread: column j = tid % 64, rows tid / 64 + 4 r (k_j loaded once for them; sums over m in order)
    float* p = p_out + ((size_t)c * num_value_heads + h) * FP32_CHUNK * FP32_CHUNK;
    {
        constexpr int GROUPS = FP32_THREADS / FP32_CHUNK, ROWS = FP32_CHUNK / GROUPS;
        const int j = threadIdx.x % FP32_CHUNK, i0 = threadIdx.x / FP32_CHUNK;
        float kk[ROWS] = {}, qk[ROWS] = {};
        for (int m = 0; m < DK; ++m) {
            const float kj = ks[j * FP32_LD + m];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const int i = i0 + GROUPS * r;
                if (j <= i) {
                    kk[r] += ks[i * FP32_LD + m] * kj;
                    qk[r] += qs[i * FP32_LD + m] * kj;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int i = i0 + GROUPS * r;
            float a = 0.f, pv = 0.f;
            if (j <= i) {
                const float d = expf((float)(cum[i] - cum[j]));
                pv = qk[r] * d;
                if (j < i) a = beta[i] * kk[r] * d;
            }
            amat[i * FP32_LDC + j] = a;
            p[i * FP32_CHUNK + j] = pv;
        }
    }
    __syncthreads();
    // T = (I + A)^-1: column j by thread j in registers, t[i] = -sum_{m < i} A[i][m] t[m] (t[m] = 0 above the
    // diagonal, so the sum's terms before m = j add zeros; A's loads are broadcasts, independent of t)
    if (threadIdx.x < FP32_CHUNK) {
        const int j = threadIdx.x;
        float t[FP32_CHUNK];
#pragma unroll
        for (int i = 0; i < FP32_CHUNK; ++i) {
            float acc = 0.f;
#pragma unroll
            for (int m = 0; m < i; ++m) acc -= amat[i * FP32_LDC + m] * t[m];
            t[i] = i > j ? acc : (i == j ? 1.f : 0.f);
        }
#pragma unroll
        for (int i = 0; i < FP32_CHUNK; ++i) tinv[i * FP32_LDC + j] = t[i];
    }
    __syncthreads();
    // U = T diag(beta) V, W = T diag(beta exp(c)) K (rows < n): a thread: column tid % width, rows
    // tid / width + (256 / width) r (V's / K's element loaded once for them; sums over m in order)
    auto product = [&](const float* scale, const float* rows, int ld, int width, float* dst, size_t dst_stride) {
        const int groups = FP32_THREADS / width, j = threadIdx.x % width, i0 = threadIdx.x / width;
        const int count = FP32_CHUNK / groups;  // <= DK / 4 (width <= DK)
        float acc[DK / 4] = {};
        for (int m = 0; m < FP32_CHUNK; ++m) {
            const float sm = scale[m], x = rows[m * ld + j];
#pragma unroll
            for (int r = 0; r < DK / 4; ++r) {
                const int i = i0 + groups * r;
                if (r < count && m <= i) acc[r] += tinv[i * FP32_LDC + m] * sm * x;
            }
        }
#pragma unroll
        for (int r = 0; r < DK / 4; ++r) {
            const int i = i0 + groups * r;
            if (r < count && i < n) dst[(size_t)(t0 + i) * dst_stride + j] = acc[r];
        }
    };
    product(beta, vs, ldv, dv, u_out + (size_t)h * dv, (size_t)num_value_heads * dv);
    product(beta_decay, ks, FP32_LD, DK, w_out + (size_t)h * DK, (size_t)num_value_heads * DK);
}

extern "C" __global__ void __launch_bounds__(FP32_THREADS)
gdn_chunk_walk_fp32(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ w_in,
                    const float* __restrict__ u_in, const float* __restrict__ p_in, const float* __restrict__ cum_in,
                    const int* __restrict__ chunk_start, const int* __restrict__ chunk_len,
                    const int* __restrict__ seq_chunks, const int* __restrict__ slots, const int* __restrict__ fresh,
                    float* __restrict__ ssm_state, bf16* __restrict__ core, int num_key_heads, int num_value_heads,
                    int dv) {
    GDN_DYNAMIC_SHARED(smem);
    const int s = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * FP32_TILE;
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio, value_dim = num_value_heads * dv;
    float* qs = reinterpret_cast<float*>(smem);         // [64][FP32_LD]
    float* ks = qs + FP32_CHUNK * FP32_LD;              // [64][FP32_LD]
    float* ws = ks + FP32_CHUNK * FP32_LD;              // [64][FP32_LD]
    float* ps = ws + FP32_CHUNK * FP32_LD;              // [64][65]
    float* us = ps + FP32_CHUNK * FP32_LDC;             // [64][33] U, then V'
    float* st = us + FP32_CHUNK * (FP32_TILE + 1);      // [DK][33] S[:, j0 .. j0 + 31]
    float* cum = st + DK * (FP32_TILE + 1);             // [64]
    float* row_decay = cum + FP32_CHUNK;                // [64] exp(c)
    float* tail_decay = row_decay + FP32_CHUNK;         // [64] exp(c_C - c)
    constexpr int LDT = FP32_TILE + 1;

    float* state = ssm_state + ((size_t)slots[s] * num_value_heads + h) * DK * dv;
    const bool is_fresh = fresh[s] != 0;
    for (int e = threadIdx.x; e < DK * FP32_TILE; e += FP32_THREADS) {
        const int m = e / FP32_TILE, j = e % FP32_TILE;
        st[m * LDT + j] = is_fresh ? 0.f : state[(size_t)m * dv + j0 + j];
    }
    for (int c = seq_chunks[s]; c < seq_chunks[s + 1]; ++c) {
        const int t0 = chunk_start[c], n = chunk_len[c];
        __syncthreads();  // the last chunk's readers are done
        for (int e = threadIdx.x; e < FP32_CHUNK * DK; e += FP32_THREADS) {
            const int r = e / DK, i = e % DK;
            const bool in = r < n;
            qs[r * FP32_LD + i] = in ? qn[((size_t)(t0 + r) * num_key_heads + key_head) * DK + i] : 0.f;
            ks[r * FP32_LD + i] = in ? kn[((size_t)(t0 + r) * num_key_heads + key_head) * DK + i] : 0.f;
            ws[r * FP32_LD + i] = in ? w_in[((size_t)(t0 + r) * num_value_heads + h) * DK + i] : 0.f;
        }
        const float* p = p_in + ((size_t)c * num_value_heads + h) * FP32_CHUNK * FP32_CHUNK;
        for (int e = threadIdx.x; e < FP32_CHUNK * FP32_CHUNK; e += FP32_THREADS)
            ps[(e / FP32_CHUNK) * FP32_LDC + e % FP32_CHUNK] = p[e];
        for (int e = threadIdx.x; e < FP32_CHUNK * FP32_TILE; e += FP32_THREADS) {
            const int r = e / FP32_TILE, j = e % FP32_TILE;
            us[r * LDT + j] = r < n ? u_in[((size_t)(t0 + r) * num_value_heads + h) * dv + j0 + j] : 0.f;
        }
        if (threadIdx.x < FP32_CHUNK) {
            const int r = threadIdx.x < n ? threadIdx.x : n - 1;
            cum[threadIdx.x] = cum_in[(size_t)(t0 + r) * num_value_heads + h];
        }
        __syncthreads();
        if (threadIdx.x < FP32_CHUNK) {  // (read after the next barrier)
            row_decay[threadIdx.x] = expf(cum[threadIdx.x]);
            tail_decay[threadIdx.x] = expf(cum[FP32_CHUNK - 1] - cum[threadIdx.x]);
        }
        // V' = U - W S (in place of U; rows past the chunk stay 0). A thread: channel `lane`, rows warp + 8 k
        // (each S element loaded once for its 8 rows; sums over m in order)
        constexpr int ROWS = FP32_CHUNK / (FP32_THREADS / 32);
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        {
            float acc[ROWS] = {};
            for (int m = 0; m < DK; ++m) {
                const float sv = st[m * LDT + lane];
#pragma unroll
                for (int k = 0; k < ROWS; ++k) acc[k] += ws[(warp + 8 * k) * FP32_LD + m] * sv;
            }
#pragma unroll
            for (int k = 0; k < ROWS; ++k)
                if (warp + 8 * k < n) us[(warp + 8 * k) * LDT + lane] -= acc[k];
        }
        __syncthreads();
        // O = diag(exp(c)) Q S + P V'
        {
            float inter[ROWS] = {}, intra[ROWS] = {};
            for (int m = 0; m < DK; ++m) {
                const float sv = st[m * LDT + lane];
#pragma unroll
                for (int k = 0; k < ROWS; ++k) inter[k] += qs[(warp + 8 * k) * FP32_LD + m] * sv;
            }
            for (int l = 0; l < n; ++l) {
                const float v = us[l * LDT + lane];
#pragma unroll
                for (int k = 0; k < ROWS; ++k)
                    if (l <= warp + 8 * k) intra[k] += ps[(warp + 8 * k) * FP32_LDC + l] * v;
            }
#pragma unroll
            for (int k = 0; k < ROWS; ++k) {
                const int r = warp + 8 * k;
                if (r < n)
                    core[(size_t)(t0 + r) * value_dim + (size_t)h * dv + j0 + lane] =
                        __float2bfloat16_rn(row_decay[r] * inter[k] + intra[k]);
            }
        }
        __syncthreads();  // S is read above before it is updated below
        // S <- exp(c_C) S + K^T diag(exp(c_C - c)) V': a thread: channel `lane`, state rows warp + 8 k
        {
            constexpr int STATE_ROWS = DK / (FP32_THREADS / 32);
            const float chunk_decay = expf(cum[FP32_CHUNK - 1]);
            float acc[STATE_ROWS] = {};
            for (int r = 0; r < n; ++r) {
                const float td = tail_decay[r], v = us[r * LDT + lane];
#pragma unroll
                for (int k = 0; k < STATE_ROWS; ++k) acc[k] += ks[r * FP32_LD + warp + 8 * k] * td * v;
            }
#pragma unroll
            for (int k = 0; k < STATE_ROWS; ++k) {
                float* at = st + (warp + 8 * k) * LDT + lane;
                *at = chunk_decay * *at + acc[k];
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < DK * FP32_TILE; e += FP32_THREADS) {
        const int m = e / FP32_TILE, j = e % FP32_TILE;
        state[(size_t)m * dv + j0 + j] = st[m * LDT + j];
    }
}
