// The chunked gated delta rule on tensor cores with split operands (OPENINFER_QWEN35_GDN_PREFILL=chunked_split;
// issue #17): gdn_chunked.cu's chunk algorithm (chunks of 64, the UT transform, the state carried between
// chunks; see its header for the equations) with every product at ~fp32 accuracy on bf16 mma.sync:
//   - the q / k products on the raw bf16 rows of conv_out (exact products, fp32 sums), their l2 norms kept in
//     fp32 and applied as fp32 scales after the mma (q . k = rq rk (q_raw . k_raw));
//   - every other operand fp32, split when its fragment is loaded into bf16 parts x = hi + mid + lo (8 bits
//     each: the three hold an fp32 value to ~2^-24), each part an exact bf16 mma operand, fp32 accumulate.
//     The products keep the terms down to ~2^-18 of the leading one (P V': hi*hi, hi*mid, mid*hi, hi*lo,
//     lo*hi, mid*mid), but W S only hi*hi, hi*mid, mid*hi and T diag(beta exp c) 2 parts: the CPU emulation
//     of the teacher-forced test (tests/plugins/qwen35/gdn_teacher_forced_emulation.py, 12 prompts, 1,516
//     positions) gives 0.0060 / 0.0301 vs HF as built (token-by-token 0.0060 / 0.0304), and says what
//     dropping more costs: P V' to 3 terms 0.0098, T diag(beta) to 2 parts 0.0077, S or
//     diag(exp(c_C - c)) V' to 2 parts 0.0063;
//   - intermediates between the kernels in fp32 (U, W, P; c; the norms).
// The chain's 16-bit operands (grouped_staged: q / k normed, W, U, P, S^T, V' rounded to bf16) put the
// teacher-forced test vs HF at 0.0173 / 0.059 (mean / p99 |dlogprob|); the fp32 chain (gdn_chunked_fp32.cu)
// at the token-by-token kernels' 0.0071 / 0.030 but 11x slower on CUDA cores.
//
// gdn_chunk_prepare_split: grid (chunks, value heads), 128 threads (warp w: rows 16w .. 16w + 15): raw q / k
// rows (and k^T, v^T) in shared memory, the norms, gates and c (fp64 sums), Q K^T and K K^T on tensor cores
// (exact), A and P in fp32, T = (I + A)^-1 by 16 x 16 blocks (fp32), U = (T diag(beta)) V_raw (3 mmas)
// and W = (T diag(beta exp(c) rk)) K_raw (2 mmas: W to 16 bits); writes U, W, P, c and the key head's norms.
// gdn_chunk_walk_split: grid (dv / 32, sequences, value heads), 128 threads: S^T's 32 rows (value channels) in
// the warps' mma accumulators (fp32; each warp a 16 x DK/2 region for the whole sequence) and as bf16 hi / mid /
// lo planes in shared memory (every warp's B operand), per chunk V' = U - W S (W 2 parts x S 2 parts less mid*mid: 3 mmas),
// O = diag(rq exp(c)) Q_raw S (3) + P V' (3 x 3 parts: 6 mmas) to `core` (bf16), S^T <- exp(c_C) S^T +
// (diag(rk exp(c_C - c)) V')^T K_raw (3).
//
// Layouts (T tokens, N chunks): conv_out / proj as gdn_chunked.cu; w [T, nv, DK], u [T, nv, dv] fp32;
// p [N, nv, 64, 64] fp32; cum [T, nv] fp32; norms [T, nk, 2] fp32 (q's with DK^-1/2, k's); core [T, nv * dv] bf16.
#include "gdn_common.cuh"
#include "mma.cuh"

#define SPLIT_CHUNK 64
#define SPLIT_THREADS 128
#define SPLIT_TILE 32           // value channels a walk block
#define SPLIT_LDH (DK + 8)      // bf16 rows of DK (raw q / k): conflict-free 4-byte fragment loads
#define SPLIT_LDCH (SPLIT_CHUNK + 8)  // bf16 rows of 64 (k^T, v^T)
#define SPLIT_LDF (SPLIT_CHUNK + 8)   // fp32 rows of 64 (A, T, P, V'^T): 8-byte fragment loads, ld = 8 mod 32
#define SPLIT_LDU (SPLIT_TILE + 8)    // fp32 rows of the walk's 32 channels (U): 8-byte loads, ld = 8 mod 32

static_assert(DK % 64 == 0, "the split chunked kernels take key head dims that are multiples of 64");

#ifndef GDN_DYNAMIC_SHARED
#define GDN_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// Diagnostic builds of benchmarks/gpu_qwen35.py --gdn-prefill-only (never the plugin's):
// GDN_PHASE_CLOCKS: lane 0 of the last warp (the longest strip's products) of every block adds each phase's SM
// clock cycles to gdn_split_phase_cycles[phase] (phases 1.. as marked below, a walk's summed over its chunks;
// [0] counts blocks) — where a block's time goes. GDN_SPLIT_ONE_PART (timing only, wrong outputs): every product
// as its hi * hi mma alone (the parts' splits dead with it) — what the extra mmas cost.
#ifdef GDN_PHASE_CLOCKS
extern "C" {
__device__ unsigned long long gdn_split_phase_cycles[16];
}
#define SPLIT_PHASE_THREAD (SPLIT_THREADS - 32)
#define SPLIT_PHASES_BEGIN() long long phase_clock = clock64()
#define SPLIT_PHASE(k)                                                                        \
    do {                                                                                      \
        if (threadIdx.x == SPLIT_PHASE_THREAD) {                                              \
            const long long now = clock64();                                                  \
            atomicAdd(gdn_split_phase_cycles + (k), (unsigned long long)(now - phase_clock)); \
            phase_clock = now;                                                                \
        }                                                                                     \
    } while (0)
#define SPLIT_PHASES_DONE() \
    if (threadIdx.x == SPLIT_PHASE_THREAD) atomicAdd(gdn_split_phase_cycles, 1ull)
#else
#define SPLIT_PHASES_BEGIN()
#define SPLIT_PHASE(k)
#define SPLIT_PHASES_DONE()
#endif
#ifdef GDN_SPLIT_ONE_PART
#define MMA_PART(acc, a, b0, b1)
#else
#define MMA_PART(acc, a, b0, b1) mma_bf16_16816(acc, a, b0, b1)
#endif

// x0, x1 as three packed bf16 pairs hi + mid + lo (each part exact in bf16: the remainders are exact in fp32)
__device__ __forceinline__ void split3_pair(float x0, float x1, unsigned& hi, unsigned& mid, unsigned& lo) {
    const float h0 = round_bf16(x0), h1 = round_bf16(x1);
    const float r0 = x0 - h0, r1 = x1 - h1;
    const float m0 = round_bf16(r0), m1 = round_bf16(r1);
    hi = pack_bf16x2(h0, h1);
    mid = pack_bf16x2(m0, m1);
    lo = pack_bf16x2(r0 - m0, r1 - m1);
}
__device__ __forceinline__ void split2_pair(float x0, float x1, unsigned& hi, unsigned& mid) {
    const float h0 = round_bf16(x0), h1 = round_bf16(x1);
    hi = pack_bf16x2(h0, h1);
    mid = pack_bf16x2(x0 - h0, x1 - h1);
}

__device__ __forceinline__ float2 load_f2(const float* at) { return *reinterpret_cast<const float2*>(at); }

// The fp32 values of an A fragment 16 x 16 at `base` (row-major, leading dim ld, even): rows g, g + 8,
// columns 2q, 2q + 1 and 2q + 8, 2q + 9 (mma_bf16_16816's order), each column times scale[column] when given.
__device__ __forceinline__ void load_a_f32(float2* f, const float* base, int ld, const float* col_scale) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    f[0] = load_f2(base + g * ld + 2 * q);
    f[1] = load_f2(base + (g + 8) * ld + 2 * q);
    f[2] = load_f2(base + g * ld + 2 * q + 8);
    f[3] = load_f2(base + (g + 8) * ld + 2 * q + 8);
    if (col_scale != nullptr) {
        const float2 s0 = load_f2(col_scale + 2 * q), s1 = load_f2(col_scale + 2 * q + 8);
        f[0].x *= s0.x, f[0].y *= s0.y, f[1].x *= s0.x, f[1].y *= s0.y;
        f[2].x *= s1.x, f[2].y *= s1.y, f[3].x *= s1.x, f[3].y *= s1.y;
    }
}
// The same from global rows `rows` + r stride (r = row0 + g, row0 + g + 8; rows from n on: zeros)
__device__ __forceinline__ void load_a_rows_f32(float2* f, const float* rows, size_t stride, int row0, int n, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, r0 = row0 + g, r1 = row0 + g + 8;
    const float2 zero = make_float2(0.f, 0.f);
    f[0] = r0 < n ? load_f2(rows + r0 * stride + k0 + 2 * q) : zero;
    f[1] = r1 < n ? load_f2(rows + r1 * stride + k0 + 2 * q) : zero;
    f[2] = r0 < n ? load_f2(rows + r0 * stride + k0 + 2 * q + 8) : zero;
    f[3] = r1 < n ? load_f2(rows + r1 * stride + k0 + 2 * q + 8) : zero;
}
// The fp32 values of a B fragment 16(k) x 8(n) from its transpose bt [n][k] (row-major, ld even).
__device__ __forceinline__ void load_b_f32(float2* f, const float* base, int ld) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    f[0] = load_f2(base + g * ld + 2 * q);
    f[1] = load_f2(base + g * ld + 2 * q + 8);
}
// 16-bit fragments as stored (raw bf16 rows: exact operands; or fp16 bits): gdn_chunked.cu's load_a / load_b.
template <class Half>
__device__ __forceinline__ void load_a_raw(unsigned* a, const Half* base, int ld) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    a[0] = *reinterpret_cast<const unsigned*>(base + g * ld + 2 * q);
    a[1] = *reinterpret_cast<const unsigned*>(base + (g + 8) * ld + 2 * q);
    a[2] = *reinterpret_cast<const unsigned*>(base + g * ld + 2 * q + 8);
    a[3] = *reinterpret_cast<const unsigned*>(base + (g + 8) * ld + 2 * q + 8);
}
template <class Half>
__device__ __forceinline__ void load_b_raw(unsigned* b, const Half* base, int ld) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    b[0] = *reinterpret_cast<const unsigned*>(base + g * ld + 2 * q);
    b[1] = *reinterpret_cast<const unsigned*>(base + g * ld + 2 * q + 8);
}

template <int N>
__device__ __forceinline__ void split3_fragment(const float2* f, unsigned* hi, unsigned* mid, unsigned* lo) {
#pragma unroll
    for (int e = 0; e < N; ++e) split3_pair(f[e].x, f[e].y, hi[e], mid[e], lo[e]);
}

// 8 bf16 of a 16-byte vector (16-byte aligned: one vector load / store)
struct alignas(16) Bf16x8 {
    bf16 x[8];
};

__device__ __forceinline__ Bf16x8 zero_bf16x8() {
    Bf16x8 v;
#pragma unroll
    for (int m = 0; m < 8; ++m) v.x[m] = __float2bfloat16_rn(0.f);
    return v;
}

// A chunk's rows of q and k (row r at rows + r * stride and key_offset further; rows from n on: zeros) as
// 8-element vectors, the row index fastest (a warp's transposed stores then fall in 16 distinct words): each
// thread's loads all issued before its stores (store(r, i, q8, k8): columns i .. i + 7 of row r).
template <class Store>
__device__ __forceinline__ void load_qk_rows(const bf16* rows, size_t stride, int key_offset, int n, Store store) {
    constexpr int PER_THREAD = SPLIT_CHUNK * (DK / 8) / SPLIT_THREADS;
    static_assert(PER_THREAD * SPLIT_THREADS == SPLIT_CHUNK * (DK / 8), "a thread's share of the q / k vectors");
    Bf16x8 q8[PER_THREAD], k8[PER_THREAD];
#pragma unroll
    for (int b = 0; b < PER_THREAD; ++b) {
        const int e = threadIdx.x + b * SPLIT_THREADS, r = e % SPLIT_CHUNK, i = 8 * (e / SPLIT_CHUNK);
        if (r < n) {
            const bf16* row = rows + (size_t)r * stride + i;
            q8[b] = *reinterpret_cast<const Bf16x8*>(row);
            k8[b] = *reinterpret_cast<const Bf16x8*>(row + key_offset);
        } else {
            q8[b] = k8[b] = zero_bf16x8();
        }
    }
#pragma unroll
    for (int b = 0; b < PER_THREAD; ++b) {
        const int e = threadIdx.x + b * SPLIT_THREADS;
        store(e % SPLIT_CHUNK, 8 * (e / SPLIT_CHUNK), q8[b], k8[b]);
    }
}

// A warp's accumulator element (nt, e) of a 16-row strip: row g (+ 8 for e >= 2), column 8 nt + 2q (+ 1 for odd e)
__device__ __forceinline__ int acc_row(int e) { return ((threadIdx.x & 31) >> 2) + (e >= 2 ? 8 : 0); }
__device__ __forceinline__ int acc_col(int nt, int e) { return 8 * nt + 2 * ((threadIdx.x & 31) & 3) + (e & 1); }

// T = (I + A)^-1 for the strictly lower 64 x 64 A (fp32, leading dim SPLIT_LDF) in 16 x 16 blocks, all 128
// threads busy (gdn_chunked.cu's solve_blocked): (a) each diagonal block's inverse T_bb by forward
// substitution, a thread per (block, column); (b) block row by block row, i = 1..3, every j < i at once:
// M_ij = sum_{j<=k<i} A_ik T_kj (kept in A's unused upper triangle, block (j, i)), T_ij = -T_ii M_ij.
// Writes every element of T (zeros above the diagonal).
__device__ __forceinline__ void solve_blocked_split(float* amat, float* tinv) {
    constexpr int B = 16, NB = SPLIT_CHUNK / B, LD = SPLIT_LDF;
    if (threadIdx.x < SPLIT_CHUNK) {
        const int base = (threadIdx.x / B) * B, j = threadIdx.x;
        for (int i = 0; i <= j; ++i) tinv[i * LD + j] = i == j ? 1.f : 0.f;
        for (int i = j + 1; i < base + B; ++i) {
            float acc = -amat[i * LD + j];
            for (int m = j + 1; m < i; ++m) acc -= amat[i * LD + m] * tinv[m * LD + j];
            tinv[i * LD + j] = acc;
        }
    }
    __syncthreads();
#pragma unroll 1
    for (int ib = 1; ib < NB; ++ib) {
        for (int e = threadIdx.x; e < ib * B * B; e += SPLIT_THREADS) {
            const int jb = e / (B * B), r = (e / B) % B, c = e % B;
            const float* a_row = amat + (ib * B + r) * LD;
            float acc = 0.f;
            for (int m = jb * B; m < ib * B; ++m) acc += a_row[m] * tinv[m * LD + jb * B + c];
            amat[(jb * B + r) * LD + ib * B + c] = acc;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < ib * B * B; e += SPLIT_THREADS) {
            const int jb = e / (B * B), r = (e / B) % B, c = e % B;
            const float* t_row = tinv + (ib * B + r) * LD + ib * B;  // T_ii's row r: unit diagonal
            float acc = amat[(jb * B + r) * LD + ib * B + c];
            for (int m = 0; m < r; ++m) acc += t_row[m] * amat[(jb * B + m) * LD + ib * B + c];
            tinv[(ib * B + r) * LD + jb * B + c] = -acc;
        }
        __syncthreads();
    }
}

// fp16 operand parts (the _f16 kernels; OPENINFER_QWEN35_GDN_PREFILL=chunked_split_f16): x = hi + 2^-11 lo with
// hi = fp16(x) and lo = fp16((x - hi) 2^11) (the remainder scaled back into fp16's normal range): ~22 bits in two
// parts where bf16 needs three, so a product of two split operands takes 3 mmas (hi*hi into one accumulator,
// hi*lo + lo*hi into another, summed times 2^-11 after the k loop) instead of 6, and a split operand against
// the raw q / k / v rows (bf16 values: exact in fp16 within its range) 2 instead of 3. The teacher-forced CPU
// emulation with every operand in this form (tests/plugins/qwen35/gdn_teacher_forced_emulation.py, "fp16 hi +
// scaled lo" products, 12 prompts): 0.0059 / 0.0297 vs HF, the token-by-token rule 0.0060 / 0.0304, the bf16
// parts as built 0.0060 / 0.0301; T = (I + A)^-1 rounded to 22 bits 0.0059 (to 16: 0.0073). Range: the parts
// are fp16, so |S|, |V'|, |W|, |U|, T and the raw q / k / v below 65504 (the state and V' are the size of the
// layer's v: the delta rule's update is a contraction; grouped_f16 assumes the same).
#define F16_LO_SCALE 2048.f  // 2^11: an fp16 rounding's remainder back to the value's scale
#define F16_LO_UNSCALE (1.f / 2048.f)

#ifdef MMA_HOST_STANDIN
// the host emulation (tests/helpers/cuda_host): fp16 as the compiler's _Float16, the fp16 mma as four bf16
// stand-in mmas over exact bf16 hi / lo parts of each fp16 operand (11 significant bits = 8 + 3)
__device__ __forceinline__ unsigned short f16_bits(float x) {
    const _Float16 h = static_cast<_Float16>(x);
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
__device__ __forceinline__ float f16_value(unsigned short bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
}
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    return static_cast<unsigned>(f16_bits(lo)) | (static_cast<unsigned>(f16_bits(hi)) << 16);
}
__device__ __forceinline__ float2 unpack_f16x2(unsigned packed) {
    return make_float2(f16_value(packed & 0xFFFFu), f16_value(packed >> 16));
}
__device__ __forceinline__ unsigned short f16_from_bf16(bf16 x) { return f16_bits(to_f(x)); }
__device__ __forceinline__ void f16_pair_as_bf16(unsigned packed, unsigned& hi, unsigned& lo) {
    const float2 x = unpack_f16x2(packed);
    const float h0 = round_bf16(x.x), h1 = round_bf16(x.y);
    hi = pack_bf16x2(h0, h1);
    lo = pack_bf16x2(x.x - h0, x.y - h1);
}
__device__ __forceinline__ void mma_f16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    unsigned a_hi[4], a_lo[4], b_hi[2], b_lo[2];
    for (int e = 0; e < 4; ++e) f16_pair_as_bf16(a[e], a_hi[e], a_lo[e]);
    f16_pair_as_bf16(b0, b_hi[0], b_lo[0]);
    f16_pair_as_bf16(b1, b_hi[1], b_lo[1]);
    mma_bf16_16816(d, a_hi, b_hi[0], b_hi[1]);
    mma_bf16_16816(d, a_hi, b_lo[0], b_lo[1]);
    mma_bf16_16816(d, a_lo, b_hi[0], b_hi[1]);
    mma_bf16_16816(d, a_lo, b_lo[0], b_lo[1]);
}
#else
#include <cuda_fp16.h>
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}
__device__ __forceinline__ float2 unpack_f16x2(unsigned packed) {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
}
__device__ __forceinline__ unsigned short f16_from_bf16(bf16 x) {
    return __half_as_ushort(__float2half_rn(__bfloat162float(x)));
}
// D = A·B + D for one m16n8k16 fp16 tile (fp32 accumulate), mma_bf16_16816's fragment layout
__device__ __forceinline__ void mma_f16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
#ifdef GDN_SPLIT_ONE_PART
#define MMA_F16_PART(acc, a, b0, b1)
#else
#define MMA_F16_PART(acc, a, b0, b1) mma_f16_16816(acc, a, b0, b1)
#endif

// x0, x1 as packed fp16 pairs hi and lo = (x - hi) 2^11
__device__ __forceinline__ void split_f16_pair(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = pack_f16x2(x0, x1);
    const float2 h = unpack_f16x2(hi);
    lo = pack_f16x2((x0 - h.x) * F16_LO_SCALE, (x1 - h.y) * F16_LO_SCALE);
}
// a packed bf16 pair as a packed fp16 pair (exact within fp16's range)
__device__ __forceinline__ unsigned f16x2_from_bf16x2(unsigned packed) {
    return pack_f16x2(__int_as_float((int)(packed << 16)), __int_as_float((int)(packed & 0xFFFF0000u)));
}
// An A fragment of raw bf16 rows (load_a_raw) as fp16 operands
__device__ __forceinline__ void load_a_raw_as_f16(unsigned* a, const bf16* base, int ld) {
    load_a_raw(a, base, ld);
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = f16x2_from_bf16x2(a[e]);
}
// The B fragment 16(k) x 8(n) of row-major [k][n] raw bf16 rows (16-byte aligned rows) as fp16 operands
__device__ __forceinline__ void load_b_rows_as_f16(unsigned* b, const bf16* base, int ld) {
#ifdef MMA_HOST_STANDIN
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    b[0] = pack_f16x2(to_f(base[(2 * q) * ld + g]), to_f(base[(2 * q + 1) * ld + g]));
    b[1] = pack_f16x2(to_f(base[(2 * q + 8) * ld + g]), to_f(base[(2 * q + 9) * ld + g]));
#else
    ldmatrix_x2_trans(b[0], b[1], base + (threadIdx.x & 15) * ld);
    b[0] = f16x2_from_bf16x2(b[0]);
    b[1] = f16x2_from_bf16x2(b[1]);
#endif
}
// 16 bytes global -> shared without registers (zeros when !valid), and the wait for a thread's copies
#ifdef MMA_HOST_STANDIN
__device__ __forceinline__ void copy16_async(void* smem, const void* gmem, bool valid) {
    if (valid) std::memcpy(smem, gmem, 16);
    else std::memset(smem, 0, 16);
}
__device__ __forceinline__ void copies16_wait() {}
#else
__device__ __forceinline__ void copy16_async(void* smem, const void* gmem, bool valid) {
    cp_async16(reinterpret_cast<bf16*>(smem), reinterpret_cast<const bf16*>(gmem), valid);
}
__device__ __forceinline__ void copies16_wait() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#endif

// x0, x1's fp16 parts (hi, lo) in a float2's 8 bytes (bit patterns, not values): the prepare stores W and P so,
// and the walk's blocks load them as split fragments
__device__ __forceinline__ float2 f16_parts_as_float2(float x0, float x1) {
    unsigned hi, lo;
    split_f16_pair(x0, x1, hi, lo);
    return make_float2(__int_as_float((int)hi), __int_as_float((int)lo));
}

// an A (16 x 16) by B (16 x 8) product of fp32 fragments on fp16 parts: hi*hi into acc, hi*lo + lo*hi into acc_lo
__device__ __forceinline__ void mma_f16_split(float* acc, float* acc_lo, const float2* fa, const float2* fb) {
    unsigned ahi[4], alo[4], bhi[2], blo[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) split_f16_pair(fa[e].x, fa[e].y, ahi[e], alo[e]);
#pragma unroll
    for (int e = 0; e < 2; ++e) split_f16_pair(fb[e].x, fb[e].y, bhi[e], blo[e]);
    mma_f16_16816(acc, ahi, bhi[0], bhi[1]);
    MMA_F16_PART(acc_lo, ahi, blo[0], blo[1]);
    MMA_F16_PART(acc_lo, alo, bhi[0], bhi[1]);
}

// The fp32 values of a B fragment 16(k) x 8(n) from a row-major [k][n] tile (leading dim ld)
__device__ __forceinline__ void load_b_f32_rows(float2* f, const float* base, int ld) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    f[0] = make_float2(base[(2 * q) * ld + g], base[(2 * q + 1) * ld + g]);
    f[1] = make_float2(base[(2 * q + 8) * ld + g], base[(2 * q + 9) * ld + g]);
}

// solve_blocked_split with its block products on tensor cores (fp16 parts, ~22 bits: T to 22 bits costs
// nothing in the teacher-forced emulation) and the diagonal blocks' columns in registers (gdn_chunked.cu's
// solve_blocked_mma): (a) T_bb by forward substitution, a thread per (block, column), the column in registers
// (A's loads broadcast within the block's 16 lanes); (b) block row i = 1..3, warp j < i: M_ij = sum_{j<=k<i}
// A_ik T_kj (kept in A's unused upper triangle, block (j, i)), T_ij = -T_ii M_ij. Writes every element of T.
__device__ __forceinline__ void solve_blocked_split_f16(float* amat, float* tinv) {
    constexpr int B = 16, NB = SPLIT_CHUNK / B, LD = SPLIT_LDF;
    if (threadIdx.x < SPLIT_CHUNK) {
        const int base = (threadIdx.x / B) * B, jl = threadIdx.x % B, j = threadIdx.x;
        float t[B];
#pragma unroll
        for (int i = 0; i < B; ++i) {
            float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
            for (int m = 0; m < i; ++m) {
                const float a = amat[(base + i) * LD + base + m];
                if (m & 1) acc1 -= a * t[m];
                else acc0 -= a * t[m];
            }
            t[i] = i > jl ? acc0 + acc1 : (i == jl ? 1.f : 0.f);
        }
        for (int i = 0; i < base; ++i) tinv[i * LD + j] = 0.f;  // above the diagonal block
#pragma unroll
        for (int i = 0; i < B; ++i) tinv[(base + i) * LD + j] = t[i];
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
#pragma unroll 1
    for (int ib = 1; ib < NB; ++ib) {
        if (warp < ib) {
            const int jb = warp;
            float m_acc[2][4] = {}, m_lo[2][4] = {};
            for (int kb = jb; kb < ib; ++kb) {
                float2 fa[4];
                load_a_f32(fa, amat + (ib * B) * LD + kb * B, LD, nullptr);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    float2 fb[2];
                    load_b_f32_rows(fb, tinv + (kb * B) * LD + jb * B + 8 * nt, LD);
                    mma_f16_split(m_acc[nt], m_lo[nt], fa, fb);
                }
            }
            float* m_tile = amat + (jb * B) * LD + ib * B;  // A's upper triangle: free
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    *reinterpret_cast<float2*>(m_tile + (g + 8 * half) * LD + 8 * nt + 2 * q) =
                        make_float2(m_acc[nt][2 * half] + F16_LO_UNSCALE * m_lo[nt][2 * half],
                                    m_acc[nt][2 * half + 1] + F16_LO_UNSCALE * m_lo[nt][2 * half + 1]);
            __syncwarp();
            float2 ft[4];
            load_a_f32(ft, tinv + (ib * B) * LD + ib * B, LD, nullptr);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                float2 fb[2];
                load_b_f32_rows(fb, m_tile + 8 * nt, LD);
                float t_acc[4] = {}, t_lo[4] = {};
                mma_f16_split(t_acc, t_lo, ft, fb);
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    *reinterpret_cast<float2*>(tinv + (ib * B + g + 8 * half) * LD + jb * B + 8 * nt + 2 * q) =
                        make_float2(-(t_acc[2 * half] + F16_LO_UNSCALE * t_lo[2 * half]),
                                    -(t_acc[2 * half + 1] + F16_LO_UNSCALE * t_lo[2 * half + 1]));
            }
        }
        __syncthreads();
    }
}

// x as a 16-bit operand: the raw bf16 value, or (F16) its fp16 value (exact within fp16's range)
template <bool F16>
__device__ __forceinline__ bf16 raw_operand(bf16 x) {
    if constexpr (F16) return __ushort_as_bfloat16(f16_from_bf16(x));
    else return x;
}

// ---------------------------------------------------------------------------------------------
// F16 (gdn_chunk_prepare_split_f16): T solved by solve_blocked_split_f16, U and W as fp16-part products
// (T diag(beta) and T diag(beta exp(c) rk) in hi / lo against V and K as fp16: 2 mmas each, ~22 bits)
#define SPLIT_PREPARE_PARAMS                                                                                        \
    const bf16 *__restrict__ conv_out, const bf16 *__restrict__ proj, int proj_stride,                             \
        const float *__restrict__ neg_decay_rate, const float *__restrict__ dt_bias,                               \
        const int *__restrict__ chunk_start, const int *__restrict__ chunk_len, float *__restrict__ norms,         \
        float *__restrict__ w_out, float *__restrict__ u_out, float *__restrict__ p_out, float *__restrict__ cum_out, \
        int num_key_heads, int num_value_heads, int dv
#define SPLIT_PREPARE_ARGS \
    conv_out, proj, proj_stride, neg_decay_rate, dt_bias, chunk_start, chunk_len, norms, w_out, u_out, p_out, \
        cum_out, num_key_heads, num_value_heads, dv
template <bool F16>
__device__ __forceinline__ void chunk_prepare_split(unsigned char* smem, SPLIT_PREPARE_PARAMS) {
    const int c = blockIdx.x, h = blockIdx.y, t0 = chunk_start[c], n = chunk_len[c];
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv, conv_dim = 2 * key_dim + value_dim;
    const int warp = threadIdx.x >> 5, row0 = 16 * warp;
    SPLIT_PHASES_BEGIN();
    // the raw q / k rows until the scores are taken, then A and T in the same bytes (3 blocks an SM at the 4B
    // shape's 75 KB)
    constexpr int ROWS_BYTES = 2 * SPLIT_CHUNK * SPLIT_LDH * 2, SOLVE_BYTES = 2 * SPLIT_CHUNK * SPLIT_LDF * 4;
    constexpr int FIRST_BYTES = ROWS_BYTES > SOLVE_BYTES ? ROWS_BYTES : SOLVE_BYTES;
    bf16* qr = reinterpret_cast<bf16*>(smem);      // [64][SPLIT_LDH] raw q rows
    bf16* kr = qr + SPLIT_CHUNK * SPLIT_LDH;       // [64][SPLIT_LDH] raw k rows
    float* amat = reinterpret_cast<float*>(smem);  // [64][SPLIT_LDF] A, strictly lower (after the scores)
    float* tinv = amat + SPLIT_CHUNK * SPLIT_LDF;  // [64][SPLIT_LDF] T, lower
    // (F16: k and v as raw rows, [64][DK + 8] and [64][dv + 8], their B fragments by ldmatrix.trans)
    bf16* kt = reinterpret_cast<bf16*>(smem + FIRST_BYTES);  // [DK][SPLIT_LDCH] raw k^T
    bf16* vt = kt + DK * SPLIT_LDCH;               // [dv][SPLIT_LDCH] raw v^T
    const int vt_elems = dv * SPLIT_LDCH > SPLIT_CHUNK * (dv + 8) ? dv * SPLIT_LDCH : SPLIT_CHUNK * (dv + 8);
    float* rq = reinterpret_cast<float*>(vt + vt_elems);  // [64] q's norm scale (x DK^-1/2)
    float* rk = rq + SPLIT_CHUNK;                  // [64] k's
    float* beta = rk + SPLIT_CHUNK;                // [64]
    float* beta_decay = beta + SPLIT_CHUNK;        // [64] beta exp(c) rk
    double* cum = reinterpret_cast<double*>(beta_decay + SPLIT_CHUNK);  // [64]

    // the gates' inputs (a row a thread) loaded first: in flight with the rows'
    const bool gate_row = threadIdx.x < SPLIT_CHUNK && (int)threadIdx.x < n;
    bf16 gate_b = __float2bfloat16_rn(0.f), gate_a = gate_b;
    if (gate_row) {
        const bf16* row = proj + (size_t)(t0 + threadIdx.x) * proj_stride + conv_dim + value_dim + h;
        gate_b = row[0];
        gate_a = row[num_value_heads];
    }
    if constexpr (F16) {  // q / k rows (k twice: for the scores, and W's rows) and v rows by cp.async, all at once
        const bf16* qk_rows = conv_out + (size_t)t0 * conv_dim + key_head * DK;
        for (int e = threadIdx.x; e < SPLIT_CHUNK * (DK / 8); e += SPLIT_THREADS) {
            const int r = e / (DK / 8), i = 8 * (e % (DK / 8));
            const bf16* row = qk_rows + (size_t)(r < n ? r : 0) * conv_dim + i;
            copy16_async(qr + r * SPLIT_LDH + i, row, r < n);
            copy16_async(kr + r * SPLIT_LDH + i, row + key_dim, r < n);
            copy16_async(kt + r * SPLIT_LDH + i, row + key_dim, r < n);
        }
        const bf16* v_rows = conv_out + (size_t)t0 * conv_dim + 2 * key_dim + h * dv;
        for (int e = threadIdx.x; e < SPLIT_CHUNK * (dv / 8); e += SPLIT_THREADS) {
            const int r = e / (dv / 8), j = 8 * (e % (dv / 8));
            copy16_async(vt + r * (dv + 8) + j, v_rows + (size_t)(r < n ? r : 0) * conv_dim + j, r < n);
        }
        copies16_wait();
    } else {  // raw q, k rows (and k^T), v^T by 16-byte loads (a thread's issued together); rows past the chunk zeros
        constexpr int V_BATCH = 4;  // v vectors a thread issues together (dv / 16 in all)
        Bf16x8 v8[V_BATCH];
        const int v_total = SPLIT_CHUNK * (dv / 8);
        const bf16* v_rows = conv_out + (size_t)t0 * conv_dim + 2 * key_dim + h * dv;
#pragma unroll
        for (int b = 0; b < V_BATCH; ++b) {  // the first batch of v ahead of q / k's stores
            const int e = threadIdx.x + b * SPLIT_THREADS, r = e % SPLIT_CHUNK, j = 8 * (e / SPLIT_CHUNK);
            v8[b] = e < v_total && r < n ? *reinterpret_cast<const Bf16x8*>(v_rows + (size_t)r * conv_dim + j)
                                         : zero_bf16x8();
        }
        load_qk_rows(conv_out + (size_t)t0 * conv_dim + key_head * DK, conv_dim, key_dim, n,
                     [&](int r, int i, const Bf16x8& q8, const Bf16x8& k8) {
                         *reinterpret_cast<Bf16x8*>(qr + r * SPLIT_LDH + i) = q8;
                         *reinterpret_cast<Bf16x8*>(kr + r * SPLIT_LDH + i) = k8;
#pragma unroll
                         for (int m = 0; m < 8; ++m) kt[(i + m) * SPLIT_LDCH + r] = raw_operand<F16>(k8.x[m]);
                     });
        for (int base = threadIdx.x;; base += V_BATCH * SPLIT_THREADS) {
#pragma unroll
            for (int b = 0; b < V_BATCH; ++b) {
                const int e = base + b * SPLIT_THREADS, r = e % SPLIT_CHUNK, j = 8 * (e / SPLIT_CHUNK);
                if (e < v_total) {
#pragma unroll
                    for (int m = 0; m < 8; ++m) vt[(j + m) * SPLIT_LDCH + r] = raw_operand<F16>(v8[b].x[m]);
                }
            }
            if (base + V_BATCH * SPLIT_THREADS >= v_total) break;
#pragma unroll
            for (int b = 0; b < V_BATCH; ++b) {  // the next batch
                const int e = base + (V_BATCH + b) * SPLIT_THREADS, r = e % SPLIT_CHUNK, j = 8 * (e / SPLIT_CHUNK);
                v8[b] = e < v_total && r < n ? *reinterpret_cast<const Bf16x8*>(v_rows + (size_t)r * conv_dim + j)
                                             : zero_bf16x8();
            }
        }
    }
    if (threadIdx.x < SPLIT_CHUNK) {  // the gates, a row a thread
        const int r = threadIdx.x;
        float b = 0.f, lg = 0.f;
        if (gate_row) {
            b = gdn_beta(to_f(gate_b));
            lg = gdn_log_decay(to_f(gate_a), neg_decay_rate[h], dt_bias[h]);
        }
        beta[r] = b;
        cum[r] = (double)lg;
    }
    __syncthreads();
    SPLIT_PHASE(1);  // raw q / k / v staged, gates
    if (threadIdx.x == 0) {  // the cumulative log-decay, in order (fp64: c reaches -1000 for fast heads)
        double sum = 0.0;
        for (int r = 0; r < SPLIT_CHUNK; ++r) {
            sum += cum[r];
            cum[r] = sum;
        }
    }
    __syncthreads();
    SPLIT_PHASE(2);  // cumulative decay
    if (threadIdx.x < n) cum_out[(size_t)(t0 + threadIdx.x) * num_value_heads + h] = (float)cum[threadIdx.x];
    // the l2 norms (fp32, of the raw rows): a thread a (row, q or k), its pairs from a rotated start (the
    // warp's 32 rows in distinct banks)
    {
        const int r = threadIdx.x % SPLIT_CHUNK, tensor = threadIdx.x / SPLIT_CHUNK;
        const bf16* row = (tensor == 0 ? qr : kr) + r * SPLIT_LDH;
        float sq = 0.f;
        for (int m = 0; m < DK / 2; ++m) {
            const int pair = (m + r) % (DK / 2);
            const float x = to_f(row[2 * pair]), y = to_f(row[2 * pair + 1]);
            sq += x * x + y * y;
        }
        const float scale = rsqrtf(sq + L2_NORM_EPS) * (tensor == 0 ? rsqrtf((float)DK) : 1.f);
        (tensor == 0 ? rq : rk)[r] = scale;
        if (r < n && h % ratio == 0) norms[((size_t)(t0 + r) * num_key_heads + key_head) * 2 + tensor] = scale;
    }
    __syncthreads();
    SPLIT_PHASE(3);  // the l2 norms
    if (threadIdx.x < SPLIT_CHUNK) {  // (read after the solve's barriers)
        const int r = threadIdx.x;
        beta_decay[r] = beta[r] * expf((float)cum[r]) * rk[r];
    }

    // Q K^T and K K^T on the raw rows (exact products), then A and P in fp32. Warp w: rows 16w.., columns
    // j <= 16w + 15 (n-tiles below 2w + 2)
    float* p = p_out + ((size_t)c * num_value_heads + h) * SPLIT_CHUNK * SPLIT_CHUNK;
    {
        float qk[8][4] = {}, kk[8][4] = {};
#pragma unroll
        for (int k0 = 0; k0 < DK; k0 += 16) {
            unsigned aq[4], ak[4];
            load_a_raw(aq, qr + row0 * SPLIT_LDH + k0, SPLIT_LDH);
            load_a_raw(ak, kr + row0 * SPLIT_LDH + k0, SPLIT_LDH);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                if (nt >= 2 * warp + 2) break;
                unsigned b[2];
                load_b_raw(b, kr + nt * 8 * SPLIT_LDH + k0, SPLIT_LDH);
                mma_bf16_16816(qk[nt], aq, b[0], b[1]);
                mma_bf16_16816(kk[nt], ak, b[0], b[1]);
            }
        }
        __syncthreads();  // every warp's reads of q / k are done: A overwrites them
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                float pv[2];
#pragma unroll
                for (int odd = 0; odd < 2; ++odd) {
                    const int i = row0 + acc_row(e), j = acc_col(nt, e + odd);
                    float a = 0.f;
                    pv[odd] = 0.f;
                    if (j <= i) {
                        const float d = expf((float)(cum[i] - cum[j]));
                        pv[odd] = rq[i] * rk[j] * qk[nt][e + odd] * d;
                        if (j < i) a = beta[i] * rk[i] * rk[j] * kk[nt][e + odd] * d;
                    }
                    amat[i * SPLIT_LDF + j] = a;
                }
                // F16: P's pair as its fp16 parts (hi, lo) in the pair's 8 bytes, split once for the walk's tiles
                *reinterpret_cast<float2*>(p + (row0 + acc_row(e)) * SPLIT_CHUNK + acc_col(nt, e)) =
                    F16 ? f16_parts_as_float2(pv[0], pv[1]) : make_float2(pv[0], pv[1]);
            }
    }
    __syncthreads();
    SPLIT_PHASE(4);  // scores (tensor cores), A and P stored
    if constexpr (F16) solve_blocked_split_f16(amat, tinv);  // T = (I + A)^-1, ~fp32
    else solve_blocked_split(amat, tinv);
    __syncthreads();
    SPLIT_PHASE(5);  // T = (I + A)^-1
    // U = (T diag(beta)) V_raw (T's side in 3 parts) and W = (T diag(beta exp(c) rk)) K_raw (2 parts), rows
    // 16w .. 16w + 15; T lower: the k tiles up to the strip's own
    // (presplit, F16 only: each pair of dst as its fp16 parts, f16_parts_as_float2)
    // (F16: bt holds the rows, [64][ld]; else their transpose, [width][SPLIT_LDCH])
    auto product = [&](const float* scale, const bf16* bt, int ld, int width, int parts, float* dst,
                       size_t dst_stride, bool presplit) {
        for (int n0 = 0; n0 < width; n0 += 64) {  // 8 n-tiles at a time (64 accumulators)
            float acc[8][4] = {}, acc_lo[8][4] = {};  // (acc_lo: F16's lo products)
            for (int k0 = 0; k0 <= row0; k0 += 16) {
                float2 f[4];
                load_a_f32(f, tinv + row0 * SPLIT_LDF + k0, SPLIT_LDF, scale + k0);
                if constexpr (F16) {
                    unsigned hi[4], lo[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) split_f16_pair(f[e].x, f[e].y, hi[e], lo[e]);
#pragma unroll
                    for (int nt = 0; nt < 8; ++nt) {
                        if (n0 + nt * 8 >= width) break;
                        unsigned b[2];
                        load_b_rows_as_f16(b, bt + k0 * ld + n0 + nt * 8, ld);
                        mma_f16_16816(acc[nt], hi, b[0], b[1]);
                        MMA_F16_PART(acc_lo[nt], lo, b[0], b[1]);
                    }
                } else {
                    unsigned hi[4], mid[4], lo[4];
                    split3_fragment<4>(f, hi, mid, lo);
#pragma unroll
                    for (int nt = 0; nt < 8; ++nt) {
                        if (n0 + nt * 8 >= width) break;
                        unsigned b[2];
                        load_b_raw(b, bt + (n0 + nt * 8) * SPLIT_LDCH + k0, SPLIT_LDCH);
                        mma_bf16_16816(acc[nt], hi, b[0], b[1]);
                        MMA_PART(acc[nt], mid, b[0], b[1]);
                        if (parts == 3) MMA_PART(acc[nt], lo, b[0], b[1]);
                    }
                }
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int i = row0 + acc_row(e);
                    if (i < n && n0 + nt * 8 < width)
                        *reinterpret_cast<float2*>(dst + (size_t)(t0 + i) * dst_stride + n0 + acc_col(nt, e)) =
                            presplit ? f16_parts_as_float2(acc[nt][e] + F16_LO_UNSCALE * acc_lo[nt][e],
                                                           acc[nt][e + 1] + F16_LO_UNSCALE * acc_lo[nt][e + 1])
                                     : make_float2(acc[nt][e] + F16_LO_UNSCALE * acc_lo[nt][e],
                                                   acc[nt][e + 1] + F16_LO_UNSCALE * acc_lo[nt][e + 1]);
                }
        }
    };
    product(beta, vt, F16 ? dv + 8 : SPLIT_LDCH, dv, 3, u_out + (size_t)h * dv, (size_t)value_dim, false);
    SPLIT_PHASE(6);  // U (tensor cores) stored
    product(beta_decay, kt, F16 ? SPLIT_LDH : SPLIT_LDCH, DK, 2, w_out + (size_t)h * DK, (size_t)num_value_heads * DK,
            F16);
    SPLIT_PHASE(7);  // W (tensor cores) stored
    SPLIT_PHASES_DONE();
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) gdn_chunk_prepare_split(SPLIT_PREPARE_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_prepare_split<false>(smem, SPLIT_PREPARE_ARGS);
}

// (3 blocks an SM, as its shared memory allows: up to 170 registers, no spills)
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS, 3) gdn_chunk_prepare_split_f16(SPLIT_PREPARE_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_prepare_split<true>(smem, SPLIT_PREPARE_ARGS);
}

// ---------------------------------------------------------------------------------------------
// The walk's state: warp w owns S^T's rows 16 (w & 1) .. + 15 (value channels of the tile) x key columns
// (w >> 1) DK / 2 .. + DK / 2 - 1 in mma accumulator registers (fp32) for the whole sequence; after each
// update it writes that region's bf16 parts hi / mid / lo to shared planes, the B operand every warp reads.
#define STATE_NT (DK / 16)  // n-tiles of a warp's state region

// this warp's state region's element (nt, e): S^T row, key column
__device__ __forceinline__ int state_row(int e) { return 16 * ((threadIdx.x >> 5) & 1) + acc_row(e); }
__device__ __forceinline__ int state_col(int nt, int e) { return ((threadIdx.x >> 5) >> 1) * (DK / 2) + acc_col(nt, e); }

__device__ __forceinline__ void store_state_planes(const float (*acc)[4], bf16* planes) {
    constexpr int PLANE = SPLIT_TILE * SPLIT_LDH;
#pragma unroll
    for (int nt = 0; nt < STATE_NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            unsigned hi, mid, lo;
            split3_pair(acc[nt][e], acc[nt][e + 1], hi, mid, lo);
            const int at = state_row(e) * SPLIT_LDH + state_col(nt, e);
            *reinterpret_cast<unsigned*>(planes + at) = hi;
            *reinterpret_cast<unsigned*>(planes + PLANE + at) = mid;
            *reinterpret_cast<unsigned*>(planes + 2 * PLANE + at) = lo;
        }
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
gdn_chunk_walk_split(const bf16* __restrict__ conv_out, const float* __restrict__ norms,
                     const float* __restrict__ w_in, const float* __restrict__ u_in, const float* __restrict__ p_in,
                     const float* __restrict__ cum_in, const int* __restrict__ chunk_start,
                     const int* __restrict__ chunk_len, const int* __restrict__ seq_chunks,
                     const int* __restrict__ slots, const int* __restrict__ fresh, float* __restrict__ ssm_state,
                     bf16* __restrict__ core, int num_key_heads, int num_value_heads, int dv) {
    GDN_DYNAMIC_SHARED(smem);
    // grid (dv / 32, sequences, value heads): a head's tiles adjacent in launch order, so they walk its chunks
    // together and read each chunk's q / k / W / P from L2 after the first
    const int j0 = blockIdx.x * SPLIT_TILE, s = blockIdx.y, h = blockIdx.z;
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv, conv_dim = 2 * key_dim + value_dim;
    const int warp = threadIdx.x >> 5, row0 = 16 * warp;
    constexpr int PLANE = SPLIT_TILE * SPLIT_LDH;
    float* vt = reinterpret_cast<float*>(smem);            // [32][SPLIT_LDF] V'^T
    float* us = vt + SPLIT_TILE * SPLIT_LDF;               // [64][SPLIT_LDU] the chunk's U, the tile's channels
    float* row_scale = us + SPLIT_CHUNK * SPLIT_LDU;       // [64] rq exp(c)
    float* tail_scale = row_scale + SPLIT_CHUNK;           // [64] rk exp(c_C - c)
    float* cum = tail_scale + SPLIT_CHUNK;                 // [64]
    bf16* planes = reinterpret_cast<bf16*>(cum + SPLIT_CHUNK);  // 3 x [32][SPLIT_LDH] S^T as bf16 hi, mid, lo
    bf16* qr = planes + 3 * PLANE;                         // [64][SPLIT_LDH] raw q rows
    bf16* kt = qr + SPLIT_CHUNK * SPLIT_LDH;               // [DK][SPLIT_LDCH] raw k^T

    SPLIT_PHASES_BEGIN();
    float* state = ssm_state + ((size_t)slots[s] * num_value_heads + h) * DK * dv;
    const bool is_fresh = fresh[s] != 0;
    float sacc[STATE_NT][4];  // this warp's region of S^T (fp32)
#pragma unroll
    for (int nt = 0; nt < STATE_NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            sacc[nt][e] = is_fresh ? 0.f : state[(size_t)state_col(nt, e) * dv + j0 + state_row(e)];
    store_state_planes(sacc, planes);
    SPLIT_PHASE(1);  // the state loaded, its planes
    for (int c = seq_chunks[s]; c < seq_chunks[s + 1]; ++c) {
        const int t0 = chunk_start[c], n = chunk_len[c];
        // W's and P's rows 16w .. are read by warp w alone: their fragments straight from global memory into
        // registers, issued first (in flight while the shared tiles load)
        const float* p = p_in + ((size_t)c * num_value_heads + h) * SPLIT_CHUNK * SPLIT_CHUNK;
        float2 wf[DK / 16][4], pf[SPLIT_CHUNK / 16][4];
        {
            const size_t w_stride = (size_t)num_value_heads * DK;
            const float* w_rows = w_in + ((size_t)t0 * num_value_heads + h) * DK;
#pragma unroll
            for (int kt16 = 0; kt16 < DK / 16; ++kt16) load_a_rows_f32(wf[kt16], w_rows, w_stride, row0, n, 16 * kt16);
#pragma unroll
            for (int kt16 = 0; kt16 < SPLIT_CHUNK / 16; ++kt16)
                if (16 * kt16 <= row0) load_a_f32(pf[kt16], p + row0 * SPLIT_CHUNK + 16 * kt16, SPLIT_CHUNK, nullptr);
        }
        __syncthreads();  // the last chunk's readers are done, its state planes written
        load_qk_rows(conv_out + (size_t)t0 * conv_dim + key_head * DK, conv_dim, key_dim, n,
                     [&](int r, int i, const Bf16x8& q8, const Bf16x8& k8) {
                         *reinterpret_cast<Bf16x8*>(qr + r * SPLIT_LDH + i) = q8;
#pragma unroll
                         for (int m = 0; m < 8; ++m) kt[(i + m) * SPLIT_LDCH + r] = k8.x[m];
                     });
        for (int e = threadIdx.x; e < SPLIT_CHUNK * (SPLIT_TILE / 4); e += SPLIT_THREADS) {  // U (rows past n: 0)
            const int r = e / (SPLIT_TILE / 4), j = 4 * (e % (SPLIT_TILE / 4));
            float4 u4 = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r < n) u4 = *reinterpret_cast<const float4*>(u_in + ((size_t)(t0 + r) * num_value_heads + h) * dv + j0 + j);
            *reinterpret_cast<float4*>(us + r * SPLIT_LDU + j) = u4;
        }
        float q_norm = 0.f, k_norm = 0.f;  // row threadIdx.x's (rows past the chunk: 0)
        if (threadIdx.x < SPLIT_CHUNK) {
            const int r = threadIdx.x < n ? threadIdx.x : n - 1;
            cum[threadIdx.x] = cum_in[(size_t)(t0 + r) * num_value_heads + h];
            if (threadIdx.x < n) {
                const float* nq = norms + ((size_t)(t0 + r) * num_key_heads + key_head) * 2;
                q_norm = nq[0];
                k_norm = nq[1];
            }
        }
        __syncthreads();
        if (threadIdx.x < SPLIT_CHUNK) {  // (read after the next barrier)
            const int r = threadIdx.x;
            row_scale[r] = q_norm * expf(cum[r]);
            tail_scale[r] = k_norm * expf(cum[SPLIT_CHUNK - 1] - cum[r]);
        }
        SPLIT_PHASE(2);  // the chunk's W / P fragments, q / k^T / U tiles, scales
        // V' = U - W S (W in 2 parts x S's hi / mid: hi*hi, hi*mid, mid*hi, 3 mmas) and Q_raw S (S's three parts: 3)
        // in one pass over S's planes: warp w rows 16w .., the tile's 32 channels
        float inter[4][4] = {};
        {
            float acc[4][4] = {};
#pragma unroll
            for (int k0 = 0; k0 < DK; k0 += 16) {
                const float2* f = wf[k0 / 16];
                unsigned whi[4], wmid[4], a[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) split2_pair(f[e].x, f[e].y, whi[e], wmid[e]);
                load_a_raw(a, qr + row0 * SPLIT_LDH + k0, SPLIT_LDH);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    unsigned bhi[2], bmid[2], blo[2];
                    load_b_raw(bhi, planes + nt * 8 * SPLIT_LDH + k0, SPLIT_LDH);
                    load_b_raw(bmid, planes + PLANE + nt * 8 * SPLIT_LDH + k0, SPLIT_LDH);
                    load_b_raw(blo, planes + 2 * PLANE + nt * 8 * SPLIT_LDH + k0, SPLIT_LDH);
                    mma_bf16_16816(acc[nt], whi, bhi[0], bhi[1]);
                    MMA_PART(acc[nt], whi, bmid[0], bmid[1]);
                    MMA_PART(acc[nt], wmid, bhi[0], bhi[1]);
                    mma_bf16_16816(inter[nt], a, bhi[0], bhi[1]);
                    MMA_PART(inter[nt], a, bmid[0], bmid[1]);
                    MMA_PART(inter[nt], a, blo[0], blo[1]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int r = row0 + acc_row(e), j = acc_col(nt, e);
                    const float2 u = load_f2(us + r * SPLIT_LDU + j);
                    vt[j * SPLIT_LDF + r] = r < n ? u.x - acc[nt][e] : 0.f;
                    vt[(j + 1) * SPLIT_LDF + r] = r < n ? u.y - acc[nt][e + 1] : 0.f;
                }
        }
        __syncthreads();
        SPLIT_PHASE(3);  // V' = U - W S and Q S (tensor cores)
        // O = diag(rq exp(c)) Q_raw S + P V' (P, V' in 3 parts, 6 mmas: the terms to ~2^-18), rows 16w ..
        {
            float intra[4][4] = {};
#pragma unroll
            for (int k0 = 0; k0 < SPLIT_CHUNK; k0 += 16) {
                if (k0 > row0) break;
                unsigned ahi[4], amid[4], alo[4];
                split3_fragment<4>(pf[k0 / 16], ahi, amid, alo);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    float2 fb[2];
                    load_b_f32(fb, vt + nt * 8 * SPLIT_LDF + k0, SPLIT_LDF);
                    unsigned bhi[2], bmid[2], blo[2];
                    split3_fragment<2>(fb, bhi, bmid, blo);
                    mma_bf16_16816(intra[nt], ahi, bhi[0], bhi[1]);
                    MMA_PART(intra[nt], ahi, bmid[0], bmid[1]);
                    MMA_PART(intra[nt], amid, bhi[0], bhi[1]);
                    MMA_PART(intra[nt], ahi, blo[0], blo[1]);
                    MMA_PART(intra[nt], alo, bhi[0], bhi[1]);
                    MMA_PART(intra[nt], amid, bmid[0], bmid[1]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int r = row0 + acc_row(e);
                    if (r < n) {
                        const float o0 = row_scale[r] * inter[nt][e] + intra[nt][e];
                        const float o1 = row_scale[r] * inter[nt][e + 1] + intra[nt][e + 1];
                        *reinterpret_cast<unsigned*>(core + (size_t)(t0 + r) * value_dim + (size_t)h * dv + j0 +
                                                     acc_col(nt, e)) = pack_bf16x2(o0, o1);
                    }
                }
        }
        SPLIT_PHASE(4);  // P V' (tensor cores), O stored
        // S^T <- exp(c_C) S^T + (diag(rk exp(c_C - c)) V')^T K_raw on this warp's region (V' side in 3 parts:
        // 3 mmas), then its planes rewritten
        {
            const int srow = 16 * (warp & 1), scol = (warp >> 1) * (DK / 2);
            const float chunk_decay = expf(cum[SPLIT_CHUNK - 1]);
#pragma unroll
            for (int nt = 0; nt < STATE_NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sacc[nt][e] *= chunk_decay;
            for (int k0 = 0; k0 < SPLIT_CHUNK; k0 += 16) {
                if (k0 >= n) break;
                float2 f[4];
                load_a_f32(f, vt + srow * SPLIT_LDF + k0, SPLIT_LDF, tail_scale + k0);
                unsigned hi[4], mid[4], lo[4];
                split3_fragment<4>(f, hi, mid, lo);
#pragma unroll
                for (int nt = 0; nt < STATE_NT; ++nt) {
                    unsigned b[2];
                    load_b_raw(b, kt + (scol + nt * 8) * SPLIT_LDCH + k0, SPLIT_LDCH);
                    mma_bf16_16816(sacc[nt], hi, b[0], b[1]);
                    MMA_PART(sacc[nt], mid, b[0], b[1]);
                    MMA_PART(sacc[nt], lo, b[0], b[1]);
                }
            }
            store_state_planes(sacc, planes);  // (every warp read the planes before the barrier after V')
        }
        SPLIT_PHASE(5);  // the state update (tensor cores), its planes
    }
#pragma unroll
    for (int nt = 0; nt < STATE_NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) state[(size_t)state_col(nt, e) * dv + j0 + state_row(e)] = sacc[nt][e];
    SPLIT_PHASE(6);  // the state stored
    SPLIT_PHASES_DONE();
}

// ---------------------------------------------------------------------------------------------
// gdn_chunk_walk_split_f16: gdn_chunk_walk_split's walk with fp16 operand parts instead of bf16 ones (see the
// fp16 parts above): per warp and chunk 272 mmas instead of 384, two state planes instead of three.
// 8 fp16 of a 16-byte vector
struct alignas(16) F16x8 {
    unsigned short x[8];
};

__device__ __forceinline__ void store_state_planes_f16(const float (*acc)[4], unsigned short* planes) {
    constexpr int PLANE = SPLIT_TILE * SPLIT_LDH;
#pragma unroll
    for (int nt = 0; nt < STATE_NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            unsigned hi, lo;
            split_f16_pair(acc[nt][e], acc[nt][e + 1], hi, lo);
            const int at = state_row(e) * SPLIT_LDH + state_col(nt, e);
            *reinterpret_cast<unsigned*>(planes + at) = hi;
            *reinterpret_cast<unsigned*>(planes + PLANE + at) = lo;
        }
}

// gdn_chunk_walk_split's grid, block, arguments and phases; shared memory: V'^T, U, the scales and c as there,
// then 2 x [32][SPLIT_LDH] S^T as fp16 hi, lo and the raw bf16 q and k rows ([64][SPLIT_LDH] each). A chunk's
// global reads go out at once (q / k rows and U by cp.async, c and the norms by the first 64 threads): one round
// trip (its staging was ~half the walk's time with three; H200, D1 2026-11-24); q / k become fp16 operands as
// their fragments load (the update's k^T fragments by ldmatrix.trans from the rows).
#define SPLIT_WALK_PARAMS                                                                                           \
    const bf16 *__restrict__ conv_out, const float *__restrict__ norms, const float *__restrict__ w_in,           \
        const float *__restrict__ u_in, const float *__restrict__ p_in, const float *__restrict__ cum_in,          \
        const int *__restrict__ chunk_start, const int *__restrict__ chunk_len, const int *__restrict__ seq_chunks, \
        const int *__restrict__ slots, const int *__restrict__ fresh, float *__restrict__ ssm_state,               \
        bf16 *__restrict__ core, int num_key_heads, int num_value_heads, int dv
#define SPLIT_WALK_ARGS                                                                                            \
    conv_out, norms, w_in, u_in, p_in, cum_in, chunk_start, chunk_len, seq_chunks, slots, fresh, ssm_state, core, \
        num_key_heads, num_value_heads, dv
// SNAPSHOT (the _snapshot entries, for an in-step prefix snapshot): S entering layout chunk snapshot_chunk[s]
// (-1: none; the sequence's end: its final state) also stored into slot snapshot_slot[s] (fp32, the slot layout).
template <bool SNAPSHOT>
__device__ __forceinline__ void chunk_walk_split_f16(unsigned char* smem, SPLIT_WALK_PARAMS,
                                                     const int* __restrict__ snapshot_chunk,
                                                     const int* __restrict__ snapshot_slot) {
    const int j0 = blockIdx.x * SPLIT_TILE, s = blockIdx.y, h = blockIdx.z;
    const int ratio = num_value_heads / num_key_heads, key_head = h / ratio;
    const int key_dim = num_key_heads * DK, value_dim = num_value_heads * dv, conv_dim = 2 * key_dim + value_dim;
    const int warp = threadIdx.x >> 5, row0 = 16 * warp;
    constexpr int PLANE = SPLIT_TILE * SPLIT_LDH;
    float* vt = reinterpret_cast<float*>(smem);            // [32][SPLIT_LDF] V'^T
    float* us = vt + SPLIT_TILE * SPLIT_LDF;               // [64][SPLIT_LDU] the chunk's U, the tile's channels
    float* row_scale = us + SPLIT_CHUNK * SPLIT_LDU;       // [64] rq exp(c)
    float* tail_scale = row_scale + SPLIT_CHUNK;           // [64] rk exp(c_C - c)
    float* cum = tail_scale + SPLIT_CHUNK;                 // [64]
    unsigned short* planes = reinterpret_cast<unsigned short*>(cum + SPLIT_CHUNK);  // 2 x [32][SPLIT_LDH]
    bf16* qraw = reinterpret_cast<bf16*>(planes + 2 * PLANE);  // [64][SPLIT_LDH] raw q rows
    bf16* kraw = qraw + SPLIT_CHUNK * SPLIT_LDH;           // [64][SPLIT_LDH] raw k rows
    // chunk c's q / k rows and U (rows past its end: zeros) by cp.async, and (threads < 64) its c and norms into
    // registers: every global read of a chunk but W's and P's, issued at once
    auto request_chunk = [&](int c, float& cum_value, float& q_norm, float& k_norm) {
        const int t0 = chunk_start[c], n = chunk_len[c];
        const bf16* qk_rows = conv_out + (size_t)t0 * conv_dim + key_head * DK;
        for (int e = threadIdx.x; e < SPLIT_CHUNK * (DK / 8); e += SPLIT_THREADS) {
            const int r = e / (DK / 8), i = 8 * (e % (DK / 8));
            const bf16* row = qk_rows + (size_t)(r < n ? r : 0) * conv_dim + i;
            copy16_async(qraw + r * SPLIT_LDH + i, row, r < n);
            copy16_async(kraw + r * SPLIT_LDH + i, row + key_dim, r < n);
        }
        for (int e = threadIdx.x; e < SPLIT_CHUNK * (SPLIT_TILE / 4); e += SPLIT_THREADS) {
            const int r = e / (SPLIT_TILE / 4), j = 4 * (e % (SPLIT_TILE / 4));
            copy16_async(us + r * SPLIT_LDU + j,
                         u_in + ((size_t)(t0 + (r < n ? r : 0)) * num_value_heads + h) * dv + j0 + j, r < n);
        }
        q_norm = k_norm = 0.f;  // (rows past the chunk: 0; their c: the last row's)
        if (threadIdx.x < SPLIT_CHUNK) {
            const int r = threadIdx.x < n ? threadIdx.x : n - 1;
            cum_value = cum_in[(size_t)(t0 + r) * num_value_heads + h];
            if (threadIdx.x < n) {
                const float* nq = norms + ((size_t)(t0 + r) * num_key_heads + key_head) * 2;
                q_norm = nq[0];
                k_norm = nq[1];
            }
        }
    };

    SPLIT_PHASES_BEGIN();
    float* state = ssm_state + ((size_t)slots[s] * num_value_heads + h) * DK * dv;
    const bool is_fresh = fresh[s] != 0;
    float sacc[STATE_NT][4];  // this warp's region of S^T (fp32)
#pragma unroll
    for (int nt = 0; nt < STATE_NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            sacc[nt][e] = is_fresh ? 0.f : state[(size_t)state_col(nt, e) * dv + j0 + state_row(e)];
    store_state_planes_f16(sacc, planes);
    SPLIT_PHASE(1);  // the state loaded, its planes
    const int snapshot_at = SNAPSHOT ? snapshot_chunk[s] : -1;
    auto store_state = [&](float* to) {
#pragma unroll
        for (int nt = 0; nt < STATE_NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) to[(size_t)state_col(nt, e) * dv + j0 + state_row(e)] = sacc[nt][e];
    };
    auto store_snapshot = [&]() { store_state(ssm_state + ((size_t)snapshot_slot[s] * num_value_heads + h) * DK * dv); };
    for (int c = seq_chunks[s]; c < seq_chunks[s + 1]; ++c) {
        if (SNAPSHOT && c == snapshot_at) store_snapshot();
        const int t0 = chunk_start[c], n = chunk_len[c];
        const float* p = p_in + ((size_t)c * num_value_heads + h) * SPLIT_CHUNK * SPLIT_CHUNK;
        const size_t w_stride = (size_t)num_value_heads * DK;
        const float* w_rows = w_in + ((size_t)t0 * num_value_heads + h) * DK;
        float2 wf[DK / 16][4], pf[SPLIT_CHUNK / 16][4];
#pragma unroll
        for (int kt16 = 0; kt16 < DK / 16; ++kt16) load_a_rows_f32(wf[kt16], w_rows, w_stride, row0, n, 16 * kt16);
#pragma unroll
        for (int kt16 = 0; kt16 < SPLIT_CHUNK / 16; ++kt16)
            if (16 * kt16 <= row0) load_a_f32(pf[kt16], p + row0 * SPLIT_CHUNK + 16 * kt16, SPLIT_CHUNK, nullptr);
        __syncthreads();  // the last chunk's readers are done, its state planes written
        float cum_value = 0.f, q_norm, k_norm;  // row threadIdx.x's
        request_chunk(c, cum_value, q_norm, k_norm);
        if (threadIdx.x < SPLIT_CHUNK) cum[threadIdx.x] = cum_value;
        copies16_wait();
        __syncthreads();
        if (threadIdx.x < SPLIT_CHUNK) {  // (read after the next barrier)
            const int r = threadIdx.x;
            row_scale[r] = q_norm * expf(cum[r]);
            tail_scale[r] = k_norm * expf(cum[SPLIT_CHUNK - 1] - cum[r]);
        }
        SPLIT_PHASE(2);  // the chunk's W / P fragments, q / k^T / U tiles, scales
        // V' = U - W S (W hi / lo x S hi / lo: 3 mmas) and Q S (q exact x S hi / lo: 2) in one pass over S's
        // planes: warp w rows 16w .., the tile's 32 channels
        float inter[4][4] = {};
        {
            float acc[4][4] = {}, acc_lo[4][4] = {}, inter_lo[4][4] = {};
#pragma unroll
            for (int k0 = 0; k0 < DK; k0 += 16) {
                const float2* f = wf[k0 / 16];  // split by the prepare: (hi, lo)
                unsigned whi[4], wlo[4], a[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) whi[e] = __float_as_uint(f[e].x), wlo[e] = __float_as_uint(f[e].y);
                load_a_raw_as_f16(a, qraw + row0 * SPLIT_LDH + k0, SPLIT_LDH);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    unsigned bhi[2], blo[2];
                    load_b_raw(bhi, planes + nt * 8 * SPLIT_LDH + k0, SPLIT_LDH);
                    load_b_raw(blo, planes + PLANE + nt * 8 * SPLIT_LDH + k0, SPLIT_LDH);
                    mma_f16_16816(acc[nt], whi, bhi[0], bhi[1]);
                    MMA_F16_PART(acc_lo[nt], whi, blo[0], blo[1]);
                    MMA_F16_PART(acc_lo[nt], wlo, bhi[0], bhi[1]);
                    mma_f16_16816(inter[nt], a, bhi[0], bhi[1]);
                    MMA_F16_PART(inter_lo[nt], a, blo[0], blo[1]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    inter[nt][e] += F16_LO_UNSCALE * inter_lo[nt][e];
                    inter[nt][e + 1] += F16_LO_UNSCALE * inter_lo[nt][e + 1];
                    const int r = row0 + acc_row(e), j = acc_col(nt, e);
                    const float2 u = load_f2(us + r * SPLIT_LDU + j);
                    const float ws0 = acc[nt][e] + F16_LO_UNSCALE * acc_lo[nt][e];
                    const float ws1 = acc[nt][e + 1] + F16_LO_UNSCALE * acc_lo[nt][e + 1];
                    vt[j * SPLIT_LDF + r] = r < n ? u.x - ws0 : 0.f;
                    vt[(j + 1) * SPLIT_LDF + r] = r < n ? u.y - ws1 : 0.f;
                }
        }
        __syncthreads();
        SPLIT_PHASE(3);  // V' = U - W S and Q S (tensor cores)
        // O = diag(rq exp(c)) Q S + P V' (P, V' hi / lo: 3 mmas), rows 16w ..
        {
            float intra[4][4] = {}, intra_lo[4][4] = {};
#pragma unroll
            for (int k0 = 0; k0 < SPLIT_CHUNK; k0 += 16) {
                if (k0 > row0) break;
                unsigned ahi[4], alo[4];
                const float2* f = pf[k0 / 16];
#pragma unroll
                for (int e = 0; e < 4; ++e)  // split by the prepare
                    ahi[e] = __float_as_uint(f[e].x), alo[e] = __float_as_uint(f[e].y);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    float2 fb[2];
                    load_b_f32(fb, vt + nt * 8 * SPLIT_LDF + k0, SPLIT_LDF);
                    unsigned bhi[2], blo[2];
                    split_f16_pair(fb[0].x, fb[0].y, bhi[0], blo[0]);
                    split_f16_pair(fb[1].x, fb[1].y, bhi[1], blo[1]);
                    mma_f16_16816(intra[nt], ahi, bhi[0], bhi[1]);
                    MMA_F16_PART(intra_lo[nt], ahi, blo[0], blo[1]);
                    MMA_F16_PART(intra_lo[nt], alo, bhi[0], bhi[1]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int r = row0 + acc_row(e);
                    if (r < n) {
                        const float o0 = row_scale[r] * inter[nt][e] + intra[nt][e] + F16_LO_UNSCALE * intra_lo[nt][e];
                        const float o1 = row_scale[r] * inter[nt][e + 1] + intra[nt][e + 1] +
                                         F16_LO_UNSCALE * intra_lo[nt][e + 1];
                        *reinterpret_cast<unsigned*>(core + (size_t)(t0 + r) * value_dim + (size_t)h * dv + j0 +
                                                     acc_col(nt, e)) = pack_bf16x2(o0, o1);
                    }
                }
        }
        SPLIT_PHASE(4);  // P V' (tensor cores), O stored
        // S^T <- exp(c_C) S^T + (diag(rk exp(c_C - c)) V')^T K (V' side hi / lo: 2 mmas, the lo products summed
        // apart), then this warp's planes rewritten
        {
            const int srow = 16 * (warp & 1), scol = (warp >> 1) * (DK / 2);
            const float chunk_decay = expf(cum[SPLIT_CHUNK - 1]);
            float update_lo[STATE_NT][4] = {};
#pragma unroll
            for (int nt = 0; nt < STATE_NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sacc[nt][e] *= chunk_decay;
            for (int k0 = 0; k0 < SPLIT_CHUNK; k0 += 16) {
                if (k0 >= n) break;
                float2 f[4];
                load_a_f32(f, vt + srow * SPLIT_LDF + k0, SPLIT_LDF, tail_scale + k0);
                unsigned hi[4], lo[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) split_f16_pair(f[e].x, f[e].y, hi[e], lo[e]);
#pragma unroll
                for (int nt = 0; nt < STATE_NT; ++nt) {
                    unsigned b[2];
                    load_b_rows_as_f16(b, kraw + k0 * SPLIT_LDH + scol + nt * 8, SPLIT_LDH);
                    mma_f16_16816(sacc[nt], hi, b[0], b[1]);
                    MMA_F16_PART(update_lo[nt], lo, b[0], b[1]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < STATE_NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sacc[nt][e] += F16_LO_UNSCALE * update_lo[nt][e];
            store_state_planes_f16(sacc, planes);  // (every warp read the planes before the barrier after V')
        }
        SPLIT_PHASE(5);  // the state update (tensor cores), its planes
    }
    if (SNAPSHOT && snapshot_at == seq_chunks[s + 1]) store_snapshot();
    store_state(state);
    SPLIT_PHASE(6);  // the state stored
    SPLIT_PHASES_DONE();
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) gdn_chunk_walk_split_f16(SPLIT_WALK_PARAMS) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_walk_split_f16<false>(smem, SPLIT_WALK_ARGS, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
gdn_chunk_walk_split_f16_snapshot(SPLIT_WALK_PARAMS, const int* __restrict__ snapshot_chunk,
                                  const int* __restrict__ snapshot_slot) {
    GDN_DYNAMIC_SHARED(smem);
    chunk_walk_split_f16<true>(smem, SPLIT_WALK_ARGS, snapshot_chunk, snapshot_slot);
}
