// FP4 (e2m1) routed experts and the clamped SwiGLU of DeepSeek-V4, beside moe.cu's formats.
//
//   weights  [E, N, K/2] uint8: two e2m1 codes per byte, the low nibble the even k
//            (values 0 .5 1 1.5 2 3 4 6, bit 3 the sign)
//   scales   [E, N, K/32] uint8: e8m0, 2^(s − 127), one per 32 inputs of a row
//
// Both GEMMs read the routing of moe.cu's moe_sort (sorted_slots, tile_expert, tile_row,
// num_tiles, offsets: tiles of at most 64 rows of one expert) and write rows in the same sorted
// order, so moe_combine finishes the layer unchanged. K must be a multiple of 32.
//
// e2m1 → bf16 without a table: a code's three magnitude bits moved to bits 6..8 of a bf16 (the
// sign to bit 15) read as m · 2^−126 for every code (0.5 is the one subnormal), so one bf16
// multiply by 2^(s − 1) gives the scaled weight exactly (two multiplies, 2^126 then 2^(s − 127),
// when s > 128 would overflow 2^(s − 1)). A 32-bit word of 8 codes becomes 4 bf16x2 registers
// in 11 integer instructions; the pairs come out as (k, k + 4), (k + 1, k + 5), ... and the
// activations are paired the same way.
//
// moe_fp4_grouped_gemm (any row count): a 64×64 output tile per block; each 64-wide K step
// decodes the weight tile to bf16 in shared memory and multiplies it with tensor cores
// (mma.sync m16n8k16, the tile steps of mma.cuh, as moe.cu's grouped GEMM).
//
// moe_fp4_stream_gemm (few rows per expert: decode): weights are the mma's A operand straight
// from registers — each warp owns 16 weight rows, each lane streams 16-byte loads (32 codes =
// one scale group) several K steps ahead — and the tile's rows (≤ 64 tokens, 8 per mma column
// block) are the B operand, staged in shared memory 128 k at a time by cp.async. The weight is
// read once per tile with no shared-memory round trip and no wasted MMA rows.
//
// swiglu_clamp: out = silu(min(gate, limit)) · clamp(up, −limit, limit) of fused [rows, 2I] rows
// (gate first); limit ≤ 0 means no clamp.
#include "mma.cuh"

#define TILE MMA_TILE  // mma.cuh's 64×64 block tile on 4 warps
#define PAD 8
#define THREADS MMA_TILE_THREADS

// ---- e2m1 decoding ----------------------------------------------------------------------------

// Codes 8j .. 8j+7 of `word` (nibble i = code i) as bf16x2 pairs of m · 2^−126:
// pairs[i] = (code i, code i + 4), i = 0..3.
__device__ __forceinline__ void fp4x8_pairs(unsigned word, unsigned* pairs) {
    pairs[0] = ((word << 6) & 0x01C001C0u) | ((word << 12) & 0x80008000u);
    pairs[1] = ((word << 2) & 0x01C001C0u) | ((word << 8) & 0x80008000u);
    pairs[2] = ((word >> 2) & 0x01C001C0u) | ((word << 4) & 0x80008000u);
    pairs[3] = ((word >> 6) & 0x01C001C0u) | (word & 0x80008000u);
}

// 2^e as bf16 bits in both halves (e in −126 .. 127).
__device__ __forceinline__ unsigned bf16x2_power_of_two(int e) {
    const unsigned bits = (unsigned)(e + 127) << 7;
    return bits | (bits << 16);
}

// a · b per bf16 half (exact here: powers of two times at most 2 significant bits).
__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
#ifdef MMA_HOST_STANDIN
    const auto half = [](unsigned v, int hi) {
        return __bfloat162float(__nv_bfloat16{static_cast<uint16_t>(hi ? v >> 16 : v & 0xFFFFu)});
    };
    return pack_bf16x2(half(a, 0) * half(b, 0), half(a, 1) * half(b, 1));
#else
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<unsigned*>(&r);
#endif
}

// The scale of e8m0 `s` for fp4x8_pairs' values: 2^(s − 1) in `first` (s ≤ 128), or 2^126 in
// `first` and 2^(s − 127) in `second` (2^(s − 1) would overflow bf16); `second` is 1 when unused.
// Returns whether `second` is needed.
__device__ __forceinline__ bool fp4_scale_factors(unsigned s, unsigned& first, unsigned& second) {
    const bool twice = s > 128u;
    first = bf16x2_power_of_two(twice ? 126 : (int)s - 1);
    second = bf16x2_power_of_two(twice ? (int)s - 127 : 0);
    return twice;
}

// 8 codes of one word, scaled, as 4 bf16x2 pairs (code i, code i + 4).
__device__ __forceinline__ void fp4x8_scaled(unsigned word, unsigned first, unsigned second, bool twice,
                                             unsigned* pairs) {
    fp4x8_pairs(word, pairs);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = bf16x2_mul(pairs[i], first);
    if (twice) {
#pragma unroll
        for (int i = 0; i < 4; ++i) pairs[i] = bf16x2_mul(pairs[i], second);
    }
}

// bf16x2 (lo half of a, lo half of b) and (hi of a, hi of b): PRMT on the device.
__device__ __forceinline__ unsigned pair_low_halves(unsigned a, unsigned b) { return (a & 0xFFFFu) | (b << 16); }
__device__ __forceinline__ unsigned pair_high_halves(unsigned a, unsigned b) { return (a >> 16) | (b & 0xFFFF0000u); }

// ---- moe_fp4_grouped_gemm ---------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(THREADS)
moe_fp4_grouped_gemm(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                     const unsigned char* __restrict__ weight, const unsigned char* __restrict__ scale,
                     const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                     const int* __restrict__ num_tiles, const int* __restrict__ offsets,
                     bf16* __restrict__ out, int N, int K) {
    __shared__ __align__(16) bf16 a_tile[TILE][TILE + PAD];
    __shared__ __align__(16) bf16 b_tile[TILE][TILE + PAD];
    __shared__ float c_tile[TILE][TILE + 4];
    __shared__ int a_rows[TILE];
    if ((int)blockIdx.x >= *num_tiles) return;
    const int expert = tile_expert[blockIdx.x], row_begin = tile_row[blockIdx.x];
    const int rows = min(TILE, offsets[expert + 1] - row_begin), n0 = blockIdx.y * TILE;
    for (int r = threadIdx.x; r < TILE; r += THREADS)
        a_rows[r] = r < rows ? (sorted_slots ? sorted_slots[row_begin + r] / top_k : row_begin + r) : -1;
    const MmaTileLane lane = mma_tile_lane();
    float acc[2][4][4] = {};
    const long long expert_rows = (long long)expert * N;
    __syncthreads();
    for (int k0 = 0; k0 < K; k0 += TILE) {
        load_row_tile_vec(a, a_rows, k0, K, a_tile);
        for (int i = threadIdx.x; i < TILE * TILE / 8; i += THREADS) {  // 8 codes = one 4-byte word
            const int r = i / (TILE / 8), c = (i % (TILE / 8)) * 8, n = n0 + r, k = k0 + c;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (n < N && k < K) {
                const long long row = expert_rows + n;
                const unsigned word = *reinterpret_cast<const unsigned*>(weight + row * (K / 2) + k / 2);
                unsigned first, second, p[4];
                const bool twice = fp4_scale_factors(scale[row * (K / 32) + k / 32], first, second);
                fp4x8_scaled(word, first, second, twice, p);  // (k, k+4), (k+1, k+5), ...: back to k order
                v = make_uint4(pair_low_halves(p[0], p[1]), pair_low_halves(p[2], p[3]), pair_high_halves(p[0], p[1]),
                               pair_high_halves(p[2], p[3]));
            }
            *reinterpret_cast<uint4*>(&b_tile[r][c]) = v;
        }
        __syncthreads();
        mma_tile_step(acc, a_tile, b_tile, lane);
        __syncthreads();
    }
    store_mma_tile(c_tile, acc, lane);
    __syncthreads();
    for (int i = threadIdx.x; i < TILE * TILE; i += THREADS) {
        const int r = i / TILE, c = i % TILE;
        if (r < rows && n0 + c < N) out[(long long)(row_begin + r) * N + n0 + c] = __float2bfloat16_rn(c_tile[r][c]);
    }
}

// ---- the stream GEMMs: moe_fp4_stream_gemm, fp8_stream_linear -------------------------------------

#define STREAM_WARPS 4
#define STREAM_THREADS (STREAM_WARPS * 32)  // = 8 rows × 16 copies of 16 bytes: one staged row chunk per step
#define STREAM_N (16 * STREAM_WARPS)  // weight rows (output columns) per block
#define STREAM_K 128                  // k per step: 4 lanes × one 32-k group
#define STREAM_TOKENS TILE            // rows of a moe_sort tile (and of a dense block row)
#ifndef STREAM_CHUNKS
#define STREAM_CHUNKS (STREAM_TOKENS / 8)  // 8-token column blocks kept: the launcher's bound on rows per tile
#endif
// Blocks per SM the registers must allow (ptxas otherwise picked 96 registers and spilled at 1 chunk)
#define STREAM_MIN_BLOCKS (STREAM_CHUNKS > 4 ? 3 : 4)
#ifdef MMA_HOST_STANDIN  // the host stand-in's __launch_bounds__ takes one argument
#define STREAM_LAUNCH_BOUNDS __launch_bounds__(STREAM_THREADS)
#else
#define STREAM_LAUNCH_BOUNDS __launch_bounds__(STREAM_THREADS, STREAM_MIN_BLOCKS)
#endif
// The staged rows: per token, 4 groups of 32 bf16 (64 B) each followed by 16 B of padding, so
// a quarter warp's 16-byte reads (2 tokens × 4 groups) hit 8 distinct bank quads.
#define X_GROUP_BYTES 80
#define X_ROW_BYTES (4 * X_GROUP_BYTES)

// Staging buffers of the activation rows, a ring over K steps: step s + STREAM_STAGES − 1 is
// copied while step s multiplies. 2 (the default): one step ahead, so every step waits out the
// latency of its rows' copy; 4 (STREAM_STAGES=4 from the launcher, for 1–2 chunks: 4 × 5 KB at
// most) keeps three steps of copies in flight.
#ifndef STREAM_STAGES
#define STREAM_STAGES 2
#endif
static_assert(STREAM_STAGES >= 2 && STREAM_STAGES * 8 * STREAM_CHUNKS * 320 <= 48 * 1024,
              "the staging ring must fit in 48 KB of static shared memory (320 B: X_ROW_BYTES)");

#ifdef MMA_HOST_STANDIN
__device__ __forceinline__ void stage16(unsigned char* smem, const unsigned char* gmem, bool valid) {
    for (int i = 0; i < 16; ++i) smem[i] = valid ? gmem[i] : 0;
}
__device__ __forceinline__ void stage_commit() {}
__device__ __forceinline__ void stage_wait() {}
#else
__device__ __forceinline__ void stage_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void stage16(unsigned char* smem, const unsigned char* gmem, bool valid) {
    cp_async16(reinterpret_cast<bf16*>(smem), reinterpret_cast<const bf16*>(gmem), valid);
}
// Close the thread's copies issued since the last call into one group, then wait until at most
// STREAM_STAGES − 2 groups (the newest steps' copies) are still in flight.
__device__ __forceinline__ void stage_wait() {
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STREAM_STAGES - 2) : "memory");
}
#endif

// A lane's A fragments of one K step: frag[m][h] is the mma k-step (m, h) of weight rows g and
// g + 8; its columns (2q, 2q+1, 2q+8, 2q+9) are k (8m + 2h, 8m + 2h + 4, 8m + 2h + 1, 8m + 2h + 5)
// of the lane's 32-k group q of the step (any order of k serves, the B operand is paired the same).
typedef unsigned StreamFragments[4][2][4];

// A weight format of the stream GEMM: `Step` is one lane's share of a K step (its 32-k group of
// weight rows g and g + 8), `Cursor` where it reads that share at step 0, `load` a step's share
// (zeros for a row past N or a group past K), `fragments` its 8 A fragments, `DEPTH` the steps a
// lane keeps in flight.

// FP4 e2m1 codes [E, N, K/2] with an e8m0 scale per 32 codes [E, N, K/32]: a group is 16 bytes
// and one scale per row.
struct Fp4Stream {
    static constexpr int DEPTH = 3;
    struct Step {
        uint4 lo, hi;
        unsigned scale_lo, scale_hi;
    };
    struct Cursor {
        const unsigned char* codes_lo;  // null: a row past N
        const unsigned char* codes_hi;
        const unsigned char* scale_lo;
        const unsigned char* scale_hi;
    };
    __device__ __forceinline__ static Cursor cursor(const unsigned char* weight, const unsigned char* scale, int expert,
                                                    int n_lo, int N, int K, int q) {
        const long long row_lo = (long long)expert * N + n_lo;
        const int groups = K / 32;
        return Cursor{n_lo < N ? weight + row_lo * (K / 2) + 16 * q : nullptr,
                      n_lo + 8 < N ? weight + (row_lo + 8) * (K / 2) + 16 * q : nullptr, scale + row_lo * groups + q,
                      scale + (row_lo + 8) * groups + q};
    }
    __device__ __forceinline__ static Step load(const Cursor& at, int step, bool group_ok) {
        Step w{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), 127u, 127u};
        if (group_ok && at.codes_lo) {
            w.lo = *reinterpret_cast<const uint4*>(at.codes_lo + 64 * step);
            w.scale_lo = at.scale_lo[4 * step];
        }
        if (group_ok && at.codes_hi) {
            w.hi = *reinterpret_cast<const uint4*>(at.codes_hi + 64 * step);
            w.scale_hi = at.scale_hi[4 * step];
        }
        return w;
    }
    // The lane's 64 codes decoded once (32 registers); each word holds k 8m .. 8m + 7.
    __device__ __forceinline__ static void fragments(const Step& w, StreamFragments& frag) {
        unsigned lo_first, lo_second, hi_first, hi_second;
        const bool twice = fp4_scale_factors(w.scale_lo, lo_first, lo_second) |
                           fp4_scale_factors(w.scale_hi, hi_first, hi_second);
        const unsigned lo_words[4] = {w.lo.x, w.lo.y, w.lo.z, w.lo.w}, hi_words[4] = {w.hi.x, w.hi.y, w.hi.z, w.hi.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            unsigned lo[4], hi[4];
            fp4x8_pairs(lo_words[m], lo);
            fp4x8_pairs(hi_words[m], hi);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                frag[m][h][0] = bf16x2_mul(lo[2 * h], lo_first);
                frag[m][h][1] = bf16x2_mul(hi[2 * h], hi_first);
                frag[m][h][2] = bf16x2_mul(lo[2 * h + 1], lo_first);
                frag[m][h][3] = bf16x2_mul(hi[2 * h + 1], hi_first);
            }
        }
        if (twice) {  // scales above 2^1: a second factor (1 for the row that needs none)
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        frag[m][h][i] = bf16x2_mul(frag[m][h][i], (i & 1) ? hi_second : lo_second);
        }
    }
};

// ---- e4m3 decoding ------------------------------------------------------------------------------

// Byte i of `a` in byte 0 and byte i of `b` in byte 2 (bytes 1 and 3: don't care): one PRMT.
__device__ __forceinline__ unsigned byte_pair(unsigned a, unsigned b, int i) {
#ifdef MMA_HOST_STANDIN
    return ((a >> (8 * i)) & 0xFFu) | (((b >> (8 * i)) & 0xFFu) << 16);
#else
    return __byte_perm(a, b, (unsigned)(i | ((4 + i) << 8)));
#endif
}

// The e4m3 codes in bytes 0 and 2 of `t` as a bf16x2 pair of (value · 2^−120): the code's 7
// exponent-and-mantissa bits move to bf16 bits 4..10 (its 4-bit exponent, bias 7, becomes an
// 8-bit one, bias 127; the subnormals land on bf16 subnormals the same way), the sign to bit 15.
// NaN codes (0x7F, 0xFF) come out as ±480 · 2^−120: a checkpoint never holds them.
__device__ __forceinline__ unsigned fp8x2_pair(unsigned t) {
    return ((t << 4) & 0x07F007F0u) | ((t << 8) & 0x80008000u);
}

// The factors of e8m0 `s` (2^(s − 127)) for values carrying 2^−`bias`: 2^(s − 127 + bias) in
// `first`, or 2^126 in `first` and the rest in `second` when one bf16 cannot hold it; `second`
// is 1 when unused. Returns whether `second` is needed. (fp4_scale_factors is bias 126.)
__device__ __forceinline__ bool scale_factors(unsigned s, int bias, unsigned& first, unsigned& second) {
    const int e = (int)s - 127 + bias;
    const bool twice = e > 127;
    first = bf16x2_power_of_two(twice ? 126 : e);
    second = bf16x2_power_of_two(twice ? e - 126 : 0);
    return twice;
}

// FP8 e4m3 codes [E, N, K] with e8m0 scales per 128×128 block [E, ⌈N/128⌉, ⌈K/128⌉]: a group is
// 32 bytes; a warp's 16 rows and a step's 128 k lie in one scale block, so one scale per step.
struct Fp8Stream {
    static constexpr int DEPTH = 2;  // 64 bytes a step per lane: twice FP4's, so one step fewer in flight
    struct Step {
        uint4 lo[2], hi[2];
        unsigned scale;
    };
    struct Cursor {
        const unsigned char* codes_lo;  // null: a row past N
        const unsigned char* codes_hi;
        const unsigned char* scale;  // the warp's block row, step 0
    };
    __device__ __forceinline__ static Cursor cursor(const unsigned char* weight, const unsigned char* scale, int expert,
                                                    int n_lo, int N, int K, int q) {
        const long long row_lo = (long long)expert * N + n_lo;
        const int block_rows = (N + 127) / 128, block_cols = (K + 127) / 128;
        return Cursor{n_lo < N ? weight + row_lo * K + 32 * q : nullptr,
                      n_lo + 8 < N ? weight + (row_lo + 8) * K + 32 * q : nullptr,
                      scale + ((long long)expert * block_rows + n_lo / 128) * block_cols};
    }
    __device__ __forceinline__ static Step load(const Cursor& at, int step, bool group_ok) {
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        Step w{{zero, zero}, {zero, zero}, 127u};
        if (group_ok && at.codes_lo) {
            const uint4* codes = reinterpret_cast<const uint4*>(at.codes_lo + STREAM_K * step);
            w.lo[0] = codes[0];
            w.lo[1] = codes[1];
            w.scale = at.scale[step];
        }
        if (group_ok && at.codes_hi) {
            const uint4* codes = reinterpret_cast<const uint4*>(at.codes_hi + STREAM_K * step);
            w.hi[0] = codes[0];
            w.hi[1] = codes[1];
        }
        return w;
    }
    // Words 2m and 2m + 1 hold k 8m .. 8m + 3 and 8m + 4 .. 8m + 7: pair i is (k 8m + i, 8m + i + 4).
    __device__ __forceinline__ static void fragments(const Step& w, StreamFragments& frag) {
        unsigned first, second;
        const bool twice = scale_factors(w.scale, 120, first, second);
        const unsigned lo[8] = {w.lo[0].x, w.lo[0].y, w.lo[0].z, w.lo[0].w, w.lo[1].x, w.lo[1].y, w.lo[1].z, w.lo[1].w};
        const unsigned hi[8] = {w.hi[0].x, w.hi[0].y, w.hi[0].z, w.hi[0].w, w.hi[1].x, w.hi[1].y, w.hi[1].z, w.hi[1].w};
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                frag[m][h][0] = bf16x2_mul(fp8x2_pair(byte_pair(lo[2 * m], lo[2 * m + 1], 2 * h)), first);
                frag[m][h][1] = bf16x2_mul(fp8x2_pair(byte_pair(hi[2 * m], hi[2 * m + 1], 2 * h)), first);
                frag[m][h][2] = bf16x2_mul(fp8x2_pair(byte_pair(lo[2 * m], lo[2 * m + 1], 2 * h + 1)), first);
                frag[m][h][3] = bf16x2_mul(fp8x2_pair(byte_pair(hi[2 * m], hi[2 * m + 1], 2 * h + 1)), first);
            }
        if (twice) {  // scales above 2^7
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int i = 0; i < 4; ++i) frag[m][h][i] = bf16x2_mul(frag[m][h][i], second);
        }
    }
};

// The thread's 16-byte copies of a step's staged rows: copy j is row 8j + tid / 16 (a chunk
// each), values 8 · (tid % 16) .. +7 of the step's 128 k; `source[j]` is that row's step-0
// address (null: a padding row, staged as zeros).
struct StageCursor {
    const bf16* source[STREAM_CHUNKS];
    const bf16* any_row;  // a valid address for the zero-filling copies (they read no bytes)
    int offset;  // bytes into a staging buffer of copy 0 (copy j: + 8j rows)
    int k;       // the copies' first k at step 0
};

__device__ __forceinline__ void stage_rows(const StageCursor& at, int chunks, int step, int K, unsigned char* buffer) {
    const int k = at.k + step * STREAM_K;
#pragma unroll
    for (int j = 0; j < STREAM_CHUNKS; ++j) {
        if (j < chunks) {
            const bool valid = at.source[j] != nullptr && k < K;
            stage16(buffer + at.offset + 8 * j * X_ROW_BYTES,
                    reinterpret_cast<const unsigned char*>(valid ? at.source[j] + step * STREAM_K : at.any_row), valid);
        }
    }
}

// acc[c] += W[16 rows, this step's 128 k] · X[8 tokens of chunk c, same k]^T for c < chunks.
__device__ __forceinline__ void stream_mma(float (&acc)[STREAM_CHUNKS][4], const StreamFragments& frag,
                                           const unsigned char* buffer, int chunks, int g, int q) {
#pragma unroll
    for (int c = 0; c < STREAM_CHUNKS; ++c) {
        if (c < chunks) {
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                // 8 staged values x0..x7 of token 8c + g at k 8m.. of the lane's group, paired as the codes
                const uint4 x = *reinterpret_cast<const uint4*>(buffer + (8 * c + g) * X_ROW_BYTES + q * X_GROUP_BYTES +
                                                                m * 16);
                mma_bf16_16816(acc[c], frag[m][0], pair_low_halves(x.x, x.z), pair_high_halves(x.x, x.z));
                mma_bf16_16816(acc[c], frag[m][1], pair_low_halves(x.y, x.w), pair_high_halves(x.y, x.w));
            }
        }
    }
}

// One block's work: weight rows blockIdx.x · 64 .. +63 of `expert` times `tile_rows` rows of
// `a` (row r: sorted_slots[first_row + r] / top_k, or first_row + r without sorted_slots), over
// K steps first_step .. end_step − 1 (128 k each), into out rows first_row .. first_row +
// tile_rows − 1 — or, with `partial` (split K), fp32 sums into partial rows instead. Warp w owns
// weight rows n0 + 16w .. +15; the rows are taken 8·STREAM_CHUNKS at a time (one pass over the
// weights each): the launcher picks STREAM_CHUNKS to cover the most rows a tile can hold in its step.
template <class Format>
__device__ __forceinline__ void stream_gemm(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                                            const unsigned char* __restrict__ weight,
                                            const unsigned char* __restrict__ scale, int expert, int first_row,
                                            int tile_rows, int first_step, int end_step, bf16* __restrict__ out,
                                            float* __restrict__ partial, int N, int K) {
    __shared__ __align__(16) unsigned char staged[STREAM_STAGES][8 * STREAM_CHUNKS * X_ROW_BYTES];
    __shared__ int a_rows[8 * STREAM_CHUNKS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int n_lo = blockIdx.x * STREAM_N + 16 * warp + g;
    const int groups = K / 32;
    const typename Format::Cursor weights = Format::cursor(weight, scale, expert, n_lo, N, K, q);
    for (int row_begin = first_row, done = 0; done < tile_rows; done += 8 * STREAM_CHUNKS, row_begin += 8 * STREAM_CHUNKS) {
        const int rows = min(8 * STREAM_CHUNKS, tile_rows - done), chunks = (rows + 7) / 8;
        __syncthreads();  // the previous pass is done with a_rows and the staging buffers
        for (int r = threadIdx.x; r < 8 * STREAM_CHUNKS; r += STREAM_THREADS)
            a_rows[r] = r < rows ? (sorted_slots ? sorted_slots[row_begin + r] / top_k : row_begin + r) : -1;
        float acc[STREAM_CHUNKS][4] = {};
        typename Format::Step ring[Format::DEPTH];
#pragma unroll
        for (int d = 0; d < Format::DEPTH; ++d)  // (a step past end_step but inside K: read, unused)
            ring[d] = Format::load(weights, first_step + d, 4 * (first_step + d) + q < groups);
        __syncthreads();  // a_rows
        StageCursor stage;
        {
            const int r = threadIdx.x / (STREAM_K / 8), c8 = threadIdx.x % (STREAM_K / 8);
            stage.offset = r * X_ROW_BYTES + (c8 / 4) * X_GROUP_BYTES + (c8 % 4) * 16;
            stage.k = 8 * c8;
            stage.any_row = a;
#pragma unroll
            for (int j = 0; j < STREAM_CHUNKS; ++j) {
                const int src = a_rows[8 * j + r];
                stage.source[j] = src >= 0 ? a + (long long)src * K + stage.k : nullptr;
            }
        }
        // steps first_step .. + STREAM_STAGES − 2 in flight, one group each; the first one landed
#pragma unroll
        for (int p = 0; p < STREAM_STAGES - 1; ++p) {
            if (p > 0) stage_commit();  // (a step past end_step: zeros past K, else read and unused)
            stage_rows(stage, chunks, first_step + p, K, staged[(unsigned)(first_step + p) % STREAM_STAGES]);
        }
        stage_wait();
        __syncthreads();
        for (int s0 = first_step; s0 < end_step; s0 += Format::DEPTH) {
#pragma unroll
            for (int d = 0; d < Format::DEPTH; ++d) {  // unrolled: ring[d] stays in registers
                const int s = s0 + d;
                if (s < end_step) {  // the same for every thread of the block
                    // into the buffer step s − 1 used: every thread is past it (the barrier below)
                    if (s + STREAM_STAGES - 1 < end_step)
                        stage_rows(stage, chunks, s + STREAM_STAGES - 1, K, staged[(unsigned)(s + STREAM_STAGES - 1) % STREAM_STAGES]);
                    const typename Format::Step current = ring[d];
                    const int ahead = s + Format::DEPTH;
                    if (ahead < end_step) ring[d] = Format::load(weights, ahead, 4 * ahead + q < groups);
                    StreamFragments frag;
                    Format::fragments(current, frag);
                    stream_mma(acc, frag, staged[(unsigned)s % STREAM_STAGES], chunks, g, q);
                    stage_wait();
                    __syncthreads();
                }
            }
        }
        // acc[c] = weight rows (n_lo, n_lo + 8) × tokens (8c + 2q, 8c + 2q + 1)
#pragma unroll
        for (int c = 0; c < STREAM_CHUNKS; ++c) {
            if (c < chunks) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int token = 8 * c + 2 * q + (e & 1), n = n_lo + 8 * (e >> 1);
                    if (token < rows && n < N) {
                        if (partial) partial[(long long)(row_begin + token) * N + n] = acc[c][e];
                        else out[(long long)(row_begin + token) * N + n] = __float2bfloat16_rn(acc[c][e]);
                    }
                }
            }
        }
    }
}

// grid (⌈N / 64⌉, max_tiles), STREAM_THREADS threads: tile blockIdx.y of moe_sort's layout.
extern "C" __global__ void STREAM_LAUNCH_BOUNDS
moe_fp4_stream_gemm(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                    const unsigned char* __restrict__ weight, const unsigned char* __restrict__ scale,
                    const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                    const int* __restrict__ num_tiles, const int* __restrict__ offsets,
                    bf16* __restrict__ out, int N, int K) {
    const int tile = blockIdx.y;
    if (tile >= *num_tiles) return;
    const int expert = tile_expert[tile];
    const int tile_rows = min(STREAM_TOKENS, offsets[expert + 1] - tile_row[tile]);
    stream_gemm<Fp4Stream>(a, sorted_slots, top_k, weight, scale, expert, tile_row[tile], tile_rows, 0,
                           (K + STREAM_K - 1) / STREAM_K, out, nullptr, N, K);
}

// out [M, N] = a [M, K] · W^T for one FP8 weight (W8A16: the codes decoded to bf16 in registers;
// K a multiple of 32). grid (⌈N / 64⌉, ⌈M / 64⌉, splits), STREAM_THREADS threads: rows
// 64·blockIdx.y .. +63, K steps of split blockIdx.z. splits > 1 (few blocks: a decode step of a
// narrow weight): each split writes fp32 sums to partial [splits, M, N] and fp8_stream_reduce
// adds them in split order.
extern "C" __global__ void STREAM_LAUNCH_BOUNDS
fp8_stream_linear(const bf16* __restrict__ a, const unsigned char* __restrict__ weight,
                  const unsigned char* __restrict__ scale, bf16* __restrict__ out, float* __restrict__ partial,
                  int M, int N, int K) {
    const int first_row = STREAM_TOKENS * blockIdx.y, steps = (K + STREAM_K - 1) / STREAM_K;
    // an empty split (first_step ≥ steps; the launcher avoids them) writes zeros
    const int per_split = (steps + gridDim.z - 1) / gridDim.z, first_step = blockIdx.z * per_split;
    stream_gemm<Fp8Stream>(a, nullptr, 1, weight, scale, 0, first_row, min(STREAM_TOKENS, M - first_row), first_step,
                           min(steps, first_step + per_split), out,
                           partial ? partial + (long long)blockIdx.z * M * N : nullptr, N, K);
}

// out [M, N] (bf16) = Σ_z partial [z, M, N] in z order; grid-stride over M·N.
extern "C" __global__ void fp8_stream_reduce(const float* __restrict__ partial, bf16* __restrict__ out, long long size,
                                             int splits) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < size; i += (long long)gridDim.x * blockDim.x) {
        float total = 0.f;
        for (int z = 0; z < splits; ++z) total += partial[z * size + i];
        out[i] = __float2bfloat16_rn(total);
    }
}

extern "C" __global__ void swiglu_clamp(const bf16* __restrict__ gate_up, bf16* __restrict__ out, long long rows,
                                        int half, float limit) {
    const long long total = rows * half;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / half;
        const int c = (int)(i % half);
        float gate = __bfloat162float(gate_up[r * 2 * half + c]), up = __bfloat162float(gate_up[r * 2 * half + half + c]);
        if (limit > 0.f) {
            gate = fminf(gate, limit);
            up = fminf(fmaxf(up, -limit), limit);
        }
        out[i] = __float2bfloat16_rn(gate / (1.f + __expf(-gate)) * up);
    }
}
