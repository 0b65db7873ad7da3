// Mixture-of-experts on the GPU: routing, grouping by expert, grouped GEMM with in-kernel weight
// dequantisation (bf16 | INT4 pack-quantized | FP8 e4m3 block-scaled), weighted combine.
//
//   x [T, H] bf16 ──moe_route──► ids [T, k] int32, weights [T, k] fp32
//                 ──moe_sort───► sorted_slots [T·k] (slot = t·k + j, grouped by expert),
//                                slot_pos [T·k] (inverse), tiles [(expert, first row)], num_tiles
//   grouped GEMM 1: rows x[sorted_slots[p] / k] · gate_up_e^T  → h [T·k, 2I] (sorted order)
//   silu_mul (elementwise.cu)                                   → a [T·k, I]
//   grouped GEMM 2: rows a[p] · down_e^T                        → y [T·k, H]
//   moe_combine: out[t] = Σ_j weights[t, j] · y[slot_pos[t·k + j]]   (fixed j order: deterministic)
//
// Rows of one expert may land in any order inside its segment (atomics in moe_sort); every output
// row is a dot product of its own input row, so the values never depend on that order.
//
// Weight formats (WEIGHT_FORMAT), all laid out per expert as [N, K] rows (K contiguous):
//   0  bf16                      w [E, N, K]
//   1  INT4 pack-quantized       words [E, N, K/8] int32 (nibble j%8 of word j/8, LSB first, value−8)
//                                scales [E, N, K/GROUP] bf16
//   2  FP8 e4m3, block-scaled    codes [E, N, K] uint8, scale_inv [E, ⌈N/128⌉, ⌈K/128⌉] fp32
// A weight tile is dequantised to bf16 in shared memory, then multiplied with tensor cores
// (bf16 in, fp32 accumulate: mma.sync m16n8k16); USE_MMA=0 gives a plain-FMA kernel with the same
// indexing (and no inline PTX, so the source also runs under a host emulation).
#include "mma.cuh"
#include "moe_route.cuh"

#ifndef WEIGHT_FORMAT
#define WEIGHT_FORMAT 0
#endif
#ifndef GROUP
#define GROUP 32
#endif
#ifndef USE_MMA
#define USE_MMA 1
#endif
#ifndef FP8_BLOCK
#define FP8_BLOCK 128
#endif
#ifndef INT4_TILED
#define INT4_TILED 0  // INT4 words and scales in the GEMV-tiled layout (int4_word_index), not [N, K/8];
#endif            // 2: its lane-groups variant (moe_int4.cu moe_gemv_int4_groups)
#if INT4_TILED && (WEIGHT_FORMAT != 1 || GROUP != 32)
#error "the tiled INT4 layout holds group-32 INT4 weights only"
#endif
#define BM MMA_TILE  // mma.cuh's 64×64 block tile on 4 warps
#define BN MMA_TILE
#define BK MMA_TILE  // 64 bf16 = 128 B of an A row, 32 B of an INT4 weight row per tile step (whole sectors)
#define SMEM_PAD 8
#define GEMM_THREADS MMA_TILE_THREADS
#define MAX_TOPK 16
#define MAX_EXPERTS 512

// ---------------------------------------------------------------------------------------------
// Routing: one block per token. Logits in fp32 from bf16 x and bf16 router weight; scores
// (SCORING 0 softmax, 1 sigmoid, 2 sqrt(softplus)); choice = score + bias; group-limited top-k
// (group score: sum of the best two, or the best one when GROUP_SCORE_MAX); weights = chosen
// scores, renormalised (norm_topk) and scaled.
// ---------------------------------------------------------------------------------------------
// Router logits spread over the GPU: grid (T, ⌈E / ROUTER_WARPS⌉), one warp per (token, expert),
// 16-byte loads (hidden % 8 == 0 and 16-byte aligned rows: the caller checks). A decode step's
// few tokens would otherwise leave the whole [E, H] router matrix to one block per token.
#define ROUTER_WARPS 8
extern "C" __global__ void moe_router_logits(const bf16* __restrict__ x, const bf16* __restrict__ gate, int hidden,
                                             int num_experts, float* __restrict__ logits) {
    const int t = blockIdx.x, e = blockIdx.y * ROUTER_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (e >= num_experts) return;
    const bf16* row = x + (long long)t * hidden;
    const bf16* w = gate + (long long)e * hidden;
    float acc = 0.f;
    for (int i = lane * 8; i < hidden; i += 32 * 8) {
        float a[8], b[8];
        load8(row + i, a);
        load8(w + i, b);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc += a[j] * b[j];
    }
    acc = warp_sum(acc);
    if (lane == 0) logits[(long long)t * num_experts + e] = acc;
}

// logits [T, E] from moe_router_logits, or null: computed here (one block per token).
// ROUTE_SHARED_EXPERTS S > 0 (shared-experts fusion, moe.py ``fuse_shared_experts``): the layer's shared
// experts are experts E .. E+S-1 of the stacked weights, so every token's row of ids / weights is k + S wide,
// its last S entries those experts with weight 1 (the grouped GEMMs stream them with the routed ones).
#ifndef ROUTE_SHARED_EXPERTS
#define ROUTE_SHARED_EXPERTS 0
#endif
#if ROUTE_SHARED_EXPERTS < 0 || ROUTE_SHARED_EXPERTS > MAX_TOPK
#error "ROUTE_SHARED_EXPERTS must be in 0 .. MAX_TOPK"
#endif
extern "C" __global__ void moe_route(const bf16* __restrict__ x, const bf16* __restrict__ gate,
                                     const float* __restrict__ logits,
                                     const float* __restrict__ bias /* [E] or null */, int hidden, int num_experts,
                                     int top_k, int scoring, int num_groups, int topk_groups, int group_score_max,
                                     int norm_topk, float scaling, const int* __restrict__ token_ids,
                                     const long long* __restrict__ tid2eid /* [vocab, k] or null */,
                                     int* __restrict__ ids, float* __restrict__ weights) {
    __shared__ RouteShared shared;
    float* score = shared.score;
    const int t = blockIdx.x;
    const bf16* row = x + (long long)t * hidden;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
    if (logits) {
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) score[e] = logits[(long long)t * num_experts + e];
    } else {
        for (int e = warp; e < num_experts; e += num_warps) {
            const bf16* w = gate + (long long)e * hidden;
            float acc = 0.f;
            for (int i = lane; i < hidden; i += 32) acc += __bfloat162float(row[i]) * __bfloat162float(w[i]);
            acc = warp_sum(acc);
            if (lane == 0) score[e] = acc;
        }
    }
    __syncthreads();
    const int row_width = top_k + ROUTE_SHARED_EXPERTS;
    route_token(shared, bias, num_experts, top_k, scoring, num_groups, topk_groups, group_score_max, norm_topk,
                scaling, tid2eid ? tid2eid + (long long)token_ids[t] * top_k : nullptr, ids + t * row_width,
                weights + t * row_width);
#if ROUTE_SHARED_EXPERTS
    if (threadIdx.x < ROUTE_SHARED_EXPERTS) {
        ids[t * row_width + top_k + threadIdx.x] = num_experts + threadIdx.x;
        weights[t * row_width + top_k + threadIdx.x] = 1.f;
    }
#endif
}

// ---------------------------------------------------------------------------------------------
// Grouping: one block. Counts per expert, segment offsets, each slot's place in its expert's
// segment, and the GEMM tile list (BM rows of one expert per tile).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void moe_sort(const int* __restrict__ ids, int num_slots, int num_experts,
                                    int* __restrict__ counts /* [E] zeroed scratch */,
                                    int* __restrict__ offsets /* [E+1] */, int* __restrict__ sorted_slots,
                                    int* __restrict__ slot_pos, int* __restrict__ tile_expert,
                                    int* __restrict__ tile_row, int* __restrict__ num_tiles, int max_tiles) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < num_slots; i += blockDim.x) atomicAdd(&counts[ids[i]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int running = 0, tiles = 0;
        for (int e = 0; e < num_experts; ++e) {
            offsets[e] = running;
            for (int row = 0; row < counts[e] && tiles < max_tiles; row += BM) {
                tile_expert[tiles] = e;
                tile_row[tiles] = running + row;
                ++tiles;
            }
            running += counts[e];
            counts[e] = 0;
        }
        offsets[num_experts] = running;
        *num_tiles = tiles;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_slots; i += blockDim.x) {
        const int e = ids[i];
        const int p = offsets[e] + atomicAdd(&counts[e], 1);
        sorted_slots[p] = i;
        slot_pos[i] = p;
    }
}

// moe_sort's layout with nothing serial (a block of up to 1024 threads): counts in shared memory,
// each thread a run of consecutive experts, one block-wide scan of (rows, tiles) gives each expert
// its offset and its first tile. The same offsets and tile list as moe_sort; a slot's place in its
// expert's segment is the order atomics hand out, as there. moe_sort's thread 0 walks every
// expert reading global memory, one round trip after another, whatever the batch.
#define SORT_MAX_THREADS 1024
extern "C" __global__ void moe_sort_parallel(const int* __restrict__ ids, int num_slots, int num_experts,
                                             int* __restrict__ offsets /* [E+1] */, int* __restrict__ sorted_slots,
                                             int* __restrict__ slot_pos, int* __restrict__ tile_expert,
                                             int* __restrict__ tile_row, int* __restrict__ num_tiles, int max_tiles) {
    __shared__ int count[MAX_EXPERTS];  // rows per expert, then each expert's next free row
    __shared__ int row_scan[SORT_MAX_THREADS], tile_scan[SORT_MAX_THREADS];
    const int tid = threadIdx.x, threads = blockDim.x;
    for (int e = tid; e < num_experts; e += threads) count[e] = 0;
    __syncthreads();
    for (int i = tid; i < num_slots; i += threads) atomicAdd(&count[ids[i]], 1);
    __syncthreads();
    const ExpertRun run = expert_run<BM>(count, num_experts, tid, threads);  // moe_route.cuh: as moe_route_sort
    row_scan[tid] = run.rows;
    tile_scan[tid] = run.tiles;
    __syncthreads();
    for (int o = 1; o < threads; o <<= 1) {  // inclusive scan over the threads (Hillis-Steele)
        const int r = tid >= o ? row_scan[tid - o] : 0, t = tid >= o ? tile_scan[tid - o] : 0;
        __syncthreads();
        row_scan[tid] += r;
        tile_scan[tid] += t;
        __syncthreads();
    }
    lay_out_expert_run<BM>(run, row_scan[tid] - run.rows, tile_scan[tid] - run.tiles, count, offsets, tile_expert,
                           tile_row, max_tiles);
    if (tid == 0) {
        offsets[num_experts] = row_scan[threads - 1];
        *num_tiles = min(tile_scan[threads - 1], max_tiles);
    }
    __syncthreads();
    place_slots(num_slots, ids, count, sorted_slots, slot_pos);
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM: out[p, n] = Σ_k A[row(p), k] · W_e[n, k] for the rows p of tile blockIdx.x
// (expert e), columns n of tile blockIdx.y. row(p) = sorted_slots[p] / top_k when gathering from
// token rows (GEMM 1), else p. Dense mode (tile_expert == null): expert 0, rows blockIdx.x·BM ...
// ---------------------------------------------------------------------------------------------
// e4m3 (bias 7) → fp32 by moving sign, exponent and mantissa into fp32's fields and rescaling by
// 2^(127−7): exact for normal and subnormal codes alike (fp32 keeps subnormals without fast-math).
__device__ __forceinline__ float fp8_e4m3_value(unsigned char code) {
    const unsigned bits = ((unsigned)(code & 0x80) << 24) | ((unsigned)(code & 0x7F) << 20);
    return __int_as_float((int)bits) * 1.329227995784916e36f;  // 2^120
}

#if WEIGHT_FORMAT == 1
// Where INT4 weight words and group scales live. Checkpoint layout (INT4_TILED 0): words [E, N, K/8]
// (word k/8 of row n holds weights k .. k+7), scales [E, N, K/GROUP]. Tiled layout (INT4_TILED 1,
// group 32, N % 16 == 0, K % 128 == 0; core/quant.py tile_int4_for_gemv builds it): the weights of
// 16 rows × 128 k form one 1024-byte chunk, chunks ordered (expert, row block n/16, k/128), so the
// decode GEMV's warp (16 rows) streams one contiguous run of HBM and its 32 lanes read 512
// contiguous bytes per 16-byte load. Inside a chunk: half (n/8)%2, lane (n%8)·4 + (k/8)%4, word
// (k/32)%4 — lane (g, t) of moe_gemv_int4_tiled finds at 16·lane (row g) and 512 + 16·lane (row
// g + 8) one word (8 consecutive weights) of each of the chunk's 4 groups. Scales per chunk: 64
// bf16 ordered (n%8, half, group): a lane's 8 scales (rows g and g + 8) in 16 bytes.
__device__ __forceinline__ long long int4_chunk_index(long long e, int n, int k, int N, int K) {
    return (e * (N / 16) + n / 16) * (long long)(K / 128) + k / 128;
}

// Index of the int32 word holding weights k .. k+7 of row n (k % 8 == 0).
__device__ __forceinline__ long long int4_word_index(long long e, int n, int k, int N, int K) {
#if INT4_TILED == 2  // lane-groups layout: a lane's 16 bytes hold the 4 words of one group (word (k/8)%4)
    return ((int4_chunk_index(e, n, k, N, K) * 2 + ((n >> 3) & 1)) * 8 + (n & 7)) * 16 + ((k >> 5) & 3) * 4 +
           ((k >> 3) & 3);
#elif INT4_TILED
    return ((int4_chunk_index(e, n, k, N, K) * 2 + ((n >> 3) & 1)) * 8 + (n & 7)) * 16 + ((k >> 3) & 3) * 4 +
           ((k >> 5) & 3);
#else
    return (e * N + n) * (long long)(K / 8) + k / 8;
#endif
}

// Index of the bf16 scale of weight (n, k)'s group.
__device__ __forceinline__ long long int4_scale_index(long long e, int n, int k, int N, int K) {
#if INT4_TILED
    return ((int4_chunk_index(e, n, k, N, K) * 8 + (n & 7)) * 2 + ((n >> 3) & 1)) * 4 + ((k >> 5) & 3);
#else
    return (e * N + n) * (long long)(K / GROUP) + k / GROUP;
#endif
}
#endif

// Dequantise weight element (n, k) of expert e (n < N, k < K checked by the caller).
__device__ __forceinline__ float weight_value(const void* __restrict__ weight, const void* __restrict__ scale,
                                             long long e, int n, int k, int N, int K) {
#if WEIGHT_FORMAT == 0
    return __bfloat162float(((const bf16*)weight)[(e * N + n) * (long long)K + k]);
#elif WEIGHT_FORMAT == 1
    const unsigned word = ((const unsigned*)weight)[int4_word_index(e, n, k & ~7, N, K)];
    const int q = (int)((word >> (4 * (k & 7))) & 0xF) - 8;
    return (float)q * __bfloat162float(((const bf16*)scale)[int4_scale_index(e, n, k, N, K)]);
#else
    const int nb = (N + FP8_BLOCK - 1) / FP8_BLOCK, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const unsigned char code = ((const unsigned char*)weight)[(e * N + n) * (long long)K + k];
    return fp8_e4m3_value(code) * ((const float*)scale)[(e * nb + n / FP8_BLOCK) * kb + k / FP8_BLOCK];
#endif
}

// Vectorised tile loads (``vec``: K % 8 == 0 and 16-byte aligned rows): A by mma.cuh's
// load_row_tile_vec (8 bf16 per 16-byte load), B here.
// B: 8 weights of one row per thread step, dequantised from one 16-byte bf16 load, one INT4 word
// (+ its group's scale) or two FP8 words (+ the block's scale).
__device__ __forceinline__ void load_b_tile_vec(const void* __restrict__ weight, const void* __restrict__ scale,
                                                long long e, int n0, int k0, int N, int K,
                                                bf16 (*b_tile)[BK + SMEM_PAD]) {
    for (int i = threadIdx.x; i < BN * BK / 8; i += GEMM_THREADS) {
        const int r = i / (BK / 8), c = (i % (BK / 8)) * 8;
        const int n = n0 + r, k = k0 + c;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (n < N && k < K) {
#if WEIGHT_FORMAT == 0
            v = *reinterpret_cast<const uint4*>((const bf16*)weight + (e * N + n) * (long long)K + k);
#elif WEIGHT_FORMAT == 1
            const unsigned word = ((const unsigned*)weight)[int4_word_index(e, n, k, N, K)];
            const float s = __bfloat162float(((const bf16*)scale)[int4_scale_index(e, n, k, N, K)]);
            float f[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) f[j] = (float)((int)((word >> (4 * j)) & 0xF) - 8) * s;
            v = make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                           pack_bf16x2(f[6], f[7]));
#else
            const int nb = (N + FP8_BLOCK - 1) / FP8_BLOCK, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
            const float s = ((const float*)scale)[(e * nb + n / FP8_BLOCK) * kb + k / FP8_BLOCK];
            const unsigned char* codes = (const unsigned char*)weight + (e * N + n) * (long long)K + k;
            float f[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) f[j] = fp8_e4m3_value(codes[j]) * s;
            v = make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                           pack_bf16x2(f[6], f[7]));
#endif
        }
        *reinterpret_cast<uint4*>(&b_tile[r][c]) = v;
    }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
moe_grouped_gemm(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                 const void* __restrict__ weight, const void* __restrict__ scale,
                 const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                 const int* __restrict__ num_tiles, const int* __restrict__ offsets, int dense_rows,
                 bf16* __restrict__ out, int N, int K, int vec) {
    __shared__ __align__(16) bf16 a_tile[BM][BK + SMEM_PAD];
    __shared__ __align__(16) bf16 b_tile[BN][BK + SMEM_PAD];
    __shared__ float c_tile[BM][BN + 4];
    __shared__ int a_rows[BM];
    int expert, row_begin, row_end;
    if (tile_expert) {
        if ((int)blockIdx.x >= *num_tiles) return;
        expert = tile_expert[blockIdx.x];
        row_begin = tile_row[blockIdx.x];
        row_end = min(row_begin + BM, offsets[expert + 1]);
    } else {
        expert = 0;
        row_begin = blockIdx.x * BM;
        if (row_begin >= dense_rows) return;
        row_end = min(row_begin + BM, dense_rows);
    }
    const int n0 = blockIdx.y * BN;
    const int rows = row_end - row_begin;
    for (int r = threadIdx.x; r < BM; r += GEMM_THREADS) {
        const int p = row_begin + r;
        a_rows[r] = r < rows ? (sorted_slots ? sorted_slots[p] / top_k : p) : -1;
    }
#if USE_MMA
    const MmaTileLane lane = mma_tile_lane();
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
#else
    float acc[BM * BN / GEMM_THREADS];
    for (int i = 0; i < BM * BN / GEMM_THREADS; ++i) acc[i] = 0.f;
#endif
    __syncthreads();
    for (int k0 = 0; k0 < K; k0 += BK) {
        if (vec) {
            load_row_tile_vec(a, a_rows, k0, K, a_tile);
            load_b_tile_vec(weight, scale, expert, n0, k0, N, K, b_tile);
        } else {
            for (int i = threadIdx.x; i < BM * BK; i += GEMM_THREADS) {
                const int r = i / BK, c = i % BK;
                const int src = a_rows[r];
                a_tile[r][c] = (src >= 0 && k0 + c < K) ? a[(long long)src * K + k0 + c] : __float2bfloat16_rn(0.f);
            }
            for (int i = threadIdx.x; i < BN * BK; i += GEMM_THREADS) {
                const int r = i / BK, c = i % BK;
                const int n = n0 + r, k = k0 + c;
                b_tile[r][c] = __float2bfloat16_rn((n < N && k < K) ? weight_value(weight, scale, expert, n, k, N, K) : 0.f);
            }
        }
        __syncthreads();
#if USE_MMA
        mma_tile_step(acc, a_tile, b_tile, lane);
#else
        for (int i = 0; i < BM * BN / GEMM_THREADS; ++i) {
            const int idx = threadIdx.x + i * GEMM_THREADS;
            const int r = idx / BN, c = idx % BN;
            float sum = 0.f;
            for (int kk = 0; kk < BK; ++kk) sum += __bfloat162float(a_tile[r][kk]) * __bfloat162float(b_tile[c][kk]);
            acc[i] += sum;
        }
#endif
        __syncthreads();
    }
#if USE_MMA
    store_mma_tile(c_tile, acc, lane);
#else
    for (int i = 0; i < BM * BN / GEMM_THREADS; ++i) {
        const int idx = threadIdx.x + i * GEMM_THREADS;
        c_tile[idx / BN][idx % BN] = acc[i];
    }
#endif
    __syncthreads();
    for (int i = threadIdx.x; i < BM * BN; i += GEMM_THREADS) {
        const int r = i / BN, c = i % BN;
        if (r < rows && n0 + c < N) out[(long long)(row_begin + r) * N + n0 + c] = __float2bfloat16_rn(c_tile[r][c]);
    }
}

// ---------------------------------------------------------------------------------------------
// Skinny GEMM for decode (few rows per weight): every weight byte is read once per GEMV_ROWS rows,
// straight from its stored format, with 16-byte loads, no shared memory and no tensor cores.
// One warp per output column n; a lane takes WEIGHT_CHUNK consecutive weights of the row per step
// (bf16: 8, FP8: 16, INT4: 32 = one 16-byte load), dequantises them in registers (one scale per
// chunk: WEIGHT_CHUNK divides the FP8 block; INT4 per 8 weights) and multiplies the matching
// slices of up to GEMV_ROWS activation rows; a warp sum finishes each dot product.
// Rows: the tile list of moe_sort (grouped: rows of one expert, gathered like the grouped GEMM) or,
// in dense mode (tile_expert null), rows blockIdx.y·GEMV_ROWS ... of expert 0.
// Needs K % WEIGHT_CHUNK == 0 and 16-byte aligned rows (the caller checks).
// ---------------------------------------------------------------------------------------------
#define GEMV_ROWS 8
#define GEMV_WARPS 8
#if WEIGHT_FORMAT == 0
#define WEIGHT_CHUNK 8
#elif WEIGHT_FORMAT == 1
#define WEIGHT_CHUNK 32
#else
#define WEIGHT_CHUNK 16
#endif

#ifndef GEMV_STREAM_LOADS
#define GEMV_STREAM_LOADS 0  // 1: the decode GEMVs' 16-byte weight loads past L1, L2 asked for 256-byte lines
#endif

// 16 bytes read once (a weight): ld.global.nc.L1::no_allocate.L2::256B (the host emulation: a plain load).
__device__ __forceinline__ uint4 stream_load16(const void* p) {
#ifdef MMA_HOST_STANDIN
    return *reinterpret_cast<const uint4*>(p);
#else
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#endif
}

// 16 bytes at p, by stream_load16 under GEMV_STREAM_LOADS.
__device__ __forceinline__ uint4 weight_load16(const void* p) {
#if GEMV_STREAM_LOADS
    return stream_load16(p);
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}

// The 16 bytes holding WEIGHT_CHUNK weights of row n (expert e) from k on, as stored.
__device__ __forceinline__ uint4 weight_raw(const void* __restrict__ weight, long long e, int n, int k, int N, int K) {
#if WEIGHT_FORMAT == 0
    return weight_load16((const bf16*)weight + (e * N + n) * (long long)K + k);
#elif WEIGHT_FORMAT == 1
#if INT4_TILED == 2  // lane-groups layout: a group's 4 words are 16 contiguous bytes (k % 32 == 0 here)
    return weight_load16((const unsigned*)weight + int4_word_index(e, n, k, N, K));
#elif INT4_TILED  // the 4 words lie 16 bytes apart (moe_gemv_int4_tiled reads this layout whole)
    const unsigned* words = (const unsigned*)weight;
    return make_uint4(words[int4_word_index(e, n, k, N, K)], words[int4_word_index(e, n, k + 8, N, K)],
                      words[int4_word_index(e, n, k + 16, N, K)], words[int4_word_index(e, n, k + 24, N, K)]);
#else
    return weight_load16((const unsigned*)weight + int4_word_index(e, n, k, N, K));
#endif
#else
    return weight_load16((const unsigned char*)weight + (e * N + n) * (long long)K + k);
#endif
}

// Those bytes dequantised (the scales read here).
__device__ __forceinline__ void weight_decode(uint4 raw, const void* __restrict__ scale, long long e, int n, int k,
                                              int N, int K, float* w) {
    const unsigned word[4] = {raw.x, raw.y, raw.z, raw.w};
#if WEIGHT_FORMAT == 0
    (void)scale;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[2 * i] = __int_as_float((int)(word[i] << 16));
        w[2 * i + 1] = __int_as_float((int)(word[i] & 0xFFFF0000u));
    }
#elif WEIGHT_FORMAT == 1
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float s = __bfloat162float(((const bf16*)scale)[int4_scale_index(e, n, k + 8 * i, N, K)]);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * i + j] = (float)((int)((word[i] >> (4 * j)) & 0xF) - 8) * s;
    }
#else
    const int nb = (N + FP8_BLOCK - 1) / FP8_BLOCK, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const float s = ((const float*)scale)[(e * nb + n / FP8_BLOCK) * kb + k / FP8_BLOCK];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = fp8_e4m3_value((unsigned char)(word[i / 4] >> (8 * (i % 4)))) * s;
#endif
}

#define GEMV_UNROLL 4  // weight loads in flight per lane before any is used

// Activation row of expert-sorted slot p: token sorted_slots[p] / top_k when gathering, else row p.
__device__ __forceinline__ const bf16* gemv_activation_row(const bf16* __restrict__ a, const int* __restrict__ sorted_slots,
                                                           int top_k, int p, int K) {
    return a + (long long)(sorted_slots ? sorted_slots[p] / top_k : p) * K;
}

// moe_gemv_wide's and moe_gemv_mma's block row: tile blockIdx.y's expert and slots [row_begin,
// row_end) (grouped; the tile's entries read beside the count, the arrays hold gridDim.y
// entries), or expert 0 and all dense_rows rows (dense: one block row loops over them so a weight
// is read from HBM once). False: the tile lies past the step's count.
__device__ __forceinline__ bool gemv_block_rows(const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                                                const int* __restrict__ num_tiles, const int* __restrict__ offsets,
                                                int dense_rows, int& expert, int& row_begin, int& row_end) {
    if (tile_expert) {
        const int tiles = *num_tiles, tile_e = tile_expert[blockIdx.y], tile_r = tile_row[blockIdx.y];
        expert = tile_e;
        row_begin = tile_r;
        if ((int)blockIdx.y >= tiles) return false;
        row_end = min(row_begin + BM, offsets[expert + 1]);
    } else {
        expert = 0;
        row_begin = 0;
        row_end = dense_rows;
    }
    return true;
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
moe_gemv(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
         const void* __restrict__ weight, const void* __restrict__ scale,
         const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
         const int* __restrict__ num_tiles, const int* __restrict__ offsets, int dense_rows,
         bf16* __restrict__ out, int N, int K) {
    int expert, row_begin, row_end;
    if (tile_expert) {
        if ((int)blockIdx.y >= *num_tiles) return;
        expert = tile_expert[blockIdx.y];
        row_begin = tile_row[blockIdx.y];
        row_end = min(row_begin + BM, offsets[expert + 1]);
    } else {
        expert = 0;
        row_begin = blockIdx.y * GEMV_ROWS;
        if (row_begin >= dense_rows) return;
        row_end = min(row_begin + GEMV_ROWS, dense_rows);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * GEMV_WARPS + warp;
    if (n >= N) return;
    for (int chunk = row_begin; chunk < row_end; chunk += GEMV_ROWS) {
        const int rows = min(GEMV_ROWS, row_end - chunk);
        const bf16* a_row[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            const int p = chunk + min(r, rows - 1);
            a_row[r] = gemv_activation_row(a, sorted_slots, top_k, p, K);
        }
        float acc[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.f;
        for (int k0 = lane * WEIGHT_CHUNK; k0 < K; k0 += 32 * WEIGHT_CHUNK * GEMV_UNROLL) {
            uint4 raw[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int k = k0 + u * 32 * WEIGHT_CHUNK;
                raw[u] = k < K ? weight_raw(weight, expert, n, k, N, K) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int k = k0 + u * 32 * WEIGHT_CHUNK;
                if (k >= K) break;
                float w[WEIGHT_CHUNK];
                weight_decode(raw[u], scale, expert, n, k, N, K, w);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) {
                    if (r >= rows) break;
#pragma unroll
                    for (int c = 0; c < WEIGHT_CHUNK; c += 8) {
                        float x[8];
                        load8(a_row[r] + k + c, x);
#pragma unroll
                        for (int j = 0; j < 8; ++j) acc[r] += x[j] * w[c + j];
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            const float total = warp_sum(acc[r]);  // every lane joins the shuffle
            if (lane == 0 && r < rows) out[(long long)(chunk + r) * N + n] = __float2bfloat16_rn(total);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// moe_gemv_wide: the decode GEMV again (same arguments, rows and tile list as moe_gemv; dense
// mode loops over all rows in one block so a weight is read from HBM once), built to keep HBM
// busy and spend fewer instructions per weight (an INT4 decode GEMV on CUDA cores runs close to
// the SM's issue limit):
//  * a warp takes WIDE_COLUMNS output columns: each 16-byte slice of an activation row is loaded
//    and unpacked once for all of them, and every lane has WIDE_COLUMNS 16-byte weight loads (and
//    their scales) in flight for the next chunk while it multiplies the current one;
//  * no int→float conversion: an INT4 nibble pair is or-ed into the mantissas of bf16 128.0
//    (giving 128 + q), an FP8 e4m3 byte pair moved into bf16 fields (the value × 2^-120); the
//    offset (−136·Σx for INT4, Σx shared by all columns) and the scale (× 2^120 for FP8, hoisted
//    to one multiply per chunk) are applied once per 8 weights and row, not per weight.
// Needs what moe_gemv needs (the caller checks). WIDE_ROWS activation rows share a pass over the
// weights; more rows take further passes (re-read from L2).
// ---------------------------------------------------------------------------------------------
#ifndef WIDE_ROWS
#define WIDE_ROWS 4
#endif
#define WIDE_WARPS 4
#ifndef WIDE_COLUMNS
#define WIDE_COLUMNS 4
#endif
#ifndef WIDE_MIN_BLOCKS
#define WIDE_MIN_BLOCKS 3  // resident blocks per SM the register budget must allow
#endif
#ifdef __CUDACC__
#define WIDE_LAUNCH_BOUNDS __launch_bounds__(WIDE_WARPS * 32, WIDE_MIN_BLOCKS)
#else  // the host emulation's stand-in takes the thread count only
#define WIDE_LAUNCH_BOUNDS __launch_bounds__(WIDE_WARPS * 32)
#endif
#define WIDE_PIECES (WEIGHT_CHUNK / 8)  // 8-weight pieces per 16-byte load: bf16 1, FP8 2, INT4 4
#ifndef WIDE_FUSE_SILU
#define WIDE_FUSE_SILU 0  // 1: gate_up with SiLU·mul fused: out [rows, N / 2]; a warp's columns half gate, half up
#endif
#if WIDE_FUSE_SILU && WIDE_COLUMNS % 2
#error "WIDE_FUSE_SILU pairs a warp's columns: WIDE_COLUMNS must be even"
#endif
#if WEIGHT_FORMAT == 1 && GROUP % 32 != 0
#define WIDE_SCALES WIDE_PIECES  // INT4 groups smaller than a chunk: one scale per piece
#else
#define WIDE_SCALES 1
#endif

// The scales of the WEIGHT_CHUNK weights of row n from k on, as multipliers of the raw pieces.
__device__ __forceinline__ void wide_scales(const void* __restrict__ scale, long long e, int n, int k, int N, int K,
                                            float* s) {
#if WEIGHT_FORMAT == 0
    (void)scale, (void)e, (void)n, (void)k, (void)N, (void)K;
    s[0] = 1.f;
#elif WEIGHT_FORMAT == 1
#pragma unroll
    for (int i = 0; i < WIDE_SCALES; ++i) s[i] = __bfloat162float(((const bf16*)scale)[int4_scale_index(e, n, k + 8 * i, N, K)]);
#else
    const int nb = (N + FP8_BLOCK - 1) / FP8_BLOCK, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    s[0] = ((const float*)scale)[(e * nb + n / FP8_BLOCK) * kb + k / FP8_BLOCK] * 1.329227995784916e36f;  // 2^120
#endif
}

// bf16 pair in a 32-bit word → two floats (exact: a bf16 is the top half of its fp32).
__device__ __forceinline__ float bf16_low(unsigned pair) { return __int_as_float((int)(pair << 16)); }
__device__ __forceinline__ float bf16_high(unsigned pair) { return __int_as_float((int)(pair & 0xFFFF0000u)); }

// Piece i (weights 8i .. 8i+7) of a 16-byte chunk as unscaled floats: bf16 as is, INT4 128 + q
// (q the stored nibble), FP8 the e4m3 value × 2^-120.
__device__ __forceinline__ void wide_piece(const uint4& raw, int i, float* w) {
    const unsigned word[4] = {raw.x, raw.y, raw.z, raw.w};
#if WEIGHT_FORMAT == 0
    (void)i;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        w[2 * q] = bf16_low(word[q]);
        w[2 * q + 1] = bf16_high(word[q]);
    }
#elif WEIGHT_FORMAT == 1
    const unsigned v = word[i];
#pragma unroll
    for (int s = 0; s < 4; ++s) {  // nibbles s and s + 4 land in the low and high bf16
        const unsigned pair = ((v >> (4 * s)) & 0x000F000Fu) | 0x43004300u;
        w[s] = bf16_low(pair);
        w[s + 4] = bf16_high(pair);
    }
#else
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const unsigned v = word[2 * i + q];
        // bytes 0 and 2, then 1 and 3: sign to bit 15, exponent and mantissa to bits 4..10
        const unsigned even = ((v << 8) & 0x80008000u) | ((v << 4) & 0x07F007F0u);
        const unsigned odd = (v & 0x80008000u) | ((v >> 4) & 0x07F007F0u);
        w[4 * q] = bf16_low(even);
        w[4 * q + 1] = bf16_low(odd);
        w[4 * q + 2] = bf16_high(even);
        w[4 * q + 3] = bf16_high(odd);
    }
#endif
}

extern "C" __global__ void WIDE_LAUNCH_BOUNDS
moe_gemv_wide(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
              const void* __restrict__ weight, const void* __restrict__ scale,
              const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
              const int* __restrict__ num_tiles, const int* __restrict__ offsets, int dense_rows,
              bf16* __restrict__ out, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#if WIDE_FUSE_SILU  // output n0 + c: silu(row n0 + c) * row (N / 2 + n0 + c), c < WIDE_COLUMNS / 2
    constexpr int OUT_COLUMNS = WIDE_COLUMNS / 2;
    const int out_width = N / 2;
#else
    constexpr int OUT_COLUMNS = WIDE_COLUMNS;
    const int out_width = N;
#endif
    const int n0 = (blockIdx.x * WIDE_WARPS + warp) * OUT_COLUMNS;
    if (n0 >= out_width) return;  // whole warps only: the shuffles below stay warp-wide
    int expert, row_begin, row_end;
    if (!gemv_block_rows(tile_expert, tile_row, num_tiles, offsets, dense_rows, expert, row_begin, row_end)) return;
    int column[WIDE_COLUMNS];  // past the output: a valid row is read, the result dropped
#pragma unroll
    for (int c = 0; c < WIDE_COLUMNS; ++c)
        column[c] = WIDE_FUSE_SILU ? (c < OUT_COLUMNS ? 0 : out_width) + min(n0 + c % OUT_COLUMNS, out_width - 1)
                                   : min(n0 + c, N - 1);
    constexpr int STEP = 32 * WEIGHT_CHUNK;
    for (int chunk = row_begin; chunk < row_end; chunk += WIDE_ROWS) {
        uint4 raw[WIDE_COLUMNS];
        float s[WIDE_COLUMNS][WIDE_SCALES];
        int k = lane * WEIGHT_CHUNK;
        if (k < K) {
#pragma unroll
            for (int c = 0; c < WIDE_COLUMNS; ++c) {
                raw[c] = weight_raw(weight, expert, column[c], k, N, K);
                wide_scales(scale, expert, column[c], k, N, K, s[c]);
            }
        }
        const int rows = min(WIDE_ROWS, row_end - chunk);
        const bf16* a_row[WIDE_ROWS];
#pragma unroll
        for (int r = 0; r < WIDE_ROWS; ++r) {
            const int p = chunk + min(r, rows - 1);
            a_row[r] = gemv_activation_row(a, sorted_slots, top_k, p, K);
        }
        float acc[WIDE_ROWS][WIDE_COLUMNS];
#pragma unroll
        for (int r = 0; r < WIDE_ROWS; ++r)
#pragma unroll
            for (int c = 0; c < WIDE_COLUMNS; ++c) acc[r][c] = 0.f;
        for (; k < K; k += STEP) {
            uint4 cur[WIDE_COLUMNS];
            float cur_s[WIDE_COLUMNS][WIDE_SCALES];
#pragma unroll
            for (int c = 0; c < WIDE_COLUMNS; ++c) {
                cur[c] = raw[c];
#pragma unroll
                for (int i = 0; i < WIDE_SCALES; ++i) cur_s[c][i] = s[c][i];
            }
            if (k + STEP < K) {  // the next chunk's loads fly while this one is multiplied
#pragma unroll
                for (int c = 0; c < WIDE_COLUMNS; ++c) {
                    raw[c] = weight_raw(weight, expert, column[c], k + STEP, N, K);
                    wide_scales(scale, expert, column[c], k + STEP, N, K, s[c]);
                }
            }
#pragma unroll
            for (int i = 0; i < WIDE_PIECES; ++i) {
                float x[WIDE_ROWS][8], x_sum[WIDE_ROWS];
#pragma unroll
                for (int r = 0; r < WIDE_ROWS; ++r) {
                    if (r >= rows) break;
                    load8(a_row[r] + k + 8 * i, x[r]);
                    x_sum[r] = 0.f;
#if WEIGHT_FORMAT == 1
#pragma unroll
                    for (int j = 0; j < 8; ++j) x_sum[r] += x[r][j];
#endif
                }
#pragma unroll
                for (int c = 0; c < WIDE_COLUMNS; ++c) {
                    float w[8];
                    wide_piece(cur[c], i, w);
#pragma unroll
                    for (int r = 0; r < WIDE_ROWS; ++r) {
                        if (r >= rows) break;
                        float dot = 0.f;
#pragma unroll
                        for (int j = 0; j < 8; ++j) dot += x[r][j] * w[j];
#if WEIGHT_FORMAT == 0
                        acc[r][c] += dot;
#else
#if WEIGHT_FORMAT == 1
                        dot -= 136.f * x_sum[r];  // Σ x·(128 + q) − 136·Σx = Σ x·(q − 8)
#endif
                        acc[r][c] += dot * cur_s[c][WIDE_SCALES == 1 ? 0 : i];
#endif
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < WIDE_ROWS; ++r) {
            if (r >= rows) break;  // warp-uniform
#if WIDE_FUSE_SILU  // elementwise.cu's silu_mul on the bf16-rounded gate and up: the unfused pair's bits
            float total[WIDE_COLUMNS];
#pragma unroll
            for (int c = 0; c < WIDE_COLUMNS; ++c) total[c] = warp_sum(acc[r][c]);
#pragma unroll
            for (int c = 0; c < OUT_COLUMNS; ++c) {
                const float g = round_bf16(total[c]), u = round_bf16(total[c + OUT_COLUMNS]);
                const float silu_mul = round_bf16(g / (1.f + __expf(-g))) * u;
                if (lane == 0 && n0 + c < out_width)
                    out[(long long)(chunk + r) * out_width + n0 + c] = __float2bfloat16_rn(silu_mul);
            }
#else
#pragma unroll
            for (int c = 0; c < WIDE_COLUMNS; ++c) {
                const float total = warp_sum(acc[r][c]);
                if (lane == 0 && n0 + c < N) out[(long long)(chunk + r) * N + n0 + c] = __float2bfloat16_rn(total);
            }
#endif
        }
    }
}

// ---------------------------------------------------------------------------------------------
// moe_gemv_mma: the decode GEMV on tensor cores (same arguments, rows and tile list as moe_gemv;
// dense mode loops over all rows in one block row, like moe_gemv_wide). mma.sync m16n8k16 with
// the weight as the A operand (a warp's 16 output columns are its 16 rows) and token rows as the
// B operand (8 per n-tile), so a tile's rows share every dequantised weight fragment: one pass
// over the weights serves up to 8·MMA_GEMV_NTILES rows, where the CUDA cores spend an FMA per
// weight and row.
// No shared memory and no repacking of the checkpoint layout: a dot product may visit k in any
// order as long as A and B agree. Lane (g, t) loads 16 bytes of weight row g and of row g+8 from
// k_lane = k0 + t·WEIGHT_CHUNK (WEIGHT_CHUNK weights, as moe_gemv's 16-byte loads) and feeds
// each mma step four of them as its fragment slots (2t, 2t+1 | 2t+8, 2t+9), with the same four
// activations of its token row as its B slots; over the quad's lanes and the chunk's
// WEIGHT_CHUNK/4 steps every k of the chunk is summed once. Step 2u+h (u: the lane's 16-byte load
// of 8 activations) takes the weights k_lane + 8u + 4h + {0, 1 | 2, 3} (bf16, FP8: pairs as
// stored) or, for INT4, k_lane + 8u + {2h, 2h+4 | 2h+1, 2h+5}: nibbles four apart, which one shift
// and one mask place in a bf16 pair (the activation pairs then take a byte permute each).
// Dequantisation in registers, rounded to bf16 as the tiles kernel rounds: bf16 as stored; INT4
// nibbles or-ed into bf16 128 + q, then (−136) × the group's scale in bf16x2 arithmetic (q − 8
// exact, one rounding of the product); FP8 e4m3 × the block's scale in fp32.
// Needs moe_gemv's conditions (the caller checks); K need not fill the last chunk (a lane whose
// 16 bytes lie past K feeds zeros). FP8: the block size a multiple of 16 (rows g and g+8 share a
// scale block).
// ---------------------------------------------------------------------------------------------
#define MMA_GEMV_WARPS 4
#ifndef MMA_GEMV_NTILES
#define MMA_GEMV_NTILES 2  // 8-row n-tiles accumulated per pass over the weights
#endif
#ifndef MMA_GEMV_DEPTH
#define MMA_GEMV_DEPTH 2  // chunks per lane in flight or in use: a ring of registers (one multiplied, the rest loading)
#endif
#ifndef MMA_GEMV_KSPLIT
#define MMA_GEMV_KSPLIT 1  // warps sharing a block's 16 columns, each over one slice of K (summed in shared memory)
#endif
#define MMA_GEMV_BLOCK_COLUMNS (16 * MMA_GEMV_WARPS / MMA_GEMV_KSPLIT)
#if MMA_GEMV_WARPS % MMA_GEMV_KSPLIT != 0
#error "MMA_GEMV_KSPLIT must divide MMA_GEMV_WARPS"
#endif
#if WEIGHT_FORMAT == 1 && GROUP % 32 != 0
#define MMA_GEMV_SCALES 4  // INT4 groups not whole chunks: a scale per 8-weight word (GROUP % 8 == 0)
#else
#define MMA_GEMV_SCALES 1
#endif

// One lane's share of a chunk: 16 bytes of weight rows g and g+8 and their scales.
struct MmaGemvChunk {
    uint4 lo, hi;
    float s_lo[MMA_GEMV_SCALES], s_hi[MMA_GEMV_SCALES];
};

// The scales of row n's WEIGHT_CHUNK weights from k on (bf16: unused).
__device__ __forceinline__ void mma_gemv_scales(const void* __restrict__ scale, long long e, int n, int k, int N, int K,
                                                float* s) {
#if WEIGHT_FORMAT == 0
    (void)scale, (void)e, (void)n, (void)k, (void)N, (void)K;
    s[0] = 1.f;
#elif WEIGHT_FORMAT == 1
#pragma unroll
    for (int i = 0; i < MMA_GEMV_SCALES; ++i)
        s[i] = __bfloat162float(((const bf16*)scale)[int4_scale_index(e, n, k + 8 * i, N, K)]);
#else
    const int nb = (N + FP8_BLOCK - 1) / FP8_BLOCK, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    s[0] = ((const float*)scale)[(e * nb + n / FP8_BLOCK) * kb + k / FP8_BLOCK];
#endif
}

// The lane's chunk from k on, or zeros when it lies past K.
__device__ __forceinline__ MmaGemvChunk mma_gemv_load(const void* __restrict__ weight, const void* __restrict__ scale,
                                                      long long e, int n_lo, int n_hi, int k, int N, int K) {
    MmaGemvChunk c;
    c.lo = c.hi = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int i = 0; i < MMA_GEMV_SCALES; ++i) c.s_lo[i] = c.s_hi[i] = 0.f;
    if (k < K) {
        c.lo = weight_raw(weight, e, n_lo, k, N, K);
        c.hi = weight_raw(weight, e, n_hi, k, N, K);
        mma_gemv_scales(scale, e, n_lo, k, N, K, c.s_lo);
        mma_gemv_scales(scale, e, n_hi, k, N, K, c.s_hi);
    }
    return c;
}

#if WEIGHT_FORMAT == 1
// INT4 codes in bits 0-3 and 16-19 of v → the bf16 pair (q − 8)·scale.
__device__ __forceinline__ unsigned mma_int4_pair(unsigned v, float scale) {
#ifdef MMA_HOST_STANDIN
    const unsigned biased = (v & 0x000F000Fu) | 0x43004300u;  // bf16 128 + q, twice
    return pack_bf16x2((bf16_low(biased) - 136.f) * scale, (bf16_high(biased) - 136.f) * scale);
#else
    unsigned biased;  // (v & mask) | bits in one lop3 (the compiler would spend two)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(biased) : "r"(v), "n"(0x000F000F), "r"(0x43004300));
    __nv_bfloat162 w = *reinterpret_cast<const __nv_bfloat162*>(&biased);
    w = __hmul2(__hsub2(w, __float2bfloat162_rn(136.f)), __float2bfloat162_rn(scale));
    return *reinterpret_cast<unsigned*>(&w);
#endif
}
#endif

// A registers of step 2u+h for one weight row (raw 16 bytes, scales), dequantised; see above.
__device__ __forceinline__ void mma_gemv_a(const uint4& raw, const float* s, int u, int h, unsigned& lo, unsigned& hi) {
    const unsigned word[4] = {raw.x, raw.y, raw.z, raw.w};
#if WEIGHT_FORMAT == 0
    (void)s;
    (void)u;  // one 8-weight load per chunk: u == 0
    lo = word[2 * h];
    hi = word[2 * h + 1];
#elif WEIGHT_FORMAT == 1
    const float scale = s[MMA_GEMV_SCALES == 1 ? 0 : u];
    lo = mma_int4_pair(word[u] >> (8 * h), scale);      // nibbles 2h, 2h+4 of word u
    hi = mma_int4_pair(word[u] >> (8 * h + 4), scale);  // nibbles 2h+1, 2h+5
#else
    const unsigned v = word[2 * u + h];  // bytes 8u + 4h .. 8u + 4h + 3 of the chunk
    lo = pack_bf16x2(fp8_e4m3_value((unsigned char)v) * s[0], fp8_e4m3_value((unsigned char)(v >> 8)) * s[0]);
    hi = pack_bf16x2(fp8_e4m3_value((unsigned char)(v >> 16)) * s[0], fp8_e4m3_value((unsigned char)(v >> 24)) * s[0]);
#endif
}

// B registers of step 2u+h from the token row's 8 activations x (k_lane + 8u ..): the same k as mma_gemv_a.
__device__ __forceinline__ void mma_gemv_b(const uint4& x, int h, unsigned& b0, unsigned& b1) {
    const unsigned word[4] = {x.x, x.y, x.z, x.w};
#if WEIGHT_FORMAT == 1
    b0 = (word[h] & 0xFFFFu) | (word[h + 2] << 16);  // x[2h], x[2h+4]
    b1 = (word[h] >> 16) | (word[h + 2] & 0xFFFF0000u);  // x[2h+1], x[2h+5]
#else
    b0 = word[2 * h];
    b1 = word[2 * h + 1];
#endif
}

// acc[j] += this lane's share of chunk `c` (from k on; past K the weights are zero and so are the
// activations read) times n-tile j's rows. Every lane of the warp calls it (the mma is collective).
__device__ __forceinline__ void mma_gemv_chunk(float (&acc)[MMA_GEMV_NTILES][4], const MmaGemvChunk& c,
                                               const bf16* const (&b_row)[MMA_GEMV_NTILES], int ntiles, int k, int K) {
    const bool valid = k < K;
#pragma unroll
    for (int u = 0; u < WEIGHT_CHUNK / 8; ++u) {
        uint4 x[MMA_GEMV_NTILES];
#pragma unroll
        for (int j = 0; j < MMA_GEMV_NTILES; ++j)
            x[j] = (j < ntiles && valid) ? *reinterpret_cast<const uint4*>(b_row[j] + k + 8 * u)
                                         : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            unsigned a[4];
            mma_gemv_a(c.lo, c.s_lo, u, h, a[0], a[2]);
            mma_gemv_a(c.hi, c.s_hi, u, h, a[1], a[3]);
#pragma unroll
            for (int j = 0; j < MMA_GEMV_NTILES; ++j) {
                if (j >= ntiles) break;  // warp-uniform
                unsigned b0, b1;
                mma_gemv_b(x[j], h, b0, b1);
                mma_bf16_16816(acc[j], a, b0, b1);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(MMA_GEMV_WARPS * 32)
moe_gemv_mma(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
             const void* __restrict__ weight, const void* __restrict__ scale,
             const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
             const int* __restrict__ num_tiles, const int* __restrict__ offsets, int dense_rows,
             bf16* __restrict__ out, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int slice = warp % MMA_GEMV_KSPLIT;  // this warp's slice of K (KSPLIT 1: all of it)
    const int n0 = blockIdx.x * MMA_GEMV_BLOCK_COLUMNS + warp / MMA_GEMV_KSPLIT * 16;
#if MMA_GEMV_KSPLIT == 1
    if (n0 >= N) return;  // whole warps only: the mma is warp-collective
#endif  // (split K: a warp past N still meets the block's barriers, its rows clamped, its result dropped)
    int expert, row_begin, row_end;
    if (!gemv_block_rows(tile_expert, tile_row, num_tiles, offsets, dense_rows, expert, row_begin, row_end)) return;
    const int n_lo = min(n0 + g, N - 1), n_hi = min(n0 + g + 8, N - 1);  // past N: a valid row, result dropped
    constexpr int STEP = 4 * WEIGHT_CHUNK;                                // k per chunk (the quad's 4 lanes)
    // whole chunks per slice, so only the last chunk of K is ever partial
    const int slice_chunks = ((K + STEP - 1) / STEP + MMA_GEMV_KSPLIT - 1) / MMA_GEMV_KSPLIT;
    const int k_begin = slice * slice_chunks * STEP, k_end = min(K, k_begin + slice_chunks * STEP);
    for (int pass = row_begin; pass < row_end; pass += 8 * MMA_GEMV_NTILES) {
        const int rows = min(8 * MMA_GEMV_NTILES, row_end - pass), ntiles = (rows + 7) / 8;  // warp-uniform
        const bf16* b_row[MMA_GEMV_NTILES];
#pragma unroll
        for (int j = 0; j < MMA_GEMV_NTILES; ++j) {
            const int p = pass + min(8 * j + g, rows - 1);  // rows past the tile repeat its last row
            b_row[j] = gemv_activation_row(a, sorted_slots, top_k, p, K);
        }
        float acc[MMA_GEMV_NTILES][4];
#pragma unroll
        for (int j = 0; j < MMA_GEMV_NTILES; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
        // a ring of MMA_GEMV_DEPTH chunk buffers: while one is multiplied the next DEPTH - 1 chunks'
        // loads fly (a batch-1 step has few warps per SM, so the bytes in flight come from depth)
        const int lane_k = t * WEIGHT_CHUNK;
        MmaGemvChunk ring[MMA_GEMV_DEPTH];
#pragma unroll
        for (int d = 0; d + 1 < MMA_GEMV_DEPTH; ++d)  // zeros past K (mma_gemv_load reads nothing there)
            if (k_begin + d * STEP < k_end)
                ring[d] = mma_gemv_load(weight, scale, expert, n_lo, n_hi, k_begin + d * STEP + lane_k, N, K);
        for (int k0 = k_begin; k0 < k_end; k0 += MMA_GEMV_DEPTH * STEP) {  // warp-uniform: every lane takes every branch
#pragma unroll
            for (int d = 0; d < MMA_GEMV_DEPTH; ++d) {
                const int ahead = k0 + (d + MMA_GEMV_DEPTH - 1) * STEP;  // refills the slot multiplied last
                if (ahead < k_end)
                    ring[(d + MMA_GEMV_DEPTH - 1) % MMA_GEMV_DEPTH] =
                        mma_gemv_load(weight, scale, expert, n_lo, n_hi, ahead + lane_k, N, K);
                if (k0 + d * STEP < k_end) mma_gemv_chunk(acc, ring[d], b_row, ntiles, k0 + d * STEP + lane_k, K);
            }
        }
#if MMA_GEMV_KSPLIT > 1
        // the slices' sums meet in shared memory; the block's first warp of each column group adds them
        __shared__ float slice_acc[MMA_GEMV_WARPS][MMA_GEMV_NTILES][4][32];
        if (slice) {
#pragma unroll
            for (int j = 0; j < MMA_GEMV_NTILES; ++j)
#pragma unroll
                for (int v = 0; v < 4; ++v) slice_acc[warp][j][v][lane] = acc[j][v];
        }
        __syncthreads();
        if (slice == 0) {
#pragma unroll
            for (int other = 1; other < MMA_GEMV_KSPLIT; ++other)
#pragma unroll
                for (int j = 0; j < MMA_GEMV_NTILES; ++j)
#pragma unroll
                    for (int v = 0; v < 4; ++v) acc[j][v] += slice_acc[warp + other][j][v][lane];
        }
        __syncthreads();  // read before the next pass writes
        if (slice) continue;
#endif
        // C of n-tile j: lane (g, t) holds columns n0+g (v 0, 1) and n0+g+8 (v 2, 3) of rows 8j+2t (+1)
#pragma unroll
        for (int j = 0; j < MMA_GEMV_NTILES; ++j) {
            if (j >= ntiles) break;
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int r = 8 * j + 2 * t + (v & 1), n = n0 + g + 8 * (v >> 1);
                if (r < rows && n < N) out[(long long)(pass + r) * N + n] = __float2bfloat16_rn(acc[j][v]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// moe_gemv_mma_staged: moe_gemv_mma for INT4 weights with group-32 scales, its weights staged per
// warp in shared memory by cp.async. moe_gemv_mma's lanes read 64 contiguous bytes of a row per
// load (a quad's 4 × 16 bytes; the next 64 come a chunk later), so HBM sees many short scattered
// reads; here all 32 lanes copy 256 contiguous bytes of two rows per instruction (STAGED_CHUNKS
// chunks of every row of the warp, and their scales, per stage), a ring of STAGED_STAGES stages
// per warp (one computed while the rest fly), synchronised by the warp alone. The compute is
// moe_gemv_mma's (mma_gemv_chunk on fragments read from the stage; same k order, same bits).
// Same arguments, rows and tile list as moe_gemv_mma; needs K % (STAGED_CHUNKS · 128) == 0 (the
// caller checks) and whole warps of columns (a warp past N leaves).
// ---------------------------------------------------------------------------------------------
// cp.async: 16 bytes global → shared, a commit group, and a wait until all but the PENDING newest
// groups of this lane's copies landed (the host emulation copies at once).
#ifdef MMA_HOST_STANDIN
__device__ __forceinline__ void staged_copy16(void* smem, const void* gmem) { std::memcpy(smem, gmem, 16); }
__device__ __forceinline__ void staged_commit() {}
template <int PENDING>
__device__ __forceinline__ void staged_wait_pending() {}
#else
__device__ __forceinline__ void staged_copy16(void* smem, const void* gmem) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
#if GEMV_STREAM_LOADS  // L2 asked for the whole 256-byte line
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
#endif
}
__device__ __forceinline__ void staged_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void staged_wait_pending() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }
#endif

#if WEIGHT_FORMAT == 1 && GROUP == 32 && !INT4_TILED  // reads the checkpoint layout's rows
#ifndef STAGED_CHUNKS
#define STAGED_CHUNKS 4  // 128-weight chunks per stage: 256 contiguous bytes of each row
#endif
#ifndef STAGED_STAGES
#define STAGED_STAGES 2
#endif
#define STAGED_WARPS 4
#define STAGED_ROW_BYTES (STAGED_CHUNKS * 64)
#define STAGED_ROW_PITCH (STAGED_ROW_BYTES + 64)  // rows 16 banks apart: a quad phase's 8 lanes, 32 banks
#define STAGED_SCALE_BYTES (STAGED_CHUNKS * 8)     // 4 bf16 scales per 128-weight chunk
#define STAGED_SCALE_PITCH (((STAGED_SCALE_BYTES + 16 + 15) / 16) * 16)  // 16-byte aligned, shifted banks
#define STAGED_STAGE_BYTES (16 * (STAGED_ROW_PITCH + STAGED_SCALE_PITCH))
static_assert(STAGED_WARPS * STAGED_STAGES * STAGED_STAGE_BYTES <= 48 * 1024, "static shared memory");
static_assert(STAGED_SCALE_BYTES % 16 == 0, "whole 16-byte scale copies");

// this lane's copies of all but the STAGED_STAGES - 1 newest groups landed
__device__ __forceinline__ void staged_wait() { staged_wait_pending<STAGED_STAGES - 1>(); }
#ifdef MMA_HOST_STANDIN  // a warp meets at its shuffle barrier
__device__ __forceinline__ void staged_warp_sync() { (void)__shfl_xor_sync(0xffffffffu, 0.f, 1); }
#else
__device__ __forceinline__ void staged_warp_sync() { __syncwarp(); }
#endif

// Stage `k` (STAGED_CHUNKS chunks from weight k on) of the warp's 16 rows into `stage`: weights,
// then scales; lane l copies 16 bytes of row 2i + l/16 in turn i (whole 256-byte row runs).
__device__ __forceinline__ void staged_issue(unsigned char* stage, const void* __restrict__ weight,
                                             const void* __restrict__ scale, long long e, int n0, int N, int K,
                                             int k, int lane) {
    constexpr int PIECES = STAGED_ROW_BYTES / 16;  // per row
#pragma unroll
    for (int i = 0; i < 16 * PIECES / 32; ++i) {
        const int index = i * 32 + lane, r = index / PIECES, piece = index % PIECES;
        const long long row = e * N + min(n0 + r, N - 1);
        staged_copy16(stage + r * STAGED_ROW_PITCH + piece * 16,
                      (const unsigned char*)weight + row * (K / 2) + k / 2 + piece * 16);
    }
    constexpr int SCALE_PIECES = STAGED_SCALE_BYTES / 16;
    unsigned char* scales = stage + 16 * STAGED_ROW_PITCH;
    for (int index = lane; index < 16 * SCALE_PIECES; index += 32) {
        const int r = index / SCALE_PIECES, piece = index % SCALE_PIECES;
        const long long row = e * N + min(n0 + r, N - 1);
        staged_copy16(scales + r * STAGED_SCALE_PITCH + piece * 16,
                      (const unsigned char*)scale + (row * (K / GROUP) + k / GROUP) * 2 + piece * 16);
    }
}

// Lane (g, t)'s MmaGemvChunk of chunk c of a landed stage: rows g and g + 8, bytes 64c + 16t
// (weights k + 128c + 32t ..), the group scale of each (group 4c + t of the stage)
__device__ __forceinline__ MmaGemvChunk staged_chunk(const unsigned char* stage, int c, int g, int t) {
    MmaGemvChunk chunk;
    chunk.lo = *reinterpret_cast<const uint4*>(stage + g * STAGED_ROW_PITCH + c * 64 + t * 16);
    chunk.hi = *reinterpret_cast<const uint4*>(stage + (g + 8) * STAGED_ROW_PITCH + c * 64 + t * 16);
    const unsigned char* scales = stage + 16 * STAGED_ROW_PITCH;
    chunk.s_lo[0] = __bfloat162float(*reinterpret_cast<const bf16*>(scales + g * STAGED_SCALE_PITCH + (4 * c + t) * 2));
    chunk.s_hi[0] =
        __bfloat162float(*reinterpret_cast<const bf16*>(scales + (g + 8) * STAGED_SCALE_PITCH + (4 * c + t) * 2));
    return chunk;
}

extern "C" __global__ void __launch_bounds__(STAGED_WARPS * 32)
moe_gemv_mma_staged(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                    const void* __restrict__ weight, const void* __restrict__ scale,
                    const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                    const int* __restrict__ num_tiles, const int* __restrict__ offsets, int dense_rows,
                    bf16* __restrict__ out, int N, int K) {
    __shared__ __align__(16) unsigned char staged[STAGED_WARPS][STAGED_STAGES][STAGED_STAGE_BYTES];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = (blockIdx.x * STAGED_WARPS + warp) * 16;
    if (n0 >= N) return;  // the warp syncs with itself only
    int expert, row_begin, row_end;
    if (!gemv_block_rows(tile_expert, tile_row, num_tiles, offsets, dense_rows, expert, row_begin, row_end)) return;
    constexpr int STAGE_K = STAGED_CHUNKS * 4 * WEIGHT_CHUNK;  // weights per stage
    const int stages = K / STAGE_K;
    for (int pass = row_begin; pass < row_end; pass += 8 * MMA_GEMV_NTILES) {
        const int rows = min(8 * MMA_GEMV_NTILES, row_end - pass), ntiles = (rows + 7) / 8;  // warp-uniform
        const bf16* b_row[MMA_GEMV_NTILES];
#pragma unroll
        for (int j = 0; j < MMA_GEMV_NTILES; ++j) {
            const int p = pass + min(8 * j + g, rows - 1);
            b_row[j] = gemv_activation_row(a, sorted_slots, top_k, p, K);
        }
        float acc[MMA_GEMV_NTILES][4];
#pragma unroll
        for (int j = 0; j < MMA_GEMV_NTILES; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
#pragma unroll
        for (int s = 0; s + 1 < STAGED_STAGES; ++s) {  // every turn commits a group, empty or not
            if (s < stages) staged_issue(staged[warp][s], weight, scale, expert, n0, N, K, s * STAGE_K, lane);
            staged_commit();
        }
        for (int i = 0; i < stages; ++i) {
            const int ahead = i + STAGED_STAGES - 1;  // refills the stage computed last turn
            if (ahead < stages)
                staged_issue(staged[warp][ahead % STAGED_STAGES], weight, scale, expert, n0, N, K, ahead * STAGE_K,
                             lane);
            staged_commit();
            staged_wait();
            staged_warp_sync();  // every lane's copies of stage i visible to the warp
            const unsigned char* stage = staged[warp][i % STAGED_STAGES];
#pragma unroll
            for (int c = 0; c < STAGED_CHUNKS; ++c)
                mma_gemv_chunk(acc, staged_chunk(stage, c, g, t), b_row, ntiles,
                               i * STAGE_K + c * 4 * WEIGHT_CHUNK + t * WEIGHT_CHUNK, K);
            staged_warp_sync();  // read before the next turn's copies overwrite it
        }
#pragma unroll
        for (int j = 0; j < MMA_GEMV_NTILES; ++j) {
            if (j >= ntiles) break;
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int r = 8 * j + 2 * t + (v & 1), n = n0 + g + 8 * (v >> 1);
                if (r < rows && n < N) out[(long long)(pass + r) * N + n] = __float2bfloat16_rn(acc[j][v]);
            }
        }
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// moe_gemv_int4_tiled: the decode GEMV on tensor cores for INT4 weights in the tiled layout
// (INT4_TILED; same arguments, rows and tile list as moe_gemv_mma). A warp owns 16 output columns
// = one row block of the layout and streams its chunks (1 KB of weights + 128 bytes of scales per
// 128 k, contiguous over k): every lane loads 16 bytes of row g, 16 of row g + 8 and its 8 scales,
// three fully coalesced loads, TILED_DEPTH chunks in flight in a ring of registers (or, with
// TILED_STAGES, TILED_STAGES - 1 in flight to a ring in shared memory by cp.async).
// A lane's word j of a row holds 8 consecutive weights k0 .. k0+7 of group j (k0 = 32j + 8t), so
// all 4 lanes of a quad feed one mma step from the same group; the scale then leaves the weights:
// nibbles are or-ed into bf16 128 + q (exact, nothing else per weight pair but a shift), a group's
// two mma steps sum Σ (128 + q)·x on top of two with the constant A = −136 (Σ −136·x), and the
// group's fp32 sum (q − 8)·x takes its row's scale in one FMA per output. Step p of a group takes
// the weights k0 + {2p, 2p+4 | 2p+1, 2p+5} (fragment slots 2t, 2t+1 | 2t+8, 2t+9, one shift and
// one lop3 per pair) and the same activations (byte permutes of one 16-byte load of x[k0 ..]).
// The products are exact in the tensor cores; the sums differ from moe_gemv_mma's (which rounds
// each dequantised weight to bf16) by fp32 rounding only.
// Needs INT4_TILED's shapes (N % 16 == 0, K % 128 == 0; the caller checks).
// ---------------------------------------------------------------------------------------------
#if INT4_TILED == 1  // (the lane-groups layout, INT4_TILED 2, has moe_int4.cu's GEMV)
#ifndef TILED_NTILES
#define TILED_NTILES 1  // 8-row n-tiles per pass over the weights
#endif
#ifndef TILED_DEPTH
#define TILED_DEPTH 4  // chunks per lane in flight or in use
#endif
#ifndef TILED_STREAM_LOADS
#define TILED_STREAM_LOADS 0  // 1: weight loads past L1 (read once) asking L2 for 256-byte lines
#endif
#ifndef TILED_ROTATE
#define TILED_ROTATE 0  // 1: each warp starts its chunk stream at its own place (37 chunks per row block on)
#endif
#ifndef TILED_STAGES
#define TILED_STAGES 0  // > 0: the ring of chunks in shared memory, filled by cp.async (TILED_DEPTH unused)
#endif
#ifndef TILED_ROW_BLOCKS
#define TILED_ROW_BLOCKS 1  // 16-row blocks per warp, walked as one chunk stream (register ring only)
#endif
#ifndef TILED_FUSE_SILU
#define TILED_FUSE_SILU 0  // 1: gate_up with SiLU·mul fused: out [rows, N / 2] (each warp: its gate rows, then up)
#endif
#if TILED_STAGES && (TILED_ROW_BLOCKS != 1 || TILED_FUSE_SILU)
#error "TILED_ROW_BLOCKS / TILED_FUSE_SILU need the register ring (TILED_STAGES 0)"
#endif
// A lane's share of a chunk in a shared-memory stage: the 16 bytes of row g, of row g + 8 and its
// scales, each copied by the lane itself (so only its own cp.async groups need waiting for).
#define TILED_STAGE_BYTES (3 * 32 * 16)
#define TILED_WARPS 4
#define TILED_NEG136 0xC308C308u  // bf16 −136, twice
#if TILED_STAGES
static_assert(TILED_WARPS * TILED_STAGES * TILED_STAGE_BYTES <= 48 * 1024, "static shared memory");
#endif

struct TiledChunk {
    uint4 lo, hi, scales;  // rows g, g + 8: one word per group; scales (row g: groups 0-3, row g + 8: 0-3)
};

__device__ __forceinline__ uint4 tiled_weight_load(const uint4* p) {
#if TILED_STREAM_LOADS
    return stream_load16(p);
#else
    return *p;
#endif
}

__device__ __forceinline__ TiledChunk tiled_load(const unsigned* __restrict__ weight, const bf16* __restrict__ scale,
                                                 long long chunk, int lane, int g) {
    const uint4* w = reinterpret_cast<const uint4*>(weight + chunk * 256);
    TiledChunk c;
    c.lo = tiled_weight_load(w + lane);
    c.hi = tiled_weight_load(w + 32 + lane);
    c.scales = reinterpret_cast<const uint4*>(scale + chunk * 64)[g];
    return c;
}

// Nibbles s and s + 4 of v → the bf16 pair (128 + q_s, 128 + q_{s+4}).
__device__ __forceinline__ unsigned tiled_pair(unsigned v, int s) {
#ifdef MMA_HOST_STANDIN
    return ((v >> (4 * s)) & 0x000F000Fu) | 0x43004300u;
#else
    unsigned biased;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(biased) : "r"(v >> (4 * s)), "n"(0x000F000F), "r"(0x43004300));
    return biased;
#endif
}

// acc[j] += chunk c's products with n-tile j's rows (x rows b_row[j], this lane's k from k_chunk + 8t).
__device__ __forceinline__ void tiled_chunk(float (&acc)[TILED_NTILES][4], const TiledChunk& c,
                                            const bf16* const (&b_row)[TILED_NTILES], int ntiles, int k_chunk, int t) {
    const unsigned lo[4] = {c.lo.x, c.lo.y, c.lo.z, c.lo.w}, hi[4] = {c.hi.x, c.hi.y, c.hi.z, c.hi.w};
    const unsigned sw[4] = {c.scales.x, c.scales.y, c.scales.z, c.scales.w};
    const unsigned neg136[4] = {TILED_NEG136, TILED_NEG136, TILED_NEG136, TILED_NEG136};
#pragma unroll
    for (int group = 0; group < 4; ++group) {
        const float s_lo = (group & 1) ? bf16_high(sw[group >> 1]) : bf16_low(sw[group >> 1]);
        const float s_hi = (group & 1) ? bf16_high(sw[2 + (group >> 1)]) : bf16_low(sw[2 + (group >> 1)]);
        unsigned a[2][4];  // step p: rows g, g + 8 at slots (2t, 2t+1 | 2t+8, 2t+9)
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            a[p][0] = tiled_pair(lo[group], 2 * p);
            a[p][1] = tiled_pair(hi[group], 2 * p);
            a[p][2] = tiled_pair(lo[group], 2 * p + 1);
            a[p][3] = tiled_pair(hi[group], 2 * p + 1);
        }
#pragma unroll
        for (int j = 0; j < TILED_NTILES; ++j) {
            if (j >= ntiles) break;  // warp-uniform
            const uint4 xv = *reinterpret_cast<const uint4*>(b_row[j] + k_chunk + 32 * group + 8 * t);
            const unsigned x[4] = {xv.x, xv.y, xv.z, xv.w};
            float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int p = 0; p < 2; ++p) {  // x[k0 + 2p], x[k0 + 2p + 4] | x[k0 + 2p + 1], x[k0 + 2p + 5]
                const unsigned b0 = (x[p] & 0xFFFFu) | (x[p + 2] << 16), b1 = (x[p] >> 16) | (x[p + 2] & 0xFFFF0000u);
                mma_bf16_16816(sum, neg136, b0, b1);
                mma_bf16_16816(sum, a[p], b0, b1);
            }
            acc[j][0] += s_lo * sum[0];
            acc[j][1] += s_lo * sum[1];
            acc[j][2] += s_hi * sum[2];
            acc[j][3] += s_hi * sum[3];
        }
    }
}

extern "C" __global__ void __launch_bounds__(TILED_WARPS * 32)
moe_gemv_int4_tiled(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                    const void* __restrict__ weight, const void* __restrict__ scale,
                    const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                    const int* __restrict__ num_tiles, const int* __restrict__ offsets, int dense_rows,
                    bf16* __restrict__ out, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if TILED_FUSE_SILU  // output column n: silu(row n) * row (N / 2 + n); a warp's gate rows, then its up rows
    const int out_columns = N / 2, block_stride = N / 32;
    const int n_first = (blockIdx.x * TILED_WARPS + warp) * 16;
#else
    const int out_columns = N, block_stride = 1;
    const int n_first = (blockIdx.x * TILED_WARPS + warp) * 16 * TILED_ROW_BLOCKS;
#endif
    if (n_first >= out_columns) return;  // whole warps only: the mma is warp-collective
    int expert, row_begin, row_end;
    if (!gemv_block_rows(tile_expert, tile_row, num_tiles, offsets, dense_rows, expert, row_begin, row_end)) return;
    const int chunks = K / 128;
    // this warp's chunks: row blocks n_first / 16 + b * block_stride for b < row_blocks, each `chunks` long
    const int row_blocks = TILED_FUSE_SILU ? 2 : min(TILED_ROW_BLOCKS, (N - n_first) / 16);
    const long long first = ((long long)expert * (N / 16) + n_first / 16) * chunks;
    // within a row block, the order a warp walks its chunks in: from `start` on, wrapping (TILED_ROTATE:
    // warps in lockstep would otherwise read addresses a row block's stride apart)
    const auto start_of = [&](int block) {
        return TILED_ROTATE ? (int)((n_first / 16 + block * block_stride) * 37LL % chunks) : 0;
    };
    const int start = start_of(0);
    const auto chunk_at = [&](int c) { return c + start < chunks ? c + start : c + start - chunks; };
    const unsigned* words = (const unsigned*)weight;
    const bf16* scales = (const bf16*)scale;
#if TILED_STAGES
    __shared__ __align__(16) unsigned char tiled_ring[TILED_WARPS][TILED_STAGES][TILED_STAGE_BYTES];
    unsigned char (*ring)[TILED_STAGE_BYTES] = tiled_ring[warp];
    // chunk c of the warp's stream into stage c % TILED_STAGES (this lane's 48 bytes)
    const auto issue = [&](int c) {
        unsigned char* stage = ring[c % TILED_STAGES] + lane * 16;
        const long long at = first + chunk_at(c);
        const unsigned char* w = reinterpret_cast<const unsigned char*>(words + at * 256) + lane * 16;
        staged_copy16(stage, w);
        staged_copy16(stage + 512, w + 512);
        staged_copy16(stage + 1024, reinterpret_cast<const unsigned char*>(scales + at * 64) + g * 16);
    };
#endif
    // C of n-tile j: lane (g, t) holds columns n0+g (v 0, 1) and n0+g+8 (v 2, 3) of rows 8j+2t (+1)
    const auto store = [&](const float (&acc)[TILED_NTILES][4], int pass, int rows, int ntiles, int n0) {
#pragma unroll
        for (int j = 0; j < TILED_NTILES; ++j) {
            if (j >= ntiles) break;
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int r = 8 * j + 2 * t + (v & 1), n = n0 + g + 8 * (v >> 1);
                if (r < rows) out[(long long)(pass + r) * out_columns + n] = __float2bfloat16_rn(acc[j][v]);
            }
        }
    };
#if TILED_FUSE_SILU
    // elementwise.cu's silu_mul on the bf16-rounded gate and up: the unfused pair's bits
    const auto store_silu = [&](const float (&gate)[TILED_NTILES][4], const float (&up)[TILED_NTILES][4], int pass,
                                int rows, int ntiles, int n0) {
        float fused[TILED_NTILES][4];
#pragma unroll
        for (int j = 0; j < TILED_NTILES; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const float g = round_bf16(gate[j][v]), u = round_bf16(up[j][v]);
                fused[j][v] = round_bf16(g / (1.f + __expf(-g))) * u;
            }
        store(fused, pass, rows, ntiles, n0);
    };
    float gate_acc[TILED_NTILES][4];
#endif
    for (int pass = row_begin; pass < row_end; pass += 8 * TILED_NTILES) {
        const int rows = min(8 * TILED_NTILES, row_end - pass), ntiles = (rows + 7) / 8;  // warp-uniform
        const bf16* b_row[TILED_NTILES];
#pragma unroll
        for (int j = 0; j < TILED_NTILES; ++j)  // rows past the tile repeat its last row
            b_row[j] = gemv_activation_row(a, sorted_slots, top_k, pass + min(8 * j + g, rows - 1), K);
        float acc[TILED_NTILES][4];
#pragma unroll
        for (int j = 0; j < TILED_NTILES; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
#if TILED_STAGES
#pragma unroll
        for (int c = 0; c + 1 < TILED_STAGES; ++c) {  // every turn commits a group, empty or not
            if (c < chunks) issue(c);
            staged_commit();
        }
        for (int c = 0; c < chunks; ++c) {
            if (c + TILED_STAGES - 1 < chunks) issue(c + TILED_STAGES - 1);  // the stage read last turn
            staged_commit();
            staged_wait_pending<TILED_STAGES - 1>();  // chunk c landed (this lane's copies)
            const unsigned char* stage = ring[c % TILED_STAGES] + lane * 16;
            TiledChunk chunk;
            chunk.lo = *reinterpret_cast<const uint4*>(stage);
            chunk.hi = *reinterpret_cast<const uint4*>(stage + 512);
            chunk.scales = *reinterpret_cast<const uint4*>(stage + 1024);
            tiled_chunk(acc, chunk, b_row, ntiles, chunk_at(c) * 128, t);
        }
        store(acc, pass, rows, ntiles, n_first);
#else
#if TILED_ROW_BLOCKS == 1 && !TILED_FUSE_SILU  // (the kernel as measured before row blocks existed)
        TiledChunk ring[TILED_DEPTH];
#pragma unroll
        for (int d = 0; d + 1 < TILED_DEPTH; ++d)
            if (d < chunks) ring[d] = tiled_load(words, scales, first + chunk_at(d), lane, g);
        for (int c0 = 0; c0 < chunks; c0 += TILED_DEPTH) {  // warp-uniform
#pragma unroll
            for (int d = 0; d < TILED_DEPTH; ++d) {
                const int ahead = c0 + d + TILED_DEPTH - 1;  // refills the slot used last
                if (ahead < chunks)
                    ring[(d + TILED_DEPTH - 1) % TILED_DEPTH] = tiled_load(words, scales, first + chunk_at(ahead), lane, g);
                if (c0 + d < chunks) tiled_chunk(acc, ring[d], b_row, ntiles, chunk_at(c0 + d) * 128, t);
            }
        }
        store(acc, pass, rows, ntiles, n_first);
#else
        // stream chunk c: row block c / chunks, its chunk (c % chunks) in the block's walking order
        const int stream = row_blocks * chunks;
        const auto stream_chunk = [&](int c) {
            const int block = c / chunks, in_block = c - block * chunks, at = in_block + start_of(block);
            return at < chunks ? at : at - chunks;
        };
        // the chunk's place in the weights: its row block's first chunk + its place in the block
        const auto stream_at = [&](int c) {
            return first + (long long)(c / chunks) * block_stride * chunks + stream_chunk(c);
        };
        TiledChunk ring[TILED_DEPTH];
#pragma unroll
        for (int d = 0; d + 1 < TILED_DEPTH; ++d)
            if (d < stream) ring[d] = tiled_load(words, scales, stream_at(d), lane, g);
        for (int c0 = 0; c0 < stream; c0 += TILED_DEPTH) {  // warp-uniform
#pragma unroll
            for (int d = 0; d < TILED_DEPTH; ++d) {
                const int ahead = c0 + d + TILED_DEPTH - 1;  // refills the slot used last
                if (ahead < stream)
                    ring[(d + TILED_DEPTH - 1) % TILED_DEPTH] = tiled_load(words, scales, stream_at(ahead), lane, g);
                const int c = c0 + d;
                if (c < stream) {
                    tiled_chunk(acc, ring[d], b_row, ntiles, stream_chunk(c) * 128, t);
                    if ((c + 1) % chunks == 0 && c + 1 < stream) {  // a row block done
#if TILED_FUSE_SILU
#pragma unroll
                        for (int j = 0; j < TILED_NTILES; ++j)
#pragma unroll
                            for (int v = 0; v < 4; ++v) gate_acc[j][v] = acc[j][v];
#else
                        store(acc, pass, rows, ntiles, n_first + 16 * (c / chunks));
#endif
#pragma unroll
                        for (int j = 0; j < TILED_NTILES; ++j)
#pragma unroll
                            for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
                    }
                }
            }
        }
#if TILED_FUSE_SILU
        store_silu(gate_acc, acc, pass, rows, ntiles, n_first);
#else
        store(acc, pass, rows, ntiles, n_first + 16 * (row_blocks - 1));
#endif
#endif
#endif
    }
}

#if !TILED_FUSE_SILU  // the pair kernel has no fused SiLU·mul: its fused form was not bit-equal to the
                      // unfused pair (s9 GPU suite, 40 tokens) and slower than tiled1_nc_rot anyway
// moe_gemv_int4_tiled_pair: each warp two 16-row blocks side by side over one walk of K (rows n0 .. n0 + 31):
// per chunk step the activation fragments, and the −136·Σx mma (the same for every row), are built once
// for both blocks, where moe_gemv_int4_tiled builds them per block. A ring of TILED_DEPTH chunk pairs.
// The sums differ from moe_gemv_int4_tiled's by fp32 rounding (the −136 terms are added first).
__device__ __forceinline__ void tiled_pair_step(float (&acc_a)[4], float (&acc_b)[4], const TiledChunk& ca,
                                                const TiledChunk& cb, const bf16* b_row, int k_chunk, int t) {
    const unsigned lo_a[4] = {ca.lo.x, ca.lo.y, ca.lo.z, ca.lo.w}, hi_a[4] = {ca.hi.x, ca.hi.y, ca.hi.z, ca.hi.w};
    const unsigned lo_b[4] = {cb.lo.x, cb.lo.y, cb.lo.z, cb.lo.w}, hi_b[4] = {cb.hi.x, cb.hi.y, cb.hi.z, cb.hi.w};
    const unsigned sw_a[4] = {ca.scales.x, ca.scales.y, ca.scales.z, ca.scales.w};
    const unsigned sw_b[4] = {cb.scales.x, cb.scales.y, cb.scales.z, cb.scales.w};
    const unsigned neg136[4] = {TILED_NEG136, TILED_NEG136, TILED_NEG136, TILED_NEG136};
#pragma unroll
    for (int group = 0; group < 4; ++group) {
        const uint4 xv = *reinterpret_cast<const uint4*>(b_row + k_chunk + 32 * group + 8 * t);
        const unsigned x[4] = {xv.x, xv.y, xv.z, xv.w};
        unsigned b[2][2];
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            b[p][0] = (x[p] & 0xFFFFu) | (x[p + 2] << 16);
            b[p][1] = (x[p] >> 16) | (x[p + 2] & 0xFFFF0000u);
        }
        float neg[4] = {0.f, 0.f, 0.f, 0.f};  // −136·Σx over the group's k, per token column
        mma_bf16_16816(neg, neg136, b[0][0], b[0][1]);
        mma_bf16_16816(neg, neg136, b[1][0], b[1][1]);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const unsigned* lo = half ? lo_b : lo_a;
            const unsigned* hi = half ? hi_b : hi_a;
            const unsigned* sw = half ? sw_b : sw_a;
            float* acc = half ? acc_b : acc_a;
            float sum[4] = {neg[0], neg[1], neg[2], neg[3]};
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const unsigned a[4] = {tiled_pair(lo[group], 2 * p), tiled_pair(hi[group], 2 * p),
                                       tiled_pair(lo[group], 2 * p + 1), tiled_pair(hi[group], 2 * p + 1)};
                mma_bf16_16816(sum, a, b[p][0], b[p][1]);
            }
            const float s_lo = (group & 1) ? bf16_high(sw[group >> 1]) : bf16_low(sw[group >> 1]);
            const float s_hi = (group & 1) ? bf16_high(sw[2 + (group >> 1)]) : bf16_low(sw[2 + (group >> 1)]);
            acc[0] += s_lo * sum[0];
            acc[1] += s_lo * sum[1];
            acc[2] += s_hi * sum[2];
            acc[3] += s_hi * sum[3];
        }
    }
}

extern "C" __global__ void __launch_bounds__(TILED_WARPS * 32)
moe_gemv_int4_tiled_pair(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                         const void* __restrict__ weight, const void* __restrict__ scale,
                         const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                         const int* __restrict__ num_tiles, const int* __restrict__ offsets, int dense_rows,
                         bf16* __restrict__ out, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp_index = blockIdx.x * TILED_WARPS + warp;
    const int out_columns = N, n0 = warp_index * 32, second = 1;  // block B: the next 16 rows
    if (n0 >= out_columns) return;  // whole warps only: the mma is warp-collective
    int expert, row_begin, row_end;
    if (!gemv_block_rows(tile_expert, tile_row, num_tiles, offsets, dense_rows, expert, row_begin, row_end)) return;
    const int chunks = K / 128;
    // a lone last row block (N / 16 odd) walks block A twice and drops B
    const bool has_b = n0 + 16 < N;
    const long long first_a = ((long long)expert * (N / 16) + n0 / 16) * chunks;
    const long long first_b = has_b ? first_a + (long long)second * chunks : first_a;
    const int start = TILED_ROTATE ? (int)(warp_index * 37LL % chunks) : 0;  // one walk: both blocks alike
    const auto chunk_at = [&](int c) { return c + start < chunks ? c + start : c + start - chunks; };
    const unsigned* words = (const unsigned*)weight;
    const bf16* scales = (const bf16*)scale;
    const auto put = [&](const float (&acc)[4], int pass, int rows, int column0) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const int r = 2 * t + (v & 1), n = column0 + g + 8 * (v >> 1);
            if (r < rows) out[(long long)(pass + r) * out_columns + n] = __float2bfloat16_rn(acc[v]);
        }
    };
    for (int pass = row_begin; pass < row_end; pass += 8) {
        const int rows = min(8, row_end - pass);  // warp-uniform
        const bf16* b_row = gemv_activation_row(a, sorted_slots, top_k, pass + min(g, rows - 1), K);
        float acc_a[4] = {0.f, 0.f, 0.f, 0.f}, acc_b[4] = {0.f, 0.f, 0.f, 0.f};
        TiledChunk ring_a[TILED_DEPTH], ring_b[TILED_DEPTH];
#pragma unroll
        for (int d = 0; d + 1 < TILED_DEPTH; ++d)
            if (d < chunks) {
                ring_a[d] = tiled_load(words, scales, first_a + chunk_at(d), lane, g);
                ring_b[d] = tiled_load(words, scales, first_b + chunk_at(d), lane, g);
            }
        for (int c0 = 0; c0 < chunks; c0 += TILED_DEPTH) {  // warp-uniform
#pragma unroll
            for (int d = 0; d < TILED_DEPTH; ++d) {
                const int ahead = c0 + d + TILED_DEPTH - 1;  // refills the slot used last
                if (ahead < chunks) {
                    ring_a[(d + TILED_DEPTH - 1) % TILED_DEPTH] = tiled_load(words, scales, first_a + chunk_at(ahead), lane, g);
                    ring_b[(d + TILED_DEPTH - 1) % TILED_DEPTH] = tiled_load(words, scales, first_b + chunk_at(ahead), lane, g);
                }
                if (c0 + d < chunks) tiled_pair_step(acc_a, acc_b, ring_a[d], ring_b[d], b_row, chunk_at(c0 + d) * 128, t);
            }
        }
        put(acc_a, pass, rows, n0);
        if (has_b) put(acc_b, pass, rows, n0 + 16);
    }
}
#endif  // !TILED_FUSE_SILU
#endif

// Dense weight (expert 0) → bf16 [N, K] for cuBLAS (prefill-sized FP8 / INT4 linears); one
// WEIGHT_CHUNK per thread, grid-stride.
extern "C" __global__ void moe_dequantize(const void* __restrict__ weight, const void* __restrict__ scale, int N, int K,
                                          bf16* __restrict__ out) {
    const long long chunks = (long long)N * (K / WEIGHT_CHUNK);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < chunks; i += (long long)gridDim.x * blockDim.x) {
        const int n = (int)(i / (K / WEIGHT_CHUNK)), k = (int)(i % (K / WEIGHT_CHUNK)) * WEIGHT_CHUNK;
        float w[WEIGHT_CHUNK];
        weight_decode(weight_raw(weight, 0, n, k, N, K), scale, 0, n, k, N, K, w);
#pragma unroll
        for (int c = 0; c < WEIGHT_CHUNK; c += 8) store8(out + (long long)n * K + k + c, w + c);
    }
}

// out[t, :] = Σ_j weights[t, j] · y[slot_pos[t·k + j], :]  (+ shared[t, :] when given), bf16 out.
// COMBINE_PDL=1 (OPENINFER_MOE_COMBINE_PDL): launched with programmatic stream serialization right after the down
// projection (whose Hopper build lets dependents launch at its start), each block waits in griddepcontrol.wait for
// it to finish before reading y: the launch and block start overlap the down projection's last wave.
#ifndef COMBINE_PDL
#define COMBINE_PDL 0
#endif
extern "C" __global__ void moe_combine(const bf16* __restrict__ y, const int* __restrict__ slot_pos,
                                       const float* __restrict__ weights, const bf16* __restrict__ shared,
                                       int top_k, int hidden, bf16* __restrict__ out) {
#if COMBINE_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    const int t = blockIdx.x;  // gridDim.y blocks share a token's columns (1: one block walks them all)
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < hidden; c += gridDim.y * blockDim.x) {
        float sum = 0.f;
        for (int j = 0; j < top_k; ++j)
            sum += weights[t * top_k + j] * __bfloat162float(y[(long long)slot_pos[t * top_k + j] * hidden + c]);
        if (shared) sum = round_bf16(sum) + __bfloat162float(shared[(long long)t * hidden + c]);
        out[(long long)t * hidden + c] = __float2bfloat16_rn(sum);
    }
}
