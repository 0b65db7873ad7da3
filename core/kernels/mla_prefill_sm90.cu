// MLA decompressed prefill attention for Hopper (sm_90a): mla.cu's mla_prefill_attention_pipelined
// contract (causal attention of a prefill tile's queries over its sequence's expanded context, K =
// [k_nope | k_pe] of QK_DIM = NOPE_DIM + ROPE_DIM, V of V_DIM) on wgmma instead of mma.sync.
//
// prefill_seqs, tile_seq, tile_query: the work items of mla_prefill.cuh (a query tile of one sequence;
// query i of a sequence sits at position L - n + i and sees context rows 0 ..= L - n + i).
//   q [T, H, QK_DIM] (q_pe rotated)   k_nope [C, H, NOPE_DIM]   k_pe [C, ROPE_DIM] (every head's)
//   values [C, H, V_DIM]              out [T, H, V_DIM] (only the tiles' query rows are written)
//
// One CTA = BLOCK_M (128) queries of one sequence and one head, 3 warpgroups:
//   warpgroup 0 (producer, 40 registers): the Q tile once, then each BLOCK_N-key K and V tile with
//     cp.async into a STAGES-deep ring of 128-byte-swizzled tiles; each thread's copies arrive on
//     the stage's "full" mbarrier when they land, so it blocks only on a stage being released.
//     K's column blocks come from k_nope (the first NOPE_DIM / 64) and the shared k_pe (the rest).
//   warpgroups 1, 2 (consumers, 64 query rows each): S = Q K^T by wgmma (both from shared memory),
//     causal mask + online softmax in registers, O += P V by wgmma (P from registers, V read
//     N-major), the stage released on its "empty" mbarrier. S of tile j is issued together with
//     P V of tile j-1, so the softmax of one tile runs while the tensor cores multiply the other.
//
//   smem: [Q: QK_BLOCKS x 128 x 128 B][stage s: K QK_BLOCKS x BLOCK_N x 128 B, V V_BLOCKS x ...]...[mbarriers]
#include "wgmma.cuh"  // wgmma shapes, exp2; sm90.cuh: mbarriers, copies, descriptors
#include "mla_prefill.cuh"  // PREFILL_SEQ_FIELDS, MlaPrefillTile

#ifndef NOPE_DIM
#define NOPE_DIM 128
#endif
#ifndef ROPE_DIM
#define ROPE_DIM 64
#endif
#ifndef V_DIM
#define V_DIM 128
#endif
#define QK_DIM (NOPE_DIM + ROPE_DIM)
static_assert(QK_DIM % 64 == 0 && NOPE_DIM % 8 == 0 && ROPE_DIM % 8 == 0,
              "K rows are whole 64-wide column blocks of 16-byte chunks");
static_assert(V_DIM == 128, "O is one m64n128 accumulator per consumer warpgroup");
#define BLOCK_M 128
#ifndef BLOCK_N
#define BLOCK_N 128  // keys per K / V tile: 128 or 64 (S is BLOCK_N / 2 fp32 registers per consumer thread)
#endif
static_assert(BLOCK_N == 128 || BLOCK_N == 64, "S is one m64n128 or m64n64 wgmma accumulator");
#ifndef STAGES
#define STAGES (BLOCK_N == 128 ? 2 : 4)  // 48 KB of Q + 2 x 80 KB (4 x 40 KB) of K / V at QK_DIM 192
#endif
#ifndef PINGPONG
#define PINGPONG 0  // 1: the two consumer warpgroups take turns issuing their wgmmas (named barriers 1, 2)
#endif
// 1: a stage's K and V halves have their own full / empty mbarriers. K of tile j is released once S of
// tile j has landed (V only after P V), and the producer copies K one tile ahead of V (K j+1, then V j):
// with 2 stages, tile j+1's K then loads while tile j is still being multiplied, rather than after it.
#ifndef SPLIT_KV
#define SPLIT_KV 0
#endif
// 1: K / V tiles come by TMA (one 64-column box of BLOCK_N rows per column block, issued by one producer
// thread; rows past the context are zero-filled, rows past the tile's last key are masked), cp.async else.
#ifndef TMA_KV_LOADS
#define TMA_KV_LOADS 0
#endif
// 1: tile j's softmax is kept before the wait for tile j-1's P V. Nothing in the softmax depends on that wait,
// so ptxas may hoist the wait above it and the two then run one after the other (attn16 found this in the
// SASS of prefill_attention_sm90.cu); a shared-memory store of the row sums (which take every P value)
// issued before the wait pins the order.
#ifndef ORDERED_SOFTMAX
#define ORDERED_SOFTMAX 0
#endif
#if TMA_KV_LOADS
static_assert(NOPE_DIM % 64 == 0 && ROPE_DIM % 64 == 0, "TMA boxes of 64 columns: k_nope and k_pe in whole blocks");
#endif

// Tiles written by cp.async (the generic proxy) are read by wgmma (the async proxy): each consumer thread fences
// once their barrier has completed. TMA tiles are written by the async proxy and need none.
__device__ __forceinline__ void wait_tile(u32 bar, u32 parity, bool by_cp_async) {
    mbar_wait(bar, parity);
    if (by_cp_async) fence_proxy_async_shared();
}
#define KV_BY_CP_ASYNC (!TMA_KV_LOADS)
static_assert(STAGES >= 2, "S of tile j is issued while tile j-1's V is still read");
#define NUM_THREADS 384
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232  // 128 x 40 + 256 x 232 <= 65536
#define QK_BLOCKS (QK_DIM / 64)
#define V_BLOCKS (V_DIM / 64)
#define NOPE_CHUNKS (NOPE_DIM / 8)
#define Q_BYTES (QK_BLOCKS * BLOCK_M * 128)
#define K_TILE_BYTES (QK_BLOCKS * BLOCK_N * 128)
#define V_TILE_BYTES (V_BLOCKS * BLOCK_N * 128)
#define STAGE_BYTES (K_TILE_BYTES + V_TILE_BYTES)
#define BARRIER_OFFSET (Q_BYTES + STAGES * STAGE_BYTES)
// mbarriers: Q, full[STAGES], empty[STAGES], full_v[STAGES], empty_v[STAGES] (SPLIT_KV; reserved either
// way), then 8 bytes that ORDERED_SOFTMAX writes and nobody reads; + 1024 so the tiles start on a swizzle atom
#define SHARED_BYTES (BARRIER_OFFSET + 8 * (1 + 4 * STAGES) + 8 + 1024)
#define FULL_ARRIVALS (TMA_KV_LOADS ? 1 : 128)  // producer thread 0's expect-bytes arrival, or each producer thread's
static_assert(SHARED_BYTES <= 227 * 1024, "Q and the K / V ring fit one SM's shared memory");

// ---- consumer steps --------------------------------------------------------------------------------

#define S_REGS (BLOCK_N / 2)

// Warpgroup turn-taking (PINGPONG): a warpgroup waits on its own named barrier before issuing its
// wgmmas and arrives on the other's after, so one's softmax runs while the other's matmuls do.
__device__ __forceinline__ void take_turn(int wg) {
#if PINGPONG
    asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
#endif
}
__device__ __forceinline__ void pass_turn(int wg) {
#if PINGPONG
    asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory");
#endif
}

// S = Q K^T for this warpgroup's 64 rows: 16-wide k steps walk 32 bytes along the swizzled rows.
__device__ __forceinline__ void issue_qk(float (&s)[S_REGS], u32 q_rows, u32 k_smem) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < QK_DIM / 16; ++kk) {
        const u32 block_a = q_rows + (kk / 4) * (BLOCK_M * 128) + (kk % 4) * 32;
        const u32 block_b = k_smem + (kk / 4) * (BLOCK_N * 128) + (kk % 4) * 32;
#if BLOCK_N == 128
        wgmma_ss_n128(s, smem_desc(block_a, 16, 1024), smem_desc(block_b, 16, 1024), kk > 0);
#else
        wgmma_ss_n64(s, smem_desc(block_a, 16, 1024), smem_desc(block_b, 16, 1024), kk > 0);
#endif
    }
    wgmma_commit();
}

// O += P V: V's rows are keys (the k index), its two 128-byte column blocks the 128 output dims.
__device__ __forceinline__ void issue_pv(float (&o)[64], const u32 (&p)[BLOCK_N / 16][4], u32 v_smem) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        wgmma_rs_n128_tb(o, p[kk], smem_desc(v_smem + kk * 16 * 128, BLOCK_N * 128, 1024));
    wgmma_commit();
}

struct SoftmaxRows {
    int query_pos;        // position of fragment row `row` (row + 8 is query_pos + 8)
    int first_query_pos;  // this warpgroup's first query position
    int col;              // fragment column inside each 8-column group
    float m[2];           // running max (log2 units) of rows row, row + 8
    float l[2];           // running sum of this thread's P values of those rows
};

// Causal mask (only on tiles reaching past the warpgroup's first query), running max and sum,
// S <- exp2(S scale - m) in place; `correction` rescales O for the new max (l is rescaled here).
__device__ __forceinline__ void softmax_in_place(float (&s)[S_REGS], float (&correction)[2], SoftmaxRows& state, int k0,
                                                 float scale_log2) {
    if (k0 + BLOCK_N - 1 > state.first_query_pos) {
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (k0 + 8 * j + state.col + (e & 1) > state.query_pos + 8 * (e >> 1)) s[4 * j + e] = -INFINITY;
    }
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) {
        row_max[0] = fmaxf(row_max[0], fmaxf(s[4 * j], s[4 * j + 1]));
        row_max[1] = fmaxf(row_max[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    float neg_m[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
        // finite from the first tile on: context row 0 is visible to every query
        const float m_new = fmaxf(state.m[h], row_max[h] * scale_log2);
        correction[h] = fast_exp2(state.m[h] - m_new);
        state.m[h] = m_new;
        neg_m[h] = -m_new;
        state.l[h] *= correction[h];
    }
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], scale_log2, neg_m[e >> 1]));
            state.l[e >> 1] += s[4 * j + e];
        }
}

// P (in S's registers) -> bf16 A fragments: 8-column groups 2kk and 2kk+1 are keys 16kk .. 16kk+15.
__device__ __forceinline__ void pack_p(const float (&s)[S_REGS], u32 (&p)[BLOCK_N / 16][4]) {
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) {
        p[j / 2][(j % 2) * 2] = pack_bf16x2(s[4 * j], s[4 * j + 1]);
        p[j / 2][(j % 2) * 2 + 1] = pack_bf16x2(s[4 * j + 2], s[4 * j + 3]);
    }
}

__device__ __forceinline__ void rescale(float (&o)[64], const float (&correction)[2]) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        o[4 * j] *= correction[0];
        o[4 * j + 1] *= correction[0];
        o[4 * j + 2] *= correction[1];
        o[4 * j + 3] *= correction[1];
    }
}

// ---- the kernel ------------------------------------------------------------------------------------

// grid (num_tiles, num_heads): a head's tiles run next to each other (its expanded K / V stays in L2),
// in the order of tile_seq / tile_query (most keys first). scale_log2 = softmax scale x log2(e).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
mla_prefill_attention_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k_nope, const bf16* __restrict__ k_pe,
                           const bf16* __restrict__ values, const int* __restrict__ prefill_seqs,
                           const int* __restrict__ tile_seq, const int* __restrict__ tile_query, int num_heads,
                           float scale_log2, bf16* __restrict__ out,
#if TMA_KV_LOADS
                           // 3-d maps (column, head, context row) of k_nope [C, H, NOPE], k_pe [C, 1, ROPE] and
                           // values [C, H, V]: box 64 columns x 1 head x BLOCK_N rows, 128-byte swizzle
                           const __grid_constant__ TensorMap k_nope_map, const __grid_constant__ TensorMap k_pe_map,
                           const __grid_constant__ TensorMap v_map
#else
                           const void* k_nope_map, const void* k_pe_map, const void* v_map  // NULL: unused
#endif
) {
// wgmma and setmaxnreg exist for sm_90a only; a build for another target (the CPU CI compiles every
// source for plain sm_90 too) gets a kernel that traps. core builds it with SM90A_TARGET=1.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(SM90A_TARGET)
    extern __shared__ uint4 smem_raw[];
    const u32 base = ((u32)__cvta_generic_to_shared(smem_raw) + 1023) & ~1023u;
    const u32 q_smem = base;
    const u32 bar_q = base + BARRIER_OFFSET;
    const u32 bar_full = bar_q + 8;                // [STAGES] (SPLIT_KV: a stage's K half)
    const u32 bar_empty = bar_full + 8 * STAGES;  // [STAGES]
#if SPLIT_KV
    const u32 bar_full_v = bar_empty + 8 * STAGES;     // [STAGES]: a stage's V half
    const u32 bar_empty_v = bar_full_v + 8 * STAGES;  // [STAGES]
#else
    const u32 bar_full_v = bar_full, bar_empty_v = bar_empty;
    (void)bar_full_v;
#endif
    if (threadIdx.x == 0) {
        mbar_init(bar_q, 128);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full + 8 * s, FULL_ARRIVALS);
            mbar_init(bar_empty + 8 * s, 256);  // one per consumer thread
#if SPLIT_KV
            mbar_init(bar_full_v + 8 * s, FULL_ARRIVALS);
            mbar_init(bar_empty_v + 8 * s, 256);
#endif
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const MlaPrefillTile w = mla_prefill_tile(prefill_seqs, tile_seq, tile_query, blockIdx.x, BLOCK_M);
    const int q_first = w.q_first + w.tile_q;         // step row of the tile's first query
    const int first_query = w.offset + w.tile_q;      // its position
    const int num_kv_tiles = (w.key_end + BLOCK_N - 1) / BLOCK_N;
    const int head = blockIdx.y;
    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        // ---------------- producer ----------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        // thread t copies 16-byte chunk t % 8 of rows t / 8, t / 8 + 16, ... of every column block
        const int t = threadIdx.x, chunk = t % 8, row0 = t / 8;
        for (int b = 0; b < QK_BLOCKS; ++b)
            for (int r = row0; r < BLOCK_M; r += 16) {
                const bool valid = r < w.rows;
                const bf16* src = valid ? q + ((size_t)(q_first + r) * num_heads + head) * QK_DIM + b * 64 + chunk * 8 : q;
                cp_async16(q_smem + b * (BLOCK_M * 128) + swizzled(r, chunk), src, valid);
            }
        mbar_arrive_on_copies(bar_q);

#if TMA_KV_LOADS
        if (t == 0) {
            prefetch_tensor_map(&k_nope_map);
            prefetch_tensor_map(&k_pe_map);
            prefetch_tensor_map(&v_map);
        }
        // tile kt's K / V boxes into its stage, counted on `bar` (producer thread 0 only)
        auto copy_k = [&](int kt, u32 bar) {
            const u32 k_smem = base + Q_BYTES + (kt % STAGES) * STAGE_BYTES;
            const int row = (int)w.ctx_first + kt * BLOCK_N;
#pragma unroll
            for (int b = 0; b < QK_BLOCKS; ++b) {
                if (b * 64 < NOPE_DIM)
                    tma_load_3d(k_smem + b * (BLOCK_N * 128), &k_nope_map, b * 64, head, row, bar);
                else
                    tma_load_3d(k_smem + b * (BLOCK_N * 128), &k_pe_map, b * 64 - NOPE_DIM, 0, row, bar);
            }
        };
        auto copy_v = [&](int kt, u32 bar) {
            const u32 v_smem = base + Q_BYTES + (kt % STAGES) * STAGE_BYTES + K_TILE_BYTES;
            const int row = (int)w.ctx_first + kt * BLOCK_N;
#pragma unroll
            for (int b = 0; b < V_BLOCKS; ++b) tma_load_3d(v_smem + b * (BLOCK_N * 128), &v_map, b * 64, head, row, bar);
        };
        auto wait_free = [&](u32 bars, int kt) {
            if (kt >= STAGES) mbar_wait(bars + 8 * (kt % STAGES), ((kt / STAGES) - 1) & 1);
        };
        if (t == 0) {
#if SPLIT_KV
            mbar_arrive_expect_bytes(bar_full, K_TILE_BYTES);
            copy_k(0, bar_full);
            for (int kt = 0; kt < num_kv_tiles; ++kt) {
                if (kt + 1 < num_kv_tiles) {
                    wait_free(bar_empty, kt + 1);
                    const u32 bar = bar_full + 8 * ((kt + 1) % STAGES);
                    mbar_arrive_expect_bytes(bar, K_TILE_BYTES);
                    copy_k(kt + 1, bar);
                }
                wait_free(bar_empty_v, kt);
                const u32 bar = bar_full_v + 8 * (kt % STAGES);
                mbar_arrive_expect_bytes(bar, V_TILE_BYTES);
                copy_v(kt, bar);
            }
#else
            for (int kt = 0; kt < num_kv_tiles; ++kt) {
                wait_free(bar_empty, kt);
                const u32 bar = bar_full + 8 * (kt % STAGES);
                mbar_arrive_expect_bytes(bar, STAGE_BYTES);
                copy_k(kt, bar);
                copy_v(kt, bar);
            }
#endif
        }
#else
        (void)k_nope_map;
        (void)k_pe_map;
        (void)v_map;
        const size_t nope_stride = (size_t)num_heads * NOPE_DIM, v_stride = (size_t)num_heads * V_DIM;
        const bf16* nope_rows = k_nope + (size_t)w.ctx_first * nope_stride + (size_t)head * NOPE_DIM;
        const bf16* pe_rows = k_pe + (size_t)w.ctx_first * ROPE_DIM;
        const bf16* v_rows = values + (size_t)w.ctx_first * v_stride + (size_t)head * V_DIM + chunk * 8;
        // tile kt's K rows into its stage (rows past the last key: zeros, so P V sees 0 x 0 there)
        auto copy_k = [&](int kt) {
            const u32 k_smem = base + Q_BYTES + (kt % STAGES) * STAGE_BYTES;
            const int k0 = kt * BLOCK_N;
            for (int b = 0; b < QK_BLOCKS; ++b) {
                const int c = b * 8 + chunk;  // the chunk's 16 bytes along the K row
                const bf16* column = c < NOPE_CHUNKS ? nope_rows + c * 8 : pe_rows + (c - NOPE_CHUNKS) * 8;
                const size_t stride = c < NOPE_CHUNKS ? nope_stride : ROPE_DIM;
                for (int r = row0; r < BLOCK_N; r += 16) {
                    const int key = k0 + r;
                    const bool valid = key < w.key_end;  // rows past the last key: zeros (P is 0 there)
                    cp_async16(k_smem + b * (BLOCK_N * 128) + swizzled(r, chunk), column + (valid ? key : 0) * stride,
                               valid);
                }
            }
        };
        auto copy_v = [&](int kt) {
            const u32 v_smem = base + Q_BYTES + (kt % STAGES) * STAGE_BYTES + K_TILE_BYTES;
            const int k0 = kt * BLOCK_N;
            for (int b = 0; b < V_BLOCKS; ++b)
                for (int r = row0; r < BLOCK_N; r += 16) {
                    const int key = k0 + r;
                    const bool valid = key < w.key_end;
                    cp_async16(v_smem + b * (BLOCK_N * 128) + swizzled(r, chunk),
                               v_rows + (valid ? key : 0) * v_stride + b * 64, valid);
                }
        };
        // a tile's stage (or half of it) is free once the consumers have released its previous use
        auto wait_free = [&](u32 bars, int kt) {
            if (kt >= STAGES) mbar_wait(bars + 8 * (kt % STAGES), ((kt / STAGES) - 1) & 1);
        };
#if SPLIT_KV
        // K 0, then K kt+1 before V kt: each arrival also waits for the thread's earlier copies, so
        // V kt's barrier completes with K kt+1 landed too (the consumers need both at the same step)
        copy_k(0);
        mbar_arrive_on_copies(bar_full);
        for (int kt = 0; kt < num_kv_tiles; ++kt) {
            if (kt + 1 < num_kv_tiles) {
                wait_free(bar_empty, kt + 1);
                copy_k(kt + 1);
                mbar_arrive_on_copies(bar_full + 8 * ((kt + 1) % STAGES));
            }
            wait_free(bar_empty_v, kt);
            copy_v(kt);
            mbar_arrive_on_copies(bar_full_v + 8 * (kt % STAGES));
        }
#else
        for (int kt = 0; kt < num_kv_tiles; ++kt) {
            wait_free(bar_empty, kt);
            copy_k(kt);
            copy_v(kt);
            mbar_arrive_on_copies(bar_full + 8 * (kt % STAGES));
        }
#endif
#endif  // TMA_KV_LOADS
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // exit with no copies in flight
    } else {
        // ---------------- consumers ----------------
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
        const int wg = warpgroup - 1;  // 64-row half of the query tile
        const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
        const int row = wg * 64 + warp * 16 + lane / 4;  // fragment rows `row` and `row + 8`
        const u32 q_rows = q_smem + wg * 64 * 128;
        const u32 stages = base + Q_BYTES;
#if ORDERED_SOFTMAX
        const u32 order_sink = bar_q + 8 * (1 + 4 * STAGES);
#endif

        SoftmaxRows state;
        state.query_pos = first_query + row;
        state.first_query_pos = first_query + wg * 64;
        state.col = 2 * (lane % 4);
        state.m[0] = state.m[1] = -INFINITY;
        state.l[0] = state.l[1] = 0.f;
        float o[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] = 0.f;
        float s[S_REGS];
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) s[i] = 0.f;
        u32 p[BLOCK_N / 16][4];
        float correction[2];

        wait_tile(bar_q, 0, true);
        if (wg == 1) pass_turn(wg);  // warpgroup 0 issues first
        wait_tile(bar_full, 0, KV_BY_CP_ASYNC);
        take_turn(wg);
        issue_qk(s, q_rows, stages);
        pass_turn(wg);
        wgmma_wait<0>();
#if SPLIT_KV
        mbar_arrive(bar_empty);  // K of tile 0 is read
#endif
        softmax_in_place(s, correction, state, 0, scale_log2);
        pack_p(s, p);
        for (int kt = 1; kt < num_kv_tiles; ++kt) {
            const int stage = kt % STAGES, previous = (kt - 1) % STAGES;
            wait_tile(bar_full + 8 * stage, (kt / STAGES) & 1, KV_BY_CP_ASYNC);
            take_turn(wg);
            issue_qk(s, q_rows, stages + stage * STAGE_BYTES);
#if SPLIT_KV
            wait_tile(bar_full_v + 8 * previous, ((kt - 1) / STAGES) & 1, KV_BY_CP_ASYNC);
#endif
            issue_pv(o, p, stages + previous * STAGE_BYTES + K_TILE_BYTES);
            pass_turn(wg);
            wgmma_wait<1>();  // S of tile kt
#if SPLIT_KV
            mbar_arrive(bar_empty + 8 * stage);  // K of tile kt is read
#endif
            softmax_in_place(s, correction, state, kt * BLOCK_N, scale_log2);
#if ORDERED_SOFTMAX
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(order_sink), "f"(state.l[0]), "f"(state.l[1])
                         : "memory");
#endif
            wgmma_wait<0>();  // P V of tile kt-1: its stage (V half) is free, P may be rewritten
            mbar_arrive(bar_empty_v + 8 * previous);
            pack_p(s, p);
            rescale(o, correction);
        }
        const int last = (num_kv_tiles - 1) % STAGES;
#if SPLIT_KV
        wait_tile(bar_full_v + 8 * last, ((num_kv_tiles - 1) / STAGES) & 1, KV_BY_CP_ASYNC);
#endif
        take_turn(wg);
        issue_pv(o, p, stages + last * STAGE_BYTES + K_TILE_BYTES);
        if (wg == 0) pass_turn(wg);  // (warpgroup 1 issues last: every arrival is matched)
        wgmma_wait<0>();
        mbar_arrive(bar_empty_v + 8 * last);

        float* l = state.l;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row + 8 * h;
            if (r >= w.rows) continue;
            const float inv = 1.f / l[h];
            bf16* dst = out + ((size_t)(q_first + r) * num_heads + head) * V_DIM + state.col;
#pragma unroll
            for (int jj = 0; jj < 16; ++jj)
                *reinterpret_cast<__nv_bfloat162*>(dst + 8 * jj) =
                    __floats2bfloat162_rn(o[4 * jj + 2 * h] * inv, o[4 * jj + 2 * h + 1] * inv);
        }
    }
#else
    __trap();
#endif
}
