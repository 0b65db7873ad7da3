// The chunked gated delta rule on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate):
// the prefill path of a Gated DeltaNet layer, after gdn_conv1d / gdn_conv_state and before
// gdn_gated_norm (gated_deltanet.cu). Chunks of C = 64 tokens of one sequence; per chunk and
// value head, with the in-chunk cumulative log-decay c_t (c_t = g_1 + ... + g_t) and the state
// S [DK, dv] entering the chunk (the WY / UT-transform form, as gated_deltanet.py's NumPy
// reference):
//
//   A = strict_lower(diag(beta) K K^T * D),  D[i, j] = exp(c_i - c_j)
//   T = (I + A)^-1                       (unit lower triangular: forward substitution)
//   U = T diag(beta) V,  W = T diag(beta exp(c)) K
//   V' = U - W S                          (the chunk's corrected values)
//   O  = diag(exp(c)) Q S + P V',          P = lower(Q K^T * D)   (diagonal included)
//   S <- exp(c_C) S + K^T diag(exp(c_C - c)) V'
//
// gdn_chunk_prepare (grid: chunks x value heads, all independent; gdn_chunk_prepare_staged the
// same faster) computes the l2-normalised q and k, c, P, U and W of every chunk; gdn_chunk_scan
// (grid: sequences x value heads x dv/32) walks a sequence's chunks in order for 32 value channels
// (the delta rule is independent per value channel), keeping S in shared memory (fp32; a bf16 copy
// feeds the mma) — or, split (the default path, see below), gdn_chunk_states walks the chunks for
// S and V' only and gdn_chunk_output computes every chunk's O at once.
// The last chunk of a sequence may be short: its missing rows are zeros (g = 0, beta = 0).
//
// Layouts (T tokens of the step, N chunks; the step's chunks listed by the host):
//   conv_out [T, conv_dim] bf16 (q | k | v), proj as gated_deltanet.cu (b, a columns)
//   chunk_start [N] first token row, chunk_len [N] (1..64), seq_chunks [B+1] chunks of each sequence
//   qn, kn [T, nk, DK] bf16   q l2-normalised and scaled by DK^-1/2, k l2-normalised
//   w [T, nv, DK], u [T, nv, dv] bf16;  p [N, nv, 64, 64] bf16;  cum [T, nv] fp32 (c_t)
//   core [T, nv * dv] bf16 (the delta-rule output O, for gdn_gated_norm)
#include "gdn_common.cuh"
#include "mma.cuh"

#define CHUNK 64
#define SCAN_TILE 32  // value channels per gdn_chunk_scan block
#define PAD 8         // bf16 row padding of shared tiles: conflict-free fragment loads

static_assert(DK % 64 == 0, "the chunked kernels take key head dims that are multiples of 64");

#ifndef GDN_DYNAMIC_SHARED
#define GDN_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// mma_bf16_16816 and pack_bf16x2 come from core's mma.cuh.

// The operand format of the intermediates between the kernels and of every mma in this module (q / k
// normed, W, U, P, S^T, V' and the solve's splits): bf16, or with GDN_F16_OPERANDS (the launcher's
// OPENINFER_QWEN35_GDN_PREFILL=grouped_f16) IEEE fp16 — the same 16 bits and tensor-core rate with 10
// mantissa bits instead of 7: 8x less error in the layer's output, yet the teacher-forced test vs HF
// moves only from 0.0173 to 0.0138 (the token-by-token kernels: 0.0074; issue #17): that test's model
// turns any bf16 flip of O into bf16-level noise downstream, so only ~fp32 products (exact q / k
// scores from the raw bf16 rows, ~24-bit splits elsewhere: tests/plugins/qwen35/gdn_operand_model.py)
// reach the token-by-token level. Every such operand is bounded (l2-normed q / k, decays <= 1, beta <= 1, the state and
// values the size of the layer's v), far inside fp16's 65504. The layer's input (conv_out) and output
// (core) stay bf16: the prepare converts V as it loads it, the output kernels store O as bf16.
#if defined(GDN_F16_OPERANDS) && defined(MMA_HOST_STANDIN)
// the host emulation (tests/helpers/cuda_host): fp16 as the compiler's _Float16 (round to nearest
// even), and the fp16 mma as four bf16 stand-in mmas over exact hi / lo bf16 splits of each operand
// (fp16's 11 significant bits = bf16's 8 + a remainder of at most 3): every product exact, fp32 sums
__device__ __forceinline__ float f16_bits_to_f(unsigned short bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
}
__device__ __forceinline__ unsigned short f_to_f16_bits(float x) {
    const _Float16 h = static_cast<_Float16>(x);
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
__device__ __forceinline__ unsigned pack_op2(float lo, float hi) {
    return static_cast<unsigned>(f_to_f16_bits(lo)) | (static_cast<unsigned>(f_to_f16_bits(hi)) << 16);
}
__device__ __forceinline__ float op_to_f(bf16 x) { return f16_bits_to_f(x.bits); }
__device__ __forceinline__ bf16 op_from_f(float x) { return bf16{f_to_f16_bits(x)}; }
__device__ __forceinline__ float round_op(float x) { return static_cast<float>(static_cast<_Float16>(x)); }
__device__ __forceinline__ void split_f16x2_to_bf16(unsigned packed, unsigned& hi, unsigned& lo) {
    const float x0 = f16_bits_to_f(packed & 0xFFFFu), x1 = f16_bits_to_f(packed >> 16);
    const float h0 = round_bf16(x0), h1 = round_bf16(x1);
    hi = pack_bf16x2(h0, h1);
    lo = pack_bf16x2(x0 - h0, x1 - h1);
}
__device__ __forceinline__ void mma_op_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    unsigned a_hi[4], a_lo[4], b_hi[2], b_lo[2];
    for (int e = 0; e < 4; ++e) split_f16x2_to_bf16(a[e], a_hi[e], a_lo[e]);
    split_f16x2_to_bf16(b0, b_hi[0], b_lo[0]);
    split_f16x2_to_bf16(b1, b_hi[1], b_lo[1]);
    mma_bf16_16816(d, a_hi, b_hi[0], b_hi[1]);
    mma_bf16_16816(d, a_hi, b_lo[0], b_lo[1]);
    mma_bf16_16816(d, a_lo, b_hi[0], b_hi[1]);
    mma_bf16_16816(d, a_lo, b_lo[0], b_lo[1]);
}
__device__ __forceinline__ uint4 op_from_bf16x8(uint4 raw) {
    const bf16* x = reinterpret_cast<const bf16*>(&raw);
    uint4 out;
    unsigned* o = reinterpret_cast<unsigned*>(&out);
    for (int m = 0; m < 4; ++m) o[m] = pack_op2(to_f(x[2 * m]), to_f(x[2 * m + 1]));
    return out;
}
#elif defined(GDN_F16_OPERANDS)
#include <cuda_fp16.h>
__device__ __forceinline__ unsigned pack_op2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}
__device__ __forceinline__ float op_to_f(bf16 bits) { return __half2float(*reinterpret_cast<const __half*>(&bits)); }
__device__ __forceinline__ bf16 op_from_f(float x) {
    const __half h = __float2half_rn(x);
    return *reinterpret_cast<const bf16*>(&h);
}
__device__ __forceinline__ float round_op(float x) { return __half2float(__float2half_rn(x)); }
// D = A·B + D for one m16n8k16 fp16 tile (fp32 accumulate), mma_bf16_16816's fragment layout
__device__ __forceinline__ void mma_op_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 8 bf16 values (conv_out's 16 bytes) as 8 operands
__device__ __forceinline__ uint4 op_from_bf16x8(uint4 raw) {
    const bf16* x = reinterpret_cast<const bf16*>(&raw);
    uint4 out;
    unsigned* o = reinterpret_cast<unsigned*>(&out);
#pragma unroll
    for (int m = 0; m < 4; ++m) o[m] = pack_op2(to_f(x[2 * m]), to_f(x[2 * m + 1]));
    return out;
}
#else
__device__ __forceinline__ unsigned pack_op2(float lo, float hi) { return pack_bf16x2(lo, hi); }
__device__ __forceinline__ float op_to_f(bf16 x) { return to_f(x); }
__device__ __forceinline__ bf16 op_from_f(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float round_op(float x) { return round_bf16(x); }
// GDN_MMA_REPEAT (benchmarks/gpu_qwen35.py's timing-only grouped_staged_mma_x3: wrong outputs) issues every
// mma that many times: what the tensor-core part of issue #17's fix (~3 mmas a product) costs at least
__device__ __forceinline__ void mma_op_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
#ifdef GDN_MMA_REPEAT
#pragma unroll
    for (int repeat = 0; repeat < GDN_MMA_REPEAT; ++repeat)
#endif
        mma_bf16_16816(d, a, b0, b1);
}
__device__ __forceinline__ uint4 op_from_bf16x8(uint4 raw) { return raw; }
#endif

// Fragment loads from shared memory (lane = 4 g + q). A tile 16x16 of a row-major matrix at
// `base` (leading dim ld): rows g and g+8, columns 2q, 2q+1 and 2q+8, 2q+9.
__device__ __forceinline__ void load_a(unsigned* a, const bf16* base, int ld) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    a[0] = *reinterpret_cast<const unsigned*>(base + g * ld + 2 * q);
    a[1] = *reinterpret_cast<const unsigned*>(base + (g + 8) * ld + 2 * q);
    a[2] = *reinterpret_cast<const unsigned*>(base + g * ld + 2 * q + 8);
    a[3] = *reinterpret_cast<const unsigned*>(base + (g + 8) * ld + 2 * q + 8);
}

// B tile 16(k) x 8(n) from its transpose stored row-major, bt[n][k] at `base`: column g, rows
// 2q, 2q+1 (b0) and 2q+8, 2q+9 (b1).
__device__ __forceinline__ void load_b(unsigned* b, const bf16* base, int ld) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    b[0] = *reinterpret_cast<const unsigned*>(base + g * ld + 2 * q);
    b[1] = *reinterpret_cast<const unsigned*>(base + g * ld + 2 * q + 8);
}

// A tile 16(m) x 16(k) of A = X^T, X row-major at `base` (X[k][m] at base + k ld + m): the pairs
// a fragment register holds are X[2q][m], X[2q+1][m] — two 16-bit loads each, so K is used as
// the left operand of K^T V' without a transposed copy.
__device__ __forceinline__ void load_a_transposed(unsigned* a, const bf16* base, int ld) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const unsigned short* x = reinterpret_cast<const unsigned short*>(base);
    auto pair = [&](int k, int m) { return (unsigned)x[k * ld + m] | ((unsigned)x[(k + 1) * ld + m] << 16); };
    a[0] = pair(2 * q, g);
    a[1] = pair(2 * q, g + 8);
    a[2] = pair(2 * q + 8, g);
    a[3] = pair(2 * q + 8, g + 8);
}

// One warp's 16-row strip of NA products that share their right operand B [KDIM][8 NT]:
//   acc[x][nt] += A_x[16][KDIM] · B[:, 8 nt .. 8 nt + 7]   for x < NA
// with A_x's fragments for columns k0 .. k0+15 from a_fragment(x, k0, regs) and B from its
// transpose bt [8 NT][ldb] in shared memory (load_b), each B fragment loaded once for all NA
// products. Every product accumulates in the same k order, whatever NA is.
template <int KDIM, int NT, int NA, class AFragment>
__device__ __forceinline__ void warp_strip_mma(float (*acc)[NT][4], AFragment a_fragment, const bf16* bt, int ldb) {
#pragma unroll
    for (int k0 = 0; k0 < KDIM; k0 += 16) {
        unsigned a[NA][4];
#pragma unroll
        for (int x = 0; x < NA; ++x) a_fragment(x, k0, a[x]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            unsigned b[2];
            load_b(b, bt + nt * 8 * ldb + k0, ldb);
#pragma unroll
            for (int x = 0; x < NA; ++x) mma_op_16816(acc[x][nt], a[x], b[0], b[1]);
        }
    }
}

__device__ __forceinline__ void store_pair(bf16* at, float lo, float hi) {  // an intermediate: operand format
    *reinterpret_cast<unsigned*>(at) = pack_op2(lo, hi);
}
__device__ __forceinline__ void store_pair_bf16(bf16* at, float lo, float hi) {  // the layer's output O
    *reinterpret_cast<unsigned*>(at) = pack_bf16x2(lo, hi);
}

__device__ __forceinline__ size_t round_up_128(size_t bytes) { return (bytes + 127) & ~(size_t)127; }

// Shared memory of gdn_chunk_prepare: row-padded tiles (see gdn_chunk_prepare_smem_bytes).
#define LDK (DK + PAD)
#define LDC (CHUNK + PAD)
#define LDF (CHUNK + 4)  // fp32 64x64 matrices

// ---------------------------------------------------------------------------------------------
// gdn_chunk_prepare: grid (N, nv), 128 threads (4 warps; warp w owns rows 16w..16w+15).
// Dynamic shared memory: gdn_chunk_prepare_smem(dv) bytes (the launcher computes the same sum).
//
// STAGED (gdn_chunk_prepare_staged, OPENINFER_QWEN35_GDN_PREFILL=staged): the same arithmetic
// with every global read of the block issued at its start — the raw q and k rows by 16-byte
// loads straight into their shared tiles (normalised there in place), the chunk's v rows by
// 16-byte loads into registers (held until (beta V)^T is written) — where the plain kernel
// loads q / k a row per warp at a time (16 dependent round trips a warp) and V element by
// element after the triangular solve; the triangular solve's loads batched 16 at a time ahead of
// its adds, the cumulative decay summed from registers. The same bits.
#define PREPARE_PARAMS                                                                                       \
    const bf16 *__restrict__ conv_out, const bf16 *__restrict__ proj, int proj_stride,                        \
        const float *__restrict__ neg_decay_rate, const float *__restrict__ dt_bias,                          \
        const int *__restrict__ chunk_start, const int *__restrict__ chunk_len, bf16 *__restrict__ qn,        \
        bf16 *__restrict__ kn, bf16 *__restrict__ w_out, bf16 *__restrict__ u_out, bf16 *__restrict__ p_out,  \
        float *__restrict__ cum_out, int num_key_heads, int num_value_heads, int dv
#define PREPARE_ARGS                                                                                         \
    conv_out, proj, proj_stride, neg_decay_rate, dt_bias, chunk_start, chunk_len, qn, kn, w_out, u_out, p_out, \
        cum_out, num_key_heads, num_value_heads, dv
#define PREPARE_MAX_DV DK  // the staged kernel's v registers: dv <= DK (the launcher checks)
// T = (I + A)^-1 for the strictly lower 64 x 64 A (fp32, leading dim LDF) in 16 x 16 blocks, all
// 128 threads busy, the longest serial chain ~120 multiply-adds (the column-per-thread
// substitution's is ~2,000, on 64 threads):
//   (a) each diagonal block's inverse T_bb by forward substitution, a thread per (block, column);
//   (b) block row by block row, i = 1..3, every j < i at once:
//         M_ij = sum_{j<=k<i} A_ik T_kj            (kept in A's unused upper triangle, block (j, i))
//         T_ij = -T_ii M_ij
// The same T in another order of fp32 adds. Writes every element of T (zeros above the diagonal).
__device__ __forceinline__ void solve_blocked(float* amat, float* tinv) {
    constexpr int B = 16, NB = CHUNK / B;
    if (threadIdx.x < CHUNK) {
        const int base = (threadIdx.x / B) * B, j = threadIdx.x;
        for (int i = 0; i <= j; ++i) tinv[i * LDF + j] = i == j ? 1.f : 0.f;
        for (int i = j + 1; i < base + B; ++i) {
            float acc = -amat[i * LDF + j];
            for (int m = j + 1; m < i; ++m) acc -= amat[i * LDF + m] * tinv[m * LDF + j];
            tinv[i * LDF + j] = acc;
        }
    }
    __syncthreads();
#pragma unroll 1
    for (int ib = 1; ib < NB; ++ib) {
        for (int e = threadIdx.x; e < ib * B * B; e += blockDim.x) {
            const int jb = e / (B * B), r = (e / B) % B, c = e % B;
            const float* a_row = amat + (ib * B + r) * LDF;
            float acc = 0.f;
            for (int m = jb * B; m < ib * B; ++m) acc += a_row[m] * tinv[m * LDF + jb * B + c];
            amat[(jb * B + r) * LDF + ib * B + c] = acc;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < ib * B * B; e += blockDim.x) {
            const int jb = e / (B * B), r = (e / B) % B, c = e % B;
            const float* t_row = tinv + (ib * B + r) * LDF + ib * B;  // T_ii's row r: unit diagonal
            float acc = amat[(jb * B + r) * LDF + ib * B + c];
            for (int m = 0; m < r; ++m) acc += t_row[m] * amat[(jb * B + m) * LDF + ib * B + c];
            tinv[(ib * B + r) * LDF + jb * B + c] = -acc;
        }
        __syncthreads();
    }
}

// GDN_PHASE_CLOCKS (a diagnostic build of benchmarks/gpu_qwen35.py --gdn-prefill-only, never the
// plugin's): thread 0 of every prepare block adds each phase's SM clock cycles to
// gdn_phase_cycles[phase] (phases 1..7 as marked below; [0] counts blocks) — where a block's time goes.
#ifdef GDN_PHASE_CLOCKS
extern "C" {
__device__ unsigned long long gdn_phase_cycles[8];
}
#define GDN_PHASES_BEGIN() long long phase_clock = clock64()
#define GDN_PHASE(k)                                                                    \
    do {                                                                                \
        if (threadIdx.x == 0) {                                                         \
            const long long now = clock64();                                            \
            atomicAdd(gdn_phase_cycles + (k), (unsigned long long)(now - phase_clock)); \
            phase_clock = now;                                                          \
        }                                                                               \
    } while (0)
#define GDN_PHASES_DONE() \
    if (threadIdx.x == 0) atomicAdd(gdn_phase_cycles, 1ull)
#else
#define GDN_PHASES_BEGIN()
#define GDN_PHASE(k)
#define GDN_PHASES_DONE()
#endif

template <bool STAGED, bool BLOCKED_SOLVE = false>
__device__ __forceinline__ void chunk_prepare(unsigned char* smem, PREPARE_PARAMS) {
    const int c = blockIdx.x, h = blockIdx.y;
    const int t0 = chunk_start[c], n = chunk_len[c];
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv;
    const int conv_dim = 2 * key_dim + value_dim;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
    GDN_PHASES_BEGIN();

    // carve: [Qs | V^T] , Ks, (beta exp(c) K)^T, A (fp32), T (fp32), Tb, cum, beta
    unsigned char* at = smem;
    const size_t region0 = round_up_128((size_t)CHUNK * LDK * 2) > round_up_128((size_t)dv * LDC * 2)
                               ? round_up_128((size_t)CHUNK * LDK * 2) : round_up_128((size_t)dv * LDC * 2);
    bf16* qs = reinterpret_cast<bf16*>(at);   // [64][LDK], later vt [dv][LDC] = (beta V)^T
    bf16* vt = qs;
    at += region0;
    bf16* ks = reinterpret_cast<bf16*>(at);   // [64][LDK]
    at += round_up_128((size_t)CHUNK * LDK * 2);
    bf16 *kt, *tb;
    float *amat, *tinv;
    if (STAGED) {
        // A and T, then over them once the solve is done (A dead; T once copied to bf16): Tb, then
        // (beta exp(c) K)^T — 72 instead of 99 KiB at DK 128: 3 blocks per SM instead of 2
        const size_t tri = round_up_128((size_t)CHUNK * LDF * 4), tb_bytes = round_up_128((size_t)CHUNK * LDC * 2);
        const size_t kt_bytes = round_up_128((size_t)DK * LDC * 2);
        amat = reinterpret_cast<float*>(at);  // [64][LDF]
        tinv = reinterpret_cast<float*>(at + tri);  // [64][LDF]
        tb = reinterpret_cast<bf16*>(at);  // [64][LDC], written after the solve
        kt = reinterpret_cast<bf16*>(at + tb_bytes);  // [DK][LDC], written after T's copy
        at += 2 * tri > tb_bytes + kt_bytes ? 2 * tri : tb_bytes + kt_bytes;
    } else {
        kt = reinterpret_cast<bf16*>(at);   // [DK][LDC] = (beta exp(c) K)^T
        at += round_up_128((size_t)DK * LDC * 2);
        amat = reinterpret_cast<float*>(at);  // [64][LDF]
        at += round_up_128((size_t)CHUNK * LDF * 4);
        tinv = reinterpret_cast<float*>(at);  // [64][LDF]
        at += round_up_128((size_t)CHUNK * LDF * 4);
        tb = reinterpret_cast<bf16*>(at);  // [64][LDC]
        at += round_up_128((size_t)CHUNK * LDC * 2);
    }
    double* cum = reinterpret_cast<double*>(at);  // [64]
    at += round_up_128(CHUNK * 8);
    float* beta = reinterpret_cast<float*>(at);  // [64]
    at += round_up_128(CHUNK * 4);
    float* gate = reinterpret_cast<float*>(at);  // [64]

    // staged: the chunk's raw q / k rows into qs / ks and its v rows into registers, all in flight at once
    constexpr int ROW_VECS = DK / 8, QK_LOADS = CHUNK * ROW_VECS / 128;
    constexpr int V_LOADS = CHUNK * (PREPARE_MAX_DV / 8) / 128;
    uint4 v_rows[STAGED ? V_LOADS : 1];
    if (STAGED) {
#pragma unroll
        for (int it = 0; it < QK_LOADS; ++it) {
            const int e = threadIdx.x + it * 128, r = e / ROW_VECS, i = (e % ROW_VECS) * 8;
            const bf16* src = conv_out + (size_t)(t0 + r) * conv_dim;
            uint4 qv = make_uint4(0, 0, 0, 0), kv = qv;
            if (r < n) {
                qv = *reinterpret_cast<const uint4*>(src + key_head * DK + i);
                kv = *reinterpret_cast<const uint4*>(src + key_dim + key_head * DK + i);
            }
            *reinterpret_cast<uint4*>(qs + r * LDK + i) = qv;
            *reinterpret_cast<uint4*>(ks + r * LDK + i) = kv;
        }
        // lane = row: a warp holds 32 consecutive rows of one 8-column group, so its transposed
        // stores into (beta V)^T below hit consecutive bf16 (row-major lanes: 16-way bank conflicts)
        const int v_vecs = dv / 8;
#pragma unroll
        for (int it = 0; it < V_LOADS; ++it) {
            const int e = threadIdx.x + it * 128, r = e % CHUNK, jv = (e / CHUNK) * 8;
            v_rows[it] = make_uint4(0, 0, 0, 0);
            if (e < CHUNK * v_vecs && r < n)
                v_rows[it] = *reinterpret_cast<const uint4*>(conv_out + (size_t)(t0 + r) * conv_dim + 2 * key_dim +
                                                             h * dv + jv);
        }
        __syncthreads();
        GDN_PHASE(1);  // the chunk's q / k / v staged
    }

    // 1. q, k rows: l2 norm (q also x DK^-1/2), bf16; zeros past the chunk's end. Warp w takes rows
    //    w, w + 4, ...; staged: 4 of them at a time (their warp sums interleave), the same math a row
    const float q_scale = rsqrtf((float)DK);
    constexpr int ROWS_AT_ONCE = STAGED ? 4 : 1;
    for (int r0 = warp; r0 < CHUNK; r0 += 4 * ROWS_AT_ONCE) {
        float qv[ROWS_AT_ONCE][DK / 32], kv[ROWS_AT_ONCE][DK / 32], qf[ROWS_AT_ONCE], kf[ROWS_AT_ONCE];
#pragma unroll
        for (int rr = 0; rr < ROWS_AT_ONCE; ++rr) {
            const int r = r0 + 4 * rr;
            const bf16* src = conv_out + (size_t)(t0 + r) * conv_dim;
            float q_sq = 0.f, k_sq = 0.f;
#pragma unroll
            for (int e = 0; e < DK / 32; ++e) {
                const int i = lane + 32 * e;
                if (STAGED) {  // zeros past the end were staged too
                    qv[rr][e] = to_f(qs[r * LDK + i]);
                    kv[rr][e] = to_f(ks[r * LDK + i]);
                } else {
                    qv[rr][e] = r < n ? to_f(src[key_head * DK + i]) : 0.f;
                    kv[rr][e] = r < n ? to_f(src[key_dim + key_head * DK + i]) : 0.f;
                }
                q_sq += qv[rr][e] * qv[rr][e];
                k_sq += kv[rr][e] * kv[rr][e];
            }
            qf[rr] = q_sq;
            kf[rr] = k_sq;
        }
#pragma unroll
        for (int rr = 0; rr < ROWS_AT_ONCE; ++rr) {
            qf[rr] = rsqrtf(warp_sum(qf[rr]) + L2_NORM_EPS) * q_scale;
            kf[rr] = rsqrtf(warp_sum(kf[rr]) + L2_NORM_EPS);
        }
#pragma unroll
        for (int rr = 0; rr < ROWS_AT_ONCE; ++rr) {
            const int r = r0 + 4 * rr;
#pragma unroll
            for (int e = 0; e < DK / 32; ++e) {
                const int i = lane + 32 * e;
                const bf16 qb = __float2bfloat16_rn(qv[rr][e] * qf[rr]), kb = __float2bfloat16_rn(kv[rr][e] * kf[rr]);
                qs[r * LDK + i] = qb;
                ks[r * LDK + i] = kb;
                if (r < n && h % ratio == 0) {  // one value head of the group writes its key head's rows
                    qn[((size_t)(t0 + r) * num_key_heads + key_head) * DK + i] = qb;
                    kn[((size_t)(t0 + r) * num_key_heads + key_head) * DK + i] = kb;
                }
            }
        }
    }
    if (threadIdx.x < CHUNK) {
        const int r = threadIdx.x;
        float b = 0.f, lg = 0.f;
        if (r < n) {
            const bf16* row = proj + (size_t)(t0 + r) * proj_stride;
            b = gdn_beta(to_f(row[conv_dim + value_dim + h]));
            lg = gdn_log_decay(to_f(row[conv_dim + value_dim + num_value_heads + h]), neg_decay_rate[h], dt_bias[h]);
        }
        beta[r] = b;
        gate[r] = lg;
    }
    __syncthreads();
    GDN_PHASE(2);  // q / k normed, gates
    // c_t reaches -1000 within a chunk for fast-forgetting heads: sum in fp64 so that the
    // differences c_i - c_j keep their precision
    if (threadIdx.x == 0) {
        if (STAGED) {  // the gates into registers first: no shared-memory round trip per add
            float g[CHUNK];
#pragma unroll
            for (int r = 0; r < CHUNK; ++r) g[r] = gate[r];
            double acc = 0.0;
#pragma unroll
            for (int r = 0; r < CHUNK; ++r) {
                acc += (double)g[r];
                cum[r] = acc;
                if (r < n) cum_out[(size_t)(t0 + r) * num_value_heads + h] = (float)acc;
            }
        } else {
            double acc = 0.0;
            for (int r = 0; r < CHUNK; ++r) {
                acc += (double)gate[r];
                cum[r] = acc;
                if (r < n) cum_out[(size_t)(t0 + r) * num_value_heads + h] = (float)acc;
            }
        }
    }
    __syncthreads();
    GDN_PHASE(3);  // cumulative decay

    // 2. P = lower(Q K^T * D) to global, A = strict_lower(beta K K^T * D) to shared; warp w: rows 16w..
    {
        const int r0 = 16 * warp;
        float scores[2][CHUNK / 8][4] = {};  // Q K^T, K K^T
        // B = K^T, given by its transpose K: rows of K are columns of K^T
        warp_strip_mma<DK, CHUNK / 8, 2>(
            scores, [&](int x, int k0, unsigned* a) { load_a(a, (x == 0 ? qs : ks) + r0 * LDK + k0, LDK); }, ks, LDK);
        float(&sqk)[CHUNK / 8][4] = scores[0];
        float(&skk)[CHUNK / 8][4] = scores[1];
        bf16* p = p_out + ((size_t)c * num_value_heads + h) * CHUNK * CHUNK;
#pragma unroll
        for (int nt = 0; nt < CHUNK / 8; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = r0 + g + 8 * half, j = nt * 8 + 2 * q4;
                float pv[2], av[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int jj = j + e;
                    const float d = jj <= i ? __expf((float)(cum[i] - cum[jj])) : 0.f;
                    pv[e] = sqk[nt][2 * half + e] * d;
                    av[e] = jj < i ? beta[i] * skk[nt][2 * half + e] * d : 0.f;
                }
                store_pair(p + i * CHUNK + j, pv[0], pv[1]);
                amat[i * LDF + j] = av[0];
                amat[i * LDF + j + 1] = av[1];
            }
    }
    __syncthreads();
    GDN_PHASE(4);  // P and A (tensor cores)

    // 3. T = (I + A)^-1 by forward substitution. Column j of T depends on column j alone, so
    //    thread j solves it top-down with no barrier: T[i][j] = -A[i][j] - sum_{j<m<i} A[i][m] T[m][j]
    //    BLOCKED_SOLVE: by 16 x 16 blocks instead (solve_blocked)
    if (BLOCKED_SOLVE) {
        solve_blocked(amat, tinv);
    } else if (threadIdx.x < CHUNK) {
        const int j = threadIdx.x;
        for (int i = 0; i <= j; ++i) tinv[i * LDF + j] = i == j ? 1.f : 0.f;
        for (int i = j + 1; i < CHUNK; ++i) {
            float acc0 = -amat[i * LDF + j], acc1 = 0.f;
            int m = j + 1;
            if (STAGED) {  // 8 pairs' loads issued before their adds (the same adds in the same order)
                for (; m + 15 < i; m += 16) {
                    float a[16], tv[16];
#pragma unroll
                    for (int u = 0; u < 16; ++u) {
                        a[u] = amat[i * LDF + m + u];
                        tv[u] = tinv[(m + u) * LDF + j];
                    }
#pragma unroll
                    for (int u = 0; u < 16; u += 2) {
                        acc0 -= a[u] * tv[u];
                        acc1 -= a[u + 1] * tv[u + 1];
                    }
                }
            }
            for (; m + 1 < i; m += 2) {  // two partial sums: half the dependent-add chain
                acc0 -= amat[i * LDF + m] * tinv[m * LDF + j];
                acc1 -= amat[i * LDF + m + 1] * tinv[(m + 1) * LDF + j];
            }
            if (m < i) acc0 -= amat[i * LDF + m] * tinv[m * LDF + j];
            tinv[i * LDF + j] = acc0 + acc1;
        }
    }
    __syncthreads();
    GDN_PHASE(5);  // T = (I + A)^-1
    if (STAGED) {  // 8 loads ahead of their stores (the compiler cannot move loads past stores that may alias)
        for (int e0 = threadIdx.x; e0 < CHUNK * CHUNK; e0 += 8 * 128) {
            float x[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int e = e0 + u * 128;
                x[u] = tinv[(e / CHUNK) * LDF + e % CHUNK];
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int e = e0 + u * 128;
                tb[(e / CHUNK) * LDC + e % CHUNK] = __float2bfloat16_rn(x[u]);
            }
        }
    } else {
        for (int e = threadIdx.x; e < CHUNK * CHUNK; e += blockDim.x) {
            const int i = e / CHUNK, j = e % CHUNK;
            tb[i * LDC + j] = __float2bfloat16_rn(tinv[i * LDF + j]);
        }
    }
    // (beta V)^T over the finished Q tile, (beta exp(c) K)^T from the K tile
    if (STAGED) {
        const int v_vecs = dv / 8;
#pragma unroll
        for (int it = 0; it < V_LOADS; ++it) {
            const int e = threadIdx.x + it * 128, r = e % CHUNK, jv = (e / CHUNK) * 8;
            if (e < CHUNK * v_vecs) {
                const bf16* x = reinterpret_cast<const bf16*>(&v_rows[it]);
#pragma unroll
                for (int m = 0; m < 8; ++m) vt[(jv + m) * LDC + r] = __float2bfloat16_rn(beta[r] * to_f(x[m]));
            }
        }
    } else {
        for (int e = threadIdx.x; e < CHUNK * dv; e += blockDim.x) {
            const int r = e / dv, jv = e % dv;
            const float x = r < n ? to_f(conv_out[(size_t)(t0 + r) * conv_dim + 2 * key_dim + h * dv + jv]) : 0.f;
            vt[jv * LDC + r] = __float2bfloat16_rn(beta[r] * x);
        }
    }
    if (STAGED) {  // beta exp(c) once a row, into the dead gate[] (the same product: it is evaluated first)
        if (threadIdx.x < CHUNK) gate[threadIdx.x] = beta[threadIdx.x] * __expf((float)cum[threadIdx.x]);
        __syncthreads();
        for (int e0 = threadIdx.x; e0 < CHUNK * DK; e0 += 8 * 128) {  // 8 loads ahead of their stores
            float x[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int e = e0 + u * 128, r = e / DK, i = e % DK;
                x[u] = gate[r] * to_f(ks[r * LDK + i]);
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int e = e0 + u * 128;
                kt[(e % DK) * LDC + e / DK] = __float2bfloat16_rn(x[u]);
            }
        }
    } else {
        for (int e = threadIdx.x; e < CHUNK * DK; e += blockDim.x) {
            const int r = e / DK, i = e % DK;
            kt[i * LDC + r] = __float2bfloat16_rn(beta[r] * __expf((float)cum[r]) * to_f(ks[r * LDK + i]));
        }
    }
    __syncthreads();
    GDN_PHASE(6);  // T, (beta V)^T, (beta exp(c) K)^T in bf16

    // 4. U = T (beta V), W = T (beta exp(c) K): warp w rows 16w.., 8 columns at a time
    const int r0 = 16 * warp;
    unsigned t_frag[CHUNK / 16][4];
#pragma unroll
    for (int kk = 0; kk < CHUNK / 16; ++kk) load_a(t_frag[kk], tb + r0 * LDC + kk * 16, LDC);
    // U = T (beta V) (target 0), W = T (beta exp(c) K) (target 1), 8 columns an mma chain; staged: 4
    // column tiles' independent chains interleaved (dv and DK are multiples of 32 there)
    auto column_tile = [&](int target, int nt) {
        const bf16* bt = target == 0 ? vt : kt;
        const int width = target == 0 ? dv : DK;
        bf16* dst = target == 0 ? u_out + (size_t)h * dv : w_out + (size_t)h * DK;
        const size_t row_stride = (size_t)num_value_heads * width;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kk = 0; kk < CHUNK / 16; ++kk) {
            unsigned b[2];
            load_b(b, bt + nt * 8 * LDC + kk * 16, LDC);
            mma_op_16816(acc, t_frag[kk], b[0], b[1]);
        }
        const int j = nt * 8 + 2 * q4;
        if (r0 + g < n) store_pair(dst + (size_t)(t0 + r0 + g) * row_stride + j, acc[0], acc[1]);
        if (r0 + g + 8 < n) store_pair(dst + (size_t)(t0 + r0 + g + 8) * row_stride + j, acc[2], acc[3]);
    };
    for (int target = 0; target < 2; ++target) {
        const int tiles = (target == 0 ? dv : DK) / 8;
        if (STAGED) {
#pragma unroll 4
            for (int nt = 0; nt < tiles; ++nt) column_tile(target, nt);
        } else {
            for (int nt = 0; nt < tiles; ++nt) column_tile(target, nt);
        }
    }
    GDN_PHASE(7);  // U and W (tensor cores) stored
    GDN_PHASES_DONE();
}

extern "C" __global__ void __launch_bounds__(128) gdn_chunk_prepare(PREPARE_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_prepare<false>(smem, PREPARE_ARGS);
}

extern "C" __global__ void __launch_bounds__(128) gdn_chunk_prepare_staged(PREPARE_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_prepare<true>(smem, PREPARE_ARGS);
}

// gdn_chunk_prepare_blocked (OPENINFER_QWEN35_GDN_PREFILL=blocked, the default since E1 2026-11-24:
// 0.607 -> 0.486 ms at 8 x 1k tokens of the 4B shape on the H200): the staged kernel with the
// triangular solve by 16 x 16 blocks (solve_blocked): T in another order of fp32 adds (bf16
// tolerance of the others, not their bits).
extern "C" __global__ void __launch_bounds__(128) gdn_chunk_prepare_blocked(PREPARE_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_prepare<true, true>(smem, PREPARE_ARGS);
}

// ---------------------------------------------------------------------------------------------
// gdn_chunk_scan: grid (B, nv, dv / 32), 128 threads (4 warps). Walks sequence s's chunks in
// order for value channels [32 z, 32 z + 32) of head h; the state tile S [DK][32] lives in shared
// memory (fp32) for the whole sequence, from the slot (zeros when fresh) back to the slot. The
// walk is a chain of dependent chunks, so the next chunk's W, Q, K, P and c are loaded into
// registers while this chunk computes (one block per (sequence, head, tile) cannot hide global
// latency otherwise).
#define LDS (SCAN_TILE + 4)  // fp32 state tile
#define SCAN_THREADS 128
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
gdn_chunk_scan(const bf16* __restrict__ qn, const bf16* __restrict__ kn, const bf16* __restrict__ w_in,
               const bf16* __restrict__ u_in, const bf16* __restrict__ p_in, const float* __restrict__ cum_in,
               const int* __restrict__ chunk_start, const int* __restrict__ chunk_len,
               const int* __restrict__ seq_chunks, const int* __restrict__ slots, const int* __restrict__ fresh,
               float* __restrict__ ssm_state, bf16* __restrict__ core, int num_key_heads, int num_value_heads,
               int dv) {
    GDN_DYNAMIC_SHARED(smem);
    const int s = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * SCAN_TILE;
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int value_dim = num_value_heads * dv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;

    unsigned char* at = smem;
    float* st = reinterpret_cast<float*>(at);  // S [DK][LDS] fp32
    at += round_up_128((size_t)DK * LDS * 4);
    bf16* sbt = reinterpret_cast<bf16*>(at);  // S^T [32][LDK] bf16
    at += round_up_128((size_t)SCAN_TILE * LDK * 2);
    bf16* ws = reinterpret_cast<bf16*>(at);  // W [64][LDK]
    at += round_up_128((size_t)CHUNK * LDK * 2);
    bf16* qs = reinterpret_cast<bf16*>(at);  // Q [64][LDK]
    at += round_up_128((size_t)CHUNK * LDK * 2);
    bf16* ks = reinterpret_cast<bf16*>(at);  // K [64][LDK]
    at += round_up_128((size_t)CHUNK * LDK * 2);
    bf16* ps = reinterpret_cast<bf16*>(at);  // P [64][LDC]
    at += round_up_128((size_t)CHUNK * LDC * 2);
    bf16* vnt = reinterpret_cast<bf16*>(at);  // V'^T [32][LDC]
    at += round_up_128((size_t)SCAN_TILE * LDC * 2);
    bf16* vkt = reinterpret_cast<bf16*>(at);  // (diag(exp(c_C - c)) V')^T [32][LDC]
    at += round_up_128((size_t)SCAN_TILE * LDC * 2);
    float* cum = reinterpret_cast<float*>(at);  // [64]

    const int slot = slots[s];
    float* state = ssm_state + ((size_t)slot * num_value_heads + h) * DK * dv + j0;
    const bool is_fresh = fresh[s] != 0;
    for (int e = threadIdx.x; e < DK * SCAN_TILE; e += SCAN_THREADS) {
        const int i = e / SCAN_TILE, j = e % SCAN_TILE;
        st[i * LDS + j] = is_fresh ? 0.f : state[(size_t)i * dv + j];
    }

    const int first = seq_chunks[s], last = seq_chunks[s + 1];
    constexpr int ROW_VECS = DK / 8;  // uint4 per row of W, Q, K
    constexpr int ROW_LOADS = CHUNK * ROW_VECS / SCAN_THREADS, P_LOADS = CHUNK * (CHUNK / 8) / SCAN_THREADS;
    uint4 w_next[ROW_LOADS], q_next[ROW_LOADS], k_next[ROW_LOADS], p_next[P_LOADS];
    float cum_next = 0.f;
    auto prefetch = [&](int c) {  // chunk c's rows into registers; rows past its end as zeros
        const int t0 = chunk_start[c], n = chunk_len[c];
#pragma unroll
        for (int it = 0; it < ROW_LOADS; ++it) {
            const int e = threadIdx.x + it * SCAN_THREADS, r = e / ROW_VECS, i = (e % ROW_VECS) * 8;
            w_next[it] = q_next[it] = k_next[it] = make_uint4(0, 0, 0, 0);
            if (r < n) {
                w_next[it] = *reinterpret_cast<const uint4*>(w_in + ((size_t)(t0 + r) * num_value_heads + h) * DK + i);
                q_next[it] = *reinterpret_cast<const uint4*>(qn + ((size_t)(t0 + r) * num_key_heads + key_head) * DK + i);
                k_next[it] = *reinterpret_cast<const uint4*>(kn + ((size_t)(t0 + r) * num_key_heads + key_head) * DK + i);
            }
        }
        const bf16* p = p_in + ((size_t)c * num_value_heads + h) * CHUNK * CHUNK;
#pragma unroll
        for (int it = 0; it < P_LOADS; ++it)
            p_next[it] = *reinterpret_cast<const uint4*>(p + (threadIdx.x + it * SCAN_THREADS) * 8);
        if (threadIdx.x < CHUNK) {  // padding rows: no decay after the end
            const int r = threadIdx.x < n ? threadIdx.x : n - 1;
            cum_next = cum_in[(size_t)(t0 + r) * num_value_heads + h];
        }
    };
    if (first < last) prefetch(first);
    for (int c = first; c < last; ++c) {
        const int t0 = chunk_start[c], n = chunk_len[c];
        __syncthreads();  // the previous chunk's readers are done; S is complete
        // 1. this chunk's W, Q, K, P, c from registers; S^T in bf16
#pragma unroll
        for (int it = 0; it < ROW_LOADS; ++it) {
            const int e = threadIdx.x + it * SCAN_THREADS, r = e / ROW_VECS, i = (e % ROW_VECS) * 8;
            *reinterpret_cast<uint4*>(ws + r * LDK + i) = w_next[it];
            *reinterpret_cast<uint4*>(qs + r * LDK + i) = q_next[it];
            *reinterpret_cast<uint4*>(ks + r * LDK + i) = k_next[it];
        }
#pragma unroll
        for (int it = 0; it < P_LOADS; ++it) {
            const int e = threadIdx.x + it * SCAN_THREADS, r = e / (CHUNK / 8), j = (e % (CHUNK / 8)) * 8;
            *reinterpret_cast<uint4*>(ps + r * LDC + j) = p_next[it];
        }
        if (threadIdx.x < CHUNK) cum[threadIdx.x] = cum_next;
        for (int e = threadIdx.x; e < DK * SCAN_TILE; e += SCAN_THREADS) {
            const int i = e / SCAN_TILE, j = e % SCAN_TILE;
            sbt[j * LDK + i] = __float2bfloat16_rn(st[i * LDS + j]);
        }
        __syncthreads();
        if (c + 1 < last) prefetch(c + 1);  // in flight during this chunk's math
        const float c_last = cum[CHUNK - 1];

        // 2. warp w, rows 16w..: V' = U - W S and Q S together (the same S^T fragments)
        const int r0 = 16 * warp;
        float u_pairs[2][SCAN_TILE / 8][2];  // this lane's elements of U, loaded ahead of the mma loop
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = r0 + g + 8 * half;
            const bf16* u = u_in + ((size_t)(t0 + r) * num_value_heads + h) * dv + j0;
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                u_pairs[half][nt][0] = u_pairs[half][nt][1] = 0.f;
                if (r < n) {
                    const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(u + nt * 8 + 2 * q4);
                    u_pairs[half][nt][0] = to_f(pair.x);
                    u_pairs[half][nt][1] = to_f(pair.y);
                }
            }
        }
        float products[2][SCAN_TILE / 8][4] = {};  // W S, Q S
        warp_strip_mma<DK, SCAN_TILE / 8, 2>(
            products, [&](int x, int k0, unsigned* a) { load_a(a, (x == 0 ? ws : qs) + r0 * LDK + k0, LDK); }, sbt,
            LDK);
        float(&acc_v)[SCAN_TILE / 8][4] = products[0];
        float(&acc_o)[SCAN_TILE / 8][4] = products[1];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = r0 + g + 8 * half;
            const float row_decay = __expf(cum[r]), tail_decay = __expf(c_last - cum[r]);
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                const int j = nt * 8 + 2 * q4;
                const float v0 = r < n ? u_pairs[half][nt][0] - acc_v[nt][2 * half] : 0.f;
                const float v1 = r < n ? u_pairs[half][nt][1] - acc_v[nt][2 * half + 1] : 0.f;
                vnt[j * LDC + r] = __float2bfloat16_rn(v0);
                vnt[(j + 1) * LDC + r] = __float2bfloat16_rn(v1);
                vkt[j * LDC + r] = __float2bfloat16_rn(v0 * tail_decay);
                vkt[(j + 1) * LDC + r] = __float2bfloat16_rn(v1 * tail_decay);
                acc_o[nt][2 * half] *= row_decay;
                acc_o[nt][2 * half + 1] *= row_decay;
            }
        }
        __syncthreads();  // every row of V' is needed by every warp below

        // 3. O += P V' (rows 16w..), to core
        warp_strip_mma<CHUNK, SCAN_TILE / 8, 1>(
            &acc_o, [&](int, int k0, unsigned* a) { load_a(a, ps + r0 * LDC + k0, LDC); }, vnt, LDC);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = r0 + g + 8 * half;
            if (r < n) {
                bf16* o = core + (size_t)(t0 + r) * value_dim + (size_t)h * dv + j0;
#pragma unroll
                for (int nt = 0; nt < SCAN_TILE / 8; ++nt)
                    store_pair_bf16(o + nt * 8 + 2 * q4, acc_o[nt][2 * half], acc_o[nt][2 * half + 1]);
            }
        }

        // 4. S <- exp(c_C) S + K^T (diag(exp(c_C - c)) V'); warp w: state rows DK/4 w ..
        const float chunk_decay = __expf(c_last);
#pragma unroll
        for (int mt = 0; mt < DK / 64; ++mt) {
            const int i0 = (DK / 4) * warp + 16 * mt;
            float acc[SCAN_TILE / 8][4];
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                const int j = nt * 8 + 2 * q4;
                acc[nt][0] = chunk_decay * st[(i0 + g) * LDS + j];
                acc[nt][1] = chunk_decay * st[(i0 + g) * LDS + j + 1];
                acc[nt][2] = chunk_decay * st[(i0 + g + 8) * LDS + j];
                acc[nt][3] = chunk_decay * st[(i0 + g + 8) * LDS + j + 1];
            }
            warp_strip_mma<CHUNK, SCAN_TILE / 8, 1>(
                &acc, [&](int, int k0, unsigned* a) { load_a_transposed(a, ks + k0 * LDK + i0, LDK); }, vkt, LDC);
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                const int j = nt * 8 + 2 * q4;
                st[(i0 + g) * LDS + j] = acc[nt][0];
                st[(i0 + g) * LDS + j + 1] = acc[nt][1];
                st[(i0 + g + 8) * LDS + j] = acc[nt][2];
                st[(i0 + g + 8) * LDS + j + 1] = acc[nt][3];
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < DK * SCAN_TILE; e += blockDim.x) {
        const int i = e / SCAN_TILE, j = e % SCAN_TILE;
        state[(size_t)i * dv + j] = st[i * LDS + j];
    }
}

// ---------------------------------------------------------------------------------------------
// The scan split in two (OPENINFER_QWEN35_GDN_PREFILL=split), as FLA's chunk_gated_delta_rule
// splits its forward pass: only the state recurrence is sequential, so
//   gdn_chunk_states  (grid (B, nv, dv / 32), 128 threads): walks a sequence's chunks for 32
//                     value channels doing only  V' = U - W S  and  S <- exp(c_C) S + K^T ...;
//                     it stores each chunk's entering S^T (bf16, as the mma reads it) and V'
//   gdn_chunk_output  (grid (N, nv), 128 threads): every chunk at once,
//                     O = diag(exp(c)) Q S + P V'  for the head's dv / 32 tiles in turn
// The chain per chunk loses Q S, P V', the O stores and a barrier (and U is prefetched with W
// and K), and the walk's block needs 67 instead of 98 KiB of shared memory and at most 168
// registers a thread: 3 blocks per SM instead of 2. Every product is the
// same mma sequence on the same bf16 operands as gdn_chunk_scan's: the same bits.
//   states [N, nv, dv, DK] bf16 (S^T entering each chunk), v_new [T, nv, dv] bf16 (V')
// 3 blocks per SM at DK <= 128 (168 registers); wider key heads' W / K prefetch needs more registers
//
// Prefix-cache snapshots inside a step (the *_snapshot entry points of both walks): a sequence whose
// state after a block boundary inside its rows is wanted has its chunks cut there (the host's chunk
// layout starts a chunk at the boundary), and the walk stores the fp32 S entering that chunk into the
// snapshot slot, in the slot layout — the state a run stopping at the boundary leaves, without a
// second run of the layer. snapshot_chunk [B]: the chunk (an index into chunk_start) entering which
// the state is stored, -1 none; snapshot_slot [B]: its slot. The walk's products are unchanged.
#define CHUNK_STATES_PARAMS                                                                                    \
    const bf16 *__restrict__ kn, const bf16 *__restrict__ w_in, const bf16 *__restrict__ u_in,                 \
        const float *__restrict__ cum_in, const int *__restrict__ chunk_start, const int *__restrict__ chunk_len, \
        const int *__restrict__ seq_chunks, const int *__restrict__ slots, const int *__restrict__ fresh,        \
        float *__restrict__ ssm_state, bf16 *__restrict__ states, bf16 *__restrict__ v_new, int num_key_heads,  \
        int num_value_heads, int dv
#define CHUNK_STATES_ARGS                                                                                      \
    kn, w_in, u_in, cum_in, chunk_start, chunk_len, seq_chunks, slots, fresh, ssm_state, states, v_new,         \
        num_key_heads, num_value_heads, dv
template <bool SNAPSHOT>
__device__ __forceinline__ void chunk_states(unsigned char* smem, CHUNK_STATES_PARAMS,
                                             const int* __restrict__ snapshot_chunk,
                                             const int* __restrict__ snapshot_slot) {
    const int s = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * SCAN_TILE;
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;

    unsigned char* at = smem;
    float* st = reinterpret_cast<float*>(at);  // S [DK][LDS] fp32
    at += round_up_128((size_t)DK * LDS * 4);
    bf16* sbt = reinterpret_cast<bf16*>(at);  // S^T [32][LDK] bf16
    at += round_up_128((size_t)SCAN_TILE * LDK * 2);
    bf16* ws = reinterpret_cast<bf16*>(at);  // W [64][LDK]
    at += round_up_128((size_t)CHUNK * LDK * 2);
    bf16* ks = reinterpret_cast<bf16*>(at);  // K [64][LDK]
    at += round_up_128((size_t)CHUNK * LDK * 2);
    bf16* vkt = reinterpret_cast<bf16*>(at);  // (diag(exp(c_C - c)) V')^T [32][LDC]
    at += round_up_128((size_t)SCAN_TILE * LDC * 2);
    float* cum = reinterpret_cast<float*>(at);  // [64]

    const int slot = slots[s];
    float* state = ssm_state + ((size_t)slot * num_value_heads + h) * DK * dv + j0;
    const bool is_fresh = fresh[s] != 0;
    for (int e = threadIdx.x; e < DK * SCAN_TILE; e += SCAN_THREADS) {
        const int i = e / SCAN_TILE, j = e % SCAN_TILE;
        st[i * LDS + j] = is_fresh ? 0.f : state[(size_t)i * dv + j];
    }

    const int first = seq_chunks[s], last = seq_chunks[s + 1];
    const int snap_chunk = SNAPSHOT ? snapshot_chunk[s] : -1;
    constexpr int ROW_VECS = DK / 8;  // uint4 per row of W, K
    constexpr int ROW_LOADS = CHUNK * ROW_VECS / SCAN_THREADS, STATE_LOADS = SCAN_TILE * ROW_VECS / SCAN_THREADS;
    uint4 w_next[ROW_LOADS], k_next[ROW_LOADS];
    unsigned u_next[2][SCAN_TILE / 8];  // this lane's U pairs (bf16x2) of the mma layout
    float cum_next = 0.f;
    auto prefetch = [&](int c) {  // chunk c's rows into registers; rows past its end as zeros
        const int t0 = chunk_start[c], n = chunk_len[c];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = 16 * warp + g + 8 * half;
            const bf16* u = u_in + ((size_t)(t0 + r) * num_value_heads + h) * dv + j0;
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt)
                u_next[half][nt] = r < n ? *reinterpret_cast<const unsigned*>(u + nt * 8 + 2 * q4) : 0u;
        }
#pragma unroll
        for (int it = 0; it < ROW_LOADS; ++it) {
            const int e = threadIdx.x + it * SCAN_THREADS, r = e / ROW_VECS, i = (e % ROW_VECS) * 8;
            w_next[it] = k_next[it] = make_uint4(0, 0, 0, 0);
            if (r < n) {
                w_next[it] = *reinterpret_cast<const uint4*>(w_in + ((size_t)(t0 + r) * num_value_heads + h) * DK + i);
                k_next[it] = *reinterpret_cast<const uint4*>(kn + ((size_t)(t0 + r) * num_key_heads + key_head) * DK + i);
            }
        }
        if (threadIdx.x < CHUNK) {  // padding rows: no decay after the end
            const int r = threadIdx.x < n ? threadIdx.x : n - 1;
            cum_next = cum_in[(size_t)(t0 + r) * num_value_heads + h];
        }
    };
    if (first < last) prefetch(first);
    for (int c = first; c < last; ++c) {
        const int t0 = chunk_start[c], n = chunk_len[c];
        __syncthreads();  // the previous chunk's readers are done; S is complete
#pragma unroll
        for (int it = 0; it < ROW_LOADS; ++it) {
            const int e = threadIdx.x + it * SCAN_THREADS, r = e / ROW_VECS, i = (e % ROW_VECS) * 8;
            *reinterpret_cast<uint4*>(ws + r * LDK + i) = w_next[it];
            *reinterpret_cast<uint4*>(ks + r * LDK + i) = k_next[it];
        }
        if (threadIdx.x < CHUNK) cum[threadIdx.x] = cum_next;
        float u_pairs[2][SCAN_TILE / 8][2];  // this chunk's U from registers, before the next prefetch
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(&u_next[half][nt]);
                u_pairs[half][nt][0] = op_to_f(pair.x);
                u_pairs[half][nt][1] = op_to_f(pair.y);
            }
        for (int e = threadIdx.x; e < DK * SCAN_TILE; e += SCAN_THREADS) {
            const int i = e / SCAN_TILE, j = e % SCAN_TILE;
            sbt[j * LDK + i] = op_from_f(st[i * LDS + j]);
        }
        if (SNAPSHOT && c == snap_chunk) {  // the fp32 S entering the chunk: the state at the boundary
            float* snap = ssm_state + ((size_t)snapshot_slot[s] * num_value_heads + h) * DK * dv + j0;
            for (int e = threadIdx.x; e < DK * SCAN_TILE; e += SCAN_THREADS) {
                const int i = e / SCAN_TILE, j = e % SCAN_TILE;
                snap[(size_t)i * dv + j] = st[i * LDS + j];
            }
        }
        __syncthreads();
        if (c + 1 < last) prefetch(c + 1);  // in flight during this chunk's math
        const float c_last = cum[CHUNK - 1];
        // the entering S^T for gdn_chunk_output, 16 bytes a store
        bf16* state_out = states + (((size_t)c * num_value_heads + h) * dv + j0) * DK;
#pragma unroll
        for (int it = 0; it < STATE_LOADS; ++it) {
            const int e = threadIdx.x + it * SCAN_THREADS, j = e / ROW_VECS, i = (e % ROW_VECS) * 8;
            *reinterpret_cast<uint4*>(state_out + (size_t)j * DK + i) = *reinterpret_cast<const uint4*>(sbt + j * LDK + i);
        }

        // V' = U - W S, warp w rows 16w..: to v_new (bf16) and, decayed to the chunk's end, to vkt
        const int r0 = 16 * warp;
        float acc_v[1][SCAN_TILE / 8][4] = {};
        warp_strip_mma<DK, SCAN_TILE / 8, 1>(
            acc_v, [&](int, int k0, unsigned* a) { load_a(a, ws + r0 * LDK + k0, LDK); }, sbt, LDK);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = r0 + g + 8 * half;
            const float tail_decay = __expf(c_last - cum[r]);
            bf16* v_row = v_new + ((size_t)(t0 + r) * num_value_heads + h) * dv + j0;
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                const int j = nt * 8 + 2 * q4;
                const float v0 = r < n ? u_pairs[half][nt][0] - acc_v[0][nt][2 * half] : 0.f;
                const float v1 = r < n ? u_pairs[half][nt][1] - acc_v[0][nt][2 * half + 1] : 0.f;
                if (r < n) store_pair(v_row + j, v0, v1);
                vkt[j * LDC + r] = op_from_f(v0 * tail_decay);
                vkt[(j + 1) * LDC + r] = op_from_f(v1 * tail_decay);
            }
        }
        __syncthreads();  // every row of vkt is needed by every warp below

        // S <- exp(c_C) S + K^T (diag(exp(c_C - c)) V'); warp w: state rows DK/4 w ..
        const float chunk_decay = __expf(c_last);
#pragma unroll
        for (int mt = 0; mt < DK / 64; ++mt) {
            const int i0 = (DK / 4) * warp + 16 * mt;
            float acc[SCAN_TILE / 8][4];
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                const int j = nt * 8 + 2 * q4;
                acc[nt][0] = chunk_decay * st[(i0 + g) * LDS + j];
                acc[nt][1] = chunk_decay * st[(i0 + g) * LDS + j + 1];
                acc[nt][2] = chunk_decay * st[(i0 + g + 8) * LDS + j];
                acc[nt][3] = chunk_decay * st[(i0 + g + 8) * LDS + j + 1];
            }
            warp_strip_mma<CHUNK, SCAN_TILE / 8, 1>(
                &acc, [&](int, int k0, unsigned* a) { load_a_transposed(a, ks + k0 * LDK + i0, LDK); }, vkt, LDC);
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                const int j = nt * 8 + 2 * q4;
                st[(i0 + g) * LDS + j] = acc[nt][0];
                st[(i0 + g) * LDS + j + 1] = acc[nt][1];
                st[(i0 + g + 8) * LDS + j] = acc[nt][2];
                st[(i0 + g + 8) * LDS + j + 1] = acc[nt][3];
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < DK * SCAN_TILE; e += blockDim.x) {
        const int i = e / SCAN_TILE, j = e % SCAN_TILE;
        state[(size_t)i * dv + j] = st[i * LDS + j];
    }
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS, DK <= 128 ? 3 : 1) gdn_chunk_states(CHUNK_STATES_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_states<false>(smem, CHUNK_STATES_ARGS, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS, DK <= 128 ? 3 : 1)
gdn_chunk_states_snapshot(CHUNK_STATES_PARAMS, const int* __restrict__ snapshot_chunk,
                          const int* __restrict__ snapshot_slot) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_states<true>(smem, CHUNK_STATES_ARGS, snapshot_chunk, snapshot_slot);
}

// gdn_chunk_output: grid (N, nv), 128 threads (warp w: rows 16w..). Q and P once, then the
// head's dv / 32 tiles of S^T and V' in turn.
// NORM (gdn_chunk_output_norm, OPENINFER_QWEN35_GDN_PREFILL=fused): the gated RMSNorm fused in
// (gdn_gated_norm_warp's arithmetic: o rounded to bf16, RMS over the head's dv, times the norm
// weight, times silu(z)): a warp keeps its rows' O over every tile in registers (dv <= 128), a
// row's sum of squares met over the 4 lanes holding it, and writes the layer's output instead of
// O — no O round trip through global memory, no norm launch. The same O; the norm's sum in
// another order (fp32 rounding of gdn_gated_norm_warp's).
#define OUTPUT_NORM_MAX_TILES 4  // dv <= 128 for the fused norm
template <bool NORM>
__device__ __forceinline__ void chunk_output(unsigned char* smem, const bf16* __restrict__ qn,
                                             const bf16* __restrict__ p_in, const float* __restrict__ cum_in,
                                             const bf16* __restrict__ states, const bf16* __restrict__ v_new,
                                             const int* __restrict__ chunk_start, const int* __restrict__ chunk_len,
                                             bf16* __restrict__ core, int num_key_heads, int num_value_heads, int dv,
                                             const bf16* __restrict__ proj, int proj_stride, int conv_dim,
                                             const bf16* __restrict__ norm_weight, float eps) {
    const int c = blockIdx.x, h = blockIdx.y;
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int value_dim = num_value_heads * dv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
    const int t0 = chunk_start[c], n = chunk_len[c];

    unsigned char* at = smem;
    bf16* qs = reinterpret_cast<bf16*>(at);  // Q [64][LDK]
    at += round_up_128((size_t)CHUNK * LDK * 2);
    bf16* ps = reinterpret_cast<bf16*>(at);  // P [64][LDC]
    at += round_up_128((size_t)CHUNK * LDC * 2);
    bf16* sbt = reinterpret_cast<bf16*>(at);  // S^T [32][LDK]
    at += round_up_128((size_t)SCAN_TILE * LDK * 2);
    bf16* vnt = reinterpret_cast<bf16*>(at);  // V'^T [32][LDC]
    at += round_up_128((size_t)SCAN_TILE * LDC * 2);
    float* cum = reinterpret_cast<float*>(at);  // [64]

    constexpr int ROW_VECS = DK / 8;
    for (int e = threadIdx.x; e < CHUNK * ROW_VECS; e += SCAN_THREADS) {
        const int r = e / ROW_VECS, i = (e % ROW_VECS) * 8;
        uint4 qv = make_uint4(0, 0, 0, 0);
        if (r < n) qv = *reinterpret_cast<const uint4*>(qn + ((size_t)(t0 + r) * num_key_heads + key_head) * DK + i);
        *reinterpret_cast<uint4*>(qs + r * LDK + i) = qv;
    }
    const bf16* p = p_in + ((size_t)c * num_value_heads + h) * CHUNK * CHUNK;
    for (int e = threadIdx.x; e < CHUNK * CHUNK / 8; e += SCAN_THREADS) {
        const int r = e / (CHUNK / 8), j = (e % (CHUNK / 8)) * 8;
        *reinterpret_cast<uint4*>(ps + r * LDC + j) = *reinterpret_cast<const uint4*>(p + e * 8);
    }
    if (threadIdx.x < CHUNK) {  // padding rows: the last row's c, as gdn_chunk_scan
        const int r = threadIdx.x < n ? threadIdx.x : n - 1;
        cum[threadIdx.x] = cum_in[(size_t)(t0 + r) * num_value_heads + h];
    }
    const int r0 = 16 * warp;
    // O of rows r0 + g (+ 8) for value channels j0 .. j0 + 31 into acc_o (every thread of the block calls it)
    auto tile_output = [&](int j0, float (&acc_o)[1][SCAN_TILE / 8][4]) {
        __syncthreads();  // the previous tile's readers are done (and, first, Q, P and c are in)
        const bf16* state_in = states + (((size_t)c * num_value_heads + h) * dv + j0) * DK;
        for (int e = threadIdx.x; e < SCAN_TILE * ROW_VECS; e += SCAN_THREADS) {
            const int j = e / ROW_VECS, i = (e % ROW_VECS) * 8;
            *reinterpret_cast<uint4*>(sbt + j * LDK + i) = *reinterpret_cast<const uint4*>(state_in + (size_t)j * DK + i);
        }
        for (int e = threadIdx.x; e < CHUNK * SCAN_TILE / 8; e += SCAN_THREADS) {  // V' rows, transposed
            const int r = e / (SCAN_TILE / 8), j = (e % (SCAN_TILE / 8)) * 8;
            uint4 vv = make_uint4(0, 0, 0, 0);
            if (r < n) vv = *reinterpret_cast<const uint4*>(v_new + ((size_t)(t0 + r) * num_value_heads + h) * dv + j0 + j);
            const bf16* x = reinterpret_cast<const bf16*>(&vv);
#pragma unroll
            for (int m = 0; m < 8; ++m) vnt[(j + m) * LDC + r] = x[m];
        }
        __syncthreads();
        warp_strip_mma<DK, SCAN_TILE / 8, 1>(
            acc_o, [&](int, int k0, unsigned* a) { load_a(a, qs + r0 * LDK + k0, LDK); }, sbt, LDK);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float row_decay = __expf(cum[r0 + g + 8 * half]);
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                acc_o[0][nt][2 * half] *= row_decay;
                acc_o[0][nt][2 * half + 1] *= row_decay;
            }
        }
        warp_strip_mma<CHUNK, SCAN_TILE / 8, 1>(
            acc_o, [&](int, int k0, unsigned* a) { load_a(a, ps + r0 * LDC + k0, LDC); }, vnt, LDC);
    };
    if constexpr (!NORM) {
        for (int j0 = 0; j0 < dv; j0 += SCAN_TILE) {
            float acc_o[1][SCAN_TILE / 8][4] = {};
            tile_output(j0, acc_o);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = r0 + g + 8 * half;
                if (r < n) {
                    bf16* o = core + (size_t)(t0 + r) * value_dim + (size_t)h * dv + j0;
#pragma unroll
                    for (int nt = 0; nt < SCAN_TILE / 8; ++nt)
                        store_pair_bf16(o + nt * 8 + 2 * q4, acc_o[0][nt][2 * half], acc_o[0][nt][2 * half + 1]);
                }
            }
        }
    } else {
        float kept[OUTPUT_NORM_MAX_TILES][1][SCAN_TILE / 8][4] = {};  // this thread's O over every tile
#pragma unroll
        for (int tile = 0; tile < OUTPUT_NORM_MAX_TILES; ++tile) {
            if (tile * SCAN_TILE >= dv) break;
            tile_output(tile * SCAN_TILE, kept[tile]);
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) kept[tile][0][nt][e] = round_bf16(kept[tile][0][nt][e]);  // bf16 o, as HF's norm
        }
        // the gated RMSNorm of rows r0 + g (half 0) and r0 + g + 8 (half 1) over the head's dv outputs
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float sum_sq = 0.f;
#pragma unroll
            for (int tile = 0; tile < OUTPUT_NORM_MAX_TILES; ++tile)
#pragma unroll
                for (int nt = 0; nt < SCAN_TILE / 8; ++nt)  // tiles past dv hold zeros
                    sum_sq += kept[tile][0][nt][2 * half] * kept[tile][0][nt][2 * half] +
                              kept[tile][0][nt][2 * half + 1] * kept[tile][0][nt][2 * half + 1];
            sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, 1);  // the row's 4 lanes
            sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, 2);
            const float inv_rms = rsqrtf(sum_sq / (float)dv + eps);
            const int r = r0 + g + 8 * half;
            if (r >= n) continue;
            const bf16* z = proj + (size_t)(t0 + r) * proj_stride + conv_dim + (size_t)h * dv;
            bf16* dst = core + (size_t)(t0 + r) * value_dim + (size_t)h * dv;
#pragma unroll
            for (int tile = 0; tile < OUTPUT_NORM_MAX_TILES; ++tile) {
                if (tile * SCAN_TILE >= dv) break;
#pragma unroll
                for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                    const int j = tile * SCAN_TILE + nt * 8 + 2 * q4;
                    float y[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float normed = round_bf16(kept[tile][0][nt][2 * half + e] * inv_rms);
                        y[e] = round_bf16(to_f(norm_weight[j + e]) * normed) * silu_f(to_f(z[j + e]));
                    }
                    store_pair_bf16(dst + j, y[0], y[1]);
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
gdn_chunk_output(const bf16* __restrict__ qn, const bf16* __restrict__ p_in, const float* __restrict__ cum_in,
                 const bf16* __restrict__ states, const bf16* __restrict__ v_new, const int* __restrict__ chunk_start,
                 const int* __restrict__ chunk_len, bf16* __restrict__ core, int num_key_heads, int num_value_heads,
                 int dv) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_output<false>(smem, qn, p_in, cum_in, states, v_new, chunk_start, chunk_len, core, num_key_heads,
                        num_value_heads, dv, nullptr, 0, 0, nullptr, 0.f);
}

// gdn_chunk_output_norm: `out` gets the gated-normed rows (the layer's output) instead of O.
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
gdn_chunk_output_norm(const bf16* __restrict__ qn, const bf16* __restrict__ p_in, const float* __restrict__ cum_in,
                      const bf16* __restrict__ states, const bf16* __restrict__ v_new,
                      const int* __restrict__ chunk_start, const int* __restrict__ chunk_len, bf16* __restrict__ out,
                      int num_key_heads, int num_value_heads, int dv, const bf16* __restrict__ proj, int proj_stride,
                      int conv_dim, const bf16* __restrict__ norm_weight, float eps) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_output<true>(smem, qn, p_in, cum_in, states, v_new, chunk_start, chunk_len, out, num_key_heads,
                       num_value_heads, dv, proj, proj_stride, conv_dim, norm_weight, eps);
}

// ---------------------------------------------------------------------------------------------
// gdn_chunk_states_registers (OPENINFER_QWEN35_GDN_PREFILL=registers): gdn_chunk_states with the
// state in registers instead of shared memory. Transposed, the walk is
//   V'^T = U^T - S^T W^T,   S^T <- exp(c_C) S^T + (diag(exp(c_C - c)) V')^T K
// and a warp keeps its 16 value channels' S^T [16][DK] as mma accumulators (fp32) for the whole
// walk: the accumulator layout of S^T W^T's and V'^T K's outputs (rows g, g+8; columns 2q, 2q+1
// of each 8-wide tile) is the A-operand layout of the next product over 16 columns, so S^T and
// V'^T become A fragments by packing pairs to bf16 — no shared-memory round trip of S, no
// transposes, one barrier pair a chunk. A block is blockDim / 32 warps over 16 x warps channels
// of one (sequence, value head) (grid (B, nv, dv / (16 warps))): W and K are loaded once for
// all of them, a chunk ahead (cp.async into two buffers). The same products in the same k order
// on the same bf16 operands as gdn_chunk_states (the emulation's outputs are its bits).
// Shared memory per buffer: W, K [64][LDK], U -> V' [64][16 warps + PAD] bf16, c [64] fp32.
#ifdef MMA_HOST_STANDIN
__device__ __forceinline__ void gdn_copy16(bf16* dst, const bf16* src, bool valid) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (valid) v = *reinterpret_cast<const uint4*>(src);
    *reinterpret_cast<uint4*>(dst) = v;
}
__device__ __forceinline__ void gdn_copy4(float* dst, const float* src) { *dst = *src; }
__device__ __forceinline__ void gdn_commit_copies() {}
template <int PENDING>
__device__ __forceinline__ void gdn_wait_copies() {}
// B tile 16(k) x 8(n) of a row-major [k][n] matrix at `base`: column g, rows 2q, 2q+1 and 2q+8, 2q+9
__device__ __forceinline__ void load_b_row_major_pair(unsigned* b, const bf16* base, int ld) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const unsigned short* x = reinterpret_cast<const unsigned short*>(base);
    for (int t = 0; t < 2; ++t) {  // n tiles at base and base + 8
        auto pair = [&](int k) { return (unsigned)x[k * ld + 8 * t + g] | ((unsigned)x[(k + 1) * ld + 8 * t + g] << 16); };
        b[2 * t] = pair(2 * q);
        b[2 * t + 1] = pair(2 * q + 8);
    }
}
#else
__device__ __forceinline__ void gdn_copy16(bf16* dst, const bf16* src, bool valid) { cp_async16(dst, src, valid); }
__device__ __forceinline__ void gdn_copy4(float* dst, const float* src) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(addr), "l"(src));
}
__device__ __forceinline__ void gdn_commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void gdn_wait_copies() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }
// two B tiles 16(k) x 8(n) (n at base and base + 8) of a row-major [k][n] matrix: one ldmatrix.trans
// (lanes 0-15 address rows 0-15 of the first tile, lanes 16-31 those of the second)
__device__ __forceinline__ void load_b_row_major_pair(unsigned* b, const bf16* base, int ld) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4_trans(b, base + (lane & 15) * ld + 8 * (lane >> 4));
}
#endif

__device__ __forceinline__ size_t chunk_states_registers_buffer_bytes(int channels) {
    return 2 * round_up_128((size_t)CHUNK * LDK * 2) + round_up_128((size_t)CHUNK * (channels + PAD) * 2) + CHUNK * 4;
}

template <bool SNAPSHOT>
__device__ __forceinline__ void chunk_states_registers(unsigned char* smem, CHUNK_STATES_PARAMS,
                                                       const int* __restrict__ snapshot_chunk,
                                                       const int* __restrict__ snapshot_slot) {
    const int warps = blockDim.x >> 5, channels = 16 * warps, ldu = channels + PAD;
    const int s = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * channels;
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
    const int jw = 16 * warp;  // this warp's first channel within the block's
    const size_t buffer_bytes = chunk_states_registers_buffer_bytes(channels);
    auto w_tile = [&](int b) { return reinterpret_cast<bf16*>(smem + b * buffer_bytes); };
    auto k_tile = [&](int b) { return w_tile(b) + round_up_128((size_t)CHUNK * LDK * 2) / 2; };
    auto u_tile = [&](int b) { return k_tile(b) + round_up_128((size_t)CHUNK * LDK * 2) / 2; };
    auto cum_tile = [&](int b) {
        return reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(u_tile(b)) +
                                        round_up_128((size_t)CHUNK * ldu * 2));
    };

    constexpr int ROW_VECS = DK / 8;
    auto load_chunk = [&](int c, int b) {  // rows past the chunk's end as zeros; c of the last row
        const int t0 = chunk_start[c], n = chunk_len[c];
        bf16 *ws = w_tile(b), *ks = k_tile(b), *us = u_tile(b);
        for (int e = threadIdx.x; e < CHUNK * ROW_VECS; e += blockDim.x) {
            const int r = e / ROW_VECS, i = (e % ROW_VECS) * 8, row = t0 + (r < n ? r : 0);
            gdn_copy16(ws + r * LDK + i, w_in + ((size_t)row * num_value_heads + h) * DK + i, r < n);
            gdn_copy16(ks + r * LDK + i, kn + ((size_t)row * num_key_heads + key_head) * DK + i, r < n);
        }
        const int u_vecs = channels / 8;
        for (int e = threadIdx.x; e < CHUNK * u_vecs; e += blockDim.x) {
            const int r = e / u_vecs, j = (e % u_vecs) * 8, row = t0 + (r < n ? r : 0);
            gdn_copy16(us + r * ldu + j, u_in + ((size_t)row * num_value_heads + h) * dv + j0 + j, r < n);
        }
        if (threadIdx.x < CHUNK) {
            const int r = threadIdx.x < n ? threadIdx.x : n - 1;
            gdn_copy4(cum_tile(b) + threadIdx.x, cum_in + (size_t)(t0 + r) * num_value_heads + h);
        }
        gdn_commit_copies();
    };

    // S^T rows g, g + 8 of this warp's channels, columns 8 nt + 2 q4 (+1): st[nt][0..3]
    const int slot = slots[s];
    float* state = ssm_state + ((size_t)slot * num_value_heads + h) * DK * dv + j0 + jw;
    const bool is_fresh = fresh[s] != 0;
    float st[DK / 8][4];
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt) {
        const int i = 8 * nt + 2 * q4;
        st[nt][0] = is_fresh ? 0.f : state[(size_t)i * dv + g];
        st[nt][1] = is_fresh ? 0.f : state[(size_t)(i + 1) * dv + g];
        st[nt][2] = is_fresh ? 0.f : state[(size_t)i * dv + g + 8];
        st[nt][3] = is_fresh ? 0.f : state[(size_t)(i + 1) * dv + g + 8];
    }

    const int first = seq_chunks[s], last = seq_chunks[s + 1];
    const int snap_chunk = SNAPSHOT ? snapshot_chunk[s] : -1;
    if (first < last) load_chunk(first, 0);
    for (int c = first; c < last; ++c) {
        const int b = (c - first) & 1, t0 = chunk_start[c], n = chunk_len[c];
        if (SNAPSHOT && c == snap_chunk) {  // the fp32 S entering the chunk (the state at the boundary), as stored below
            float* snap = ssm_state + ((size_t)snapshot_slot[s] * num_value_heads + h) * DK * dv + j0 + jw;
#pragma unroll
            for (int nt = 0; nt < DK / 8; ++nt) {
                const int i = 8 * nt + 2 * q4;
                snap[(size_t)i * dv + g] = st[nt][0];
                snap[(size_t)(i + 1) * dv + g] = st[nt][1];
                snap[(size_t)i * dv + g + 8] = st[nt][2];
                snap[(size_t)(i + 1) * dv + g + 8] = st[nt][3];
            }
        }
        if (c + 1 < last) {  // the other buffer's readers finished at the last iteration's end
            load_chunk(c + 1, b ^ 1);
            gdn_wait_copies<1>();
        } else {
            gdn_wait_copies<0>();
        }
        __syncthreads();  // chunk c's tiles are in
        const bf16 *ws = w_tile(b), *ks = k_tile(b);
        bf16* us = u_tile(b);
        const float* cum = cum_tile(b);
        const float c_last = cum[CHUNK - 1];

        // S^T entering the chunk as bf16 A fragments (columns 16 kk ..), and to `states` for gdn_chunk_output
        unsigned sa[DK / 16][4];
        bf16* state_out = states + (((size_t)c * num_value_heads + h) * dv + j0 + jw) * DK;
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            sa[kk][0] = pack_op2(st[2 * kk][0], st[2 * kk][1]);
            sa[kk][1] = pack_op2(st[2 * kk][2], st[2 * kk][3]);
            sa[kk][2] = pack_op2(st[2 * kk + 1][0], st[2 * kk + 1][1]);
            sa[kk][3] = pack_op2(st[2 * kk + 1][2], st[2 * kk + 1][3]);
            const int i = 16 * kk + 2 * q4;
            *reinterpret_cast<unsigned*>(state_out + (size_t)g * DK + i) = sa[kk][0];
            *reinterpret_cast<unsigned*>(state_out + (size_t)(g + 8) * DK + i) = sa[kk][1];
            *reinterpret_cast<unsigned*>(state_out + (size_t)g * DK + i + 8) = sa[kk][2];
            *reinterpret_cast<unsigned*>(state_out + (size_t)(g + 8) * DK + i + 8) = sa[kk][3];
        }
        const float chunk_decay = __expf(c_last);
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[nt][e] *= chunk_decay;

        // 16 chunk rows at a time: V'^T for them, then their part of the state update
#pragma unroll 1
        for (int rt = 0; rt < CHUNK / 16; ++rt) {
            float acc[2][4] = {};  // S^T W^T: rows (channels) g, g + 8; columns 16 rt + 8 half + 2 q4 (+1)
#pragma unroll
            for (int kk = 0; kk < DK / 16; ++kk)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    unsigned bw[2];
                    load_b(bw, ws + (16 * rt + 8 * half) * LDK + 16 * kk, LDK);
                    mma_op_16816(acc[half], sa[kk], bw[0], bw[1]);
                }
            unsigned va[4];  // (diag(exp(c_C - c)) V')^T over these 16 rows: an A fragment
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = 16 * rt + 8 * half + 2 * q4;
                const float decay0 = __expf(c_last - cum[r]), decay1 = __expf(c_last - cum[r + 1]);
#pragma unroll
                for (int side = 0; side < 2; ++side) {  // channel g, then g + 8
                    bf16* u = us + jw + g + 8 * side;
                    const float v0 = r < n ? op_to_f(u[r * ldu]) - acc[half][2 * side] : 0.f;
                    const float v1 = r + 1 < n ? op_to_f(u[(r + 1) * ldu]) - acc[half][2 * side + 1] : 0.f;
                    u[r * ldu] = op_from_f(v0);  // V' for the copy-out below
                    u[(r + 1) * ldu] = op_from_f(v1);
                    va[2 * half + side] = pack_op2(v0 * decay0, v1 * decay1);
                }
            }
#pragma unroll
            for (int nt = 0; nt < DK / 8; nt += 2) {
                unsigned bk[4];
                load_b_row_major_pair(bk, ks + 16 * rt * LDK + 8 * nt, LDK);
                mma_op_16816(st[nt], va, bk[0], bk[1]);
                mma_op_16816(st[nt + 1], va, bk[2], bk[3]);
            }
        }
        __syncthreads();  // every warp's V' is in the U tile
        const int u_vecs = channels / 8;
        for (int e = threadIdx.x; e < CHUNK * u_vecs; e += blockDim.x) {
            const int r = e / u_vecs, j = (e % u_vecs) * 8;
            if (r < n)
                *reinterpret_cast<uint4*>(v_new + ((size_t)(t0 + r) * num_value_heads + h) * dv + j0 + j) =
                    *reinterpret_cast<const uint4*>(us + r * ldu + j);
        }
        __syncthreads();  // this buffer is free for chunk c + 2's loads
    }
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt) {
        const int i = 8 * nt + 2 * q4;
        state[(size_t)i * dv + g] = st[nt][0];
        state[(size_t)(i + 1) * dv + g] = st[nt][1];
        state[(size_t)i * dv + g + 8] = st[nt][2];
        state[(size_t)(i + 1) * dv + g + 8] = st[nt][3];
    }
}

extern "C" __global__ void __launch_bounds__(256, DK <= 128 ? 2 : 1) gdn_chunk_states_registers(CHUNK_STATES_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_states_registers<false>(smem, CHUNK_STATES_ARGS, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(256, DK <= 128 ? 2 : 1)
gdn_chunk_states_registers_snapshot(CHUNK_STATES_PARAMS, const int* __restrict__ snapshot_chunk,
                                    const int* __restrict__ snapshot_slot) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_states_registers<true>(smem, CHUNK_STATES_ARGS, snapshot_chunk, snapshot_slot);
}

// ---------------------------------------------------------------------------------------------
// gdn_chunk_prepare_grouped (OPENINFER_QWEN35_GDN_PREFILL=grouped): gdn_chunk_prepare_blocked's
// outputs (qn, kn, W, U, P, c) from one block per chunk and KEY head, for every value head of its
// group (nv / nk of them: 2 in the 4B shape) in turn — grid (N, nk), 128 threads (warp w: rows
// 16w..16w+15). What the group shares is done once: q and k are read, l2-normed and written once
// (16-byte accesses, a row's sum of squares met over the DK / 8 lanes holding it), and the raw
// scores Q K^T and K K^T stay in mma accumulators across the group's heads (a step too small to
// fill the GPU splits the group over gridDim.z blocks instead: grid (N, nk, ratio)); per value head only
// the gates, the decays D, the triangular solve and U / W remain. The solve's result scales into
// the A operands instead of the B operands:
//   U = (T diag(beta)) V,   W = (T diag(beta exp(c))) K
// so T's A fragments come straight from the fp32 solve (scaled, packed to bf16) and V and the
// normed K are the B operands as stored, row-major (ldmatrix.trans): no bf16 copy of T, no
// transposed (beta V)^T / (beta exp(c) K)^T tiles. The cumulative decay is a warp scan in fp64
// (two rows a lane). bf16 tolerance of blocked (products rounded at other points), not its bits.
// Shared memory: qs -> V [64][max(LDK, dv + PAD)] bf16, ks [64][LDK], A and T [64][LDF] fp32,
// c [64] fp64, beta and beta exp(c) [64] fp32, the group's gate inputs [ratio][64][2] and decay
// parameters [ratio][2] fp32 (read with q / k, not a global round trip per head).
#define GROUPED_PREPARE_OK (DK <= 128 && 32 % (DK / 8) == 0)  // a row's 16-byte vectors within a warp

__device__ __forceinline__ double shfl_up_double(double x, unsigned delta) {
#ifdef MMA_HOST_STANDIN
    long long bits;
    std::memcpy(&bits, &x, sizeof bits);
    const int lo = __shfl_up_sync(0xffffffffu, (int)(bits & 0xffffffffll), delta);
    const int hi = __shfl_up_sync(0xffffffffu, (int)(bits >> 32), delta);
    bits = ((long long)hi << 32) | (long long)(unsigned)lo;
    std::memcpy(&x, &bits, sizeof bits);
    return x;
#else
    return __shfl_up_sync(0xffffffffu, x, delta);
#endif
}

// x0, x1 as bf16 pairs hi + lo (hi = x rounded, lo = the rest rounded): an mma over such splits,
// hi hi' + hi lo' + lo hi', keeps ~16 bits of each product instead of bf16's 8.
__device__ __forceinline__ void split_bf16x2(float x0, float x1, unsigned& hi, unsigned& lo) {
    const float h0 = round_op(x0), h1 = round_op(x1);
    hi = pack_op2(h0, h1);
    lo = pack_op2(x0 - h0, x1 - h1);
}

// acc += A B for one 16 x 8 tile from split fragments (the lo x lo term dropped)
__device__ __forceinline__ void mma_split(float* acc, const unsigned* a_hi, const unsigned* a_lo, const unsigned* b_hi,
                                          const unsigned* b_lo) {
    mma_op_16816(acc, a_hi, b_hi[0], b_hi[1]);
    mma_op_16816(acc, a_hi, b_lo[0], b_lo[1]);
    mma_op_16816(acc, a_lo, b_hi[0], b_hi[1]);
}

// A fragment (16 x 16 at row0, col0) of an fp32 matrix in shared memory (leading dim ld), split
__device__ __forceinline__ void load_a_split(unsigned* hi, unsigned* lo, const float* m, int ld, int row0, int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // rows g, g + 8; columns 2q, then 2q + 8
        const float2 x = *reinterpret_cast<const float2*>(m + (row0 + g + 8 * (e & 1)) * ld + col0 + 2 * q + 8 * (e >> 1));
        split_bf16x2(x.x, x.y, hi[e], lo[e]);
    }
}

// B fragment (16(k) x 8(n) at row0, col0) of a row-major fp32 matrix in shared memory, split
__device__ __forceinline__ void load_b_split(unsigned* hi, unsigned* lo, const float* m, int ld, int row0, int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // rows 2q, 2q + 1, then 2q + 8, 2q + 9; column g
        const float* at = m + (row0 + 2 * q + 8 * e) * ld + col0 + g;
        split_bf16x2(at[0], at[ld], hi[e], lo[e]);
    }
}

// solve_blocked with its block products on tensor cores: (a) the diagonal blocks' inverses T_bb by
// forward substitution, a column in registers (fp32 sums in another order); (b) block row i = 1..3,
// warp j < i:
//   M_ij = sum_{j<=k<i} A_ik T_kj  (mma over hi / lo bf16 splits of the fp32 operands, fp32 sums;
//                                   M kept in A's unused upper triangle, block (j, i))
//   T_ij = -T_ii M_ij              (the same)
// Each product keeps ~16 bits of its fp32 operands (the dropped lo x lo term ~2^-16 of it): T
// within fp32-ish rounding of solve_blocked's, far inside the bf16 its users round it to.
__device__ __forceinline__ void solve_blocked_mma(float* amat, float* tinv) {
    constexpr int B = 16, NB = CHUNK / B;
    if (threadIdx.x < CHUNK) {
        // column jl of diagonal block `base` in registers, every thread through the same unrolled
        // loop: t[i] = -sum_{m < i} A[i][m] t[m] below the diagonal (t[m] = 0 above it, 1 on it
        // make the sum start at the diagonal), so A's loads (broadcast within the block's 16
        // lanes) do not wait on t and each row adds its newest term last
        const int base = (threadIdx.x / B) * B, jl = threadIdx.x % B, j = threadIdx.x;
        float t[B];
#pragma unroll
        for (int i = 0; i < B; ++i) {
            float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
            for (int m = 0; m < i; ++m) {
                const float a = amat[(base + i) * LDF + base + m];
                if (m & 1) acc1 -= a * t[m];
                else acc0 -= a * t[m];
            }
            t[i] = i > jl ? acc0 + acc1 : (i == jl ? 1.f : 0.f);
        }
        for (int i = 0; i < base; ++i) tinv[i * LDF + j] = 0.f;  // above the diagonal block
#pragma unroll
        for (int i = 0; i < B; ++i) tinv[(base + i) * LDF + j] = t[i];
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll 1
    for (int ib = 1; ib < NB; ++ib) {
        if (warp < ib) {
            const int jb = warp;
            float m_acc[2][4] = {};
            for (int kb = jb; kb < ib; ++kb) {
                unsigned a_hi[4], a_lo[4];
                load_a_split(a_hi, a_lo, amat, LDF, ib * B, kb * B);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    unsigned b_hi[2], b_lo[2];
                    load_b_split(b_hi, b_lo, tinv, LDF, kb * B, jb * B + 8 * nt);
                    mma_split(m_acc[nt], a_hi, a_lo, b_hi, b_lo);
                }
            }
            float* m_tile = amat + (jb * B) * LDF + ib * B;  // A's upper triangle: free
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    *reinterpret_cast<float2*>(m_tile + (g + 8 * half) * LDF + 8 * nt + 2 * q) =
                        make_float2(m_acc[nt][2 * half], m_acc[nt][2 * half + 1]);
                }
            __syncwarp();
            unsigned t_hi[4], t_lo[4];
            load_a_split(t_hi, t_lo, tinv, LDF, ib * B, ib * B);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                unsigned b_hi[2], b_lo[2];
                load_b_split(b_hi, b_lo, m_tile, LDF, 0, 8 * nt);
                float t_acc[4] = {};
                mma_split(t_acc, t_hi, t_lo, b_hi, b_lo);
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    *reinterpret_cast<float2*>(tinv + (ib * B + g + 8 * half) * LDF + jb * B + 8 * nt + 2 * q) =
                        make_float2(-t_acc[2 * half], -t_acc[2 * half + 1]);
            }
        }
        __syncthreads();
    }
}

// The varlen causal conv1d + SiLU (gated_deltanet.cu's gdn_conv1d_vec, the same sums in the same
// order) fused into the grouped prepare (CONV): its inputs. With it the prepare reads the projection
// rows (q | k | v columns, proj_stride apart) where it read conv_out, and a chunk's first rows reach
// back into the sequence's earlier rows of the step or its slot's conv window — which gdn_conv_state
// must update only after the prepare ran.
#define GDN_CONV_MAX_WIDTH 9
struct GroupedConv {
    const bf16* weight;  // [conv_dim][width]
    const bf16* state;   // [slots][width - 1][conv_dim]
    const int *query_start, *slots, *fresh, *token_seq;
    int width;
};

// STAGED_STORES: W and U staged through A's dead shared tile and stored as 16-byte row pieces (a warp's
// mma stores otherwise write 4 bytes to each of 8 rows per instruction); the same values.
template <bool MMA_SOLVE, bool CONV = false, bool STAGED_STORES = false>
__device__ __forceinline__ void chunk_prepare_grouped(unsigned char* smem, PREPARE_PARAMS, GroupedConv conv = {}) {
    if constexpr (GROUPED_PREPARE_OK) {
        const int c = blockIdx.x, key_head = blockIdx.y;
        const int t0 = chunk_start[c], n = chunk_len[c];
        const int ratio = num_value_heads / num_key_heads;
        const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv;
        const int conv_dim = 2 * key_dim + value_dim;
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
        const int r0 = 16 * warp, ldv = dv + PAD;
        // conv_out rows (conv_dim apart), or with CONV the projection's (proj_stride apart) to convolve
        const int in_stride = CONV ? proj_stride : conv_dim;
        GDN_PHASES_BEGIN();
#ifdef CONV_WIDTH
        constexpr int width = CONV_WIDTH;
#else
        const int width = conv.width;
#endif
        int first = 0;  // CONV: the chunk's sequence's first row in this step, and its slot's window
        bool is_fresh = true;
        const bf16* window = nullptr;
        if (CONV) {
            const int s = conv.token_seq[t0];
            first = conv.query_start[s];
            is_fresh = conv.fresh[s] != 0;
            window = conv.state + (size_t)conv.slots[s] * (width - 1) * conv_dim;
        }
        // CONV: channels c0 .. c0 + 7's taps, w[e][j] = weight[c0 + e][j] (8 width contiguous bf16)
        auto load_taps = [&](int c0, float (&w)[8][GDN_CONV_MAX_WIDTH]) {
            const uint4* src = reinterpret_cast<const uint4*>(conv.weight + (size_t)c0 * width);
#pragma unroll
            for (int v = 0; v < GDN_CONV_MAX_WIDTH; ++v) {
                if (v < width) {
                    const uint4 raw = src[v];
                    const bf16* x = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
                    for (int k = 0; k < 8; ++k) w[(8 * v + k) / width][(8 * v + k) % width] = to_f(x[k]);
                }
            }
        };
        // row r (< n) of the chunk at channels c0 .. c0 + 7: conv_out's 16 bytes, or with CONV the conv
        // over the sequence's rows (the window's before its first, zeros if fresh), SiLU, bf16
        // (w: the taps as floats, w(e, j) = weight[c0 + e][j])
        auto input_row = [&](int r, int c0, auto w) -> uint4 {
            if (!CONV) return *reinterpret_cast<const uint4*>(conv_out + (size_t)(t0 + r) * in_stride + c0);
            const int pos = t0 + r - first;
            float acc[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
            for (int j = 0; j < GDN_CONV_MAX_WIDTH; ++j) {
                if (j < width) {
                    const int m = pos - (width - 1) + j;
                    uint4 xv = make_uint4(0, 0, 0, 0);
                    if (m >= 0) xv = *reinterpret_cast<const uint4*>(conv_out + (size_t)(first + m) * in_stride + c0);
                    else if (!is_fresh)
                        xv = *reinterpret_cast<const uint4*>(window + (size_t)(width - 1 + m) * conv_dim + c0);
                    const bf16* x = reinterpret_cast<const bf16*>(&xv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[e] += w(e, j) * to_f(x[e]);
                }
            }
            uint4 yv;
            unsigned* y = reinterpret_cast<unsigned*>(&yv);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                y[e] = pack_bf16x2(silu_f(round_bf16(acc[2 * e])), silu_f(round_bf16(acc[2 * e + 1])));
            return yv;
        };

        unsigned char* at = smem;
        const size_t region0 = round_up_128((size_t)CHUNK * LDK * 2) > round_up_128((size_t)CHUNK * ldv * 2)
                                   ? round_up_128((size_t)CHUNK * LDK * 2) : round_up_128((size_t)CHUNK * ldv * 2);
        bf16* qs = reinterpret_cast<bf16*>(at);  // [64][LDK] normed q; once the scores are done, V [64][ldv]
        bf16* vs = qs;
        at += region0;
        bf16* ks = reinterpret_cast<bf16*>(at);  // [64][LDK] normed k
        at += round_up_128((size_t)CHUNK * LDK * 2);
        float* amat = reinterpret_cast<float*>(at);  // [64][LDF]
        at += round_up_128((size_t)CHUNK * LDF * 4);
        float* tinv = reinterpret_cast<float*>(at);  // [64][LDF]
        at += round_up_128((size_t)CHUNK * LDF * 4);
        double* cum = reinterpret_cast<double*>(at);  // [64]
        at += round_up_128(CHUNK * 8);
        float* beta = reinterpret_cast<float*>(at);  // [64]
        at += round_up_128(CHUNK * 4);
        float* beta_decay = reinterpret_cast<float*>(at);  // [64] beta exp(c)
        at += round_up_128(CHUNK * 4);
        // the block's value heads' gate inputs, read at the start (their latency hidden under q / k's):
        // gate_in [head][64][b, a], head_params [head][neg decay rate, dt bias]
        float* gate_in = reinterpret_cast<float*>(at);
        at += round_up_128((size_t)ratio * CHUNK * 2 * 4);
        float* head_params = reinterpret_cast<float*>(at);

        // the group's value heads this block takes: all of them, or (gridDim.z > 1: a step too small
        // to fill the GPU, or a group of more than GATE_SLOTS * 128 / 64 heads; the launcher's choice)
        // 1 / gridDim.z of them, the q / k work repeated
        const int heads_per_block = ratio / gridDim.z;
        const int h_begin = key_head * ratio + blockIdx.z * heads_per_block, h_end = h_begin + heads_per_block;
        constexpr int GATE_SLOTS = 4;  // (head, row) entries a thread: 8 heads of 64 rows
        float gate_b[GATE_SLOTS], gate_a[GATE_SLOTS], rate = 0.f, bias = 0.f;
#pragma unroll
        for (int k = 0; k < GATE_SLOTS; ++k) {
            const int e = threadIdx.x + 128 * k, r = e % CHUNK;
            gate_b[k] = gate_a[k] = 0.f;
            if (e < heads_per_block * CHUNK && r < n) {
                const bf16* row = proj + (size_t)(t0 + r) * proj_stride + conv_dim + value_dim + h_begin + e / CHUNK;
                gate_b[k] = to_f(row[0]);
                gate_a[k] = to_f(row[num_value_heads]);
            }
        }
        if (threadIdx.x < heads_per_block) {
            rate = neg_decay_rate[h_begin + threadIdx.x];
            bias = dt_bias[h_begin + threadIdx.x];
        }

        // 1. q, then k rows: 16-byte loads (ROW_VECS lanes a row, rows r, r + 128 / ROW_VECS, ...; with
        //    CONV convolved first), the row's sum of squares over its lanes, normed (q also x DK^-1/2)
        //    into qs / ks and qn / kn
        constexpr int ROW_VECS = DK / 8, ROWS_A_PASS = 128 / ROW_VECS, PASSES = CHUNK / ROWS_A_PASS;
        {
            const int row_in_pass = threadIdx.x / ROW_VECS, i = (threadIdx.x % ROW_VECS) * 8;
#pragma unroll 1
            for (int tensor = 0; tensor < 2; ++tensor) {  // q, k
                const int c0 = tensor * key_dim + key_head * DK + i;
                float taps[8][GDN_CONV_MAX_WIDTH];
                if (CONV) load_taps(c0, taps);
                uint4 raw[PASSES];
#pragma unroll
                for (int it = 0; it < PASSES; ++it) {
                    const int r = row_in_pass + ROWS_A_PASS * it;
                    raw[it] = make_uint4(0, 0, 0, 0);
                    if (r < n) raw[it] = input_row(r, c0, [&](int e, int j) { return taps[e][j]; });
                }
                const float scale = tensor == 0 ? rsqrtf((float)DK) : 1.f;
                bf16* tile = tensor == 0 ? qs : ks;
                bf16* normed_rows = tensor == 0 ? qn : kn;
#pragma unroll
                for (int it = 0; it < PASSES; ++it) {
                    const int r = row_in_pass + ROWS_A_PASS * it;
                    const bf16* xh = reinterpret_cast<const bf16*>(&raw[it]);
                    float xf[8], sq = 0.f;
#pragma unroll
                    for (int m = 0; m < 8; ++m) {
                        xf[m] = to_f(xh[m]);
                        sq += xf[m] * xf[m];
                    }
#pragma unroll
                    for (int offset = 1; offset < ROW_VECS; offset <<= 1) sq += __shfl_xor_sync(0xffffffffu, sq, offset);
                    const float norm = rsqrtf(sq + L2_NORM_EPS) * scale;
                    uint4 xo;
                    unsigned* xw = reinterpret_cast<unsigned*>(&xo);
#pragma unroll
                    for (int m = 0; m < 4; ++m) xw[m] = pack_op2(xf[2 * m] * norm, xf[2 * m + 1] * norm);
                    *reinterpret_cast<uint4*>(tile + r * LDK + i) = xo;
                    if (r < n && blockIdx.z == 0)  // one block of the group writes the key head's rows
                        *reinterpret_cast<uint4*>(normed_rows + ((size_t)(t0 + r) * num_key_heads + key_head) * DK + i) =
                            xo;
                }
            }
        }
#pragma unroll
        for (int k = 0; k < GATE_SLOTS; ++k) {
            const int e = threadIdx.x + 128 * k;
            if (e < heads_per_block * CHUNK) {
                gate_in[2 * e] = gate_b[k];
                gate_in[2 * e + 1] = gate_a[k];
            }
        }
        if (threadIdx.x < heads_per_block) {
            head_params[2 * threadIdx.x] = rate;
            head_params[2 * threadIdx.x + 1] = bias;
        }
        __syncthreads();
        GDN_PHASE(1);  // q / k loaded and normed

        // 2. raw scores Q K^T and K K^T, warp w rows 16w..: kept for every value head of the group
        float scores[2][CHUNK / 8][4] = {};
        warp_strip_mma<DK, CHUNK / 8, 2>(
            scores, [&](int x, int k0, unsigned* a) { load_a(a, (x == 0 ? qs : ks) + r0 * LDK + k0, LDK); }, ks, LDK);
        __syncthreads();  // qs is dead: V goes there
        GDN_PHASE(2);  // scores (tensor cores)

        const int v_vecs = dv / 8;
        auto load_v = [&](int h) {  // head h's V rows [64][dv] into vs (zeros past the chunk's end)
            if (CONV) {  // convolved here: registers, then shared memory; the taps kept as bf16 (the
                         // scores hold 64 registers here), reloaded per channel group
                uint4 taps[GDN_CONV_MAX_WIDTH];  // weight[c0 ..][..]: 8 width contiguous bf16
                int tap_channel = -1;
                for (int e = threadIdx.x; e < CHUNK * v_vecs; e += blockDim.x) {
                    const int r = e / v_vecs, c0 = 2 * key_dim + h * dv + (e % v_vecs) * 8;
                    if (c0 != tap_channel) {
                        const uint4* src = reinterpret_cast<const uint4*>(conv.weight + (size_t)c0 * width);
#pragma unroll
                        for (int v = 0; v < GDN_CONV_MAX_WIDTH; ++v)
                            if (v < width) taps[v] = src[v];
                        tap_channel = c0;
                    }
                    uint4 xv = make_uint4(0, 0, 0, 0);
                    if (r < n)
                        xv = input_row(r, c0, [&](int tap_e, int j) {
                            const int flat = tap_e * width + j;
                            return to_f(reinterpret_cast<const bf16*>(&taps[flat / 8])[flat % 8]);
                        });
                    *reinterpret_cast<uint4*>(vs + r * ldv + (e % v_vecs) * 8) = xv;
                }
            } else {
                for (int e = threadIdx.x; e < CHUNK * v_vecs; e += blockDim.x) {
                    const int r = e / v_vecs, jv = (e % v_vecs) * 8;
                    gdn_copy16(vs + r * ldv + jv,
                               conv_out + (size_t)(t0 + (r < n ? r : 0)) * conv_dim + 2 * key_dim + h * dv + jv, r < n);
                }
                gdn_commit_copies();
            }
        };
        load_v(h_begin);
        for (int h = h_begin; h < h_end; ++h) {
            // 3. gates and the cumulative decay c (fp64: c_t reaches -1000 within a chunk for
            //    fast-forgetting heads), warp 0: rows 2 lane, 2 lane + 1
            if (warp == 0) {
                float b[2], lg[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int r = 2 * lane + e, at_head = (h - h_begin) * CHUNK + r;
                    b[e] = lg[e] = 0.f;
                    if (r < n) {
                        b[e] = gdn_beta(gate_in[2 * at_head]);
                        lg[e] = gdn_log_decay(gate_in[2 * at_head + 1], head_params[2 * (h - h_begin)],
                                              head_params[2 * (h - h_begin) + 1]);
                    }
                }
                const double pair = (double)lg[0] + (double)lg[1];
                double inclusive = pair;
#pragma unroll
                for (unsigned offset = 1; offset < 32; offset <<= 1) {
                    const double below = shfl_up_double(inclusive, offset);
                    if (lane >= (int)offset) inclusive += below;
                }
                double before = shfl_up_double(inclusive, 1);
                if (lane == 0) before = 0.0;
                const double sums[2] = {before + (double)lg[0], inclusive};
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int r = 2 * lane + e;
                    cum[r] = sums[e];
                    beta[r] = b[e];
                    beta_decay[r] = b[e] * __expf((float)sums[e]);
                    if (r < n) cum_out[(size_t)(t0 + r) * num_value_heads + h] = (float)sums[e];
                }
            }
            __syncthreads();
            GDN_PHASE(3);  // gates, cumulative decay

            // 4. P = lower(Q K^T * D) to global, A = strict_lower(beta K K^T * D) to shared
            {
                bf16* p = p_out + ((size_t)c * num_value_heads + h) * CHUNK * CHUNK;
                // the rows' c and beta once (the compiler cannot keep them across the stores to A)
                const double cum_row[2] = {cum[r0 + g], cum[r0 + g + 8]};
                const float beta_row[2] = {beta[r0 + g], beta[r0 + g + 8]};
#pragma unroll
                for (int nt = 0; nt < CHUNK / 8; ++nt) {
                    const double cum_col[2] = {cum[nt * 8 + 2 * q4], cum[nt * 8 + 2 * q4 + 1]};
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int i = r0 + g + 8 * half, j = nt * 8 + 2 * q4;
                        float pv[2], av[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int jj = j + e;
                            const float d = jj <= i ? __expf((float)(cum_row[half] - cum_col[e])) : 0.f;
                            pv[e] = scores[0][nt][2 * half + e] * d;
                            av[e] = jj < i ? beta_row[half] * scores[1][nt][2 * half + e] * d : 0.f;
                        }
                        store_pair(p + i * CHUNK + j, pv[0], pv[1]);
                        *reinterpret_cast<float2*>(amat + i * LDF + j) = make_float2(av[0], av[1]);
                    }
                }
            }
            __syncthreads();
            GDN_PHASE(4);  // P and A

            // 5. T = (I + A)^-1 by 16 x 16 blocks (ends at a barrier)
            if (MMA_SOLVE) {
                solve_blocked_mma(amat, tinv);
            } else {
                solve_blocked(amat, tinv);
            }
            GDN_PHASE(5);  // T

            // 6. W = (T diag(beta exp(c))) K, then U = (T diag(beta)) V: warp w rows 16w.., 16 columns
            //    an mma pair; T's A fragments scaled from the fp32 solve
            auto scaled_t = [&](const float* scale, unsigned (*t_frag)[4]) {  // T diag(scale), A fragments
#pragma unroll
                for (int kk = 0; kk < CHUNK / 16; ++kk)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {  // columns 16 kk + 2 q4 (+1), then + 8
                        const int j = 16 * kk + 2 * q4 + 8 * half;
                        const float2 t_lo = *reinterpret_cast<const float2*>(tinv + (r0 + g) * LDF + j);
                        const float2 t_hi = *reinterpret_cast<const float2*>(tinv + (r0 + g + 8) * LDF + j);
                        const float2 s = *reinterpret_cast<const float2*>(scale + j);
                        t_frag[kk][2 * half] = pack_op2(t_lo.x * s.x, t_lo.y * s.y);
                        t_frag[kk][2 * half + 1] = pack_op2(t_hi.x * s.x, t_hi.y * s.y);
                    }
            };
            auto product = [&](const unsigned (*t_frag)[4], const bf16* rows, int ld, int width, bf16* dst) {
                const size_t row_stride = (size_t)num_value_heads * width;
                const int ldt = width + PAD;  // the staging tile's bf16 rows, in A's fp32 [64][LDF]
                const bool stage = STAGED_STORES && ldt <= 2 * LDF;
                bf16* tile = reinterpret_cast<bf16*>(amat);
                for (int np = 0; np < width / 16; ++np) {
                    float acc[2][4] = {};
#pragma unroll
                    for (int kk = 0; kk < CHUNK / 16; ++kk) {
                        unsigned b[4];
                        load_b_row_major_pair(b, rows + 16 * kk * ld + 16 * np, ld);
                        mma_op_16816(acc[0], t_frag[kk], b[0], b[1]);
                        mma_op_16816(acc[1], t_frag[kk], b[2], b[3]);
                    }
#pragma unroll
                    for (int t = 0; t < 2; ++t) {
                        const int j = 16 * np + 8 * t + 2 * q4;
                        if (stage) {
                            store_pair(tile + (r0 + g) * ldt + j, acc[t][0], acc[t][1]);
                            store_pair(tile + (r0 + g + 8) * ldt + j, acc[t][2], acc[t][3]);
                            continue;
                        }
                        if (r0 + g < n) store_pair(dst + (size_t)(t0 + r0 + g) * row_stride + j, acc[t][0], acc[t][1]);
                        if (r0 + g + 8 < n)
                            store_pair(dst + (size_t)(t0 + r0 + g + 8) * row_stride + j, acc[t][2], acc[t][3]);
                    }
                }
                if (stage) {  // every warp's rows in the tile, then whole 16-byte row pieces out
                    __syncthreads();
                    const int vecs = width / 8;
                    for (int e = threadIdx.x; e < CHUNK * vecs; e += blockDim.x) {
                        const int r = e / vecs, j = (e % vecs) * 8;
                        if (r < n)
                            *reinterpret_cast<uint4*>(dst + (size_t)(t0 + r) * row_stride + j) =
                                *reinterpret_cast<const uint4*>(tile + r * ldt + j);
                    }
                }
            };
            unsigned t_frag[CHUNK / 16][4];
            scaled_t(beta_decay, t_frag);
            product(t_frag, ks, LDK, DK, w_out + (size_t)h * DK);
            scaled_t(beta, t_frag);
            gdn_wait_copies<0>();
            __syncthreads();  // head h's V is in
#ifdef GDN_F16_OPERANDS  // V (bf16, as loaded) to the operand format in place
            for (int e = threadIdx.x; e < CHUNK * v_vecs; e += blockDim.x) {
                uint4* at = reinterpret_cast<uint4*>(vs + (e / v_vecs) * ldv + (e % v_vecs) * 8);
                *at = op_from_bf16x8(*at);
            }
            __syncthreads();
#endif
            product(t_frag, vs, ldv, dv, u_out + (size_t)h * dv);
            __syncthreads();  // V, T, c, beta are free for the next head
            if (h + 1 < h_end) load_v(h + 1);
            GDN_PHASE(6);  // W and U (tensor cores) stored
        }
        GDN_PHASES_DONE();
    }
}

extern "C" __global__ void __launch_bounds__(128, 3) gdn_chunk_prepare_grouped(PREPARE_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_prepare_grouped<false>(smem, PREPARE_ARGS);
}

// gdn_chunk_prepare_grouped_mma (OPENINFER_QWEN35_GDN_PREFILL=grouped_mma): the grouped kernel with
// the triangular solve's block products on tensor cores (solve_blocked_mma)
extern "C" __global__ void __launch_bounds__(128, 3) gdn_chunk_prepare_grouped_mma(PREPARE_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_prepare_grouped<true>(smem, PREPARE_ARGS);
}

// gdn_chunk_prepare_grouped_conv (OPENINFER_QWEN35_GDN_PREFILL=grouped_conv): grouped_mma with the
// conv1d + SiLU fused in (GroupedConv): reads the projection rows and the slots' conv windows instead
// of conv_out, so a step's chunked rows need no gdn_conv1d_vec pass (no conv_out written and read
// back); the launcher runs gdn_conv_state after it. conv_out's bits (the same sums in the same order).
extern "C" __global__ void __launch_bounds__(128, 3)
gdn_chunk_prepare_grouped_conv(const bf16* __restrict__ proj, int proj_stride, const bf16* __restrict__ conv_weight,
                               const bf16* __restrict__ conv_state, const int* __restrict__ query_start,
                               const int* __restrict__ slots, const int* __restrict__ fresh,
                               const int* __restrict__ token_seq, int conv_width,
                               const float* __restrict__ neg_decay_rate, const float* __restrict__ dt_bias,
                               const int* __restrict__ chunk_start, const int* __restrict__ chunk_len,
                               bf16* __restrict__ qn, bf16* __restrict__ kn, bf16* __restrict__ w_out,
                               bf16* __restrict__ u_out, bf16* __restrict__ p_out, float* __restrict__ cum_out,
                               int num_key_heads, int num_value_heads, int dv) {
    GDN_DYNAMIC_SHARED(smem);
    const GroupedConv conv{conv_weight, conv_state, query_start, slots, fresh, token_seq, conv_width};
    chunk_prepare_grouped<true, true>(smem, proj, proj, proj_stride, neg_decay_rate, dt_bias, chunk_start, chunk_len,
                                      qn, kn, w_out, u_out, p_out, cum_out, num_key_heads, num_value_heads, dv, conv);
}

// gdn_chunk_output_staged (OPENINFER_QWEN35_GDN_PREFILL=grouped_out): gdn_chunk_output with every
// operand of the block — Q, P, the head's whole S^T [dv][DK] and V' [64][dv] — in flight at once
// (cp.async, one wait) instead of a 32-channel tile of S^T / V' at a time behind two barriers, and
// V' as the row-major B operand of P V' (ldmatrix.trans) instead of a transposed copy made by
// scalar shared-memory stores. The same products in the same k order: gdn_chunk_output's bits.
// grid (N, nv), 128 threads; shared: Q [64][LDK], P [64][LDC], S^T [dv][LDK], V' [64][dv + PAD]
// bf16, c [64] fp32 (79 KiB at 128 / 128: 2 blocks an SM).
extern "C" __global__ void __launch_bounds__(SCAN_THREADS, 2)
gdn_chunk_output_staged(const bf16* __restrict__ qn, const bf16* __restrict__ p_in, const float* __restrict__ cum_in,
                        const bf16* __restrict__ states, const bf16* __restrict__ v_new,
                        const int* __restrict__ chunk_start, const int* __restrict__ chunk_len,
                        bf16* __restrict__ core, int num_key_heads, int num_value_heads, int dv) {
    GDN_DYNAMIC_SHARED(smem);
    const int c = blockIdx.x, h = blockIdx.y;
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int value_dim = num_value_heads * dv, ldv = dv + PAD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
    const int t0 = chunk_start[c], n = chunk_len[c];

    unsigned char* at = smem;
    bf16* qs = reinterpret_cast<bf16*>(at);  // Q [64][LDK]
    at += round_up_128((size_t)CHUNK * LDK * 2);
    bf16* ps = reinterpret_cast<bf16*>(at);  // P [64][LDC]
    at += round_up_128((size_t)CHUNK * LDC * 2);
    bf16* sbt = reinterpret_cast<bf16*>(at);  // S^T [dv][LDK]
    at += round_up_128((size_t)dv * LDK * 2);
    bf16* vs = reinterpret_cast<bf16*>(at);  // V' [64][ldv]
    at += round_up_128((size_t)CHUNK * ldv * 2);
    float* cum = reinterpret_cast<float*>(at);  // [64]

    constexpr int ROW_VECS = DK / 8;
    for (int e = threadIdx.x; e < CHUNK * ROW_VECS; e += SCAN_THREADS) {
        const int r = e / ROW_VECS, i = (e % ROW_VECS) * 8;
        gdn_copy16(qs + r * LDK + i, qn + ((size_t)(t0 + (r < n ? r : 0)) * num_key_heads + key_head) * DK + i, r < n);
    }
    const bf16* p = p_in + ((size_t)c * num_value_heads + h) * CHUNK * CHUNK;
    for (int e = threadIdx.x; e < CHUNK * CHUNK / 8; e += SCAN_THREADS)
        gdn_copy16(ps + (e / (CHUNK / 8)) * LDC + (e % (CHUNK / 8)) * 8, p + e * 8, true);
    const bf16* state_in = states + ((size_t)c * num_value_heads + h) * dv * DK;
    for (int e = threadIdx.x; e < dv * ROW_VECS; e += SCAN_THREADS) {
        const int j = e / ROW_VECS, i = (e % ROW_VECS) * 8;
        gdn_copy16(sbt + j * LDK + i, state_in + (size_t)j * DK + i, true);
    }
    const int v_vecs = dv / 8;
    for (int e = threadIdx.x; e < CHUNK * v_vecs; e += SCAN_THREADS) {
        const int r = e / v_vecs, j = (e % v_vecs) * 8;
        gdn_copy16(vs + r * ldv + j, v_new + ((size_t)(t0 + (r < n ? r : 0)) * num_value_heads + h) * dv + j, r < n);
    }
    gdn_commit_copies();
    if (threadIdx.x < CHUNK) {  // padding rows: the last row's c, as gdn_chunk_output
        const int r = threadIdx.x < n ? threadIdx.x : n - 1;
        cum[threadIdx.x] = cum_in[(size_t)(t0 + r) * num_value_heads + h];
    }
    gdn_wait_copies<0>();
    __syncthreads();

    const int r0 = 16 * warp;
    const float row_decay[2] = {__expf(cum[r0 + g]), __expf(cum[r0 + g + 8])};
    for (int j0 = 0; j0 < dv; j0 += SCAN_TILE) {
        float acc_o[1][SCAN_TILE / 8][4] = {};
        warp_strip_mma<DK, SCAN_TILE / 8, 1>(
            acc_o, [&](int, int k0, unsigned* a) { load_a(a, qs + r0 * LDK + k0, LDK); }, sbt + j0 * LDK, LDK);
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int nt = 0; nt < SCAN_TILE / 8; ++nt) {
                acc_o[0][nt][2 * half] *= row_decay[half];
                acc_o[0][nt][2 * half + 1] *= row_decay[half];
            }
#pragma unroll
        for (int k0 = 0; k0 < CHUNK; k0 += 16) {  // + P V', V' rows as the B operand (k = chunk row)
            unsigned a[4];
            load_a(a, ps + r0 * LDC + k0, LDC);
#pragma unroll
            for (int np = 0; np < SCAN_TILE / 16; ++np) {
                unsigned b[4];
                load_b_row_major_pair(b, vs + k0 * ldv + j0 + 16 * np, ldv);
                mma_op_16816(acc_o[0][2 * np], a, b[0], b[1]);
                mma_op_16816(acc_o[0][2 * np + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = r0 + g + 8 * half;
            if (r < n) {
                bf16* o = core + (size_t)(t0 + r) * value_dim + (size_t)h * dv + j0;
#pragma unroll
                for (int nt = 0; nt < SCAN_TILE / 8; ++nt)
                    store_pair_bf16(o + nt * 8 + 2 * q4, acc_o[0][nt][2 * half], acc_o[0][nt][2 * half + 1]);
            }
        }
    }
}

// gdn_chunk_prepare_grouped_coalesced (OPENINFER_QWEN35_GDN_PREFILL=grouped_coalesced): grouped_mma with
// W and U staged through shared memory and stored as 16-byte row pieces (STAGED_STORES); its bits
extern "C" __global__ void __launch_bounds__(128, 3) gdn_chunk_prepare_grouped_coalesced(PREPARE_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_prepare_grouped<true, false, true>(smem, PREPARE_ARGS);
}
