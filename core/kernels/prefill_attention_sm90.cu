// Causal flash attention for Hopper (sm_90a) over the paged KV cache: prefill, chunked prefill
// and varlen batches, the same contract as prefill_attention.cu (the new tokens' K/V are already
// in the cache; a sequence's n queries at positions L-n .. L-1 see cache slots 0 .. key <= query).
//
// One CTA = BLOCK_M (128) queries of one sequence and one head; 3 warpgroups:
//   warpgroup 0 (producer, few registers): gathers the Q tile once and each BLOCK_N-token K/V tile
//     from the 16-token pages with cp.async into a STAGES-deep ring; each thread's copies arrive
//     on the stage's "full" mbarrier when they land (cp.async.mbarrier.arrive.noinc), so the
//     producer never blocks on its own loads, only on a stage being released.
//   warpgroups 1, 2 (consumers, 64 query rows each): S = Q K^T with wgmma (both operands in shared
//     memory), mask + online softmax in registers, O += P V with wgmma (P from registers, V from
//     shared memory read N-major), then release the stage on its "empty" mbarrier.
// While one consumer warpgroup runs its softmax the other's wgmma keeps the tensor cores busy.
//
// Shared memory tiles use the 128-byte swizzle that wgmma reads: a tile of R rows x HEAD_DIM
// bf16 is HEAD_DIM/64 column blocks of [R rows][64 bf16 = 128 bytes]; inside each 1024-byte atom
// of 8 rows the 16-byte chunk c of row r sits at chunk position c ^ (r % 8).
//
//   smem: [Q: D_BLOCKS x BLOCK_M x 128 B][stage 0: K, V: D_BLOCKS x BLOCK_N x 128 B each]...[mbarriers]
//
// Built with NVRTC for sm_90a only (wgmma, setmaxnreg); other GPUs use prefill_attention.cu.
#include "wgmma.cuh"  // sm90.cuh's mbarriers, copies, TMA and descriptors; the wgmma shapes; mma.cuh's pack_bf16x2

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
static_assert(HEAD_DIM == 128 || HEAD_DIM == 256, "the sm90 prefill kernel covers head_dim 128 and 256");
#define BLOCK_M 128
#define BLOCK_N (HEAD_DIM == 256 ? 64 : 128)  // S (BLOCK_N/2) + O (HEAD_DIM/2) fp32 registers per thread
#ifndef STAGES
#define STAGES (HEAD_DIM == 256 ? 2 : 3)  // K/V ring depth: 3 x 64 KB + the 32 KB Q tile fit in 227 KB
#endif
#ifndef INTRA_WG_OVERLAP
#define INTRA_WG_OVERLAP 1
#endif
// Variants (the dispatcher in core/backend/cuda/attention.py passes every one; see its SM90_* defaults):
#ifndef KV_HEAD_MAJOR_GRID
#define KV_HEAD_MAJOR_GRID 0  // 1: grid (group * num_tiles, num_kv_heads), see the kernel's comment
#endif
#ifndef BATCHED_PAGE_READS
#define BATCHED_PAGE_READS 0  // 1: the producer reads a batch of block-table entries before their copies
#endif
#ifndef PAGE_SIZE
#define PAGE_SIZE 16  // tokens per KV cache block with BATCHED_PAGE_READS (the block_size argument must match)
#endif
#ifndef PINGPONG
#define PINGPONG 0  // 1: the two consumer warpgroups take turns issuing their wgmmas (named barriers)
#endif
#ifndef TMA_KV_LOADS
#define TMA_KV_LOADS 0  // 1: K/V tiles whose rows are all keys come by TMA, one box per page (see the producer)
#endif
#ifndef KV_MULTICAST
#define KV_MULTICAST 0  // 1 (with TMA_KV_LOADS): CTA pairs of two query heads share their K/V tiles, see the kernel
#endif
#ifndef PERSISTENT
#define PERSISTENT 0  // 1: one CTA per SM loops over work items (grid and scheduler: see the kernel's comment)
#endif
#ifndef SKIP_KV_LOADS
#define SKIP_KV_LOADS 0  // 1: a timing diagnostic only (no K/V copies, cp.async or TMA: stale tiles, wrong output)
#endif
#ifndef PAGE_ID_PREFETCH
#define PAGE_ID_PREFETCH 0  // 1 (with TMA_KV_LOADS): the next tile's block-table entries are read before the stage wait
#endif
#ifndef SPLIT_KV
#define SPLIT_KV 0  // 1: K and V halves of a stage have their own full / empty barriers (FA3's two pipelines)
#endif
#ifndef EARLY_RESCALE
#define EARLY_RESCALE 0  // 1 (with INTRA_WG_OVERLAP): O is rescaled while Q K^T runs, before P V is issued
#endif
#ifndef DESCRIPTOR_ADDS
#define DESCRIPTOR_ADDS 0  // 1: each wgmma's shared-memory descriptor is a tile's base descriptor + a constant
#endif
#ifndef SKIP_UNIT_RESCALE
#define SKIP_UNIT_RESCALE 0  // 1: a warp skips rescaling O when every correction of its rows is exactly 1
#endif
#ifndef RESCALE_SLACK
#define RESCALE_SLACK 0  // 1: a row's running max moves only when a tile's exceeds it by more than 8 (log2 units)
#endif
#ifndef ORDERED_SOFTMAX
#define ORDERED_SOFTMAX 0  // 1 (with INTRA_WG_OVERLAP): tile k's softmax is kept before the wait for tile k-1's P V
#endif
#ifndef KV_RUNS
#define KV_RUNS 0  // 1 (with TMA_KV_LOADS): a tile whose pages are consecutive cache blocks comes in one box per column block
#endif
#if KV_RUNS && !TMA_KV_LOADS
#error "K/V runs are a TMA load path"
#endif
#ifndef Q_REGISTERS
#define Q_REGISTERS 0  // 1 (head_dim 128): Q K^T takes Q as A fragments in registers, loaded once per work item
#endif
#if Q_REGISTERS && (HEAD_DIM != 128 || !INTRA_WG_OVERLAP)
// (without the overlap, ptxas of CUDA 13 gives Q's registers to the softmax and P after the first tile:
// the SASS's P V HGMMAs read R152.. like Q K^T's, and E1's GPU tests failed from the second tile on)
#error "Q in registers is built for head_dim 128 (32 registers; 64 at 256 do not fit beside O) with the overlapped loop"
#endif
#ifndef LEAN_ARRIVALS
#define LEAN_ARRIVALS 0  // 1: one "empty" arrival per consumer warp, one counted "full" arrival per TMA tile
#endif
#if TMA_KV_LOADS && (BLOCK_N % PAGE_SIZE != 0 || PAGE_SIZE % 8 != 0 || PAGE_SIZE > 256)
#error "TMA K/V loads need whole pages of a multiple of 8 tokens per K/V tile"
#endif
#if KV_MULTICAST && (!TMA_KV_LOADS || !KV_HEAD_MAJOR_GRID || PERSISTENT)
#error "K/V multicast takes TMA loads on the KV-head-major grid, one work item per CTA pair"
#endif
#ifndef HEAD_PAIRS
#define HEAD_PAIRS 0  // 1: a CTA's consumer warpgroups take two query heads of one KV head, 64 queries each
#endif
#if HEAD_PAIRS && (KV_MULTICAST || HEAD_DIM != 128)
#error "head pairs are built for head_dim 128, without K/V multicast"
#endif
#define ITEM_ROWS (HEAD_PAIRS ? 64 : BLOCK_M)  // queries of one work item
#if PERSISTENT && HEAD_DIM != 128
#error "the persistent schedule is built for head_dim 128 (at 256 its consumers spill registers)"
#endif
#if INTRA_WG_OVERLAP && STAGES < 2
#error "the overlapped consumer loop needs at least 2 K/V stages"
#endif
#define NUM_THREADS 384
#define D_BLOCKS (HEAD_DIM / 64)
#define O_CHUNKS (HEAD_DIM / 128)             // wgmma n=128 column chunks of O
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232                     // 128 * 40 + 256 * 232 <= 65536

#define Q_BYTES (D_BLOCKS * BLOCK_M * 128)
#define KV_TILE_BYTES (D_BLOCKS * BLOCK_N * 128)
#define STAGE_BYTES (2 * KV_TILE_BYTES)
#define BARRIER_OFFSET (Q_BYTES + STAGES * STAGE_BYTES)
// + 1024 so the tiles can start on a 1024-byte boundary (the swizzle atom)
// mbarriers: Q, full[STAGES], empty[STAGES], full_v[STAGES], empty_v[STAGES] (SPLIT_KV; reserved either way)
#define SHARED_BYTES (BARRIER_OFFSET + 8 * (1 + 4 * STAGES) + 1024)

// ---- shared memory, mbarriers, async copies ----------------------------------------------------

// `count` arrivals at once.
__device__ __forceinline__ void mbar_arrive_count(u32 bar, u32 count) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar), "r"(count) : "memory");
}

// A consumer warp is done with a K/V stage. KV_MULTICAST: the next copies into it come from both
// CTAs of the pair, so both CTAs' empty barriers hear of it (one arrival per warp).
__device__ __forceinline__ void release_stage(u32 bar, int lane) {
#if KV_MULTICAST
    __syncwarp();
    if (lane == 0) {
        mbar_arrive_cluster(bar, 0);
        mbar_arrive_cluster(bar, 1);
    }
#elif LEAN_ARRIVALS
    __syncwarp();  // every lane's wgmma reads of the stage are complete (each waited on its group)
    if (lane == 0) mbar_arrive(bar);
#else
    mbar_arrive(bar);
#endif
}

// ---- wgmma -----------------------------------------------------------------------------------------

// Warpgroup turn-taking: a warpgroup waits on its own named barrier (ids 1, 2) before issuing
// its wgmmas and arrives on the other's after, so one's softmax overlaps the other's matmuls.
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

// ---- consumer steps --------------------------------------------------------------------------------

struct SoftmaxState {
    int query_pos;        // position of fragment row `row` (row + 8 is query_pos + 8)
    int first_query_pos;  // this warpgroup's first query position
    int col;              // fragment column inside each 8-column group
    float m[2];           // running max (log2 units) of rows row, row + 8
    float l[2];           // running sum of this thread's P values of those rows
};

#if Q_REGISTERS
// D[64 x 128] (+)= A[64 x 16] * B[16 x 128], A from registers (each warp's mma.m16n8k16 A fragment),
// B K-major in shared memory; scale_d == 0 overwrites D.
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const u32 (&a)[4], u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : HOPPER_ACC64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// This warpgroup's Q rows (64 of the tile from `q_rows`) as A fragments: qa[kk] holds dims
// 16 kk .. 16 kk + 15 of rows warp * 16 + lane / 4 (+ 8), read from the 128-byte-swizzled Q tile.
__device__ __forceinline__ void load_q_fragments(u32 (&qa)[HEAD_DIM / 16][4], u32 q_rows, int lane, int warp) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = warp * 16 + lane / 4 + 8 * (e & 1), col = kk * 16 + (e >> 1) * 8 + 2 * (lane % 4);
            const u32 addr = q_rows + (col / 64) * (BLOCK_M * 128) + swizzled(row, (col % 64) / 8) + (col % 8) * 2;
            asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(qa[kk][e]) : "r"(addr));
        }
}

// S = Q K^T with Q from registers (Q_REGISTERS): the wgmmas read only K from shared memory.
__device__ __forceinline__ void issue_qk(float (&s)[BLOCK_N / 2], const u32 (&qa)[HEAD_DIM / 16][4], u32 k_smem) {
    wgmma_fence();
#if DESCRIPTOR_ADDS
    const u64 desc_k = smem_desc(k_smem, 16, 1024);
#endif
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#if DESCRIPTOR_ADDS
        const u64 desc_b = desc_k + ((kk / 4) * (BLOCK_N * 128) + (kk % 4) * 32) / 16;
#else
        const u64 desc_b = smem_desc(k_smem + (kk / 4) * (BLOCK_N * 128) + (kk % 4) * 32, 16, 1024);
#endif
        wgmma_rs_n128(s, qa[kk], desc_b, kk > 0);
    }
    wgmma_commit();
}
#endif

// S = Q K^T for this warpgroup's 64 rows: 16-wide k steps walk 32 bytes along the swizzled rows.
__device__ __forceinline__ void issue_qk(float (&s)[BLOCK_N / 2], u32 q_rows, u32 k_smem) {
    wgmma_fence();
#if DESCRIPTOR_ADDS
    const u64 desc_q = smem_desc(q_rows, 16, 1024), desc_k = smem_desc(k_smem, 16, 1024);
#endif
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#if DESCRIPTOR_ADDS
        // the address field counts 16-byte units; no carry leaves it (shared addresses < 256 KB)
        const u64 desc_a = desc_q + ((kk / 4) * (BLOCK_M * 128) + (kk % 4) * 32) / 16;
        const u64 desc_b = desc_k + ((kk / 4) * (BLOCK_N * 128) + (kk % 4) * 32) / 16;
#else
        const u64 desc_a = smem_desc(q_rows + (kk / 4) * (BLOCK_M * 128) + (kk % 4) * 32, 16, 1024);
        const u64 desc_b = smem_desc(k_smem + (kk / 4) * (BLOCK_N * 128) + (kk % 4) * 32, 16, 1024);
#endif
#if BLOCK_N == 128
        wgmma_ss_n128(s, desc_a, desc_b, kk > 0);
#else
        wgmma_ss_n64(s, desc_a, desc_b, kk > 0);
#endif
    }
    wgmma_commit();
}

// O += P V: the V tile is read N-major (its rows are keys, its 128-byte column blocks are dims).
__device__ __forceinline__ void issue_pv(float (&o)[O_CHUNKS][64], const u32 (&p)[BLOCK_N / 16][4], u32 v_smem) {
    wgmma_fence();
#if DESCRIPTOR_ADDS
    const u64 desc_v = smem_desc(v_smem, BLOCK_N * 128, 1024);
#endif
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
        for (int c = 0; c < O_CHUNKS; ++c) {
#if DESCRIPTOR_ADDS
            const u64 desc_b = desc_v + (c * 2 * (BLOCK_N * 128) + kk * 16 * 128) / 16;
#else
            const u64 desc_b = smem_desc(v_smem + c * 2 * (BLOCK_N * 128) + kk * 16 * 128, BLOCK_N * 128, 1024);
#endif
            wgmma_rs_n128_tb(o[c], p[kk], desc_b);
        }
    wgmma_commit();
}

// Causal mask (only on tiles reaching past the warpgroup's first query), running max / sum, and
// S <- exp2(S scale - m) in place; `correction` rescales O (and was applied to l) for the new max.
__device__ __forceinline__ void softmax_in_place(float (&s)[BLOCK_N / 2], float (&correction)[2],
                                                 SoftmaxState& state, int k0, float scale_log2) {
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
        // finite from the first tile on: key 0 is visible to every row
#if RESCALE_SLACK
        // the running max stays while the tile's exceeds it by at most 8 (P <= 2^8, exact in bf16's
        // exponent range), so after the first tiles a row's correction is nearly always exactly 1
        const float m_tile = row_max[h] * scale_log2;
        const float m_new = m_tile > state.m[h] + 8.f ? m_tile : state.m[h];
#else
        const float m_new = fmaxf(state.m[h], row_max[h] * scale_log2);
#endif
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

// P (in S's registers) -> bf16 A fragments: 8-column groups 2kk and 2kk+1 make keys 16kk .. 16kk+15.
// Written only once the previous P V wgmma, which reads `p`, has completed.
__device__ __forceinline__ void pack_p(const float (&s)[BLOCK_N / 2], u32 (&p)[BLOCK_N / 16][4]) {
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) {
        p[j / 2][(j % 2) * 2] = pack_bf16x2(s[4 * j], s[4 * j + 1]);
        p[j / 2][(j % 2) * 2 + 1] = pack_bf16x2(s[4 * j + 2], s[4 * j + 3]);
    }
}

__device__ __forceinline__ void rescale(float (&o)[O_CHUNKS][64], const float (&correction)[2]) {
#if SKIP_UNIT_RESCALE
    // once a row's max has settled its correction is exactly 1: the 64 multiplies change nothing
    if (!__any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f)) return;
#endif
#pragma unroll
    for (int c = 0; c < O_CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            o[c][4 * j] *= correction[0];
            o[c][4 * j + 1] *= correction[0];
            o[c][4 * j + 2] *= correction[1];
            o[c][4 * j + 3] *= correction[1];
        }
}

// ---- the kernel ------------------------------------------------------------------------------------

// One unit of work: BLOCK_M queries of one sequence (prefill tile `tile`) and one query head.
// HEAD_PAIRS: ITEM_ROWS (64) queries, half `head & 1 ? 0 : 1` of the tile (the later half, with more
// keys, for the even head), and query heads `head & ~1` (consumer warpgroup 0) and `(head & ~1) + 1`
// (warpgroup 1), which share their KV head: each K/V tile is loaded once for both. The item count is
// the same (two halves x half as many head pairs). A half past the tile's last query has no rows.
struct WorkItem {
    int head, seq, first_token, q0, rows, context_start, kv_end, num_kv_tiles;
};

__device__ __forceinline__ WorkItem work_item(int head, int tile, const int* __restrict__ tile_seq,
                                              const int* __restrict__ tile_query, const int* __restrict__ query_start,
                                              const int* __restrict__ context_lens) {
    WorkItem w;
    w.seq = tile_seq[tile];
    w.first_token = query_start[w.seq];
    const int num_new = query_start[w.seq + 1] - w.first_token;
    w.context_start = context_lens[w.seq] - num_new;  // position of the first new token
#if HEAD_PAIRS
    w.head = head & ~1;
    w.q0 = tile_query[tile] + ((head & 1) ? 0 : ITEM_ROWS);
    w.rows = max(0, min(ITEM_ROWS, num_new - w.q0));
#else
    w.head = head;
    w.q0 = tile_query[tile];
    w.rows = min(BLOCK_M, num_new - w.q0);
#endif
    w.kv_end = w.context_start + w.q0 + w.rows;  // last query position + 1
    w.num_kv_tiles = w.rows > 0 ? (w.kv_end + BLOCK_N - 1) / BLOCK_N : 0;
    return w;
}

// Work item `item` of the launch's num_heads * num_tiles in the grid's order (below).
__device__ __forceinline__ void item_head_tile(int item, int num_tiles, int num_heads, int num_kv_heads, int& head,
                                               int& tile) {
#if KV_HEAD_MAJOR_GRID
    const int group = num_heads / num_kv_heads;
    const int x = item % (group * num_tiles), y = item / (group * num_tiles);
    head = y * group + x % group;
    tile = x / group;
#else
    head = item % num_heads;
    tile = item / num_heads;
#endif
}

// Grid (num_heads, num_tiles): the heads of one tile run next to each other (GQA heads share K/V
// in L2), tiles in the order of tile_seq / tile_query (longest key range first).
// KV_HEAD_MAJOR_GRID: grid (group * num_tiles, num_kv_heads), group = num_heads / num_kv_heads:
// blocks run KV head by KV head, so the CTAs resident at once stream one KV head's K/V (8 MB at
// 16k tokens, L2-resident) rather than every head's; inside a KV head, tiles in the same order
// with the group's query heads next to each other.
// KV_MULTICAST: clusters of 2 CTAs along x, i.e. query heads 2i and 2i+1 of one KV head on the same
// tile (group even): each TMA tile is copied once for the pair, half the pages from each CTA.
// PERSISTENT: grid (min(SMs, items), 1); CTA b takes work item b, then the next unclaimed one
// (in the same order: longest first, so greedy, as the hardware dispatches blocks) from the
// counter scheduler[0], until none is left. The producer claims the next item once it has issued
// the current one's loads and loads its Q tile as soon as the consumers' last Q K^T is done, so
// one item's last softmax, P V and stores overlap the next one's first loads. The last CTA to
// finish resets scheduler[0..1] to 0 for the next launch (launches sharing a scheduler must not
// overlap).
#if KV_MULTICAST
#define CLUSTER_ATTRIBUTE __cluster_dims__(2, 1, 1)
#else
#define CLUSTER_ATTRIBUTE
#endif
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) CLUSTER_ATTRIBUTE
prefill_attention_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                       const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
                       int max_blocks_per_seq, const int* __restrict__ query_start,
                       const int* __restrict__ context_lens, const int* __restrict__ tile_seq,
                       const int* __restrict__ tile_query, bf16* __restrict__ out, int num_heads,
                       int num_kv_heads, int block_size, float scale_log2,
#if TMA_KV_LOADS
                       const __grid_constant__ TensorMap k_map_param, const __grid_constant__ TensorMap v_map_param,
#if KV_RUNS
                       // the same caches with a box of BLOCK_N tokens (tensor_maps.page_maps, box_tokens=BLOCK_N)
                       const __grid_constant__ TensorMap k_run_map_param, const __grid_constant__ TensorMap v_run_map_param,
#endif
#else
                       const void* k_map_param, const void* v_map_param,  // NULL: unused
#endif
                       int num_tiles, int* __restrict__ scheduler) {
    extern __shared__ uint4 smem_raw[];
    const u32 raw_base = (u32)__cvta_generic_to_shared(smem_raw);
    const u32 base = (raw_base + 1023) & ~1023u;
    const u32 q_smem = base;
    const u32 bar_q = base + BARRIER_OFFSET;
    const u32 bar_full = bar_q + 8;                // [STAGES]
    const u32 bar_empty = bar_full + 8 * STAGES;  // [STAGES]
    // SPLIT_KV: bar_full / bar_empty track a stage's K half, bar_full_v / bar_empty_v its V half (Q K^T
    // waits for K only, and K is released once S has landed); otherwise the first two track both
#if SPLIT_KV
    const u32 bar_full_v = bar_empty + 8 * STAGES;     // [STAGES]
    const u32 bar_empty_v = bar_full_v + 8 * STAGES;  // [STAGES]
#else
    const u32 bar_full_v = bar_full, bar_empty_v = bar_empty;
    (void)bar_full_v;
#endif
#if PERSISTENT
    // the consumers are done reading the Q tile; the producer has published the next item
    __shared__ alignas(8) u64 persistent_bars[2];
    __shared__ int published_item;  // the consumers' next item (written after they read the previous one)
    __shared__ int claimed_item;    // producer thread 0's claim, to the other producer threads
    const u32 bar_q_free = (u32)__cvta_generic_to_shared(&persistent_bars[0]);
    const u32 bar_item = (u32)__cvta_generic_to_shared(&persistent_bars[1]);
    const int num_items = num_heads * num_tiles;
#endif
#if BATCHED_PAGE_READS || TMA_KV_LOADS
    if (block_size != PAGE_SIZE) __trap();  // compiled for another KV block size
#endif

    if (threadIdx.x == 0) {
        mbar_init(bar_q, 128);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full + 8 * s, 128);   // one arrival per producer thread
#if KV_MULTICAST
            constexpr u32 releases = 16;  // one arrival per consumer warp of both CTAs of the pair
#elif LEAN_ARRIVALS
            constexpr u32 releases = 8;  // one arrival per consumer warp
#else
            constexpr u32 releases = 256;  // one arrival per consumer thread
#endif
            mbar_init(bar_empty + 8 * s, releases);
#if SPLIT_KV
            mbar_init(bar_full_v + 8 * s, 128);
            mbar_init(bar_empty_v + 8 * s, releases);
#endif
        }
#if PERSISTENT
        mbar_init(bar_q_free, 256);
        mbar_init(bar_item, 1);
#endif
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
#if KV_MULTICAST
    cluster_sync();  // the pair's barriers are ready before either's copies reach them
    const u32 pair_rank = cluster_cta_rank();
#else
    __syncthreads();
#endif

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        // ---------------- producer ----------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        const int t = threadIdx.x;
        constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row
        constexpr int ROWS_PER_PASS = 128 / CHUNKS;
        const int chunk = t % CHUNKS, row0 = t / CHUNKS;
        const size_t token_stride = (size_t)num_kv_heads * HEAD_DIM;
#if BATCHED_PAGE_READS
        constexpr int ROWS = BLOCK_N / ROWS_PER_PASS;  // rows of a K/V tile this thread copies
        constexpr int PAGE_BATCH = HEAD_DIM == 256 ? 4 : 8;  // what fits the producer's 40 registers
        static_assert(ROWS % PAGE_BATCH == 0, "K/V rows per producer thread come in whole batches");
#endif
#if TMA_KV_LOADS
        constexpr int PAGES = BLOCK_N / PAGE_SIZE;
        const void* k_map = &k_map_param;
        const void* v_map = &v_map_param;
        if (t == 0) {
            prefetch_tensor_map(k_map);
            prefetch_tensor_map(v_map);
        }
#if KV_RUNS
        const void* k_run_map = &k_run_map_param;
        const void* v_run_map = &v_run_map_param;
        if (t == 0) {
            prefetch_tensor_map(k_run_map);
            prefetch_tensor_map(v_run_map);
        }
#endif
#endif
        // One work item's Q tile, then its K/V tiles into the ring from ring position g0 on.
        auto produce = [&](const WorkItem& w, int g0) {
            const int kv_head = w.head / (num_heads / num_kv_heads);
            const int* table = block_tables + (size_t)w.seq * max_blocks_per_seq;
            const int kv_end = w.kv_end;
            for (int r = row0; r < BLOCK_M; r += ROWS_PER_PASS) {
                // HEAD_PAIRS: rows 0-63 are the first head's queries, rows 64-127 the second's (same queries)
                const int query = r % ITEM_ROWS, head = w.head + r / ITEM_ROWS;
                const bool valid = query < w.rows;
                const bf16* src =
                    valid ? q + ((size_t)(w.first_token + w.q0 + query) * num_heads + head) * HEAD_DIM + chunk * 8 : q;
                cp_async16(q_smem + (chunk / 8) * (BLOCK_M * 128) + swizzled(r, chunk % 8), src, valid);
            }
            mbar_arrive_on_copies(bar_q);

            const bf16* k_head = k_cache + (size_t)kv_head * HEAD_DIM + chunk * 8;
            const bf16* v_head = v_cache + (size_t)kv_head * HEAD_DIM + chunk * 8;
#if TMA_KV_LOADS
            // Tiles whose BLOCK_N rows are all keys (every one but a ragged last tile) come by TMA:
            // lane p of warp 0 copies page p of the tile, one [PAGE_SIZE rows x 64 dims] box per
            // 128-byte column block of K and of V, into the rows the cp.async path would fill (a
            // page is a multiple of 8 rows, so the swizzle atoms line up). The other producer
            // threads only arrive; the ragged last tile takes the cp.async path below, which
            // zero-fills its rows past the last key (their P is 0, but stale V bits could be NaN).
            const int full_kv_tiles = kv_end / BLOCK_N;
#if PAGE_ID_PREFETCH
            // lane p's page of the next TMA tile, read one tile ahead: its latency overlaps the wait
            // for a free stage instead of following it
            int next_page = t < PAGES && full_kv_tiles > 0 ? table[t] : 0;
#endif
#endif
            for (int kt = 0; kt < w.num_kv_tiles; ++kt) {
                const int g = g0 + kt, stage = g % STAGES;
                if (g >= STAGES) mbar_wait(bar_empty + 8 * stage, ((g / STAGES) - 1) & 1);
                const u32 k_smem = base + Q_BYTES + stage * STAGE_BYTES + (chunk / 8) * (BLOCK_N * 128);
                const u32 v_smem = k_smem + KV_TILE_BYTES;
                const int k0 = kt * BLOCK_N;
#if TMA_KV_LOADS
                if (kt < full_kv_tiles) {
#if PAGE_ID_PREFETCH
                    const int page = next_page;
                    next_page = t < PAGES && kt + 1 < full_kv_tiles ? table[(k0 + BLOCK_N) / PAGE_SIZE + t] : 0;
#else
                    const int page = t < PAGES ? table[k0 / PAGE_SIZE + t] : 0;
#endif
#if KV_RUNS
                    // the tile's pages are consecutive cache blocks (a fresh prompt's usually are: the block
                    // pool hands out its free queue in order): one BLOCK_N-token box per column block of K
                    // and of V (4 copies at head_dim 128) instead of one per page (32), each far larger
                    bool run = false;
                    if (t < 32) {
                        const int first = __shfl_sync(0xffffffffu, page, 0);
                        run = __all_sync(0xffffffffu, t >= PAGES || page == first + t);
                    }
#endif
                    // the TMA boxes of halves first_half .. last_half (0: K, 1: V) of the tile, counted on `bar`
                    auto copy_boxes = [&](int first_half, int last_half, u32 bar, u32 bytes) {
                        if (t < 32) {
                            if (t == 0) {
                                mbar_arrive_expect_bytes(bar, SKIP_KV_LOADS ? 0 : bytes);
#if LEAN_ARRIVALS
                                mbar_arrive_count(bar, 127);  // the other producer threads', after the bytes
#endif
                            }
                            __syncwarp();  // the expected bytes are counted before any copy can land
#if KV_MULTICAST
                            // the pair's two query heads read the same K/V tile: each CTA copies every
                            // other page into both CTAs' stage, so each tile crosses from L2 once
                            const bool copies = t < PAGES && (t & 1) == (int)pair_rank;
#else
                            const bool copies = t < PAGES;
#endif
#if KV_RUNS
                            if (run) {
                                if (t == 0 && !SKIP_KV_LOADS) {
                                    const u32 tile = base + Q_BYTES + stage * STAGE_BYTES;
                                    for (int half = first_half; half <= last_half; ++half)
#pragma unroll
                                        for (int c = 0; c < D_BLOCKS; ++c) {
                                            const u32 dst = tile + half * KV_TILE_BYTES + c * (BLOCK_N * 128);
                                            const void* map = half ? v_run_map : k_run_map;
#if KV_MULTICAST
                                            // the pair's CTAs take alternate boxes, each into both CTAs
                                            // (both read the same block table, so both see the run)
                                            if (((half * D_BLOCKS + c) & 1) == (int)pair_rank)
                                                tma_load_3d_multicast(dst, map, c * 64, kv_head, page * PAGE_SIZE,
                                                                      bar, 3);
#else
                                            tma_load_3d(dst, map, c * 64, kv_head, page * PAGE_SIZE, bar);
#endif
                                        }
                                }
                            } else
#endif
                            if (copies && !SKIP_KV_LOADS) {
                                const u32 k_page = base + Q_BYTES + stage * STAGE_BYTES + t * (PAGE_SIZE * 128);
                                for (int half = first_half; half <= last_half; ++half)
#pragma unroll
                                    for (int c = 0; c < D_BLOCKS; ++c) {
                                        const u32 dst = k_page + half * KV_TILE_BYTES + c * (BLOCK_N * 128);
                                        const void* map = half ? v_map : k_map;
#if KV_MULTICAST
                                        tma_load_3d_multicast(dst, map, c * 64, kv_head, page * PAGE_SIZE, bar, 3);
#else
                                        tma_load_3d(dst, map, c * 64, kv_head, page * PAGE_SIZE, bar);
#endif
                                    }
                            }
                        }
#if !LEAN_ARRIVALS
                        if (t != 0) mbar_arrive(bar);
#endif
                    };
#if SPLIT_KV
                    // K as soon as its half of the stage is free, V once the other half is
                    copy_boxes(0, 0, bar_full + 8 * stage, KV_TILE_BYTES);
                    if (g >= STAGES) mbar_wait(bar_empty_v + 8 * stage, ((g / STAGES) - 1) & 1);
                    copy_boxes(1, 1, bar_full_v + 8 * stage, KV_TILE_BYTES);
#else
                    copy_boxes(0, 1, bar_full + 8 * stage, STAGE_BYTES);
#endif
                    continue;
                }
#endif
#if SPLIT_KV
                if (g >= STAGES) mbar_wait(bar_empty_v + 8 * stage, ((g / STAGES) - 1) & 1);
#endif
#if BATCHED_PAGE_READS
                // block-table reads in batches (in flight together), then their copies; rows past
                // the last query read block 0 for an address and copy zeros
#pragma unroll
                for (int batch = 0; batch < ROWS; batch += PAGE_BATCH) {
                    int page[PAGE_BATCH];
#pragma unroll
                    for (int i = 0; i < PAGE_BATCH; ++i) {
                        const int token = k0 + row0 + (batch + i) * ROWS_PER_PASS;
                        page[i] = token < kv_end ? table[token / PAGE_SIZE] : 0;
                    }
#pragma unroll
                    for (int i = 0; i < PAGE_BATCH; ++i) {
                        const int r = row0 + (batch + i) * ROWS_PER_PASS, token = k0 + r;
                        const size_t offset = ((size_t)page[i] * PAGE_SIZE + token % PAGE_SIZE) * token_stride;
                        const u32 dst = swizzled(r, chunk % 8);
                        if (!SKIP_KV_LOADS) {
                            cp_async16(k_smem + dst, k_head + offset, token < kv_end);
                            cp_async16(v_smem + dst, v_head + offset, token < kv_end);
                        }
                    }
                }
#else
                for (int r = row0; r < BLOCK_N; r += ROWS_PER_PASS) {
                    const int token = k0 + r;
                    const bool valid = token < kv_end;
                    const size_t offset =
                        valid ? ((size_t)table[token / block_size] * block_size + token % block_size) * token_stride : 0;
                    const u32 dst = swizzled(r, chunk % 8);
                    if (!SKIP_KV_LOADS) {
                        cp_async16(k_smem + dst, k_head + offset, valid);
                        cp_async16(v_smem + dst, v_head + offset, valid);
                    }
                }
#endif
                mbar_arrive_on_copies(bar_full + 8 * stage);
#if SPLIT_KV
                // the cp.async tiles (short contexts, a ragged last tile) land K and V together
                mbar_arrive_on_copies(bar_full_v + 8 * stage);
#endif
            }
        };
#if PERSISTENT
        int item = blockIdx.x, ring = 0;
        for (int j = 0;; ++j) {
            if (j > 0) mbar_wait(bar_q_free, (j - 1) & 1);  // also: every thread has read the previous item
            if (t == 0) {
                published_item = item;
                mbar_arrive(bar_item);
            }
            if (item >= num_items) break;
            int head, tile;
            item_head_tile(item, num_tiles, num_heads, num_kv_heads, head, tile);
            const WorkItem w = work_item(head, tile, tile_seq, tile_query, query_start, context_lens);
            produce(w, ring);
            ring += w.num_kv_tiles;
            // Claimed once this item's loads are issued, i.e. about STAGES tiles before its consumers
            // finish, so items go to the CTA that frees up first (greedy, longest first), and the
            // claim's latency hides behind those last tiles. To every producer thread:
            if (t == 0) claimed_item = atomicAdd(scheduler, 1) + gridDim.x;
            asm volatile("bar.sync 3, 128;\n" ::: "memory");
            item = claimed_item;
            asm volatile("bar.sync 3, 128;\n" ::: "memory");  // read before thread 0 republishes it
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        if (t == 0) __threadfence();  // this CTA's claims are performed before it counts itself done
        if (t == 0 && atomicAdd(scheduler + 1, 1) == (int)gridDim.x - 1) {  // every CTA has claimed its last
            atomicExch(scheduler, 0);
            atomicExch(scheduler + 1, 0);
        }
#else
#if KV_HEAD_MAJOR_GRID
        const int group = num_heads / num_kv_heads;
        const int head = blockIdx.y * group + blockIdx.x % group, tile = blockIdx.x / group;
#else
        const int head = blockIdx.x, tile = blockIdx.y;
#endif
        produce(work_item(head, tile, tile_seq, tile_query, query_start, context_lens), 0);
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // exit with no copies in flight
#endif
    } else {
        // ---------------- consumers ----------------
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
        const int wg = warpgroup - 1;  // 64-row half of the query tile
        const int t = threadIdx.x % 128;
        const int warp = t / 32, lane = t % 32;
        // fragment rows `row` and `row + 8` of the item's queries (HEAD_PAIRS: each warpgroup's head has them all)
        const int row = (HEAD_PAIRS ? 0 : wg * 64) + warp * 16 + lane / 4;
        const u32 q_rows = q_smem + wg * 64 * 128;
        const u32 stages = base + Q_BYTES;
#if ORDERED_SOFTMAX
        __shared__ alignas(8) float order_sink_slot[2];  // written, never read: see the loop
        const u32 order_sink = (u32)__cvta_generic_to_shared(order_sink_slot);
#endif

        // One work item (its j-th on this CTA) with K/V tiles at ring positions g0, g0 + 1, ...
        auto consume = [&](const WorkItem& w, int g0, int j) {
            const int num_kv_tiles = w.num_kv_tiles;
            SoftmaxState state;
            state.query_pos = w.context_start + w.q0 + row;
            state.first_query_pos = w.context_start + w.q0 + (HEAD_PAIRS ? 0 : wg * 64);
            state.col = 2 * (lane % 4);
            state.m[0] = state.m[1] = -INFINITY;
            state.l[0] = state.l[1] = 0.f;

            float o[O_CHUNKS][64];
#pragma unroll
            for (int c = 0; c < O_CHUNKS; ++c)
#pragma unroll
                for (int i = 0; i < 64; ++i) o[c][i] = 0.f;
            float s[BLOCK_N / 2];
#pragma unroll
            for (int i = 0; i < BLOCK_N / 2; ++i) s[i] = 0.f;
            u32 p[BLOCK_N / 16][4];  // A fragments of P for keys 16kk .. 16kk+15
            float correction[2];

            mbar_wait(bar_q, j & 1);
#if HEAD_PAIRS
            if (num_kv_tiles == 0) {  // a half past the tile's last query: nothing to compute or store
#if PERSISTENT
                mbar_arrive(bar_q_free);
#endif
                return;
            }
#endif
#if Q_REGISTERS
            u32 qa[HEAD_DIM / 16][4];  // (the Q tile's shared memory is released as before, after the last Q K^T)
            load_q_fragments(qa, q_rows, lane, warp);
#define Q_OPERAND qa
#else
#define Q_OPERAND q_rows
#endif
#if INTRA_WG_OVERLAP
            // S of tile kt is computed, then exponentiated, while P V of tile kt-1 runs on the tensor
            // cores (ORDERED_SOFTMAX keeps ptxas to that order); P and O are touched only after that
            // wgmma has landed.
            if (wg == 1) pass_turn(wg);  // warpgroup 0 issues first
            mbar_wait(bar_full + 8 * (g0 % STAGES), (g0 / STAGES) & 1);
            take_turn(wg);
            issue_qk(s, Q_OPERAND, stages + (g0 % STAGES) * STAGE_BYTES);
            pass_turn(wg);
            wgmma_wait<0>();
#if SPLIT_KV
            release_stage(bar_empty + 8 * (g0 % STAGES), lane);  // K of the first tile is read
#endif
#if PERSISTENT
            if (num_kv_tiles == 1) mbar_arrive(bar_q_free);  // the last Q K^T has landed
#endif
            softmax_in_place(s, correction, state, 0, scale_log2);
            pack_p(s, p);
            for (int kt = 1; kt < num_kv_tiles; ++kt) {
                const int g = g0 + kt, stage = g % STAGES, previous = (g - 1) % STAGES;
                mbar_wait(bar_full + 8 * stage, (g / STAGES) & 1);
                take_turn(wg);
                issue_qk(s, Q_OPERAND, stages + stage * STAGE_BYTES);
#if SPLIT_KV
                mbar_wait(bar_full_v + 8 * previous, ((g - 1) / STAGES) & 1);
#endif
#if EARLY_RESCALE
                rescale(o, correction);  // tile kt-1's correction, while Q K^T runs
#endif
                issue_pv(o, p, stages + previous * STAGE_BYTES + KV_TILE_BYTES);
                pass_turn(wg);
                wgmma_wait<1>();  // S of tile kt
#if SPLIT_KV
                release_stage(bar_empty + 8 * stage, lane);  // K of tile kt is read
#endif
#if PERSISTENT
                if (kt == num_kv_tiles - 1) mbar_arrive(bar_q_free);
#endif
                softmax_in_place(s, correction, state, kt * BLOCK_N, scale_log2);
#if ORDERED_SOFTMAX
                // ptxas otherwise hoists the wait below above the softmax (no data dependency between
                // them), so the softmax would not overlap P V; a shared store of the row sums (they
                // take every P value) is ordered before the wait
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(order_sink), "f"(state.l[0]), "f"(state.l[1])
                             : "memory");
#endif
                wgmma_wait<0>();  // P V of tile kt-1
                release_stage(bar_empty_v + 8 * previous, lane);  // (the whole stage without SPLIT_KV)
                pack_p(s, p);
#if !EARLY_RESCALE
                rescale(o, correction);
#endif
            }
            const int last = (g0 + num_kv_tiles - 1) % STAGES;
#if SPLIT_KV
            mbar_wait(bar_full_v + 8 * last, ((g0 + num_kv_tiles - 1) / STAGES) & 1);
#endif
#if EARLY_RESCALE
            rescale(o, correction);
#endif
            take_turn(wg);
            issue_pv(o, p, stages + last * STAGE_BYTES + KV_TILE_BYTES);
            if (wg == 0) pass_turn(wg);  // (warpgroup 1 issues last: every arrival is matched)
            wgmma_wait<0>();
            release_stage(bar_empty_v + 8 * last, lane);
#else
            if (wg == 1) pass_turn(wg);  // warpgroup 0 issues first
            for (int kt = 0; kt < num_kv_tiles; ++kt) {
                const int g = g0 + kt, stage = g % STAGES;
                mbar_wait(bar_full + 8 * stage, (g / STAGES) & 1);
                take_turn(wg);
                issue_qk(s, Q_OPERAND, stages + stage * STAGE_BYTES);
                pass_turn(wg);
                wgmma_wait<0>();
#if SPLIT_KV
                release_stage(bar_empty + 8 * stage, lane);  // K of tile kt is read
#endif
#if PERSISTENT
                if (kt == num_kv_tiles - 1) mbar_arrive(bar_q_free);
#endif
                softmax_in_place(s, correction, state, kt * BLOCK_N, scale_log2);
                pack_p(s, p);
                rescale(o, correction);
#if SPLIT_KV
                mbar_wait(bar_full_v + 8 * stage, (g / STAGES) & 1);
#endif
                issue_pv(o, p, stages + stage * STAGE_BYTES + KV_TILE_BYTES);
                wgmma_wait<0>();
                release_stage(bar_empty_v + 8 * stage, lane);
            }
            if (wg == 0) take_turn(wg);  // consumes warpgroup 1's last turn: every arrival is matched
#endif
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
                bf16* dst = out + ((size_t)(w.first_token + w.q0 + r) * num_heads + w.head + (HEAD_PAIRS ? wg : 0)) *
                                      HEAD_DIM + state.col;
#pragma unroll
                for (int c = 0; c < O_CHUNKS; ++c)
#pragma unroll
                    for (int jj = 0; jj < 16; ++jj)
                        *reinterpret_cast<__nv_bfloat162*>(dst + c * 128 + 8 * jj) =
                            __floats2bfloat162_rn(o[c][4 * jj + 2 * h] * inv, o[c][4 * jj + 2 * h + 1] * inv);
            }
        };
#if PERSISTENT
        int ring = 0;
        for (int j = 0;; ++j) {
            mbar_wait(bar_item, j & 1);
            const int item = *(volatile int*)&published_item;
            if (item >= num_items) break;
            int head, tile;
            item_head_tile(item, num_tiles, num_heads, num_kv_heads, head, tile);
            const WorkItem w = work_item(head, tile, tile_seq, tile_query, query_start, context_lens);
            consume(w, ring, j);
            ring += w.num_kv_tiles;
        }
#else
#if KV_HEAD_MAJOR_GRID
        const int group = num_heads / num_kv_heads;
        const int head = blockIdx.y * group + blockIdx.x % group, tile = blockIdx.x / group;
#else
        const int head = blockIdx.x, tile = blockIdx.y;
#endif
        consume(work_item(head, tile, tile_seq, tile_query, query_start, context_lens), 0, 0);
#endif
    }
#if KV_MULTICAST
    cluster_sync();  // neither CTA of the pair exits while the other may still arrive on its barriers
#endif
}
