// MLA absorbed decode for Hopper (sm_90): mla.cu's mla_attention_mma_shared contract (per step token
// and 16 heads, attention of the absorbed queries [q_latent | q_pe] over the token's cached latents,
// output o_latent or a context split's partials for mla_combine_splits_*) with the latent tiles fed by
// TMA into a ring of TMA_STAGES stages.
//
// One CTA = (step token, 16 heads, context split), 4 warps, no producer warp: thread 0 keeps the ring
// full (each stage's boxes counted on its mbarrier; the block table's page ids of the tile it issues
// next are loaded a tile ahead, so the issue never waits on them).
//
//   cache [pages, block_size, LATENT] bf16 as a 3-d tensor map (64 columns, 1, cache row), box
//   64 columns x 16 rows, 128-byte swizzle: a tile of TMA_KEYS latents is LATENT / 64 column blocks of
//   TMA_KEYS rows x 128 bytes, chunk c of row r at chunk c ^ (r % 8) (sm90.cuh `swizzled`), so the
//   ldmatrix rows of 8 neighbouring keys fall in 8 different bank groups.
//
//   smem: [stage s: column block b: TMA_KEYS x 128 B] ... [score exchange] [mbarriers]
//   (TMA_ROW_BOXES: whole-row boxes of 16 x LATENT bf16, below)
//
// Per tile the four warps split the score work by latent dims, not keys: warp w computes S_w =
// Q[:, dims_w] · K[keys, dims_w]^T for all TMA_KEYS keys (TMA_KEYS / 8 independent mma chains of
// LATENT / 64 steps; the query fragments of its dims live in registers the whole kernel), the four
// partial score tiles are summed through shared memory in a fixed order (every warp gets the same bits),
// and each warp then runs the online softmax for the 16 heads itself (no exchange of maxima or sums,
// P stays in registers as the A operand) and accumulates its quarter of the output dims,
// O[:, quarter] += P · c_kv[keys, quarter] (V fragments by ldmatrix.trans). Two block barriers per tile:
// after the partial scores are stored, and before the stage is handed back to TMA.
//
// TMA_CLUSTER = C > 1 (2, 4, 8 or 16): the C context splits of a (token, 16 heads) form one thread-block cluster
// and are combined on chip: each CTA leaves its normalised partial output and (max, sum) per head in its
// own shared memory (the drained ring), and after a cluster barrier CTA rank r reads every CTA's slice r of
// the output dims through distributed shared memory and writes o_latent itself (no partials in global
// memory, no combine launch). Grid z is exactly C; the same weights and order as mla_combine_splits.
//
// balance_slots > 0 (with num_splits > 1; not in clusters): splits balanced over a ragged batch. The launch's
// total context C over its rows gives one split length L = C / balance_slots (the CTAs that run at once per
// head block); a token of context c takes n = clamp(round(c / L), 1, num_splits) equal splits, so long contexts
// spread over more CTAs and short ones stay whole. A token with n = 1 writes o_latent itself and marks its
// split 0 (max = +inf), which the combine kernels skip.
//
// Rows of a tile past the split's end are either not copied (whole 16-row boxes past it) or belong to
// the sequence's last page; their scores are masked (a select: any bits there are dropped) and their
// V fragment halves zeroed, so stale or uninitialised shared memory never reaches the output.
#include "mma.cuh"        // mma_bf16_16816, ldmatrix, pack_bf16x2
#include "sm90.cuh"       // mbarriers, TMA, TensorMap, swizzled
#include "mla_split.cuh"  // mla_split_context

#ifndef KV_LORA
#define KV_LORA 512
#endif
#ifndef ROPE_DIM
#define ROPE_DIM 64
#endif
#ifndef TMA_KEYS
#define TMA_KEYS 32  // keys per tile: 16, 32 or 64
#endif
#ifndef TMA_STAGES
#define TMA_STAGES 2  // tiles in the ring
#endif
// 1: one block barrier per tile, not two. The partial scores go to one of two exchange buffers by tile parity,
// and thread 0 refills the stage of tile i - 1 right after tile i's barrier (every warp has then finished
// tile i - 1's P V), instead of a second barrier at the end of each tile; a refill is then issued half a tile
// later (a ring of at least 2 stages).
#ifndef TMA_ONE_BARRIER
#define TMA_ONE_BARRIER 0
#endif
// 1: whole-row boxes. The cache map is (64 columns, LATENT / 64 column blocks, cache row) and one box brings 16
// whole latent rows (18 KB of contiguous cache, one TMA per 16 keys instead of LATENT / 64); the tile is then
// rows of LATENT bf16, each 128-byte segment s of it swizzled by s % 8 (s = row · LATENT / 64 + column block).
#ifndef TMA_ROW_BOXES
#define TMA_ROW_BOXES 0
#endif
#ifndef TMA_CLUSTER
#define TMA_CLUSTER 1  // > 1: the context splits of a (token, head block) combined in a cluster of this many CTAs
                      // (16: a non-portable cluster size, allowed by the launcher)
#endif
#define LATENT (KV_LORA + ROPE_DIM)
#include "mla_latent.cuh"  // mla_latent_row, mla_rope_pair (TMA_FUSED_WRITE)
#define TMA_HEADS 16
#define TMA_WARPS 4
#define TMA_THREADS (32 * TMA_WARPS)
#define TMA_BOX_ROWS 16                                 // rows per TMA box (the cache block size is a multiple)
#define LATENT_BLOCKS (LATENT / 64)                     // 128-byte column blocks of a latent row
#define SCORE_STEPS (LATENT / 16 / TMA_WARPS)           // each warp's 16-dim mma steps of the scores
#define OUT_DIMS (KV_LORA / TMA_WARPS)                  // each warp's output dims
#define KEY_TILES (TMA_KEYS / 8)                        // n8 tiles of scores per warp
#define TILE_BYTES (LATENT_BLOCKS * TMA_KEYS * 128)
#define BOX_BYTES (TMA_BOX_ROWS * 128)
#define EXCHANGE_FLOAT4S (TMA_WARPS * KEY_TILES * 32)  // each warp's partial scores, a float4 per lane and n8 tile
#define EXCHANGE_BYTES ((1 + TMA_ONE_BARRIER) * EXCHANGE_FLOAT4S * 16)
// 1: the block's 16 query rows [q_latent | q_pe] staged in shared memory by 16-byte loads (coalesced: 9 per thread),
// each warp's A fragments then by ldmatrix, instead of 36 scattered 4-byte global loads per thread. The same values.
#ifndef TMA_Q_TILE
#define TMA_Q_TILE 0
#endif
#define Q_ROW (LATENT + 8)  // bf16 per staged query row: 1,168 bytes = 73 x 16, ldmatrix rows in distinct banks
#define Q_TILE_BYTES (TMA_Q_TILE ? 16 + TMA_HEADS * Q_ROW * 2 : 0)
#define TMA_SMEM (1024 + TMA_STAGES * TILE_BYTES + EXCHANGE_BYTES + 8 * TMA_STAGES + Q_TILE_BYTES)
static_assert(LATENT % 64 == 0 && (LATENT / 16) % TMA_WARPS == 0, "latent rows of whole 64-column blocks, split 4 ways");
static_assert(KV_LORA % (16 * TMA_WARPS) == 0, "output quarters of 16-dim steps");
static_assert(TMA_KEYS == 16 || TMA_KEYS == 32 || TMA_KEYS == 64, "tiles of 16, 32 or 64 keys");
static_assert(TMA_STAGES >= 1 + TMA_ONE_BARRIER, "a ring of at least one stage (two with one barrier per tile)");
#define CLUSTER_SLICE (KV_LORA / TMA_CLUSTER)  // output dims each cluster CTA combines
static_assert(TMA_CLUSTER == 1 || ((TMA_CLUSTER == 2 || TMA_CLUSTER == 4 || TMA_CLUSTER == 8 || TMA_CLUSTER == 16) &&
                                   TMA_STAGES * TILE_BYTES >= TMA_HEADS * (KV_LORA + 2) * 4),
              "clusters of 2, 4, 8 or 16 splits; the ring holds a CTA's partial output and (max, sum)");
#if TMA_CLUSTER > 1
#define TMA_CLUSTER_ATTRIBUTE __cluster_dims__(1, 1, TMA_CLUSTER)
#else
#define TMA_CLUSTER_ATTRIBUTE
#endif

// A float of cluster CTA `cta`'s shared memory at the offset of this CTA's shared-window address `addr`.
__device__ __forceinline__ float cluster_load(u32 addr, u32 cta) {
    float value;
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %1, %2;\nld.shared::cluster.f32 %0, [remote];\n}\n"
        : "=f"(value) : "r"(addr), "r"(cta));  // volatile: kept after the cluster barrier; no clobber: loads overlap
    return value;
}

// Shared-window byte address of latent dim `dim` (a multiple of 8) of key row `row` in the tile at `tile`.
__device__ __forceinline__ u32 latent_at(u32 tile, int row, int dim) {
#if TMA_ROW_BOXES
    const int segment = row * LATENT_BLOCKS + (dim >> 6);
    return tile + segment * 128 + ((((dim & 63) >> 3) ^ (segment & 7)) << 4);
#else
    return tile + (dim >> 6) * (TMA_KEYS * 128) + swizzled(row, (dim & 63) >> 3);
#endif
}

__device__ __forceinline__ void ldmatrix_x4_at(unsigned (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans_at(unsigned (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The cache rows of the 16-row boxes of the tile starting at context position key0 (-1: past `end`, not copied).
__device__ __forceinline__ void tile_rows(int (&rows)[TMA_KEYS / TMA_BOX_ROWS], const int* __restrict__ table,
                                          int block_size, int key0, int end) {
#pragma unroll
    for (int b = 0; b < TMA_KEYS / TMA_BOX_ROWS; ++b) {
        const int pos = key0 + b * TMA_BOX_ROWS;
        rows[b] = pos < end ? table[pos / block_size] * block_size + pos % block_size : -1;
    }
}

// The tile's boxes into `tile`, counted on `bar` (issued by one thread).
__device__ __forceinline__ void issue_tile(u32 tile, u32 bar, const int (&rows)[TMA_KEYS / TMA_BOX_ROWS],
                                           const TensorMap* map) {
    int boxes = 0;
#pragma unroll
    for (int b = 0; b < TMA_KEYS / TMA_BOX_ROWS; ++b) boxes += rows[b] >= 0;
    mbar_arrive_expect_bytes(bar, boxes * LATENT_BLOCKS * BOX_BYTES);
#pragma unroll
    for (int b = 0; b < TMA_KEYS / TMA_BOX_ROWS; ++b) {
        if (rows[b] < 0) continue;
#if TMA_ROW_BOXES
        tma_load_3d(tile + b * LATENT_BLOCKS * BOX_BYTES, map, 0, 0, rows[b], bar);
#else
#pragma unroll
        for (int c = 0; c < LATENT_BLOCKS; ++c)
            tma_load_3d(tile + c * (TMA_KEYS * 128) + b * BOX_BYTES, map, 64 * c, 0, rows[b], bar);
#endif
    }
}

// Two bf16 of a register kept where their keys are valid (below `end`), zeroed else.
__device__ __forceinline__ unsigned key_pair_mask(int key, int end) {
    return (key < end ? 0x0000ffffu : 0u) | (key + 1 < end ? 0xffff0000u : 0u);
}

// 1: mla_write_latent folded in, for steps of one new token per sequence (token_list null, row t = step token t):
// the split that holds the token's own position computes its latent row (RMS-normed c_kv, rotated k_pe: mla_latent_row,
// the write kernel's sums) from kv_a, head block 0 stores it at slot_mapping[t], and the tile that holds the position
// takes the row in shared memory over whatever the TMA copy brought (the cache slot may not be written yet: no other
// CTA of the launch waits on it). Every CTA reads q's rope dims unrotated, q_token_stride elements per row (a row view
// of the projection), and rotates them in registers (mla_rope_pair, the write kernel's rounding). The same bits as the
// latent write + attention.
#ifndef TMA_FUSED_WRITE
#define TMA_FUSED_WRITE 0
#endif

// A warp's query A fragments for its score steps, without staging (TMA_Q_TILE 0): part p of step kk holds dims
// d, d + 1 (d = its step's 16-dim block + pair + 8 (p >> 1)) of head row group (p even) or group + 8 (p odd);
// word(d, high) loads that 4-byte word (high: the row of group + 8). One walk for the plain and the fused-write loads.
template <typename QueryWord>
__device__ __forceinline__ void query_fragments(unsigned (&qf)[SCORE_STEPS][4], int warp, int pair, QueryWord word) {
#pragma unroll
    for (int kk = 0; kk < SCORE_STEPS; ++kk) {
        const int dim = (warp * SCORE_STEPS + kk) * 16 + pair;
#pragma unroll
        for (int part = 0; part < 4; ++part) qf[kk][part] = word(dim + 8 * (part >> 1), (part & 1) != 0);
    }
}

// grid (T, ceil(num_heads / 16), num_splits), TMA_THREADS threads, TMA_SMEM bytes of dynamic shared memory.
// Arguments as mla_attention_mma_shared's, then the cache's tensor map (cache_map).
extern "C" __global__ void TMA_CLUSTER_ATTRIBUTE __launch_bounds__(TMA_THREADS)
mla_attention_tma(const bf16* __restrict__ q_latent, const bf16* __restrict__ q, int q_stride, int q_pe_offset,
                  const bf16* __restrict__ cache, const int* __restrict__ block_tables, int max_blocks_per_seq,
                  int block_size, const int* __restrict__ query_start, int num_seqs,
                  const int* __restrict__ positions, int num_heads, float scale, bf16* __restrict__ out,
                  int num_splits, float* __restrict__ partial_o, float* __restrict__ partial_ml,
                  const int* __restrict__ token_list, int balance_slots,
                  const bf16* __restrict__ kv_a, int kv_a_stride, const bf16* __restrict__ norm_weight, float eps,
                  const int* __restrict__ slot_mapping, const float* __restrict__ cos_table,
                  const float* __restrict__ sin_table, int q_token_stride, const __grid_constant__ TensorMap cache_map) {
    extern __shared__ uint4 smem_raw[];
    const u32 base = ((u32)__cvta_generic_to_shared(smem_raw) + 1023) & ~1023u;
    float4* exchange = reinterpret_cast<float4*>(reinterpret_cast<char*>(smem_raw) +
                                                 (base - (u32)__cvta_generic_to_shared(smem_raw)) +
                                                 TMA_STAGES * TILE_BYTES);  // [warp][n8 tile][lane]
    const u32 bars = base + TMA_STAGES * TILE_BYTES + EXCHANGE_BYTES;        // [stage] full barriers
    const u32 q_tile = (bars + 8 * TMA_STAGES + 15) & ~15u;                     // TMA_Q_TILE: [16][Q_ROW] bf16
    const int t = blockIdx.x;
    const int step_token = token_list ? token_list[t] : t;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head0 = blockIdx.y * TMA_HEADS;
    const int heads = min(TMA_HEADS, num_heads - head0);
    const int split = blockIdx.z;
    int begin, end;
    const int* table = mla_split_context<TMA_KEYS>(query_start, num_seqs, block_tables, max_blocks_per_seq, positions,
                                                   step_token, num_splits, split, begin, end);
    const int context = positions[step_token] + 1;
    // TMA_FUSED_WRITE: the splits cut the cached keys (context − 1) and the last one also takes the token's own row,
    // which comes from shared memory (no copy): a decode context of n splits' whole tiles + 1 no longer rounds every
    // split up by a tile (1,025 keys over 16 splits: 64 keys each, not 96 over 11).
    const int split_context = TMA_FUSED_WRITE ? max(1, context - 1) : context;
    {
        const int per_split = ((split_context + num_splits - 1) / num_splits + TMA_KEYS - 1) / TMA_KEYS * TMA_KEYS;
        begin = split * per_split;
        end = min(split_context, begin + per_split);
    }
#if TMA_CLUSTER == 1  // (clusters never balance: their splits always combine on chip)
    bool whole = num_splits == 1;  // this split is the token's only one: o_latent written here
    if (balance_slots > 0 && num_splits > 1) {
        __shared__ int warp_totals[TMA_WARPS];
        int total = 0;
        for (int i = threadIdx.x; i < gridDim.x; i += TMA_THREADS) total += positions[token_list ? token_list[i] : i] + 1;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        if (lane == 0) warp_totals[warp] = total;
        __syncthreads();
        total = 0;
#pragma unroll
        for (int w = 0; w < TMA_WARPS; ++w) total += warp_totals[w];
        const int length = max(TMA_KEYS, (total + balance_slots - 1) / balance_slots);
        const int n = min(num_splits, max(1, (split_context + length / 2) / length));
        const int per_split = ((split_context + n - 1) / n + TMA_KEYS - 1) / TMA_KEYS * TMA_KEYS;
        begin = split * per_split;
        end = min(split_context, begin + per_split);
    }
#endif
    if (TMA_FUSED_WRITE && begin < end && end == split_context) end = context;  // the last split: + the own row
#if TMA_CLUSTER == 1
    if (balance_slots > 0 && num_splits > 1) whole = begin == 0 && end == context;
#endif
    const int num_tiles = begin < end ? (end - begin + TMA_KEYS - 1) / TMA_KEYS : 0;  // 0: an empty split
    if (threadIdx.x == 0 && num_tiles > 0) {
        prefetch_tensor_map(&cache_map);
        for (int s = 0; s < TMA_STAGES; ++s) mbar_init(bars + 8 * s, 1);
        mbar_init_fence();
    }
    if (TMA_CLUSTER == 1 && begin >= end) {  // a split past a short context (num_splits > 1): its (max, sum) say empty
        for (int h = threadIdx.x; h < heads; h += TMA_THREADS) {
            const long long head = (long long)t * num_heads + head0 + h;
            partial_ml[(head * num_splits + split) * 2] = -INFINITY;
            partial_ml[(head * num_splits + split) * 2 + 1] = 0.f;
        }
        return;  // block-uniform
    }
    if (threadIdx.x == 0 && num_tiles > 0) {
        for (int i = 0; i < TMA_STAGES && i < num_tiles; ++i) {
            if (TMA_FUSED_WRITE && begin + i * TMA_KEYS == context - 1) break;  // the own row alone: from shared memory
            int rows[TMA_KEYS / TMA_BOX_ROWS];
            tile_rows(rows, table, block_size, begin + i * TMA_KEYS, end);
            issue_tile(base + i * TILE_BYTES, bars + 8 * i, rows, &cache_map);
        }
    }
    const int group = lane >> 2, pair = (lane & 3) * 2;
#if TMA_FUSED_WRITE
    __shared__ __align__(16) bf16 own_latent[LATENT];
    __shared__ float own_scratch[32];
    const int own_position = positions[step_token];
    const bool own_row = end == own_position + 1;  // this split holds the token's own position (block-uniform)
    const float* cos_row = cos_table + (long long)own_position * (ROPE_DIM / 2);
    const float* sin_row = sin_table + (long long)own_position * (ROPE_DIM / 2);
#endif
    // this warp's query A fragments: heads group, group + 8; dims of its score steps (zeros past `heads`)
    unsigned qf[SCORE_STEPS][4];
#if TMA_Q_TILE
    // the 16 query rows' global loads first, all in flight (q_latent: 8 x 16 bytes a thread; q_pe: one 16-byte piece
    // a thread, with its rope partner under the fused write), stored to shared memory after the own row
    constexpr int Q_ITEMS = TMA_HEADS * (KV_LORA / 8) / TMA_THREADS;
    static_assert(TMA_HEADS * (KV_LORA / 8) % TMA_THREADS == 0 && TMA_HEADS * (ROPE_DIM / 8) == TMA_THREADS,
                  "whole 16-byte pieces of the query rows per thread");
    uint4 staged[Q_ITEMS];
#pragma unroll
    for (int k = 0; k < Q_ITEMS; ++k) {
        const int i = threadIdx.x + k * TMA_THREADS, h = i / (KV_LORA / 8), d = (i % (KV_LORA / 8)) * 8;
        staged[k] = h < heads ? *reinterpret_cast<const uint4*>(q_latent + ((long long)t * num_heads + head0 + h) *
                                                                KV_LORA + d)
                              : make_uint4(0u, 0u, 0u, 0u);
    }
    const int pe_head = threadIdx.x / (ROPE_DIM / 8), pe_dim = (threadIdx.x % (ROPE_DIM / 8)) * 8;
    uint4 pe_self = make_uint4(0u, 0u, 0u, 0u);
#if TMA_FUSED_WRITE
    uint4 pe_other = make_uint4(0u, 0u, 0u, 0u);
    const int half = ROPE_DIM / 2, pe_pair = pe_dim < half ? pe_dim : pe_dim - half;
    float pe_cos[8], pe_sin[8];
    if (pe_head < heads) {
        const bf16* pe = q + (long long)t * q_token_stride + (long long)(head0 + pe_head) * q_stride + q_pe_offset;
        pe_self = *reinterpret_cast<const uint4*>(pe + pe_dim);
        pe_other = *reinterpret_cast<const uint4*>(pe + (pe_dim < half ? pe_dim + half : pe_dim - half));
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        pe_cos[e] = cos_row[pe_pair + e];
        pe_sin[e] = sin_row[pe_pair + e];
    }
#else
    if (pe_head < heads)
        pe_self = *reinterpret_cast<const uint4*>(q + ((long long)t * num_heads + head0 + pe_head) * q_stride +
                                                  q_pe_offset + pe_dim);
#endif
#elif TMA_FUSED_WRITE
    {  // q_latent as it is; q's rope dims from the projection's rows, rotated here
        const int half = ROPE_DIM / 2;
        query_fragments(qf, warp, pair, [&](int d, bool high) {
            const int h = high ? group + 8 : group;
            unsigned value = 0u;
            if (h < heads && d < KV_LORA) {
                value = *reinterpret_cast<const unsigned*>(q_latent + ((long long)t * num_heads + head0 + h) * KV_LORA + d);
            } else if (h < heads) {
                const int r = d - KV_LORA, i = r < half ? r : r - half;  // r even: dims r, r + 1 of the pair's half
                const bf16* pe = q + (long long)t * q_token_stride + (long long)(head0 + h) * q_stride + q_pe_offset;
                const __nv_bfloat162 self = *reinterpret_cast<const __nv_bfloat162*>(pe + r);
                const __nv_bfloat162 other = *reinterpret_cast<const __nv_bfloat162*>(pe + (r < half ? r + half : r - half));
                float out[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float x_self = __bfloat162float(e ? self.y : self.x);
                    const float x_other = __bfloat162float(e ? other.y : other.x);
                    out[e] = r < half ? mla_rope_pair(x_self, x_other, cos_row[i + e], sin_row[i + e]).x
                                      : mla_rope_pair(x_other, x_self, cos_row[i + e], sin_row[i + e]).y;
                }
                value = pack_bf16x2(out[0], out[1]);
            }
            return value;
        });
    }
#else
    {
        const long long head_lo = (long long)t * num_heads + head0 + group, head_hi = head_lo + 8;
        query_fragments(qf, warp, pair, [&](int d, bool high) {
            const bool valid = (high ? group + 8 : group) < heads;
            const long long head = high ? head_hi : head_lo;
            const bf16* src = d < KV_LORA ? q_latent + head * KV_LORA + d
                                          : q + head * q_stride + q_pe_offset + (d - KV_LORA);
            return valid ? *reinterpret_cast<const unsigned*>(src) : 0u;
        });
    }
#endif
#if TMA_FUSED_WRITE
    if (own_row) {  // computed while the first tiles and the query loads are in flight
        mla_latent_row(kv_a + (long long)step_token * kv_a_stride, norm_weight, eps, cos_row, sin_row, own_latent, true,
                       own_scratch);
        __syncthreads();
        const int slot = slot_mapping[step_token];
        if (blockIdx.y == 0 && slot >= 0 && threadIdx.x < LATENT / 8)  // the cache is written here, never read
            reinterpret_cast<uint4*>(const_cast<bf16*>(cache) + (long long)slot * LATENT)[threadIdx.x] =
                reinterpret_cast<const uint4*>(own_latent)[threadIdx.x];
    }
#endif
#if TMA_Q_TILE
    {
#pragma unroll
        for (int k = 0; k < Q_ITEMS; ++k) {
            const int i = threadIdx.x + k * TMA_THREADS, h = i / (KV_LORA / 8), d = (i % (KV_LORA / 8)) * 8;
            const uint4 v = staged[k];
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(q_tile + (h * Q_ROW + d) * 2), "r"(v.x),
                         "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
        }
        uint4 v = pe_self;
#if TMA_FUSED_WRITE  // q's rope dims rotated on the way (8 of a half with their 8 partners)
        {
            const bf16* self8 = reinterpret_cast<const bf16*>(&pe_self);
            const bf16* other8 = reinterpret_cast<const bf16*>(&pe_other);
            unsigned out[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                float rotated[2];
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const float x_self = __bfloat162float(self8[e + k]), x_other = __bfloat162float(other8[e + k]);
                    rotated[k] = pe_dim < half ? mla_rope_pair(x_self, x_other, pe_cos[e + k], pe_sin[e + k]).x
                                               : mla_rope_pair(x_other, x_self, pe_cos[e + k], pe_sin[e + k]).y;
                }
                out[e / 2] = pack_bf16x2(rotated[0], rotated[1]);
            }
            v = pe_head < heads ? make_uint4(out[0], out[1], out[2], out[3]) : make_uint4(0u, 0u, 0u, 0u);
        }
#endif
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(q_tile + (pe_head * Q_ROW + KV_LORA + pe_dim) * 2),
                     "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
        __syncthreads();
        const int a_row = lane & 15, a_col = 8 * (lane >> 4);  // A fragment rows (heads) and 8-dim halves
#pragma unroll
        for (int kk = 0; kk < SCORE_STEPS; ++kk)
            ldmatrix_x4_at(qf[kk], q_tile + (a_row * Q_ROW + (warp * SCORE_STEPS + kk) * 16 + a_col) * 2);
    }
#endif
    float acc[OUT_DIMS / 8][4];
#pragma unroll
    for (int j = 0; j < OUT_DIMS / 8; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[j][v] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    // ldmatrix lanes: score B fragments (keys x 16 dims, two n8 tiles per x4), V fragments (16 keys x 16 dims)
    const int score_key = (lane & 7) + 8 * (lane >> 4), score_dim = 8 * ((lane >> 3) & 1);
    const int value_key = (lane & 7) + 8 * ((lane >> 3) & 1), value_dim = warp * OUT_DIMS + 8 * (lane >> 4);
    int next_rows[TMA_KEYS / TMA_BOX_ROWS];
    __syncthreads();  // the barriers' initialisation
    for (int i = 0; i < num_tiles; ++i) {
        const int stage = i % TMA_STAGES, key0 = begin + i * TMA_KEYS;
        const u32 tile = base + stage * TILE_BYTES;
        // TMA_FUSED_WRITE: a tile of the own row alone (the last split's, at context − 1) is never copied: its row is
        // stored into the free stage below, with no wait
        const bool own_only = TMA_FUSED_WRITE && key0 == context - 1;
#if TMA_ONE_BARRIER  // the stage of tile i - 1 takes tile i - 1 + STAGES after this tile's barrier
        const bool refill = threadIdx.x == 0 && i >= 1 && i - 1 + TMA_STAGES < num_tiles &&
                            !(TMA_FUSED_WRITE && key0 + (TMA_STAGES - 1) * TMA_KEYS == context - 1);
        if (refill) tile_rows(next_rows, table, block_size, key0 + (TMA_STAGES - 1) * TMA_KEYS, end);
        float4* tile_exchange = exchange + (i & 1) * EXCHANGE_FLOAT4S;
#else
        const bool refill = threadIdx.x == 0 && i + TMA_STAGES < num_tiles &&
                            !(TMA_FUSED_WRITE && key0 + TMA_STAGES * TMA_KEYS == context - 1);
        if (refill)  // the page ids of the tile this stage takes next, loaded while this one is multiplied
            tile_rows(next_rows, table, block_size, key0 + TMA_STAGES * TMA_KEYS, end);
        float4* tile_exchange = exchange;
#endif
        if (!own_only) mbar_wait(bars + 8 * stage, (i / TMA_STAGES) & 1);
#if TMA_FUSED_WRITE
        // the split's last tile holds the own position: its row from here (over the copy's, or alone: the stage is
        // free, every warp being past the tile that used it last; rows past it are masked as any tile's past `end`)
        if (own_row && i == num_tiles - 1) {
            if (threadIdx.x < LATENT / 8) {
                const uint4 v = reinterpret_cast<const uint4*>(own_latent)[threadIdx.x];
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(latent_at(tile, end - 1 - key0, 8 * threadIdx.x)),
                             "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
            }
            __syncthreads();
        }
#endif
        float part[KEY_TILES][4];
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
            for (int v = 0; v < 4; ++v) part[n][v] = 0.f;
#pragma unroll
        for (int kk = 0; kk < SCORE_STEPS; ++kk) {
            const int dim = (warp * SCORE_STEPS + kk) * 16 + score_dim;
#pragma unroll
            for (int np = 0; np < KEY_TILES / 2; ++np) {
                unsigned kf[4];  // keys 16np .. 16np + 15, this step's 16 dims
                ldmatrix_x4_at(kf, latent_at(tile, 16 * np + score_key, dim));
                mma_bf16_16816(part[2 * np], qf[kk], kf[0], kf[1]);
                mma_bf16_16816(part[2 * np + 1], qf[kk], kf[2], kf[3]);
            }
        }
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n)
            tile_exchange[(warp * KEY_TILES + n) * 32 + lane] =
                make_float4(part[n][0], part[n][1], part[n][2], part[n][3]);
        __syncthreads();
#if TMA_ONE_BARRIER
        if (refill) {  // every warp is past tile i - 1
            const int previous = (i - 1) % TMA_STAGES;
            issue_tile(base + previous * TILE_BYTES, bars + 8 * previous, next_rows, &cache_map);
        }
#endif
        float s[KEY_TILES][4];
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n) {
            float4 sum = tile_exchange[n * 32 + lane];
#pragma unroll
            for (int w = 1; w < TMA_WARPS; ++w) {  // warps in order: the same bits in every warp
                const float4 other = tile_exchange[(w * KEY_TILES + n) * 32 + lane];
                sum.x += other.x;
                sum.y += other.y;
                sum.z += other.z;
                sum.w += other.w;
            }
            s[n][0] = sum.x;
            s[n][1] = sum.y;
            s[n][2] = sum.z;
            s[n][3] = sum.w;
        }
        mla_online_softmax_tile(s, acc, row_max, row_sum, key0, pair, end, scale);
        const bool last = key0 + TMA_KEYS > end;  // rows past `end` in this tile: their V halves zeroed
#pragma unroll
        for (int ks = 0; ks < TMA_KEYS / 16; ++ks) {
            unsigned pf[4];
            pf[0] = pack_bf16x2(s[2 * ks][0], s[2 * ks][1]);
            pf[1] = pack_bf16x2(s[2 * ks][2], s[2 * ks][3]);
            pf[2] = pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
            pf[3] = pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
            const int key = key0 + 16 * ks + pair;
            const unsigned mask_lo = last ? key_pair_mask(key, end) : 0xffffffffu;
            const unsigned mask_hi = last ? key_pair_mask(key + 8, end) : 0xffffffffu;
#pragma unroll
            for (int j = 0; j < OUT_DIMS / 16; ++j) {
                unsigned vf[4];  // keys 16ks .. 16ks + 15, dims 16j .. 16j + 15 of this warp's quarter
                ldmatrix_x4_trans_at(vf, latent_at(tile, 16 * ks + value_key, value_dim + 16 * j));
                mma_bf16_16816(acc[2 * j], pf, vf[0] & mask_lo, vf[1] & mask_hi);
                mma_bf16_16816(acc[2 * j + 1], pf, vf[2] & mask_lo, vf[3] & mask_hi);
            }
        }
#if !TMA_ONE_BARRIER
        __syncthreads();  // every warp is done with this stage and with the exchange
        if (refill) issue_tile(tile, bars + 8 * stage, next_rows, &cache_map);
#endif
    }
#if TMA_CLUSTER > 1
#if TMA_ONE_BARRIER
    __syncthreads();  // every warp is done with the last tile before the ring takes the partials
#endif
    // the ring is drained (the loop's last barrier): this CTA's normalised partial [16][KV_LORA] and (max, sum)
    float* partial = reinterpret_cast<float*>(exchange) - TMA_STAGES * TILE_BYTES / 4;
    float* max_sum = partial + TMA_HEADS * KV_LORA;  // [16][2]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = group + 8 * r;
        const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
#pragma unroll
        for (int j = 0; j < OUT_DIMS / 8; ++j)
            *reinterpret_cast<float2*>(partial + h * KV_LORA + warp * OUT_DIMS + 8 * j + pair) =
                make_float2(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
        if (warp == 0 && pair == 0) {
            max_sum[2 * h] = row_max[r];
            max_sum[2 * h + 1] = row_sum[r];
        }
    }
    cluster_sync();
    {
        // Remote loads are issued together and consumed after (one distributed-shared-memory round trip for the
        // weights, one for the partials), not one load and its use at a time.
        const u32 rank = cluster_cta_rank();
        const u32 partial_at = (u32)__cvta_generic_to_shared(partial), max_sum_at = (u32)__cvta_generic_to_shared(max_sum);
        float* weight = reinterpret_cast<float*>(exchange);  // [16][TMA_CLUSTER]: each split's share of a head
        if (threadIdx.x < TMA_HEADS) {
            const int h = threadIdx.x;
            float split_max[TMA_CLUSTER], split_sum[TMA_CLUSTER];  // each split's (max, sum); sum 0: empty
#pragma unroll
            for (int z = 0; z < TMA_CLUSTER; ++z) {
                split_max[z] = cluster_load(max_sum_at + 8 * h, z);
                split_sum[z] = cluster_load(max_sum_at + 8 * h + 4, z);
            }
            float m = -INFINITY, total = 0.f;
#pragma unroll
            for (int z = 0; z < TMA_CLUSTER; ++z)
                if (split_sum[z] > 0.f) m = fmaxf(m, split_max[z]);
#pragma unroll
            for (int z = 0; z < TMA_CLUSTER; ++z) {
                split_max[z] = split_sum[z] > 0.f ? __expf(split_max[z] - m) * split_sum[z] : 0.f;  // the weight
                total += split_max[z];
            }
            const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
            for (int z = 0; z < TMA_CLUSTER; ++z) weight[h * TMA_CLUSTER + z] = split_max[z] * inv;
        }
        __syncthreads();
        constexpr int ITEMS = TMA_HEADS * CLUSTER_SLICE / TMA_THREADS;  // outputs per thread
        static_assert(TMA_HEADS * CLUSTER_SLICE % TMA_THREADS == 0, "whole outputs per thread");
        float value[ITEMS][TMA_CLUSTER];  // empty splits' partials are zeros (finite): weighted by 0
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            const int i = threadIdx.x + k * TMA_THREADS;
            const int h = i / CLUSTER_SLICE, d = rank * CLUSTER_SLICE + i % CLUSTER_SLICE;
#pragma unroll
            for (int z = 0; z < TMA_CLUSTER; ++z) value[k][z] = cluster_load(partial_at + 4 * (h * KV_LORA + d), z);
        }
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            const int i = threadIdx.x + k * TMA_THREADS;
            const int h = i / CLUSTER_SLICE, d = rank * CLUSTER_SLICE + i % CLUSTER_SLICE;
            float sum = 0.f;
#pragma unroll
            for (int z = 0; z < TMA_CLUSTER; ++z) sum += weight[h * TMA_CLUSTER + z] * value[k][z];
            if (h < heads) out[((long long)t * num_heads + head0 + h) * KV_LORA + d] = __float2bfloat16_rn(sum);
        }
    }
    cluster_sync();  // every CTA's shared memory stays until the cluster's reads are done
#else
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = group + 8 * r;
        if (h >= heads) continue;
        const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
        const long long head = (long long)t * num_heads + head0 + h;
#pragma unroll
        for (int j = 0; j < OUT_DIMS / 8; ++j) {
            const int dim = warp * OUT_DIMS + 8 * j + pair;
            if (whole) {
                *reinterpret_cast<unsigned*>(out + head * KV_LORA + dim) =
                    pack_bf16x2(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
            } else {
                *reinterpret_cast<float2*>(partial_o + (head * num_splits + split) * KV_LORA + dim) =
                    make_float2(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
            }
        }
        if (num_splits > 1 && warp == 0 && pair == 0) {  // a whole token's: +inf, the combine leaves it
            partial_ml[(head * num_splits + split) * 2] = whole ? INFINITY : row_max[r];
            partial_ml[(head * num_splits + split) * 2 + 1] = row_sum[r];
        }
    }
#endif
}
