// Short queries on Hopper (sm_90a): a few new tokens per sequence (a warm prefix's last block, up
// to 64 / GROUP tokens per CTA) over a long paged cache, split over the keys like decode. The
// rows of one CTA are ROW_TOKENS tokens x the GROUP query heads of one KV head (row r = head r %
// GROUP of token r / GROUP): at Qwen3-4B's GQA 4, 16 tokens fill one wgmma M=64 tile, so each K/V
// tile crosses from HBM once for all 64 rows and the tensor cores run wgmma instead of mma.sync.
//
// Grid (num_splits * row_groups, num_kv_heads, num_seqs), 160 threads, two CTAs per SM (up to 3 stages):
//   warps 0-3 (one consumer warpgroup): Q as wgmma A fragments in registers (loaded once from
//     global memory), then per 64-key tile S = Q K^T (wgmma, K from shared memory), the causal
//     mask on the tiles that reach past the first token's last key, online softmax in registers,
//     O += P V (wgmma, P from registers, V read N-major), and the stage released (one arrival per warp).
//   warp 4 (producer): lane p copies page p (PAGE_SIZE keys) of each K and V tile by TMA, one
//     [PAGE_SIZE x 64 dims] box per 128-byte column block, into a STAGES-deep ring (SQ90_RUNS: a tile
//     of consecutive cache blocks in one [64 keys x 64 dims] box per column block, lane 0).
// The two co-resident CTAs overlap one's softmax with the other's wgmmas and copies.
// Split s takes tiles [s * per_split, (s + 1) * per_split) of the CTA's keys; with one split the
// CTA writes the normalised bf16 output, with several the unnormalised partials that
// decode_attention_mma.cu's decode_attention_merge combines (its layout, token rows in place of
// sequences): partial_out [T, num_heads, num_splits, HEAD_DIM] fp32, partial_ml [.., 2] (max in
// log2 units, sum). A split without keys writes max -1e30, sum 0 and zeros (weight 0 in the merge).
//
// Keys past the CTA's last key in its last tile: their pages are not copied and the rows of a
// partly used page hold whatever the cache has (possibly NaN bits), so the consumers zero those
// V rows before P V (their P is 0, but 0 * NaN is NaN) and the mask takes their S.
//
// Built with NVRTC for sm_90a only (loader.arch_kernel); without the sm_90a features (a plain
// sm_90 build, as CPU CI compiles every source) the kernel is empty.
#include "wgmma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#ifndef PAGE_SIZE
#define PAGE_SIZE 16  // tokens per KV cache block (the block_size argument must match)
#endif
#ifndef SQ90_STAGES
#define SQ90_STAGES 3  // 3 x 32 KB: two CTAs fit an SM's shared memory
#endif
#ifndef SQ90_RUNS
#define SQ90_RUNS 0  // 1: a tile whose pages are consecutive cache blocks comes in one 64-token box per column block
#endif
#ifndef SQ90_CLUSTER
#define SQ90_CLUSTER 1  // 2, 4, 8: clusters of that many splits combine their partials through DSMEM (see the end)
#endif
static_assert(SQ90_CLUSTER == 1 || SQ90_CLUSTER == 2 || SQ90_CLUSTER == 4 || SQ90_CLUSTER == 8,
              "a cluster of 1, 2, 4 or 8 splits");
#define SQ90_CTAS_PER_SM (SQ90_STAGES <= 3 ? 2 : 1)  // deeper rings: one CTA per SM (the register cap rises)
static_assert(HEAD_DIM == 128, "the sm90 short-query kernel is built for head_dim 128");
static_assert(GROUP >= 1 && GROUP <= 64, "one CTA's 64 rows hold at least one token's query heads");
#define SQ90_KEYS 64                        // keys per K/V tile
#define SQ90_ROWS 64                        // query rows per CTA (one wgmma M tile)
#define ROW_TOKENS (SQ90_ROWS / GROUP)      // tokens per CTA
#define REAL_ROWS (ROW_TOKENS * GROUP)      // rows past this are padding (GROUP not a power of two)
#define PAGES (SQ90_KEYS / PAGE_SIZE)
#define KV_TILE_BYTES (SQ90_KEYS * HEAD_DIM * 2)
#define STAGE_BYTES (2 * KV_TILE_BYTES)
#define SQ90_THREADS 160
#if SQ90_KEYS % PAGE_SIZE != 0 || PAGE_SIZE % 8 != 0
#error "TMA page copies need whole pages of a multiple of 8 tokens per 64-key tile"
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
// 4 floats at this shared-memory address's offset in cluster CTA `rank` (distributed shared memory)
__device__ __forceinline__ float4 ld_cluster_f32x4(u32 addr, u32 rank) {
    float4 v;
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %4, %5;\n"
        "ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [remote];\n}\n"
        : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
        : "r"(addr), "r"(rank)
        : "memory");
    return v;
}
__device__ __forceinline__ float ld_cluster_f32(u32 addr, u32 rank) {
    float v;
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %1, %2;\nld.shared::cluster.f32 %0, [remote];\n}\n"
                 : "=f"(v)
                 : "r"(addr), "r"(rank)
                 : "memory");
    return v;
}

constexpr float NEG_BIG = -1e30f;  // the running max before any key: finite, so exp2(NEG_BIG - NEG_BIG) = 1

// D[64 x 64] (+)= A[64 x 16] * B[16 x 64], A from registers (each warp's mma.m16n8k16 A fragment of
// its 16 rows), B K-major in shared memory; scale_d == 0 overwrites D.
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const u32 (&a)[4], u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : HOPPER_ACC32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}
#endif

#if SQ90_CLUSTER > 1
#define SQ90_CLUSTER_ATTRIBUTE __cluster_dims__(SQ90_CLUSTER, 1, 1)
#else
#define SQ90_CLUSTER_ATTRIBUTE
#endif
extern "C" __global__ void __launch_bounds__(SQ90_THREADS, SQ90_CTAS_PER_SM) SQ90_CLUSTER_ATTRIBUTE
short_query_attention_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                           const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
                           int max_blocks_per_seq, const int* __restrict__ context_lens,
                           const int* __restrict__ query_start, int row_groups, bf16* __restrict__ out,
                           float* __restrict__ partial_out, float* __restrict__ partial_ml, int num_kv_heads,
                           int block_size, int num_splits, float scale_log2,
                           const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map
#if SQ90_RUNS
                           // the same caches with a box of SQ90_KEYS tokens (tensor_maps.page_maps, box_tokens=64)
                           , const __grid_constant__ TensorMap k_run_map, const __grid_constant__ TensorMap v_run_map
#endif
) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint4 smem_raw[];
    __shared__ alignas(8) u64 barriers[2 * SQ90_STAGES];  // full[STAGES], empty[STAGES]
    const u32 base = ((u32)__cvta_generic_to_shared(smem_raw) + 1023) & ~1023u;  // the swizzle atom
    const u32 bar_full = (u32)__cvta_generic_to_shared(barriers);
    const u32 bar_empty = bar_full + 8 * SQ90_STAGES;

#if SQ90_CLUSTER > 1
    // a cluster's CTAs are consecutive splits of one row group (num_splits is a multiple of SQ90_CLUSTER)
    const int split = blockIdx.x % num_splits, row_group = blockIdx.x / num_splits;
#else
    const int split = blockIdx.x / row_groups, row_group = blockIdx.x % row_groups;
#endif
    const int kv_head = blockIdx.y, seq = blockIdx.z;
    const int num_heads = num_kv_heads * GROUP;
    const int query_begin = query_start[seq], query_len = query_start[seq + 1] - query_begin;
    const int first_token = row_group * ROW_TOKENS;
    if (first_token >= query_len) return;  // the whole CTA (cluster), before any barrier: no rows here
    if (block_size != PAGE_SIZE) __trap();  // compiled for another KV block size
    const int tokens = min(ROW_TOKENS, query_len - first_token);
    const int cached = context_lens[seq] - query_len;  // new token t sees keys 0 .. cached + t
    const int length = cached + first_token + tokens;  // keys the CTA's last token sees
    const int num_tiles = (length + SQ90_KEYS - 1) / SQ90_KEYS;
    const int per_split = (num_tiles + num_splits - 1) / num_splits;
    const int tile_begin = min(num_tiles, split * per_split);
    const int my_tiles = min(num_tiles, tile_begin + per_split) - tile_begin;

    if (threadIdx.x == 0) {
        for (int s = 0; s < SQ90_STAGES; ++s) {
            mbar_init(bar_full + 8 * s, 1);   // the producer's expect-bytes arrival (+ the TMA bytes)
            mbar_init(bar_empty + 8 * s, 4);  // one arrival per consumer warp
        }
        mbar_init_fence();
    }
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 4) {
        // ---------------- producer ----------------
        if (lane == 0) {
            prefetch_tensor_map(&k_map);
            prefetch_tensor_map(&v_map);
#if SQ90_RUNS
            prefetch_tensor_map(&k_run_map);
            prefetch_tensor_map(&v_run_map);
#endif
        }
        const int* table = block_tables + (size_t)seq * max_blocks_per_seq;
        // lane p's page of tile i (its block-table entry read one tile ahead, off the stage wait's path)
        auto page_of = [&](int i) {
            const int k0 = (tile_begin + i) * SQ90_KEYS;
            return i < my_tiles && lane < PAGES && k0 + lane * PAGE_SIZE < length ? table[k0 / PAGE_SIZE + lane] : 0;
        };
        int page = page_of(0);
        for (int i = 0; i < my_tiles; ++i) {
            const int stage = i % SQ90_STAGES;
            const int k0 = (tile_begin + i) * SQ90_KEYS;
            const int pages = min(PAGES, (length - k0 + PAGE_SIZE - 1) / PAGE_SIZE);
            const int next_page = page_of(i + 1);
#if SQ90_RUNS
            // a whole tile of consecutive cache blocks (a prefix the block pool handed out in order)
            const int first = __shfl_sync(0xffffffffu, page, 0);
            const bool run = pages == PAGES && __all_sync(0xffffffffu, lane >= PAGES || page == first + lane);
#endif
            if (i >= SQ90_STAGES) mbar_wait(bar_empty + 8 * stage, ((i / SQ90_STAGES) - 1) & 1);
            const u32 bar = bar_full + 8 * stage;
            if (lane == 0) mbar_arrive_expect_bytes(bar, pages * PAGE_SIZE * HEAD_DIM * 2 * 2);
            __syncwarp();  // the expected bytes are counted before any copy can land
#if SQ90_RUNS
            if (run) {
                if (lane == 0) {
                    const u32 k_tile = base + stage * STAGE_BYTES;
#pragma unroll
                    for (int c = 0; c < HEAD_DIM / 64; ++c) {
                        tma_load_3d(k_tile + c * (SQ90_KEYS * 128), &k_run_map, c * 64, kv_head, page * PAGE_SIZE, bar);
                        tma_load_3d(k_tile + KV_TILE_BYTES + c * (SQ90_KEYS * 128), &v_run_map, c * 64, kv_head,
                                    page * PAGE_SIZE, bar);
                    }
                }
            } else
#endif
            if (lane < pages) {
                const u32 k_page = base + stage * STAGE_BYTES + lane * (PAGE_SIZE * 128);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 64; ++c) {
                    tma_load_3d(k_page + c * (SQ90_KEYS * 128), &k_map, c * 64, kv_head, page * PAGE_SIZE, bar);
                    tma_load_3d(k_page + KV_TILE_BYTES + c * (SQ90_KEYS * 128), &v_map, c * 64, kv_head,
                                page * PAGE_SIZE, bar);
                }
            }
            page = next_page;
        }
#if SQ90_CLUSTER > 1
        // the cluster's two barriers below count every thread (this warp has nothing to publish: relaxed)
        asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
        asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
#endif
        return;  // the consumers wait for every copy this warp issued
    }

    // ---------------- consumers ----------------
    const int g = lane / 4, c2 = 2 * (lane % 4);  // fragment row (and row + 8), column pair
    // Q as A fragments: qa[kk] holds dims 16 kk .. 16 kk + 15 of rows warp * 16 + g (+ 8)
    u32 qa[HEAD_DIM / 16][4];
    int limit[2];  // keys of rows g, g + 8: 0 .. limit - 1 (padding rows: every key, never written)
    bool real[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = warp * 16 + g + 8 * h, token = row / GROUP;
        real[h] = row < REAL_ROWS && token < tokens;
        limit[h] = real[h] ? cached + first_token + token + 1 : length;
    }
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int h = e & 1, row = warp * 16 + g + 8 * h;
            const bf16* src = q + ((size_t)(query_begin + first_token + row / GROUP) * num_heads + kv_head * GROUP +
                                   row % GROUP) * HEAD_DIM + kk * 16 + (e >> 1) * 8 + c2;
            qa[kk][e] = real[h] ? *reinterpret_cast<const u32*>(src) : 0u;
        }
    const int first_limit = cached + first_token + 1;  // the CTA's smallest limit: tiles past it are masked

    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    float s[32];
    u32 p[SQ90_KEYS / 16][4];
    float m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.f, 0.f};

    for (int i = 0; i < my_tiles; ++i) {
        const int stage = i % SQ90_STAGES;
        const int k0 = (tile_begin + i) * SQ90_KEYS;
        const u32 k_smem = base + stage * STAGE_BYTES, v_smem = k_smem + KV_TILE_BYTES;
        mbar_wait(bar_full + 8 * stage, (i / SQ90_STAGES) & 1);
        if (k0 + SQ90_KEYS > length) {
            // V rows past the last key: zeros (see the top); 16 chunks of 16 bytes per row
            const int first_row = length - k0;
            for (int chunk = threadIdx.x; chunk < (SQ90_KEYS - first_row) * 16; chunk += 128) {
                const int row = first_row + chunk / 16, col = chunk % 16;
                const u32 dst = v_smem + (col / 8) * (SQ90_KEYS * 128) + swizzled(row, col % 8);
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0u) : "memory");
            }
            fence_proxy_async_shared();  // the generic-proxy zeros before wgmma's async-proxy reads
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
        }
        // S = Q K^T: k steps of 16 dims walk 32 bytes along K's swizzled 128-byte rows
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            wgmma_rs_n64(s, qa[kk], smem_desc(k_smem + (kk / 4) * (SQ90_KEYS * 128) + (kk % 4) * 32, 16, 1024), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        if (k0 + SQ90_KEYS > first_limit) {
#pragma unroll
            for (int j = 0; j < SQ90_KEYS / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (k0 + 8 * j + c2 + (e & 1) >= limit[e >> 1]) s[4 * j + e] = -INFINITY;
        }
        float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < SQ90_KEYS / 8; ++j) {
            row_max[0] = fmaxf(row_max[0], fmaxf(s[4 * j], s[4 * j + 1]));
            row_max[1] = fmaxf(row_max[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
        float correction[2], neg_m[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
            row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
            const float m_new = fmaxf(m[h], row_max[h] * scale_log2);  // -inf * scale: m stays
            correction[h] = fast_exp2(m[h] - m_new);
            m[h] = m_new;
            neg_m[h] = -m_new;
            l[h] *= correction[h];
        }
#pragma unroll
        for (int j = 0; j < SQ90_KEYS / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], scale_log2, neg_m[e >> 1]));
                l[e >> 1] += s[4 * j + e];
            }
#pragma unroll
        for (int j = 0; j < SQ90_KEYS / 8; ++j) {
            p[j / 2][(j % 2) * 2] = pack_bf16x2(s[4 * j], s[4 * j + 1]);
            p[j / 2][(j % 2) * 2 + 1] = pack_bf16x2(s[4 * j + 2], s[4 * j + 3]);
        }
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            o[4 * j] *= correction[0];
            o[4 * j + 1] *= correction[0];
            o[4 * j + 2] *= correction[1];
            o[4 * j + 3] *= correction[1];
        }
        // O += P V: V read N-major (rows are keys, its two 128-byte column blocks the 128 dims)
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < SQ90_KEYS / 16; ++kk)
            wgmma_rs_n128_tb(o, p[kk], smem_desc(v_smem + kk * 16 * 128, SQ90_KEYS * 128, 1024));
        wgmma_commit();
        wgmma_wait<0>();
        __syncwarp();  // every lane's wgmma reads of the stage are complete
        if (lane == 0) mbar_arrive(bar_empty + 8 * stage);
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#if SQ90_CLUSTER > 1
    // The cluster's SQ90_CLUSTER splits combine here: each CTA puts its (O, m, l) in its shared memory
    // (O over stage 0..: every tile is consumed, so no copy lands there any more), then CTA r merges
    // rows r * ROWS_PER_CTA .. + ROWS_PER_CTA - 1 from all of them (distributed shared memory) and
    // writes one partial per cluster (num_splits / SQ90_CLUSTER of them for decode_attention_merge),
    // or the output when the cluster holds every split. The second cluster barrier keeps each CTA's
    // shared memory alive until the others have read it.
    {
        __shared__ float cluster_m[SQ90_ROWS], cluster_l[SQ90_ROWS];
        constexpr int ROWS_PER_CTA = SQ90_ROWS / SQ90_CLUSTER;
        const u32 o_smem = base;  // [SQ90_ROWS][HEAD_DIM] fp32 (32 KB)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp * 16 + g + 8 * h;
#pragma unroll
            for (int j = 0; j < 16; ++j)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(o_smem + (row * HEAD_DIM + 8 * j + c2) * 4),
                             "f"(o[4 * j + 2 * h]), "f"(o[4 * j + 2 * h + 1])
                             : "memory");
            if (lane % 4 == 0) {
                cluster_m[row] = m[h];
                cluster_l[row] = l[h];
            }
        }
        asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
        const u32 rank = (u32)(split % SQ90_CLUSTER);
        const u32 m_smem = (u32)__cvta_generic_to_shared(cluster_m), l_smem = (u32)__cvta_generic_to_shared(cluster_l);
        const int col = 4 * (threadIdx.x % 32);  // 4 of the row's 128 dims per thread, a row per warp at a time
        for (int row = rank * ROWS_PER_CTA + warp; row < (int)(rank + 1) * ROWS_PER_CTA; row += 4) {
            const int token = row / GROUP;
            if (row >= REAL_ROWS || token >= tokens) continue;  // warp-uniform
            float mc[SQ90_CLUSTER], row_max = NEG_BIG;
#pragma unroll
            for (int c = 0; c < SQ90_CLUSTER; ++c) {
                mc[c] = ld_cluster_f32(m_smem + row * 4, c);
                row_max = fmaxf(row_max, mc[c]);
            }
            float sum = 0.f;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int c = 0; c < SQ90_CLUSTER; ++c) {
                const float w = fast_exp2(mc[c] - row_max);
                sum += w * ld_cluster_f32(l_smem + row * 4, c);
                const float4 v = ld_cluster_f32x4(o_smem + (row * HEAD_DIM + col) * 4, c);
                acc.x += w * v.x;
                acc.y += w * v.y;
                acc.z += w * v.z;
                acc.w += w * v.w;
            }
            const size_t head_row =
                (size_t)(query_begin + first_token + token) * num_heads + kv_head * GROUP + row % GROUP;
            if (num_splits == SQ90_CLUSTER) {
                const float inv = sum > 0.f ? 1.f / sum : 0.f;
                __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + head_row * HEAD_DIM + col);
                dst[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
                dst[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
            } else {
                const int parts = num_splits / SQ90_CLUSTER;
                const size_t part = head_row * parts + split / SQ90_CLUSTER;
                *reinterpret_cast<float4*>(partial_out + part * HEAD_DIM + col) = acc;
                if (threadIdx.x % 32 == 0) {
                    partial_ml[part * 2] = row_max;
                    partial_ml[part * 2 + 1] = sum;
                }
            }
        }
        // (only keeps this CTA's shared memory alive for the others' reads: no ordering to publish)
        asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
        return;
    }
#endif
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!real[h]) continue;
        const int row = warp * 16 + g + 8 * h;
        const size_t head_row =
            (size_t)(query_begin + first_token + row / GROUP) * num_heads + kv_head * GROUP + row % GROUP;
        if (num_splits == 1) {
            const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
            bf16* dst = out + head_row * HEAD_DIM + c2;
#pragma unroll
            for (int j = 0; j < 16; ++j)
                *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
                    __floats2bfloat162_rn(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
        } else {
            const size_t part = head_row * num_splits + split;
            float* dst = partial_out + part * HEAD_DIM + c2;
#pragma unroll
            for (int j = 0; j < 16; ++j)
                *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
            if (lane % 4 == 0) {
                partial_ml[part * 2] = m[h];
                partial_ml[part * 2 + 1] = l[h];
            }
        }
    }
#endif
}
