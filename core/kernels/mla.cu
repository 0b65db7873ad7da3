// Multi-head latent attention (DeepSeek-V3 / Kimi-K2) over a paged latent cache, absorbed form.
//
//   cache [num_blocks, block_size, KV_LORA + ROPE_DIM] bf16     one latent row per token:
//         [ c_kv (RMS-normed, KV_LORA) | k_pe (RoPE'd, ROPE_DIM) ]
//
// mla_write_latent: per new token, RMS-norm c_kv (kv_a_layernorm), rotate k_pe, store the row at
//   the token's slot; rotate every head's q_pe in place (rotate-half on de-interleaved dims).
// mla_attention: per (token, chunk of HEADS_PER_BLOCK heads): scores over the token's causal
//   context (positions 0 ..= its own) = (q_latent · c_kv + q_pe · k_pe) · scale, online softmax,
//   o_latent = Σ p · c_kv. W_UK (into q_latent) and W_UV (out of o_latent) are batched GEMMs
//   outside. Every latent tile is read once for all heads of the block.
//
// Decompressed (naive) form for prefill chunks, where queries are many and tensor cores pay:
// mla_gather_context: a chunk's whole context (cached + new latents) out of the paged cache into
//   contiguous c_kv [C, KV_LORA] and k_pe [C, ROPE_DIM]; cuBLAS then expands c_kv through kv_b into
//   per-head keys k_nope [C, H, NOPE] and values [C, H, V_DIM].
// mla_prefill_attention: causal flash attention per (64-query tile, head) with K = [k_nope | k_pe]
//   (192 wide for DeepSeek-V3) and V (128), bf16 mma.sync m16n8k16, fp32 online softmax.
#include "mla_prefill.cuh"  // PREFILL_SEQ_FIELDS, MlaPrefillTile
#include "mma.cuh"
#include "mla_split.cuh"    // mla_split_context

#ifndef KV_LORA
#define KV_LORA 512
#endif
#ifndef ROPE_DIM
#define ROPE_DIM 64
#endif
#define LATENT (KV_LORA + ROPE_DIM)
#define HEADS_PER_BLOCK 16
#define TOKENS_PER_TILE 16
#define MLA_THREADS (HEADS_PER_BLOCK * TOKENS_PER_TILE)
#define DIMS_PER_THREAD (KV_LORA / TOKENS_PER_TILE)

#include "mla_latent.cuh"  // mla_latent_row, mla_rope_pair

// The latent row of one new token at its slot (block-wide; slot < 0: a padding row of a captured batch, nothing
// stored).
__device__ __forceinline__ void mla_store_latent_row(const bf16* __restrict__ row, const bf16* __restrict__ norm_weight,
                                                     float eps, int slot, const float* cos_row, const float* sin_row,
                                                     bf16* __restrict__ cache, float* scratch) {
    mla_latent_row(row, norm_weight, eps, cos_row, sin_row, cache + (long long)(slot < 0 ? 0 : slot) * LATENT,
                   slot >= 0, scratch);
}

// One rotate-half pair d of head h's q_pe of row t, in place.
__device__ __forceinline__ void mla_rotate_q_pe(bf16* __restrict__ q, int t, int h, int d, int num_heads, int q_stride,
                                                int q_pe_offset, const float* cos_row, const float* sin_row) {
    const int half = ROPE_DIM / 2;
    bf16* pe = q + ((long long)t * num_heads + h) * q_stride + q_pe_offset;
    const float2 r = mla_rope_pair(__bfloat162float(pe[d]), __bfloat162float(pe[half + d]), cos_row[d], sin_row[d]);
    pe[d] = __float2bfloat16_rn(r.x);
    pe[half + d] = __float2bfloat16_rn(r.y);
}

// Blocks (new token, part of its heads' q_pe): part 0 also writes the latent row; q [T, num_heads,
// q_stride] with q_pe at q_pe_offset of each head.
extern "C" __global__ void mla_write_latent(const bf16* __restrict__ kv_a /* [T, kv_a_stride] */, int kv_a_stride,
                                            const bf16* __restrict__ norm_weight, float eps,
                                            bf16* __restrict__ q, int num_heads, int q_stride, int q_pe_offset,
                                            const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                                            const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                                            bf16* __restrict__ cache) {
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    const int half = ROPE_DIM / 2;
    const float* cos_row = cos_table + (long long)positions[t] * half;
    const float* sin_row = sin_table + (long long)positions[t] * half;
    if (blockIdx.y == 0)  // the latent row: block 0 of the token's gridDim.y (block-uniform)
        mla_store_latent_row(kv_a + (long long)t * kv_a_stride, norm_weight, eps, slot_mapping[t], cos_row, sin_row,
                             cache, scratch);
    // every head's q_pe, shared by the token's gridDim.y blocks (in place, so one block's loop runs
    // its rounds one after another: gridDim.y > 1 spreads them)
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < num_heads * half; i += gridDim.y * blockDim.x)
        mla_rotate_q_pe(q, t, i / half, i % half, num_heads, q_stride, q_pe_offset, cos_row, sin_row);
}

// mla_write_latent that leaves q where it is: the rows of q_src (a row view of the fused q / kv_a projection,
// q_src_stride elements apart, heads q_stride apart, q_pe at q_pe_offset of each head) are read, and every head's
// q_pe is stored rotated into its own contiguous q_pe [T, num_heads, ROPE_DIM] (the attention kernels read it with
// q_stride ROPE_DIM, offset 0; W_UK reads q_nope straight from the view). No copy of q, no in-place rotation: the
// same rotated values as mla_write_latent's. Blocks as mla_write_latent's.
extern "C" __global__ void mla_write_latent_q_pe(const bf16* __restrict__ kv_a /* [T, kv_a_stride] */, int kv_a_stride,
                                                 const bf16* __restrict__ norm_weight, float eps,
                                                 const bf16* __restrict__ q_src, int q_src_stride,
                                                 bf16* __restrict__ q_pe, int num_heads, int q_stride, int q_pe_offset,
                                                 const int* __restrict__ positions,
                                                 const int* __restrict__ slot_mapping,
                                                 const float* __restrict__ cos_table,
                                                 const float* __restrict__ sin_table, bf16* __restrict__ cache) {
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    const int half = ROPE_DIM / 2;
    const float* cos_row = cos_table + (long long)positions[t] * half;
    const float* sin_row = sin_table + (long long)positions[t] * half;
    if (blockIdx.y == 0)
        mla_store_latent_row(kv_a + (long long)t * kv_a_stride, norm_weight, eps, slot_mapping[t], cos_row, sin_row,
                             cache, scratch);
    const bf16* src = q_src + (long long)t * q_src_stride + q_pe_offset;
    bf16* dst = q_pe + (long long)t * num_heads * ROPE_DIM;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < num_heads * half; i += gridDim.y * blockDim.x) {
        const int h = i / half, d = i % half;  // mla_rotate_q_pe's sums
        const bf16* pe = src + h * q_stride;
        const float2 r = mla_rope_pair(__bfloat162float(pe[d]), __bfloat162float(pe[half + d]), cos_row[d], sin_row[d]);
        dst[h * ROPE_DIM + d] = __float2bfloat16_rn(r.x);
        dst[h * ROPE_DIM + half + d] = __float2bfloat16_rn(r.y);
    }
}

#ifndef NOPE_DIM
#define NOPE_DIM 128
#endif
#define ABSORB_COLUMNS 64      // W_UK output columns per block of mla_write_absorb
#define ABSORB_MAX_TOKENS 16   // core's WRITE_ABSORB_MAX_TOKENS
#define ABSORB_THREADS 128     // 8 groups of 8 columns x 16 groups of nope rows
#define ABSORB_ROWS (NOPE_DIM / 16)  // nope rows per thread

// W_UK's columns 64c .. 64c + 63 of head h for every row (mla_write_absorb's and mla_absorb_small's block (h, c)):
// `w` holds this thread's NOPE_DIM / 16 rows of 8 columns (loaded by the caller: all in flight at once), q_nope of
// every row goes through shared memory (rows q_token_stride elements apart, heads q_stride apart), the row groups are
// summed by shuffles and through shared memory in a fixed order.
template <int MAX_TOKENS>
__device__ __forceinline__ void mla_absorb_columns(const uint4 (&w)[ABSORB_ROWS], const bf16* __restrict__ q,
                                                   long long q_token_stride, int q_stride, int num_heads,
                                                   int num_tokens, bf16* __restrict__ q_latent, int h, int c,
                                                   bf16 (&q_nope)[MAX_TOKENS][NOPE_DIM],
                                                   float (&warp_sums)[ABSORB_THREADS / 32][MAX_TOKENS][ABSORB_COLUMNS]) {
    const int group = threadIdx.x & 7, row_group = threadIdx.x >> 3;  // 8 columns, ABSORB_ROWS nope rows
    for (int i = threadIdx.x; i < num_tokens * NOPE_DIM; i += ABSORB_THREADS)
        q_nope[i / NOPE_DIM][i % NOPE_DIM] = q[(long long)(i / NOPE_DIM) * q_token_stride + (long long)h * q_stride + i % NOPE_DIM];
    __syncthreads();
    float acc[MAX_TOKENS][8];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
#pragma unroll
    for (int r = 0; r < ABSORB_ROWS; ++r) {
        float weight[8];
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&w[r]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(pairs[e]);
            weight[2 * e] = f.x;
            weight[2 * e + 1] = f.y;
        }
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= num_tokens) break;  // block-uniform
            const float x = __bfloat162float(q_nope[t][row_group * ABSORB_ROWS + r]);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[t][e] += x * weight[e];
        }
    }
    // the row groups: 4 per warp by shuffles (lanes 8 and 16 apart), then the 4 warps through shared memory
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        if (t >= num_tokens) break;  // block-uniform
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float v = acc[t][e];
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            if ((threadIdx.x & 31) < 8) warp_sums[threadIdx.x >> 5][t][8 * group + e] = v;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_tokens * ABSORB_COLUMNS; i += ABSORB_THREADS) {
        const int t = i / ABSORB_COLUMNS, column = i % ABSORB_COLUMNS;
        float sum = warp_sums[0][t][column];
#pragma unroll
        for (int warp = 1; warp < ABSORB_THREADS / 32; ++warp) sum += warp_sums[warp][t][column];
        q_latent[((long long)t * num_heads + h) * KV_LORA + c * ABSORB_COLUMNS + column] = __float2bfloat16_rn(sum);
    }
}

// This thread's W_UK rows of block (h, c) as 16-byte vectors, all in flight at once.
__device__ __forceinline__ void mla_absorb_weights(uint4 (&w)[ABSORB_ROWS], const bf16* __restrict__ w_uk, int h, int c) {
    const int group = threadIdx.x & 7, row_group = threadIdx.x >> 3;
    const bf16* w_rows = w_uk + ((long long)h * NOPE_DIM + row_group * ABSORB_ROWS) * KV_LORA + c * ABSORB_COLUMNS + 8 * group;
#pragma unroll
    for (int r = 0; r < ABSORB_ROWS; ++r) w[r] = *reinterpret_cast<const uint4*>(w_rows + (long long)r * KV_LORA);
}

// W_UK alone for small steps (q_latent[t, h] = q_nope[t, h] · W_UK[h], at most ABSORB_MAX_TOKENS rows; rows of q
// q_token_stride elements apart: a row view of the projection is read in place): mla_write_absorb's blocks without
// the latent write (mla_attention_tma does it under TMA_FUSED_WRITE). grid (num_heads, KV_LORA / 64), ABSORB_THREADS.
#ifndef ABSORB_SMALL_TOKENS
#define ABSORB_SMALL_TOKENS ABSORB_MAX_TOKENS  // the most rows of a mla_absorb_small build (core builds 4 and 16)
#endif
extern "C" __global__ void __launch_bounds__(ABSORB_THREADS)
mla_absorb_small(const bf16* __restrict__ q, int q_token_stride, int q_stride, int num_heads, int num_tokens,
                 const bf16* __restrict__ w_uk /* [H, NOPE_DIM, KV_LORA] */, bf16* __restrict__ q_latent) {
    __shared__ bf16 q_nope[ABSORB_SMALL_TOKENS][NOPE_DIM];
    __shared__ float warp_sums[ABSORB_THREADS / 32][ABSORB_SMALL_TOKENS][ABSORB_COLUMNS];
    uint4 w[ABSORB_ROWS];
    mla_absorb_weights(w, w_uk, blockIdx.x, blockIdx.y);
    mla_absorb_columns<ABSORB_SMALL_TOKENS>(w, q, q_token_stride, q_stride, num_heads, num_tokens, q_latent, blockIdx.x,
                                            blockIdx.y, q_nope, warp_sums);
}

// mla_write_latent and W_UK (q_latent[t, h] = q_nope[t, h] · W_UK[h]) in one launch, for steps of at most
// ABSORB_MAX_TOKENS rows (a small decode: one launch, not a latent write and a cuBLAS batched GEMM).
// grid (num_heads, KV_LORA / 64), ABSORB_THREADS threads. Block (h, c): columns 64c .. 64c + 63 of head h's
// q_latent for every row, W_UK[h] [NOPE_DIM, KV_LORA] read once (mla_absorb_columns); then block (h, 0) rotates head
// h's q_pe of every row in place (other dims than the q_nope it read), and the blocks of c >= 1 store the rows'
// latents, row t in block (h + num_heads·(c − 1)) = t mod (num_heads·(gridDim.y − 1)).
extern "C" __global__ void __launch_bounds__(ABSORB_THREADS)
mla_write_absorb(const bf16* __restrict__ kv_a, int kv_a_stride, const bf16* __restrict__ norm_weight, float eps,
                 bf16* __restrict__ q, int num_heads, int q_stride, int q_pe_offset, int num_tokens,
                 const bf16* __restrict__ w_uk /* [H, NOPE_DIM, KV_LORA] */, bf16* __restrict__ q_latent,
                 const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                 const float* __restrict__ cos_table, const float* __restrict__ sin_table, bf16* __restrict__ cache) {
    __shared__ bf16 q_nope[ABSORB_MAX_TOKENS][NOPE_DIM];
    __shared__ float warp_sums[ABSORB_THREADS / 32][ABSORB_MAX_TOKENS][ABSORB_COLUMNS];
    __shared__ float scratch[32];
    const int h = blockIdx.x, c = blockIdx.y, rope_half = ROPE_DIM / 2;
    uint4 w[ABSORB_ROWS];
    mla_absorb_weights(w, w_uk, h, c);
    mla_absorb_columns<ABSORB_MAX_TOKENS>(w, q, (long long)num_heads * q_stride, q_stride, num_heads, num_tokens,
                                          q_latent, h, c, q_nope, warp_sums);
    if (c == 0) {
        for (int i = threadIdx.x; i < num_tokens * rope_half; i += ABSORB_THREADS) {
            const int t = i / rope_half;
            mla_rotate_q_pe(q, t, h, i % rope_half, num_heads, q_stride, q_pe_offset,
                            cos_table + (long long)positions[t] * rope_half,
                            sin_table + (long long)positions[t] * rope_half);
        }
        return;  // block-uniform
    }
    const int stride = num_heads * (gridDim.y - 1);
    for (int t = h + num_heads * (c - 1); t < num_tokens; t += stride)  // block-uniform
        mla_store_latent_row(kv_a + (long long)t * kv_a_stride, norm_weight, eps, slot_mapping[t],
                             cos_table + (long long)positions[t] * rope_half,
                             sin_table + (long long)positions[t] * rope_half, cache, scratch);
}

#ifndef V_DIM
#define V_DIM 128
#endif
#define EXPAND_COLUMNS 16     // output columns (v dims) per block of mla_expand_small
#define EXPAND_MAX_TOKENS 64  // core's EXPAND_SMALL_MAX_TOKENS
#define EXPAND_WARPS 4        // each a quarter of the KV_LORA dims

// A warp's W_UV B fragments for 16 columns from column0 of head h over its quarter of the latent dims (k_warp: which
// quarter), every step's in flight together (columns 8n + group, dims k0 (+1) and k0 + 8 (+9)): mla_expand_small's,
// and mla_combine_expand's, which must multiply with the same fragments for the same bits.
__device__ __forceinline__ void expand_weight_fragments(const bf16* __restrict__ w_uv, int h, int column0, int k_warp,
                                                        int lane, unsigned (&b)[KV_LORA / EXPAND_WARPS / 16][2][2]) {
    constexpr int STEPS = KV_LORA / EXPAND_WARPS / 16;
    const int group = lane >> 2, pair = (lane & 3) * 2;
    const bf16* weights = w_uv + ((long long)h * V_DIM + column0) * KV_LORA;
#pragma unroll
    for (int step = 0; step < STEPS; ++step)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            const bf16* row = weights + (long long)(8 * n + group) * KV_LORA + (k_warp * STEPS + step) * 16 + pair;
            b[step][n][0] = *reinterpret_cast<const unsigned*>(row);
            b[step][n][1] = *reinterpret_cast<const unsigned*>(row + 8);
        }
}

// W_UV for small steps on tensor cores (out[t, h·V_DIM + v] = Σ_j o_latent[t, h, j] · W_UV[h][v][j]), T <= 64:
// grid (num_heads, V_DIM / 16), EXPAND_WARPS warps. Block (h, c): columns 16c .. 16c + 15 of head h for every
// row; warp w multiplies dims [w · KV_LORA / 4, (w + 1) · KV_LORA / 4) (mma m16n8k16, fragments loaded straight
// from global memory, rows past T zero), and the four partial tiles are summed through shared memory in warp
// order. One launch with no split-K reduction pass where cuBLAS's batched GEMM runs a general kernel.
extern "C" __global__ void __launch_bounds__(32 * EXPAND_WARPS)
mla_expand_small(const bf16* __restrict__ o_latent /* [T, H, KV_LORA] */, const bf16* __restrict__ w_uv /* [H, V_DIM, KV_LORA] */,
                 int num_tokens, int num_heads, bf16* __restrict__ out /* [T, H·V_DIM] */) {
    __shared__ float partial[EXPAND_WARPS][EXPAND_MAX_TOKENS][EXPAND_COLUMNS];
    const int h = blockIdx.x, column0 = blockIdx.y * EXPAND_COLUMNS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = lane >> 2, pair = (lane & 3) * 2;
    constexpr int STEPS = KV_LORA / EXPAND_WARPS / 16;
    unsigned b[STEPS][2][2];
    expand_weight_fragments(w_uv, h, column0, warp, lane, b);
    float acc[EXPAND_MAX_TOKENS / 16][2][4];
#pragma unroll
    for (int m = 0; m < EXPAND_MAX_TOKENS / 16; ++m)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[m][n][v] = 0.f;
#pragma unroll
    for (int step = 0; step < STEPS; ++step) {
        const int k0 = (warp * STEPS + step) * 16 + pair;
#pragma unroll
        for (int m = 0; m < EXPAND_MAX_TOKENS / 16; ++m) {
            if (16 * m >= num_tokens) break;  // warp-uniform
            const int t_lo = 16 * m + group, t_hi = t_lo + 8;
            const bf16* lo = o_latent + ((long long)t_lo * num_heads + h) * KV_LORA + k0;
            const bf16* hi = o_latent + ((long long)t_hi * num_heads + h) * KV_LORA + k0;
            unsigned a[4];
            a[0] = t_lo < num_tokens ? *reinterpret_cast<const unsigned*>(lo) : 0u;
            a[1] = t_hi < num_tokens ? *reinterpret_cast<const unsigned*>(hi) : 0u;
            a[2] = t_lo < num_tokens ? *reinterpret_cast<const unsigned*>(lo + 8) : 0u;
            a[3] = t_hi < num_tokens ? *reinterpret_cast<const unsigned*>(hi + 8) : 0u;
            mma_bf16_16816(acc[m][0], a, b[step][0][0], b[step][0][1]);
            mma_bf16_16816(acc[m][1], a, b[step][1][0], b[step][1][1]);
        }
    }
#pragma unroll
    for (int m = 0; m < EXPAND_MAX_TOKENS / 16; ++m)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int v = 0; v < 4; ++v)
                partial[warp][16 * m + group + 8 * (v >> 1)][8 * n + pair + (v & 1)] = acc[m][n][v];
    __syncthreads();
    for (int i = threadIdx.x; i < num_tokens * EXPAND_COLUMNS; i += 32 * EXPAND_WARPS) {
        const int t = i / EXPAND_COLUMNS, c = i % EXPAND_COLUMNS;
        float sum = partial[0][t][c];
#pragma unroll
        for (int w = 1; w < EXPAND_WARPS; ++w) sum += partial[w][t][c];
        out[((long long)t * num_heads + h) * V_DIM + column0 + c] = __float2bfloat16_rn(sum);
    }
}

// --- shared by mla_attention and mla_attention_mma ---------------------------------------------

__device__ __forceinline__ void mla_zero(bf16& v) { v = __float2bfloat16_rn(0.f); }
__device__ __forceinline__ void mla_zero(uint4& v) { v = make_uint4(0u, 0u, 0u, 0u); }

// Element d of row r of a shared tile: a 2-D array (mla_attention) or a flat pointer to rows of
// ROW bf16 (mla_attention_mma's dynamic shared memory); each kernel keeps its own address arithmetic.
template <int ROW>
__device__ __forceinline__ bf16* mla_tile_at(bf16 (*tile)[ROW], int r, int d) { return &tile[r][d]; }
template <int ROW>
__device__ __forceinline__ bf16* mla_tile_at(bf16* tile, int r, int d) { return tile + r * ROW + d; }

// tile[h][0 .. LATENT) (rows of ROW bf16) = head0 + h's [q_latent | q_pe] of row t, zeros for h >=
// heads; copied Vec (bf16 or 16-byte uint4) at a time by THREADS threads.
template <typename Vec, int HEADS, int ROW, int THREADS, typename Tile>
__device__ __forceinline__ void mla_load_query_tile(Tile tile, const bf16* __restrict__ q_latent,
                                                    const bf16* __restrict__ q, int q_stride, int q_pe_offset, int t,
                                                    int num_heads, int head0, int heads) {
    constexpr int PER = sizeof(Vec) / sizeof(bf16);
    for (int i = threadIdx.x; i < HEADS * LATENT / PER; i += THREADS) {
        const int h = i / (LATENT / PER), d = (i % (LATENT / PER)) * PER;
        Vec v;
        mla_zero(v);
        if (h < heads) {
            const long long head = (long long)t * num_heads + head0 + h;
            v = d < KV_LORA ? *reinterpret_cast<const Vec*>(q_latent + head * KV_LORA + d)
                            : *reinterpret_cast<const Vec*>(q + head * q_stride + q_pe_offset + d - KV_LORA);
        }
        *reinterpret_cast<Vec*>(mla_tile_at<ROW>(tile, h, d)) = v;
    }
}

// tile[r][0 .. LATENT) (rows of ROW bf16) = the cached latent of context position key0 + r
// (zeros from `end` on), r < KEYS; copied Vec at a time by THREADS threads.
template <typename Vec, int KEYS, int ROW, int THREADS, typename Tile>
__device__ __forceinline__ void mla_load_key_tile(Tile tile, const bf16* __restrict__ cache,
                                                  const int* __restrict__ table, int block_size, int key0, int end) {
    constexpr int PER = sizeof(Vec) / sizeof(bf16);
    for (int i = threadIdx.x; i < KEYS * LATENT / PER; i += THREADS) {
        const int r = i / (LATENT / PER), d = (i % (LATENT / PER)) * PER, pos = key0 + r;
        Vec v;
        mla_zero(v);
        if (pos < end)
            v = *reinterpret_cast<const Vec*>(
                cache + ((long long)table[pos / block_size] * block_size + pos % block_size) * LATENT + d);
        *reinterpret_cast<Vec*>(mla_tile_at<ROW>(tile, r, d)) = v;
    }
}

// grid (T, ceil(num_heads / HEADS_PER_BLOCK), num_splits), MLA_THREADS threads.
// q_latent [T, num_heads, KV_LORA]; q_pe at q + (t·num_heads + h)·q_stride + q_pe_offset;
// out [T, num_heads, KV_LORA]. A token's sequence is found in query_start (binary search); its
// context is positions[t] + 1 tokens of that sequence's block table. With num_splits > 1 (few
// tokens, long contexts: more blocks than tokens × head chunks) split z covers one slice of the
// context and leaves its normalised partial output and (max, sum) in partial_o / partial_ml for
// mla_combine_splits. token_list (or null: row t is token t): the step's token of each row, when
// only some tokens (decodes beside decompressed prefills) take this kernel.
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
mla_attention(const bf16* __restrict__ q_latent, const bf16* __restrict__ q, int q_stride, int q_pe_offset,
              const bf16* __restrict__ cache, const int* __restrict__ block_tables, int max_blocks_per_seq,
              int block_size, const int* __restrict__ query_start, int num_seqs,
              const int* __restrict__ positions, int num_heads, float scale, bf16* __restrict__ out,
              int num_splits, float* __restrict__ partial_o, float* __restrict__ partial_ml,
              const int* __restrict__ token_list) {
    __shared__ __align__(16) bf16 q_tile[HEADS_PER_BLOCK][LATENT];
    // rows padded by one bf16 pair: the 16 tokens a warp scores at once sit in 16 different banks
    __shared__ __align__(16) bf16 kv_tile[TOKENS_PER_TILE][LATENT + 2];
    __shared__ float scores[HEADS_PER_BLOCK][TOKENS_PER_TILE];
    // t: this block's row of q_latent / q / out; step_token: its token in the step's batch
    const int t = blockIdx.x, head0 = blockIdx.y * HEADS_PER_BLOCK;
    const int step_token = token_list ? token_list[t] : t;
    const int heads = min(HEADS_PER_BLOCK, num_heads - head0);
    const int split = blockIdx.z;
    int begin, end;
    const int* table = mla_split_context<TOKENS_PER_TILE>(query_start, num_seqs, block_tables, max_blocks_per_seq,
                                                          positions, step_token, num_splits, split, begin, end);
    mla_load_query_tile<bf16, HEADS_PER_BLOCK, LATENT, MLA_THREADS>(q_tile, q_latent, q, q_stride, q_pe_offset,
                                                                     t, num_heads, head0, heads);
    const int my_head = threadIdx.x / TOKENS_PER_TILE, my_token = threadIdx.x % TOKENS_PER_TILE;
    // output dims of this thread: my_token, my_token + 16, ... (neighbouring threads, neighbouring dims)
    float acc[DIMS_PER_THREAD];
    for (int i = 0; i < DIMS_PER_THREAD; ++i) acc[i] = 0.f;
    float running_max = -INFINITY, running_sum = 0.f;
    for (int start = begin; start < end; start += TOKENS_PER_TILE) {
        __syncthreads();
        mla_load_key_tile<bf16, TOKENS_PER_TILE, LATENT + 2, MLA_THREADS>(kv_tile, cache, table, block_size,
                                                                          start, end);
        __syncthreads();
        float s = -INFINITY;
        if (start + my_token < end && my_head < heads) {
            float dot = 0.f;
            for (int d = 0; d < LATENT; ++d) dot += __bfloat162float(q_tile[my_head][d]) * __bfloat162float(kv_tile[my_token][d]);
            s = dot * scale;
        }
        scores[my_head][my_token] = s;
        __syncthreads();
        float tile_max = -INFINITY;
        for (int j = 0; j < TOKENS_PER_TILE; ++j) tile_max = fmaxf(tile_max, scores[my_head][j]);
        const float new_max = fmaxf(running_max, tile_max);
        const float correction = running_max == -INFINITY ? 0.f : __expf(running_max - new_max);
        running_sum *= correction;
        for (int i = 0; i < DIMS_PER_THREAD; ++i) acc[i] *= correction;
        for (int j = 0; j < TOKENS_PER_TILE; ++j) {
            const float p = scores[my_head][j] == -INFINITY ? 0.f : __expf(scores[my_head][j] - new_max);
            running_sum += p;
            for (int i = 0; i < DIMS_PER_THREAD; ++i)
                acc[i] += p * __bfloat162float(kv_tile[j][my_token + TOKENS_PER_TILE * i]);
        }
        running_max = new_max;
    }
    if (my_head < heads) {
        const float inv = running_sum > 0.f ? 1.f / running_sum : 0.f;
        const long long head = (long long)t * num_heads + head0 + my_head;
        if (num_splits == 1) {
            bf16* dst = out + head * KV_LORA + my_token;
            for (int i = 0; i < DIMS_PER_THREAD; ++i) dst[TOKENS_PER_TILE * i] = __float2bfloat16_rn(acc[i] * inv);
        } else {
            float* dst = partial_o + (head * num_splits + split) * KV_LORA + my_token;
            for (int i = 0; i < DIMS_PER_THREAD; ++i) dst[TOKENS_PER_TILE * i] = acc[i] * inv;
            if (my_token == 0) {
                partial_ml[(head * num_splits + split) * 2] = running_max;
                partial_ml[(head * num_splits + split) * 2 + 1] = running_sum;
            }
        }
    }
}

// One block per (token, head): out = Σ_z w_z · o_z with w_z ∝ e^(m_z − m) · l_z (empty splits: l_z = 0).
// Every combine skips a head whose split 0 says max = +inf: its attention kernel wrote it (no other does).
extern "C" __global__ void mla_combine_splits(const float* __restrict__ partial_o, const float* __restrict__ partial_ml,
                                              int num_splits, bf16* __restrict__ out) {
    const long long head = blockIdx.x;
    const float* ml = partial_ml + head * num_splits * 2;
    if (ml[0] == INFINITY) return;  // written whole by its one split (mla_attention_tma's balanced splits)
    float m = -INFINITY;
    for (int z = 0; z < num_splits; ++z)
        if (ml[2 * z + 1] > 0.f) m = fmaxf(m, ml[2 * z]);
    float total = 0.f;
    for (int z = 0; z < num_splits; ++z)
        if (ml[2 * z + 1] > 0.f) total += __expf(ml[2 * z] - m) * ml[2 * z + 1];
    for (int d = threadIdx.x; d < KV_LORA; d += blockDim.x) {
        float sum = 0.f;
        for (int z = 0; z < num_splits; ++z)
            if (ml[2 * z + 1] > 0.f)
                sum += __expf(ml[2 * z] - m) * ml[2 * z + 1] * partial_o[(head * num_splits + z) * KV_LORA + d];
        out[head * KV_LORA + d] = __float2bfloat16_rn(total > 0.f ? sum / total : 0.f);
    }
}

// mla_combine_splits again, with each split's weight e^(m_z − m)·l_z computed once per block (warp 0,
// into shared memory) instead of once per output dim and split, and the splits' partial rows read
// with loads in flight together; the same sums in the same order (bit-equal). Blocks of 128 threads.
#define COMBINE_MAX_SPLITS 64  // core's MAX_SPLITS
extern "C" __global__ void mla_combine_splits_shared(const float* __restrict__ partial_o,
                                                     const float* __restrict__ partial_ml, int num_splits,
                                                     bf16* __restrict__ out) {
    __shared__ float weight[COMBINE_MAX_SPLITS];  // < 0: an empty split
    __shared__ float total_of_head;
    const long long head = blockIdx.x;
    const float* ml = partial_ml + head * num_splits * 2;
    if (ml[0] == INFINITY) return;  // written whole by its one split (mla_attention_tma's balanced splits)
    if (threadIdx.x < 32) {
        float m = -INFINITY;
        for (int z = threadIdx.x; z < num_splits; z += 32)
            if (ml[2 * z + 1] > 0.f) m = fmaxf(m, ml[2 * z]);
        m = warp_max(m);
        for (int z = threadIdx.x; z < num_splits; z += 32)
            weight[z] = ml[2 * z + 1] > 0.f ? __expf(ml[2 * z] - m) * ml[2 * z + 1] : -1.f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // summed in split order, as mla_combine_splits sums
        float total = 0.f;
        for (int z = 0; z < num_splits; ++z)
            if (weight[z] >= 0.f) total += weight[z];
        total_of_head = total;
    }
    __syncthreads();
    const float total = total_of_head;
    for (int d = threadIdx.x; d < KV_LORA; d += blockDim.x) {
        const float* column = partial_o + head * num_splits * KV_LORA + d;
        float sum = 0.f;
#pragma unroll 8
        for (int z = 0; z < num_splits; ++z) {
            const float o = column[(long long)z * KV_LORA];
            if (weight[z] >= 0.f) sum += weight[z] * o;
        }
        out[head * KV_LORA + d] = __float2bfloat16_rn(total > 0.f ? sum / total : 0.f);
    }
}

// mla_combine_splits_shared over more blocks: grid (T·H, KV_LORA / 128), each block 128 output dims of
// one head (16 blocks of 512 dims left most SMs idle at batch 1), and only the non-empty splits' partial
// rows read; the same sums in the same order (bit-equal). Blocks of 128 threads.
extern "C" __global__ void mla_combine_splits_wide(const float* __restrict__ partial_o,
                                                   const float* __restrict__ partial_ml, int num_splits,
                                                   bf16* __restrict__ out) {
    __shared__ float weight[COMBINE_MAX_SPLITS];  // < 0: an empty split
    __shared__ float total_of_head;
    const long long head = blockIdx.x;
    const float* ml = partial_ml + head * num_splits * 2;
    if (ml[0] == INFINITY) return;  // written whole by its one split (mla_attention_tma's balanced splits)
    if (threadIdx.x < 32) {
        float m = -INFINITY;
        for (int z = threadIdx.x; z < num_splits; z += 32)
            if (ml[2 * z + 1] > 0.f) m = fmaxf(m, ml[2 * z]);
        m = warp_max(m);
        for (int z = threadIdx.x; z < num_splits; z += 32)
            weight[z] = ml[2 * z + 1] > 0.f ? __expf(ml[2 * z] - m) * ml[2 * z + 1] : -1.f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // summed in split order, as mla_combine_splits sums
        float total = 0.f;
        for (int z = 0; z < num_splits; ++z)
            if (weight[z] >= 0.f) total += weight[z];
        total_of_head = total;
    }
    __syncthreads();
    const float total = total_of_head;
    const int d = blockIdx.y * blockDim.x + threadIdx.x;
    if (d >= KV_LORA) return;
    const float* column = partial_o + head * num_splits * KV_LORA + d;
    float sum = 0.f;
#pragma unroll 8
    for (int z = 0; z < num_splits; ++z)
        if (weight[z] >= 0.f) sum += weight[z] * column[(long long)z * KV_LORA];
    out[head * KV_LORA + d] = __float2bfloat16_rn(total > 0.f ? sum / total : 0.f);
}

// mla_combine_splits_wide's sums with no shared memory and no block barrier: one thread per 4 output dims of a
// head (grid ceil(T·H·KV_LORA / 4 / 256) blocks of 256), every split's (max, sum) read by each thread, and the
// partial rows of COMBINE_FLAT_CHUNK splits at a time loaded together before they are summed (one memory round
// trip per chunk, not a weight pass, a barrier and then the loads). The same weights (a rounded product, as the
// wide kernel stores them), the same total and the same fused multiply-adds in split order: bit-equal.
#define COMBINE_FLAT_CHUNK 16
#define COMBINE_FLAT_THREADS 256

// Σ_z weight_of(z) · (dims d .. d + 3 of split z's partial row) in split order, by fused multiply-adds, skipping the
// splits whose weight_of(z) < 0 (empty, or z past the last); `column`: dim d of split 0's row, KV_LORA apart. The
// rows of COMBINE_FLAT_CHUNK splits are loaded together before they are summed. mla_combine_splits_flat and
// mla_combine_expand both sum here, so they write the same bits whatever they read the weights from.
template <class WeightOf>
__device__ __forceinline__ void mla_weighted_sums4(WeightOf weight_of, const float* __restrict__ column,
                                                   int num_splits, float (&sum)[4]) {
    for (int e = 0; e < 4; ++e) sum[e] = 0.f;
    for (int z0 = 0; z0 < num_splits; z0 += COMBINE_FLAT_CHUNK) {
        float weight[COMBINE_FLAT_CHUNK];  // < 0: an empty split (or past the last)
        float4 o[COMBINE_FLAT_CHUNK];
#pragma unroll
        for (int k = 0; k < COMBINE_FLAT_CHUNK; ++k) {
            const int z = z0 + k;
            weight[k] = weight_of(z);
            o[k] = weight[k] >= 0.f ? *reinterpret_cast<const float4*>(column + (long long)z * KV_LORA)
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int k = 0; k < COMBINE_FLAT_CHUNK; ++k) {
            if (weight[k] < 0.f) continue;
            sum[0] = fmaf(weight[k], o[k].x, sum[0]);
            sum[1] = fmaf(weight[k], o[k].y, sum[1]);
            sum[2] = fmaf(weight[k], o[k].z, sum[2]);
            sum[3] = fmaf(weight[k], o[k].w, sum[3]);
        }
    }
}

// The weighted sums of dims d .. d + 3 of one head row over its splits and their total weight, from the splits'
// (max, sum) pairs `ml` and partial rows (`column`: dim d of split 0's row, KV_LORA apart); the merged dim is
// sum / total (0 where total is 0). mla_combine_splits_flat's, each thread making its weights (mla_combine_expand
// makes the same ones once per block). The caller skips a row whose split 0 says max = +inf.
__device__ __forceinline__ void mla_merge_splits4(const float2* __restrict__ ml, const float* __restrict__ column,
                                                  int num_splits, float (&sum)[4], float& total) {
    float m = -INFINITY;
    for (int z = 0; z < num_splits; ++z) {
        const float2 split = ml[z];
        if (split.y > 0.f) m = fmaxf(m, split.x);
    }
    total = 0.f;  // in split order, as mla_combine_splits sums
    for (int z = 0; z < num_splits; ++z) {
        const float2 split = ml[z];
        if (split.y > 0.f) total += __fmul_rn(__expf(split.x - m), split.y);
    }
    mla_weighted_sums4([&](int z) {
        const float2 split = z < num_splits ? ml[z] : make_float2(0.f, 0.f);
        return split.y > 0.f ? __fmul_rn(__expf(split.x - m), split.y) : -1.f;
    }, column, num_splits, sum);
}

extern "C" __global__ void __launch_bounds__(COMBINE_FLAT_THREADS)
mla_combine_splits_flat(const float* __restrict__ partial_o, const float* __restrict__ partial_ml, int num_splits,
                        int num_rows /* T·H */, bf16* __restrict__ out) {
    const long long i = (long long)blockIdx.x * COMBINE_FLAT_THREADS + threadIdx.x;
    if (i >= (long long)num_rows * (KV_LORA / 4)) return;
    const long long head = i / (KV_LORA / 4);
    const int d = (int)(i % (KV_LORA / 4)) * 4;
    const float2* ml = reinterpret_cast<const float2*>(partial_ml + head * num_splits * 2);
    if (ml[0].x == INFINITY) return;  // written whole by its one split (mla_attention_tma's balanced splits)
    float sum[4], total;
    mla_merge_splits4(ml, partial_o + head * num_splits * KV_LORA + d, num_splits, sum, total);
    __nv_bfloat162 pairs[2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
        pairs[e] = __floats2bfloat162_rn(total > 0.f ? sum[2 * e] / total : 0.f,
                                         total > 0.f ? sum[2 * e + 1] / total : 0.f);
    *reinterpret_cast<uint2*>(out + head * KV_LORA + d) = *reinterpret_cast<const uint2*>(pairs);
}

// The split combine and W_UV in one launch for small decode steps (T <= COMBINE_EXPAND_MAX_TOKENS): grid
// (num_heads, V_DIM / COMBINE_EXPAND_COLUMNS), COMBINE_EXPAND_GROUPS x EXPAND_WARPS warps. Block (h, c) first
// merges head h's splits of every row into bf16 latent rows in shared memory (the bits mla_combine_splits_flat /
// _wide write, from split weights made once per block; a row written whole by its one split is read from o_latent), then
// multiplies them by columns c · COMBINE_EXPAND_COLUMNS ... of W_UV[h]: each group of EXPAND_WARPS warps 16 columns
// as one mla_expand_small block does them (the same fragments, k order and cross-warp sum: the same bits).
// Every column block of a head merges that head's partials again (L2 reads); fewer, wider blocks read less and
// run fewer warps in parallel, hence the 16 / 32 / 64 builds. Removes the combine's launch and o_latent's trip.
#ifndef COMBINE_EXPAND_COLUMNS
#define COMBINE_EXPAND_COLUMNS 16  // 16, 32 or 64 (core's $OPENINFER_MLA_COMBINE_EXPAND)
#endif
#if COMBINE_EXPAND_COLUMNS != 16 && COMBINE_EXPAND_COLUMNS != 32 && COMBINE_EXPAND_COLUMNS != 64
#error "COMBINE_EXPAND_COLUMNS is 16, 32 or 64"
#endif
#define COMBINE_EXPAND_MAX_TOKENS 16  // core's COMBINE_EXPAND_MAX_TOKENS: the rows of one mma tile
#define COMBINE_EXPAND_GROUPS (COMBINE_EXPAND_COLUMNS / EXPAND_COLUMNS)
#define COMBINE_EXPAND_THREADS (32 * EXPAND_WARPS * COMBINE_EXPAND_GROUPS)
// A latent row in shared memory: KV_LORA bf16 as pairs, padded by 4 pairs so the 8 rows of an A fragment load
// fall in different banks.
#define COMBINE_EXPAND_ROW (KV_LORA / 2 + 4)
// 512 threads an SM (at most 128 registers a thread): the W_UV fragments held across the merge without spills
// (ptxas left alone chose 64 - 72 registers and spilled), and Kimi-K2's 64 heads in one wave at every build.
#define COMBINE_EXPAND_MIN_BLOCKS (512 / COMBINE_EXPAND_THREADS)
extern "C" __global__ void __launch_bounds__(COMBINE_EXPAND_THREADS, COMBINE_EXPAND_MIN_BLOCKS)
mla_combine_expand(const float* __restrict__ partial_o /* [T, H, S, KV_LORA] */,
                   const float* __restrict__ partial_ml /* [T, H, S, 2] */, int num_splits,
                   const bf16* __restrict__ o_latent /* [T, H, KV_LORA]: the rows written whole */,
                   const bf16* __restrict__ w_uv /* [H, V_DIM, KV_LORA] */, int num_tokens, int num_heads,
                   bf16* __restrict__ out /* [T, H·V_DIM] */) {
    __shared__ __align__(16) unsigned latent[COMBINE_EXPAND_MAX_TOKENS][COMBINE_EXPAND_ROW];
    __shared__ float partial[COMBINE_EXPAND_GROUPS][EXPAND_WARPS][COMBINE_EXPAND_MAX_TOKENS][EXPAND_COLUMNS];
    __shared__ float split_weight[COMBINE_EXPAND_MAX_TOKENS][COMBINE_MAX_SPLITS];  // < 0: an empty split
    __shared__ float row_total[COMBINE_EXPAND_MAX_TOKENS];
    const int h = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = lane >> 2, pair = (lane & 3) * 2;
    const int k_warp = warp % EXPAND_WARPS, column_group = warp / EXPAND_WARPS;
    const int column0 = blockIdx.y * COMBINE_EXPAND_COLUMNS + column_group * EXPAND_COLUMNS;
    constexpr int STEPS = KV_LORA / EXPAND_WARPS / 16;
    // the warp's W_UV fragments first (mla_expand_small's): they do not wait for the merge, so in flight during it
    unsigned b[STEPS][2][2];
    expand_weight_fragments(w_uv, h, column0, k_warp, lane, b);
    // each row's split weights once for the block (a warp a row: the max over non-empty splits by a warp reduction,
    // exact in any order; the weights as mla_merge_splits4 rounds them; the total by a thread in split order), so the
    // merge below reads them from shared memory and loads only the non-empty splits' partial rows: its cost follows
    // the splits that hold keys, not the grid's split count
    for (int t = warp; t < num_tokens; t += COMBINE_EXPAND_THREADS / 32) {
        const float2* ml = reinterpret_cast<const float2*>(partial_ml + ((long long)t * num_heads + h) * num_splits * 2);
        float m = -INFINITY;
        for (int z = lane; z < num_splits; z += 32) {
            const float2 split = ml[z];
            if (split.y > 0.f) m = fmaxf(m, split.x);
        }
        m = warp_max(m);
        for (int z = lane; z < num_splits; z += 32) {
            const float2 split = ml[z];
            split_weight[t][z] = split.y > 0.f ? __fmul_rn(__expf(split.x - m), split.y) : -1.f;
        }
    }
    __syncthreads();
    if (threadIdx.x < num_tokens) {  // a thread a row: its total in split order
        const int t = threadIdx.x;
        float total = 0.f;
        for (int z = 0; z < num_splits; ++z)
            if (split_weight[t][z] >= 0.f) total += split_weight[t][z];
        const float* ml = partial_ml + ((long long)t * num_heads + h) * num_splits * 2;
        row_total[t] = ml[0] == INFINITY ? -1.f : total;  // < 0: written whole by its one split (in o_latent)
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_tokens * (KV_LORA / 4); i += COMBINE_EXPAND_THREADS) {
        const int t = i / (KV_LORA / 4), d = (i % (KV_LORA / 4)) * 4;
        const long long head = (long long)t * num_heads + h;
        const float total = row_total[t];
        uint2 pairs;
        if (total < 0.f) {  // written whole by its one split: the row is in o_latent
            pairs = *reinterpret_cast<const uint2*>(o_latent + head * KV_LORA + d);
        } else {  // mla_combine_splits_flat's sums from the block's weights, then as it rounds them
            float sum[4];
            mla_weighted_sums4([&](int z) { return z < num_splits ? split_weight[t][z] : -1.f; },
                               partial_o + head * num_splits * KV_LORA + d, num_splits, sum);
            pairs.x = pack_bf16x2(total > 0.f ? sum[0] / total : 0.f, total > 0.f ? sum[1] / total : 0.f);
            pairs.y = pack_bf16x2(total > 0.f ? sum[2] / total : 0.f, total > 0.f ? sum[3] / total : 0.f);
        }
        *reinterpret_cast<uint2*>(&latent[t][d / 2]) = pairs;
    }
    __syncthreads();
    float acc[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[n][v] = 0.f;
    const bool lo_row = group < num_tokens, hi_row = group + 8 < num_tokens;  // rows past T: zeros
#pragma unroll
    for (int step = 0; step < STEPS; ++step) {
        const int k0 = ((k_warp * STEPS + step) * 16 + pair) / 2;  // in pairs
        unsigned a[4];
        a[0] = lo_row ? latent[group][k0] : 0u;
        a[1] = hi_row ? latent[group + 8][k0] : 0u;
        a[2] = lo_row ? latent[group][k0 + 4] : 0u;
        a[3] = hi_row ? latent[group + 8][k0 + 4] : 0u;
        mma_bf16_16816(acc[0], a, b[step][0][0], b[step][0][1]);
        mma_bf16_16816(acc[1], a, b[step][1][0], b[step][1][1]);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int v = 0; v < 4; ++v)
            partial[column_group][k_warp][group + 8 * (v >> 1)][8 * n + pair + (v & 1)] = acc[n][v];
    __syncthreads();
    for (int i = threadIdx.x; i < num_tokens * COMBINE_EXPAND_COLUMNS; i += COMBINE_EXPAND_THREADS) {
        const int t = i / COMBINE_EXPAND_COLUMNS, c = i % COMBINE_EXPAND_COLUMNS;
        const int g = c / EXPAND_COLUMNS, column = c % EXPAND_COLUMNS;
        float sum = partial[g][0][t][column];  // in warp order, as mla_expand_small sums
#pragma unroll
        for (int w = 1; w < EXPAND_WARPS; ++w) sum += partial[g][w][t][column];
        out[((long long)t * num_heads + h) * V_DIM + blockIdx.y * COMBINE_EXPAND_COLUMNS + c] =
            __float2bfloat16_rn(sum);
    }
}

// ---------------------------------------------------------------------------------------------
// Decompressed prefill.
//
// prefill_seqs [S, PREFILL_SEQ_FIELDS] int32, one row per sequence taking this path:
//   table row (its row of block_tables), first query token in the step, query count n,
//   context length L (cached + new), first row of its context in c_kv / k_pe / k_nope / values.
// Query i of a sequence sits at position L − n + i and sees keys 0 ..= L − n + i.
// ---------------------------------------------------------------------------------------------
#ifndef NOPE_DIM
#define NOPE_DIM 128
#endif
#ifndef V_DIM
#define V_DIM 128
#endif
#define QK_DIM (NOPE_DIM + ROPE_DIM)
#define PREFILL_BLOCK_M 64  // queries per block: 4 warps x 16 rows
#define PREFILL_BLOCK_N 32  // keys per step
#define PREFILL_THREADS 128
#define PREFILL_PAD 8       // bf16 row padding: fragment loads of neighbouring rows hit different banks

// grid (C): one context row per block. The row's sequence is found in the context-offset column.
extern "C" __global__ void mla_gather_context(const bf16* __restrict__ cache, const int* __restrict__ block_tables,
                                              int max_blocks_per_seq, int block_size,
                                              const int* __restrict__ prefill_seqs, int num_prefill_seqs,
                                              bf16* __restrict__ c_kv, bf16* __restrict__ k_pe) {
    const int row = blockIdx.x;
    int lo = 0, hi = num_prefill_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (prefill_seqs[mid * PREFILL_SEQ_FIELDS + 4] <= row) lo = mid; else hi = mid - 1;
    }
    const int* seq = prefill_seqs + lo * PREFILL_SEQ_FIELDS;
    const int pos = row - seq[4];
    const int block = block_tables[(long long)seq[0] * max_blocks_per_seq + pos / block_size];
    const bf16* src = cache + ((long long)block * block_size + pos % block_size) * LATENT;
    // 16 bytes per thread and step (the decompressed path takes KV_LORA and ROPE_DIM in multiples of 8)
    for (int i = threadIdx.x; i < LATENT / 8; i += blockDim.x) {
        const uint4 piece = reinterpret_cast<const uint4*>(src)[i];
        if (i < KV_LORA / 8)
            reinterpret_cast<uint4*>(c_kv + (long long)row * KV_LORA)[i] = piece;
        else
            reinterpret_cast<uint4*>(k_pe + (long long)row * ROPE_DIM)[i - KV_LORA / 8] = piece;
    }
}

// two neighbouring bf16 (4-byte aligned: even column, rows of an even width) as one register
__device__ __forceinline__ unsigned mla_load_pair(const bf16* p) { return *reinterpret_cast<const unsigned*>(p); }

// ---- shared by the decompressed prefill kernels (mla_prefill_attention, mla_prefill_attention_pipelined;
// the tile decoding, mla_prefill.cuh, with mla_prefill_sm90.cu's too): one key step's online softmax and P
// fragments, the output rows. Each warp holds
// 16 query rows in the mma.m16n8k16 accumulator layout: this thread's rows row0 and row0 + 8, scores
// s[n][v] of key 8n + pair + (v & 1) and row row0 + 8 (v >> 1).

// One step of KEYS keys from key0: mask (causal, past key_end) where `masked`, running max and sum, s <- P in
// base 2 (scale_log2: the softmax scale times log2 e), acc rescaled to the new max. query_pos0: row0's position.
template <int KEYS>
__device__ __forceinline__ void mla_prefill_softmax(float (&s)[KEYS / 8][4], float (&acc)[V_DIM / 8][4],
                                                    float (&row_max)[2], float (&row_sum)[2], bool masked, int key0,
                                                    int key_end, int query_pos0, int pair, float scale_log2) {
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < KEYS / 8; ++n)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const int r = v >> 1, key = key0 + 8 * n + pair + (v & 1);
            s[n][v] = !masked || (key < key_end && key <= query_pos0 + 8 * r) ? s[n][v] * scale_log2 : -INFINITY;
            tile_max[r] = fmaxf(tile_max[r], s[n][v]);
        }
    float correction[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_max = fmaxf(row_max[r], tile_max[r]);
        correction[r] = new_max == -INFINITY ? 1.f : exp2f(row_max[r] - new_max);
        row_max[r] = new_max;
    }
    float tile_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < KEYS / 8; ++n)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const int r = v >> 1;
            s[n][v] = s[n][v] == -INFINITY ? 0.f : exp2f(s[n][v] - row_max[r]);
            tile_sum[r] += s[n][v];
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tile_sum[r] += __shfl_xor_sync(0xffffffffu, tile_sum[r], 1);
        tile_sum[r] += __shfl_xor_sync(0xffffffffu, tile_sum[r], 2);
        row_sum[r] = row_sum[r] * correction[r] + tile_sum[r];
    }
#pragma unroll
    for (int j = 0; j < V_DIM / 8; ++j) {
        acc[j][0] *= correction[0];
        acc[j][1] *= correction[0];
        acc[j][2] *= correction[1];
        acc[j][3] *= correction[1];
    }
}

// The A fragment of P for keys 16ks .. 16ks + 15 (the score accumulators of n = 2ks, 2ks + 1), bf16.
template <int KEYS>
__device__ __forceinline__ void mla_pack_p(const float (&s)[KEYS / 8][4], int ks, unsigned (&pf)[4]) {
    pf[0] = pack_bf16x2(s[2 * ks][0], s[2 * ks][1]);
    pf[1] = pack_bf16x2(s[2 * ks][2], s[2 * ks][3]);
    pf[2] = pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
    pf[3] = pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
}

// This thread's two output rows (of the tile's real ones), normalised by their sums.
__device__ __forceinline__ void mla_prefill_store(const float (&acc)[V_DIM / 8][4], const float (&row_sum)[2],
                                                  const MlaPrefillTile& w, int row0, int pair, int head, int num_heads,
                                                  bf16* __restrict__ out) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        if (row >= w.rows) continue;
        const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
        bf16* dst = out + ((long long)(w.q_first + w.tile_q + row) * num_heads + head) * V_DIM;
#pragma unroll
        for (int j = 0; j < V_DIM / 8; ++j) {
            dst[8 * j + pair] = __float2bfloat16_rn(acc[j][2 * r] * inv);
            dst[8 * j + pair + 1] = __float2bfloat16_rn(acc[j][2 * r + 1] * inv);
        }
    }
}

// grid (num_tiles, num_heads), PREFILL_THREADS threads. tile_seq / tile_query: the tile's row of
// prefill_seqs and its first query (a multiple of 64). q [T, H, QK_DIM] (q_pe rotated);
// k_nope [C, H, NOPE_DIM]; k_pe [C, ROPE_DIM] (shared by the heads); values [C, H, V_DIM];
// out [T, H, V_DIM] (only the tile's query rows are written).
extern "C" __global__ void __launch_bounds__(PREFILL_THREADS)
mla_prefill_attention(const bf16* __restrict__ q, const bf16* __restrict__ k_nope, const bf16* __restrict__ k_pe,
                      const bf16* __restrict__ values, const int* __restrict__ prefill_seqs,
                      const int* __restrict__ tile_seq, const int* __restrict__ tile_query, int num_heads,
                      float scale, bf16* __restrict__ out) {
    __shared__ __align__(16) bf16 q_tile[PREFILL_BLOCK_M][QK_DIM + PREFILL_PAD];
    __shared__ __align__(16) bf16 k_tile[PREFILL_BLOCK_N][QK_DIM + PREFILL_PAD];
    __shared__ __align__(16) bf16 v_tile_t[V_DIM][PREFILL_BLOCK_N + PREFILL_PAD];  // transposed: [dim][key]
    const MlaPrefillTile w = mla_prefill_tile(prefill_seqs, tile_seq, tile_query, blockIdx.x, PREFILL_BLOCK_M);
    const int head = blockIdx.y;
    const long long q_row_stride = (long long)num_heads * QK_DIM;
    for (int i = threadIdx.x; i < PREFILL_BLOCK_M * QK_DIM / 8; i += PREFILL_THREADS) {
        const int r = i / (QK_DIM / 8), c = (i % (QK_DIM / 8)) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < w.rows)
            v = *reinterpret_cast<const uint4*>(q + (w.q_first + w.tile_q + r) * q_row_stride + (long long)head * QK_DIM + c);
        *reinterpret_cast<uint4*>(&q_tile[r][c]) = v;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = lane >> 2, pair = (lane & 3) * 2;
    const int row0 = warp * 16 + group;  // this thread's two query rows: row0, row0 + 8
    const int query_pos0 = w.offset + w.tile_q + row0;
    const int warp_first_pos = w.offset + w.tile_q + warp * 16;
    const float scale_log2 = scale * 1.4426950408889634f;  // softmax in base 2, the scale folded in
    float acc[V_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < V_DIM / 8; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    __syncthreads();
    unsigned qf[QK_DIM / 16][4];
#pragma unroll
    for (int kk = 0; kk < QK_DIM / 16; ++kk) {
        qf[kk][0] = mla_load_pair(&q_tile[row0][16 * kk + pair]);
        qf[kk][1] = mla_load_pair(&q_tile[row0 + 8][16 * kk + pair]);
        qf[kk][2] = mla_load_pair(&q_tile[row0][16 * kk + pair + 8]);
        qf[kk][3] = mla_load_pair(&q_tile[row0 + 8][16 * kk + pair + 8]);
    }
    const long long kv_row_nope = (long long)num_heads * NOPE_DIM, kv_row_v = (long long)num_heads * V_DIM;
    for (int key0 = 0; key0 < w.key_end; key0 += PREFILL_BLOCK_N) {
        __syncthreads();  // the previous step is done with k_tile / v_tile_t
        for (int i = threadIdx.x; i < PREFILL_BLOCK_N * QK_DIM / 8; i += PREFILL_THREADS) {
            const int r = i / (QK_DIM / 8), c = (i % (QK_DIM / 8)) * 8;
            const long long key = w.ctx_first + key0 + r;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (key0 + r < w.key_end)
                v = c < NOPE_DIM ? *reinterpret_cast<const uint4*>(k_nope + key * kv_row_nope + (long long)head * NOPE_DIM + c)
                                 : *reinterpret_cast<const uint4*>(k_pe + key * ROPE_DIM + c - NOPE_DIM);
            *reinterpret_cast<uint4*>(&k_tile[r][c]) = v;
        }
        for (int i = threadIdx.x; i < PREFILL_BLOCK_N * V_DIM / 8; i += PREFILL_THREADS) {
            const int r = i / (V_DIM / 8), c = (i % (V_DIM / 8)) * 8;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (key0 + r < w.key_end)
                v = *reinterpret_cast<const uint4*>(values + (w.ctx_first + key0 + r) * kv_row_v + (long long)head * V_DIM + c);
            const bf16* e = reinterpret_cast<const bf16*>(&v);
#pragma unroll
            for (int j = 0; j < 8; ++j) v_tile_t[c + j][r] = e[j];
        }
        __syncthreads();
        // scores: 16 rows x 32 keys per warp = 4 n8 tiles
        float s[PREFILL_BLOCK_N / 8][4];
#pragma unroll
        for (int j = 0; j < PREFILL_BLOCK_N / 8; ++j) {
#pragma unroll
            for (int v = 0; v < 4; ++v) s[j][v] = 0.f;
#pragma unroll
            for (int kk = 0; kk < QK_DIM / 16; ++kk) {
                unsigned kf[2];
                kf[0] = mla_load_pair(&k_tile[8 * j + group][16 * kk + pair]);
                kf[1] = mla_load_pair(&k_tile[8 * j + group][16 * kk + pair + 8]);
                mma_bf16_16816(s[j], qf[kk], kf);
            }
        }
        const bool masked = key0 + PREFILL_BLOCK_N > min(warp_first_pos + 1, w.key_end);
        mla_prefill_softmax<PREFILL_BLOCK_N>(s, acc, row_max, row_sum, masked, key0, w.key_end, query_pos0, pair,
                                             scale_log2);
        // acc += P · V: the score accumulators are the A fragments of P (keys 16·ks ... 16·ks + 15)
#pragma unroll
        for (int ks = 0; ks < PREFILL_BLOCK_N / 16; ++ks) {
            unsigned pf[4];
            mla_pack_p<PREFILL_BLOCK_N>(s, ks, pf);
#pragma unroll
            for (int j = 0; j < V_DIM / 8; ++j) {
                unsigned vf[2];
                vf[0] = mla_load_pair(&v_tile_t[8 * j + group][16 * ks + pair]);
                vf[1] = mla_load_pair(&v_tile_t[8 * j + group][16 * ks + pair + 8]);
                mma_bf16_16816(acc[j], pf, vf);
            }
        }
    }
    mla_prefill_store(acc, row_sum, w, row0, pair, head, num_heads, out);
}

// ---------------------------------------------------------------------------------------------
// Absorbed attention on tensor cores (decode): per (token, 64 heads, quarter of the latent output
// dims, context split) one block of 4 warps, 16 heads each: S = Q̃ · latentᵀ over 576-wide rows
// (bf16 mma.sync m16n8k16, fp32), online softmax, O += P · c_kv[:, quarter]. The four quarters
// recompute the same scores (cheap on tensor cores) so a warp holds 128 output dims, not 512.
// Same arguments and outputs as mla_attention (partials for mla_combine_splits included).
// Dynamic shared memory: MMA_DECODE_SMEM bytes (Q tile + one key tile).
// ---------------------------------------------------------------------------------------------
#define MMA_DECODE_HEADS 64
#define MMA_DECODE_KEYS 32
#define MMA_DECODE_THREADS 128
#define MMA_DECODE_PARTS 4
#define MMA_DECODE_PART (KV_LORA / MMA_DECODE_PARTS)
#define MMA_DECODE_ROW (LATENT + 8)  // padded row (bf16): fragment loads of neighbouring rows, different banks
#ifndef MLA_HEADS16
#define MLA_HEADS16 0  // 1: 16 heads per block, its 4 warps the 4 output quarters (one key tile serves all four)
#endif
#if MLA_HEADS16
#define MMA_DECODE_BLOCK_HEADS 16
#define MMA_DECODE_HEAD_CHUNKS(heads) (((heads) + 15) / 16)  // grid.y
#else
#define MMA_DECODE_BLOCK_HEADS MMA_DECODE_HEADS
#define MMA_DECODE_HEAD_CHUNKS(heads) (((heads) + MMA_DECODE_HEADS - 1) / MMA_DECODE_HEADS * MMA_DECODE_PARTS)
#endif
#define MMA_DECODE_SMEM ((MMA_DECODE_BLOCK_HEADS + MMA_DECODE_KEYS) * MMA_DECODE_ROW * 2)

#ifndef MLA_ASYNC_TILES
#define MLA_ASYNC_TILES 0  // 1: tiles copied by cp.async, all of a tile's 16-byte copies in flight at once
#endif

// the cp.async tile copies (mla_attention_mma under MLA_ASYNC_TILES, mla_attention_mma_shared always)
#ifdef MMA_HOST_STANDIN  // the host emulation copies at once
__device__ __forceinline__ void mla_copy16(bf16* smem, const bf16* gmem, bool valid) {
    if (valid) std::memcpy(smem, gmem, 16); else std::memset(smem, 0, 16);
}
__device__ __forceinline__ void mla_copies_wait() {}
#else
__device__ __forceinline__ void mla_copy16(bf16* smem, const bf16* gmem, bool valid) { cp_async16(smem, gmem, valid); }
// this thread's copies landed (the barrier after it makes every thread's visible)
__device__ __forceinline__ void mla_copies_wait() {
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 0;\n" ::);
}
#endif

// mla_load_query_tile's rows by cp.async (16 bytes each; zeros for h >= heads)
template <int HEADS, int ROW, int THREADS>
__device__ __forceinline__ void mla_copy_query_tile(bf16* tile, const bf16* __restrict__ q_latent,
                                                    const bf16* __restrict__ q, int q_stride, int q_pe_offset, int t,
                                                    int num_heads, int head0, int heads) {
    for (int i = threadIdx.x; i < HEADS * LATENT / 8; i += THREADS) {
        const int h = i / (LATENT / 8), d = (i % (LATENT / 8)) * 8;
        const long long head = (long long)t * num_heads + head0 + min(h, heads - 1);
        const bf16* src = d < KV_LORA ? q_latent + head * KV_LORA + d : q + head * q_stride + q_pe_offset + d - KV_LORA;
        mla_copy16(tile + h * ROW + d, src, h < heads);
    }
}

// mla_load_key_tile's rows by cp.async (zeros from `end` on)
template <int KEYS, int ROW, int THREADS>
__device__ __forceinline__ void mla_copy_key_tile(bf16* tile, const bf16* __restrict__ cache,
                                                  const int* __restrict__ table, int block_size, int key0, int end) {
    for (int i = threadIdx.x; i < KEYS * LATENT / 8; i += THREADS) {
        const int r = i / (LATENT / 8), d = (i % (LATENT / 8)) * 8, pos = min(key0 + r, end - 1);
        mla_copy16(tile + r * ROW + d,
                   cache + ((long long)table[pos / block_size] * block_size + pos % block_size) * LATENT + d,
                   key0 + r < end);
    }
}

__device__ __forceinline__ unsigned mla_pair_of(const bf16* lo, const bf16* hi) {  // two bf16 from two rows
    return (unsigned)__bfloat16_as_ushort(*lo) | ((unsigned)__bfloat16_as_ushort(*hi) << 16);
}

extern "C" __global__ void __launch_bounds__(MMA_DECODE_THREADS)
mla_attention_mma(const bf16* __restrict__ q_latent, const bf16* __restrict__ q, int q_stride, int q_pe_offset,
                  const bf16* __restrict__ cache, const int* __restrict__ block_tables, int max_blocks_per_seq,
                  int block_size, const int* __restrict__ query_start, int num_seqs,
                  const int* __restrict__ positions, int num_heads, float scale, bf16* __restrict__ out,
                  int num_splits, float* __restrict__ partial_o, float* __restrict__ partial_ml,
                  const int* __restrict__ token_list) {
#ifdef MMA_HOST_STANDIN
    static bf16 smem[MMA_DECODE_SMEM / 2];
#else
    extern __shared__ __align__(16) bf16 smem[];
#endif
    bf16* q_tile = smem;                                            // [BLOCK_HEADS][MMA_DECODE_ROW]
    bf16* k_tile = smem + MMA_DECODE_BLOCK_HEADS * MMA_DECODE_ROW;  // [32][MMA_DECODE_ROW]
    const int t = blockIdx.x;
    const int step_token = token_list ? token_list[t] : t;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#if MLA_HEADS16  // warp w: the block's 16 heads, output quarter w
    const int head0 = blockIdx.y * 16, part = warp;
#else  // warp w: heads 16w .. 16w + 15 of the block's 64, the block's quarter
    const int head0 = (blockIdx.y / MMA_DECODE_PARTS) * MMA_DECODE_HEADS, part = blockIdx.y % MMA_DECODE_PARTS;
#endif
    const int heads = min(MMA_DECODE_BLOCK_HEADS, num_heads - head0);
    const int split = blockIdx.z;
    int begin, end;
    const int* table = mla_split_context<MMA_DECODE_KEYS>(query_start, num_seqs, block_tables, max_blocks_per_seq,
                                                          positions, step_token, num_splits, split, begin, end);
#if MLA_ASYNC_TILES
    if (begin >= end && num_splits > 1) {  // a split past a short context: no loads, its (max, sum) say empty
        if (part == 0)
            for (int h = threadIdx.x; h < heads; h += MMA_DECODE_THREADS) {
                const long long head = (long long)t * num_heads + head0 + h;
                partial_ml[(head * num_splits + split) * 2] = -INFINITY;
                partial_ml[(head * num_splits + split) * 2 + 1] = 0.f;
            }
        return;  // block-uniform
    }
    // the query tile's copies fly with the first key tile's (waited for in the loop)
    mla_copy_query_tile<MMA_DECODE_BLOCK_HEADS, MMA_DECODE_ROW, MMA_DECODE_THREADS>(
        q_tile, q_latent, q, q_stride, q_pe_offset, t, num_heads, head0, heads);
#else
    mla_load_query_tile<uint4, MMA_DECODE_BLOCK_HEADS, MMA_DECODE_ROW, MMA_DECODE_THREADS>(
        q_tile, q_latent, q, q_stride, q_pe_offset, t, num_heads, head0, heads);
#endif
    const int group = lane >> 2, pair = (lane & 3) * 2;
    const int row0 = (MLA_HEADS16 ? 0 : warp * 16) + group;  // this thread's heads (rows): row0, row0 + 8
    float acc[MMA_DECODE_PART / 8][4];
#pragma unroll
    for (int j = 0; j < MMA_DECODE_PART / 8; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    for (int key0 = begin; key0 < end; key0 += MMA_DECODE_KEYS) {
        __syncthreads();  // q_tile written (first step) / the previous step is done with k_tile
#if MLA_ASYNC_TILES
        mla_copy_key_tile<MMA_DECODE_KEYS, MMA_DECODE_ROW, MMA_DECODE_THREADS>(k_tile, cache, table, block_size, key0,
                                                                               end);
        mla_copies_wait();
#else
        mla_load_key_tile<uint4, MMA_DECODE_KEYS, MMA_DECODE_ROW, MMA_DECODE_THREADS>(k_tile, cache, table, block_size,
                                                                                      key0, end);
#endif
        __syncthreads();
        float s[MMA_DECODE_KEYS / 8][4];
#pragma unroll
        for (int j = 0; j < MMA_DECODE_KEYS / 8; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) s[j][v] = 0.f;
#pragma unroll 4
        for (int kk = 0; kk < LATENT / 16; ++kk) {
            unsigned qf[4];
            qf[0] = mla_load_pair(q_tile + row0 * MMA_DECODE_ROW + 16 * kk + pair);
            qf[1] = mla_load_pair(q_tile + (row0 + 8) * MMA_DECODE_ROW + 16 * kk + pair);
            qf[2] = mla_load_pair(q_tile + row0 * MMA_DECODE_ROW + 16 * kk + pair + 8);
            qf[3] = mla_load_pair(q_tile + (row0 + 8) * MMA_DECODE_ROW + 16 * kk + pair + 8);
#pragma unroll
            for (int j = 0; j < MMA_DECODE_KEYS / 8; ++j) {
                unsigned kf[2];
                kf[0] = mla_load_pair(k_tile + (8 * j + group) * MMA_DECODE_ROW + 16 * kk + pair);
                kf[1] = mla_load_pair(k_tile + (8 * j + group) * MMA_DECODE_ROW + 16 * kk + pair + 8);
                mma_bf16_16816(s[j], qf, kf);
            }
        }
        mla_online_softmax_tile(s, acc, row_max, row_sum, key0, pair, end, scale);
        // O += P · c_kv[keys, this quarter]: B fragment = two keys (rows) at one output dim
#pragma unroll
        for (int ks = 0; ks < MMA_DECODE_KEYS / 16; ++ks) {
            unsigned pf[4];
            pf[0] = pack_bf16x2(s[2 * ks][0], s[2 * ks][1]);
            pf[1] = pack_bf16x2(s[2 * ks][2], s[2 * ks][3]);
            pf[2] = pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
            pf[3] = pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
            const bf16* key_row = k_tile + (16 * ks + pair) * MMA_DECODE_ROW + part * MMA_DECODE_PART;
#pragma unroll
            for (int j = 0; j < MMA_DECODE_PART / 8; ++j) {
                const int dim = 8 * j + group;
                unsigned vf[2];
                vf[0] = mla_pair_of(key_row + dim, key_row + MMA_DECODE_ROW + dim);
                vf[1] = mla_pair_of(key_row + 8 * MMA_DECODE_ROW + dim, key_row + 9 * MMA_DECODE_ROW + dim);
                mma_bf16_16816(acc[j], pf, vf);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = row0 + 8 * r;
        if (h >= heads) continue;
        const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
        const long long head = (long long)t * num_heads + head0 + h;
#pragma unroll
        for (int j = 0; j < MMA_DECODE_PART / 8; ++j) {
            const int dim = part * MMA_DECODE_PART + 8 * j + pair;
            if (num_splits == 1) {
                out[head * KV_LORA + dim] = __float2bfloat16_rn(acc[j][2 * r] * inv);
                out[head * KV_LORA + dim + 1] = __float2bfloat16_rn(acc[j][2 * r + 1] * inv);
            } else {
                float* dst = partial_o + (head * num_splits + split) * KV_LORA + dim;
                dst[0] = acc[j][2 * r] * inv;
                dst[1] = acc[j][2 * r + 1] * inv;
            }
        }
        if (num_splits > 1 && part == 0 && pair == 0) {
            partial_ml[(head * num_splits + split) * 2] = row_max[r];
            partial_ml[(head * num_splits + split) * 2 + 1] = row_sum[r];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// mla_attention_mma_shared: the absorbed decode on tensor cores with every latent tile read once for
// a block's 16 heads and each score computed once. Blocks of (token, 16 heads, context split), 4
// warps; key tiles of MLA_SHARED_KEYS latents double-buffered by cp.async (the next tile's copies fly
// while this one is scored). Per tile, warp w scores its quarter of the keys for the 16 heads over
// the 576 dims; the warps trade their row maxima and bf16 probabilities through shared memory; then
// warp w accumulates output quarter w (128 latent dims) = P · c_kv[:, quarter]. Fragments by ldmatrix.
// Same arguments and outputs as mla_attention_mma (partials for the combine included); dynamic
// shared memory MLA_SHARED_SMEM bytes. PTX only: not built under the host emulation.
// ---------------------------------------------------------------------------------------------
#ifndef MMA_HOST_STANDIN
#ifndef MLA_SHARED_KEYS
#define MLA_SHARED_KEYS 32  // keys per tile: 32 (2 blocks per SM) or 64 (1)
#endif
#ifndef MLA_SHARED_Q_REGS
#define MLA_SHARED_Q_REGS 0  // 1: each warp keeps the query tile's A fragments in registers (144 per thread)
#endif                       // instead of re-reading the tile from shared memory for every key tile
#define MLA_SHARED_HEADS 16
#define MLA_SHARED_THREADS 128
#define MLA_SHARED_WARP_KEYS (MLA_SHARED_KEYS / 4)  // keys each warp scores per tile
#define MLA_SHARED_P_ROW (MLA_SHARED_KEYS + 8)      // padded probability row (bf16): ldmatrix rows in distinct banks
#define MLA_SHARED_SMEM ((MLA_SHARED_HEADS + 2 * MLA_SHARED_KEYS) * MMA_DECODE_ROW * 2 + \
                         MLA_SHARED_HEADS * MLA_SHARED_P_ROW * 2 + 2 * 4 * MLA_SHARED_HEADS * 4)

__device__ __forceinline__ void mla_commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }

// mla_copy_key_tile with a warp per latent row: one block-table lookup and slot division per row and
// warp (not per 16-byte piece and thread), the row's 72 pieces by the warp's lanes.
template <int KEYS, int ROW, int THREADS>
__device__ __forceinline__ void mla_copy_key_rows(bf16* tile, const bf16* __restrict__ cache,
                                                  const int* __restrict__ table, int block_size, int key0, int end) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < KEYS; r += THREADS / 32) {
        const int pos = min(key0 + r, end - 1), block = pos / block_size;
        const bf16* src = cache + ((long long)table[block] * block_size + (pos - block * block_size)) * LATENT;
        const bool valid = key0 + r < end;
        for (int c = lane; c < LATENT / 8; c += 32) cp_async16(tile + r * ROW + 8 * c, src + 8 * c, valid);
    }
}
__device__ __forceinline__ void mla_wait_all_but_last_copies() { asm volatile("cp.async.wait_group 1;\n" ::); }

extern "C" __global__ void __launch_bounds__(MLA_SHARED_THREADS)
mla_attention_mma_shared(const bf16* __restrict__ q_latent, const bf16* __restrict__ q, int q_stride,
                         int q_pe_offset, const bf16* __restrict__ cache, const int* __restrict__ block_tables,
                         int max_blocks_per_seq, int block_size, const int* __restrict__ query_start, int num_seqs,
                         const int* __restrict__ positions, int num_heads, float scale, bf16* __restrict__ out,
                         int num_splits, float* __restrict__ partial_o, float* __restrict__ partial_ml,
                         const int* __restrict__ token_list) {
    extern __shared__ __align__(16) bf16 smem[];
    bf16* q_tile = smem;                                       // [16][MMA_DECODE_ROW]
    bf16* k_tiles = q_tile + MLA_SHARED_HEADS * MMA_DECODE_ROW;  // [2][KEYS][MMA_DECODE_ROW]
    bf16* p_tile = k_tiles + 2 * MLA_SHARED_KEYS * MMA_DECODE_ROW;  // [16][MLA_SHARED_P_ROW]
    float* warp_max = reinterpret_cast<float*>(p_tile + MLA_SHARED_HEADS * MLA_SHARED_P_ROW);  // [4][16]
    float* warp_sum = warp_max + 4 * MLA_SHARED_HEADS;                                           // [4][16]
    const int t = blockIdx.x;
    const int step_token = token_list ? token_list[t] : t;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head0 = blockIdx.y * MLA_SHARED_HEADS;
    const int heads = min(MLA_SHARED_HEADS, num_heads - head0);
    const int split = blockIdx.z;
    int begin, end;
    const int* table = mla_split_context<MLA_SHARED_KEYS>(query_start, num_seqs, block_tables, max_blocks_per_seq,
                                                          positions, step_token, num_splits, split, begin, end);
    if (begin >= end) {  // a split past a short context (num_splits > 1): its (max, sum) say empty
        for (int h = threadIdx.x; h < heads; h += MLA_SHARED_THREADS) {
            const long long head = (long long)t * num_heads + head0 + h;
            partial_ml[(head * num_splits + split) * 2] = -INFINITY;
            partial_ml[(head * num_splits + split) * 2 + 1] = 0.f;
        }
        return;  // block-uniform
    }
    mla_copy_query_tile<MLA_SHARED_HEADS, MMA_DECODE_ROW, MLA_SHARED_THREADS>(q_tile, q_latent, q, q_stride,
                                                                              q_pe_offset, t, num_heads, head0, heads);
    mla_copy_key_rows<MLA_SHARED_KEYS, MMA_DECODE_ROW, MLA_SHARED_THREADS>(k_tiles, cache, table, block_size, begin,
                                                                           end);
    mla_commit_copies();
    const int group = lane >> 2, pair = (lane & 3) * 2;
    // ldmatrix row addresses: A fragments (16 rows x 16 columns) and this warp's B fragments
    const int a_row = lane & 15, a_col = 8 * (lane >> 4);
    const int score_key = warp * MLA_SHARED_WARP_KEYS + (lane & 7), score_dim = 8 * (lane >> 3);
    const int value_key = (lane & 7) + 8 * ((lane >> 3) & 1), value_dim = warp * MMA_DECODE_PART + 8 * (lane >> 4);
    float acc[MMA_DECODE_PART / 8][4];
#pragma unroll
    for (int j = 0; j < MMA_DECODE_PART / 8; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#if MLA_SHARED_Q_REGS
    unsigned qf[LATENT / 16][4];  // loaded once the first tile (and the query tile) landed
#endif
    int stage = 0;
    for (int key0 = begin; key0 < end; key0 += MLA_SHARED_KEYS, stage ^= 1) {
        if (key0 + MLA_SHARED_KEYS < end)  // the next tile into the other buffer (freed by the last barrier)
            mla_copy_key_rows<MLA_SHARED_KEYS, MMA_DECODE_ROW, MLA_SHARED_THREADS>(
                k_tiles + (stage ^ 1) * MLA_SHARED_KEYS * MMA_DECODE_ROW, cache, table, block_size,
                key0 + MLA_SHARED_KEYS, end);
        mla_commit_copies();
        mla_wait_all_but_last_copies();  // this tile (and the query tile) landed
        __syncthreads();
        const bf16* k_tile = k_tiles + stage * MLA_SHARED_KEYS * MMA_DECODE_ROW;
        // this warp's scores: 16 heads x MLA_SHARED_WARP_KEYS keys over the 576 latent dims
        float s[MLA_SHARED_WARP_KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < MLA_SHARED_WARP_KEYS / 8; ++n)
#pragma unroll
            for (int v = 0; v < 4; ++v) s[n][v] = 0.f;
#if MLA_SHARED_Q_REGS
        if (key0 == begin) {
#pragma unroll
            for (int kk = 0; kk < LATENT / 16; ++kk)
                ldmatrix_x4(qf[kk], q_tile + a_row * MMA_DECODE_ROW + 16 * kk + a_col);
        }
#pragma unroll
        for (int kk = 0; kk < LATENT / 32; ++kk) {
#pragma unroll
            for (int n = 0; n < MLA_SHARED_WARP_KEYS / 8; ++n) {
                unsigned kf[4];  // keys 8n.. of this warp, dims 32kk .. 32kk + 31
                ldmatrix_x4(kf, k_tile + (score_key + 8 * n) * MMA_DECODE_ROW + 32 * kk + score_dim);
                mma_bf16_16816(s[n], qf[2 * kk], kf[0], kf[1]);
                mma_bf16_16816(s[n], qf[2 * kk + 1], kf[2], kf[3]);
            }
        }
#else
#pragma unroll 6
        for (int kk = 0; kk < LATENT / 32; ++kk) {
            unsigned qf0[4], qf1[4];
            ldmatrix_x4(qf0, q_tile + a_row * MMA_DECODE_ROW + 32 * kk + a_col);
            ldmatrix_x4(qf1, q_tile + a_row * MMA_DECODE_ROW + 32 * kk + 16 + a_col);
#pragma unroll
            for (int n = 0; n < MLA_SHARED_WARP_KEYS / 8; ++n) {
                unsigned kf[4];  // keys 8n.. of this warp, dims 32kk .. 32kk + 31
                ldmatrix_x4(kf, k_tile + (score_key + 8 * n) * MMA_DECODE_ROW + 32 * kk + score_dim);
                mma_bf16_16816(s[n], qf0, kf[0], kf[1]);
                mma_bf16_16816(s[n], qf1, kf[2], kf[3]);
            }
        }
#endif
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < MLA_SHARED_WARP_KEYS / 8; ++n)
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int key = key0 + warp * MLA_SHARED_WARP_KEYS + 8 * n + pair + (v & 1);
                s[n][v] = key < end ? s[n][v] * scale : -INFINITY;
                tile_max[v >> 1] = fmaxf(tile_max[v >> 1], s[n][v]);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        }
        if (pair == 0) {
            warp_max[warp * MLA_SHARED_HEADS + group] = tile_max[0];
            warp_max[warp * MLA_SHARED_HEADS + group + 8] = tile_max[1];
        }
        __syncthreads();
        float correction[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float m = row_max[r];
#pragma unroll
            for (int w = 0; w < 4; ++w) m = fmaxf(m, warp_max[w * MLA_SHARED_HEADS + group + 8 * r]);
            correction[r] = m == -INFINITY ? 1.f : __expf(row_max[r] - m);
            row_max[r] = m;
        }
        float my_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < MLA_SHARED_WARP_KEYS / 8; ++n) {
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                s[n][v] = s[n][v] == -INFINITY ? 0.f : __expf(s[n][v] - row_max[v >> 1]);
                my_sum[v >> 1] += s[n][v];
            }
            const int key = warp * MLA_SHARED_WARP_KEYS + 8 * n + pair;
            *reinterpret_cast<unsigned*>(p_tile + group * MLA_SHARED_P_ROW + key) = pack_bf16x2(s[n][0], s[n][1]);
            *reinterpret_cast<unsigned*>(p_tile + (group + 8) * MLA_SHARED_P_ROW + key) = pack_bf16x2(s[n][2], s[n][3]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            my_sum[r] += __shfl_xor_sync(0xffffffffu, my_sum[r], 1);
            my_sum[r] += __shfl_xor_sync(0xffffffffu, my_sum[r], 2);
        }
        if (pair == 0) {
            warp_sum[warp * MLA_SHARED_HEADS + group] = my_sum[0];
            warp_sum[warp * MLA_SHARED_HEADS + group + 8] = my_sum[1];
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float tile_sum = 0.f;
#pragma unroll
            for (int w = 0; w < 4; ++w) tile_sum += warp_sum[w * MLA_SHARED_HEADS + group + 8 * r];
            row_sum[r] = row_sum[r] * correction[r] + tile_sum;
        }
#pragma unroll
        for (int j = 0; j < MMA_DECODE_PART / 8; ++j) {
            acc[j][0] *= correction[0];
            acc[j][1] *= correction[0];
            acc[j][2] *= correction[1];
            acc[j][3] *= correction[1];
        }
        // O[:, quarter] += P · c_kv[keys, quarter]: B fragments of the key-major tile by ldmatrix.trans
#pragma unroll
        for (int ks = 0; ks < MLA_SHARED_KEYS / 16; ++ks) {
            unsigned pf[4];
            ldmatrix_x4(pf, p_tile + a_row * MLA_SHARED_P_ROW + 16 * ks + a_col);
#pragma unroll
            for (int j = 0; j < MMA_DECODE_PART / 16; ++j) {
                unsigned vf[4];  // dims 16j .. 16j + 15 of the quarter, keys 16ks .. 16ks + 15
                ldmatrix_x4_trans(vf, k_tile + (16 * ks + value_key) * MMA_DECODE_ROW + value_dim + 16 * j);
                mma_bf16_16816(acc[2 * j], pf, vf[0], vf[1]);
                mma_bf16_16816(acc[2 * j + 1], pf, vf[2], vf[3]);
            }
        }
        __syncthreads();  // every warp is done with this tile, the probabilities and the maxima
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = group + 8 * r;
        if (h >= heads) continue;
        const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
        const long long head = (long long)t * num_heads + head0 + h;
#pragma unroll
        for (int j = 0; j < MMA_DECODE_PART / 8; ++j) {
            const int dim = warp * MMA_DECODE_PART + 8 * j + pair;
            if (num_splits == 1) {
                *reinterpret_cast<unsigned*>(out + head * KV_LORA + dim) =
                    pack_bf16x2(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
            } else {
                *reinterpret_cast<float2*>(partial_o + (head * num_splits + split) * KV_LORA + dim) =
                    make_float2(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
            }
        }
        if (num_splits > 1 && warp == 0 && pair == 0) {
            partial_ml[(head * num_splits + split) * 2] = row_max[r];
            partial_ml[(head * num_splits + split) * 2 + 1] = row_sum[r];
        }
    }
}
#endif  // MMA_HOST_STANDIN

// ---------------------------------------------------------------------------------------------
// mla_prefill_attention_pipelined: mla_prefill_attention's causal flash attention (same arguments,
// grid and outputs, the same tile decoding, online softmax and output rows: the mla_prefill_* device
// functions) with 64-key K / V tiles double-buffered by cp.async (the next tile's copies fly while
// this one is multiplied) and ldmatrix fragments (V's by ldmatrix.trans: no transposing stores).
// PTX only: not built under the host emulation (which builds mla_prefill_attention).
// ---------------------------------------------------------------------------------------------
#ifndef MMA_HOST_STANDIN
#define PIPE_KEYS 64
#define PIPE_THREADS PREFILL_THREADS  // 4 warps of 16 query rows
#define PIPE_BLOCK_M PREFILL_BLOCK_M    // 64 queries per tile: 2 blocks per SM
#define PIPE_QK_ROW (QK_DIM + PREFILL_PAD)  // 400 bytes (DeepSeek-V3): 25 16-byte units, ldmatrix rows in distinct banks
#define PIPE_V_ROW (V_DIM + PREFILL_PAD)    // 272 bytes: 17 units
#define PIPE_PREFILL_SMEM ((PIPE_BLOCK_M * PIPE_QK_ROW + 2 * PIPE_KEYS * (PIPE_QK_ROW + PIPE_V_ROW)) * 2)

// rows [key0, key0 + PIPE_KEYS) of the head's K = [k_nope | k_pe] and V into shared tiles (zeros from key_end on)
__device__ __forceinline__ void mla_copy_prefill_kv(bf16* k_tile, bf16* v_tile, const bf16* __restrict__ k_nope,
                                                    const bf16* __restrict__ k_pe, const bf16* __restrict__ values,
                                                    long long ctx_first, int key0, int key_end, int head, int num_heads) {
    for (int i = threadIdx.x; i < PIPE_KEYS * QK_DIM / 8; i += PIPE_THREADS) {
        const int r = i / (QK_DIM / 8), c = (i % (QK_DIM / 8)) * 8;
        const long long key = ctx_first + min(key0 + r, key_end - 1);
        const bf16* src = c < NOPE_DIM ? k_nope + key * num_heads * NOPE_DIM + (long long)head * NOPE_DIM + c
                                       : k_pe + key * ROPE_DIM + c - NOPE_DIM;
        cp_async16(k_tile + r * PIPE_QK_ROW + c, src, key0 + r < key_end);
    }
    for (int i = threadIdx.x; i < PIPE_KEYS * V_DIM / 8; i += PIPE_THREADS) {
        const int r = i / (V_DIM / 8), c = (i % (V_DIM / 8)) * 8;
        const long long key = ctx_first + min(key0 + r, key_end - 1);
        cp_async16(v_tile + r * PIPE_V_ROW + c, values + key * num_heads * V_DIM + (long long)head * V_DIM + c,
                   key0 + r < key_end);
    }
}

extern "C" __global__ void __launch_bounds__(PIPE_THREADS, 2)
mla_prefill_attention_pipelined(const bf16* __restrict__ q, const bf16* __restrict__ k_nope,
                                const bf16* __restrict__ k_pe, const bf16* __restrict__ values,
                                const int* __restrict__ prefill_seqs, const int* __restrict__ tile_seq,
                                const int* __restrict__ tile_query, int num_heads, float scale, bf16* __restrict__ out) {
    extern __shared__ __align__(16) bf16 smem[];
    bf16* q_tile = smem;                                     // [PIPE_BLOCK_M][PIPE_QK_ROW]
    bf16* k_tiles = q_tile + PIPE_BLOCK_M * PIPE_QK_ROW;     // [2][PIPE_KEYS][PIPE_QK_ROW]
    bf16* v_tiles = k_tiles + 2 * PIPE_KEYS * PIPE_QK_ROW;      // [2][PIPE_KEYS][PIPE_V_ROW]
    // the plan lists the tiles with the most keys first
    const MlaPrefillTile w = mla_prefill_tile(prefill_seqs, tile_seq, tile_query, blockIdx.x, PIPE_BLOCK_M);
    const int head = blockIdx.y, key_end = w.key_end;
    const long long q_row_stride = (long long)num_heads * QK_DIM;
    for (int i = threadIdx.x; i < PIPE_BLOCK_M * QK_DIM / 8; i += PIPE_THREADS) {
        const int r = i / (QK_DIM / 8), c = (i % (QK_DIM / 8)) * 8;
        cp_async16(q_tile + r * PIPE_QK_ROW + c,
                   q + (w.q_first + w.tile_q + min(r, w.rows - 1)) * q_row_stride + (long long)head * QK_DIM + c,
                   r < w.rows);
    }
    mla_copy_prefill_kv(k_tiles, v_tiles, k_nope, k_pe, values, w.ctx_first, 0, key_end, head, num_heads);
    mla_commit_copies();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = lane >> 2, pair = (lane & 3) * 2;
    const int row0 = warp * 16 + group;  // this thread's two query rows: row0, row0 + 8
    const int query_pos0 = w.offset + w.tile_q + row0;
    const int warp_first_pos = w.offset + w.tile_q + warp * 16;  // the warp's first query position
    const float scale_log2 = scale * 1.4426950408889634f;    // softmax in base 2, the scale folded in
    const int k_row = lane & 7, k_col = 8 * (lane >> 3);                         // K fragments (ldmatrix)
    const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1), v_col = 8 * (lane >> 4);  // V fragments (.trans)
    float acc[V_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < V_DIM / 8; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    unsigned qf[QK_DIM / 16][4];
    int stage = 0;
    for (int key0 = 0; key0 < key_end; key0 += PIPE_KEYS, stage ^= 1) {
        if (key0 + PIPE_KEYS < key_end)
            mla_copy_prefill_kv(k_tiles + (stage ^ 1) * PIPE_KEYS * PIPE_QK_ROW,
                                v_tiles + (stage ^ 1) * PIPE_KEYS * PIPE_V_ROW, k_nope, k_pe, values, w.ctx_first,
                                key0 + PIPE_KEYS, key_end, head, num_heads);
        mla_commit_copies();
        mla_wait_all_but_last_copies();
        __syncthreads();
        if (key0 == 0) {
#pragma unroll
            for (int kk = 0; kk < QK_DIM / 16; ++kk)
                ldmatrix_x4(qf[kk], q_tile + (warp * 16 + (lane & 15)) * PIPE_QK_ROW + 16 * kk + 8 * (lane >> 4));
        }
        const bf16* k_tile = k_tiles + stage * PIPE_KEYS * PIPE_QK_ROW;
        const bf16* v_tile = v_tiles + stage * PIPE_KEYS * PIPE_V_ROW;
        float s[PIPE_KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < PIPE_KEYS / 8; ++n)
#pragma unroll
            for (int v = 0; v < 4; ++v) s[n][v] = 0.f;
#pragma unroll
        for (int kk = 0; kk < QK_DIM / 32; ++kk)
#pragma unroll
            for (int n = 0; n < PIPE_KEYS / 8; ++n) {
                unsigned kf[4];  // keys 8n .. 8n + 7, dims 32kk .. 32kk + 31
                ldmatrix_x4(kf, k_tile + (8 * n + k_row) * PIPE_QK_ROW + 32 * kk + k_col);
                mma_bf16_16816(s[n], qf[2 * kk], kf[0], kf[1]);
                mma_bf16_16816(s[n], qf[2 * kk + 1], kf[2], kf[3]);
            }
        // mask (causal, past the context) only on the steps that reach the warp's diagonal or the
        // context's end; online softmax, each row's scores in the 4 lanes of a quad
        const bool masked = key0 + PIPE_KEYS > min(warp_first_pos + 1, key_end);
        mla_prefill_softmax<PIPE_KEYS>(s, acc, row_max, row_sum, masked, key0, key_end, query_pos0, pair, scale_log2);
        // acc += P · V: the score accumulators are the A fragments of P (keys 16ks .. 16ks + 15)
#pragma unroll
        for (int ks = 0; ks < PIPE_KEYS / 16; ++ks) {
            unsigned pf[4];
            mla_pack_p<PIPE_KEYS>(s, ks, pf);
#pragma unroll
            for (int j = 0; j < V_DIM / 16; ++j) {
                unsigned vf[4];  // keys 16ks .. 16ks + 15, dims 16j .. 16j + 15
                ldmatrix_x4_trans(vf, v_tile + (16 * ks + v_row) * PIPE_V_ROW + 16 * j + v_col);
                mma_bf16_16816(acc[2 * j], pf, vf[0], vf[1]);
                mma_bf16_16816(acc[2 * j + 1], pf, vf[2], vf[3]);
            }
        }
        __syncthreads();  // every warp is done with this stage's tiles
    }
    mla_prefill_store(acc, row_sum, w, row0, pair, head, num_heads, out);
}
#endif  // MMA_HOST_STANDIN
