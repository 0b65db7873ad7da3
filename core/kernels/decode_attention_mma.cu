// Paged decode attention (one new query per sequence) on tensor cores, GQA-aware split-KV.
//
// Grid (num_splits, num_kv_heads, num_seqs), DECODE_WARPS warps. A block owns one KV head of one
// sequence and one contiguous, 16-key-aligned slice of its context, and computes all GROUP query
// heads of that KV head, so every KV byte is read from HBM once. Its warps take the slice's
// 16-key tiles round-robin; each warp streams its own tiles through a private DECODE_STAGES-deep
// cp.async pipeline (no block barrier in the main loop) and does, per tile,
//   S[16 x 16] = Q[16 x d] K^T      mma.sync m16n8k16, rows = the GROUP query heads (rest zero)
//   O[16 x d] += softmax-step(S) V   the S accumulators become P's A fragments in registers
// With one split the block writes the normalized bf16 output itself; with several it writes
// unnormalized partials that `decode_attention_merge` combines:
//   partial_out [num_seqs, num_heads, num_splits, HEAD_DIM]   (fp32)
//   partial_ml  [num_seqs, num_heads, num_splits, 2]          (running max (log2 domain), sum)
//
// Shared memory, per warp and stage (16-byte chunks; chunk c of key row r sits at c ^ (r & 7) so
// that ldmatrix's 8 row reads hit distinct banks):
//   [ K tile: 16 keys x HEAD_DIM bf16 | V tile: 16 keys x HEAD_DIM bf16 ]
// After the loop the same memory holds the per-warp (O, m, l) for the block-level merge.
//
// short_query_attention_mma runs the same block for a few new tokens per sequence (rows = 16 /
// GROUP tokens x GROUP heads, each with its own causal key limit), so a warm prefix's last block
// or a short chunk over a long cached context is split over the keys like decode instead of
// running prefill's 128-query tiles with a handful of real rows.
#include "mma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#ifndef DECODE_WARPS
#define DECODE_WARPS 4
#endif
#ifndef DECODE_STAGES  // tiles per warp in flight + 1 (the one being computed on)
#define DECODE_STAGES (HEAD_DIM <= 128 ? 3 : 2)
#endif
#define MERGE_MAX_SPLITS 32

constexpr int TILE_KEYS = 16;
constexpr int ROW_CHUNKS = HEAD_DIM / 8;                 // 16-byte chunks per key row
constexpr int TILE_ELEMS = TILE_KEYS * HEAD_DIM;         // one K (or V) tile, bf16 elements
constexpr int ROWS_PER_PASS = 32 / ROW_CHUNKS;           // key rows one warp-wide copy covers
constexpr int COPIES_PER_LANE = TILE_KEYS / ROWS_PER_PASS;
constexpr float NEG_BIG = -1e30f;
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM must be 64, 128 or 256");
static_assert(GROUP >= 1 && GROUP <= 16, "one mma row block holds at most 16 query heads");

#ifndef DECODE_DYNAMIC_SHARED  // the host emulation supplies a static buffer
#define DECODE_DYNAMIC_SHARED(name) extern __shared__ uint4 name[]
#endif

// cp_async16 (mma.cuh) bypasses L1; L2::128B / 256B prefetch hints measured no different on an
// H100 (within 0.5 %). Under the host emulation its copies complete at once.
#ifdef MMA_HOST_STANDIN
__device__ __forceinline__ void commit_copies() {}
template <int PENDING>
__device__ __forceinline__ void wait_copies() {}
#else
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }
#endif

// Offset (bf16 elements) of 16-byte chunk `chunk` of key row `row` inside a swizzled tile.
__device__ __forceinline__ int tile_offset(int row, int chunk) { return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3); }

// SUBTILES consecutive 16-key tiles (k_tile / v_tile: SUBTILES tiles of TILE_ELEMS each) of a
// warp's online softmax over its 16 query rows: S = Q K^T for all of them in the log2 domain (keys
// at or past a row's limit masked), one running-max update and one rescale of O and of the sum,
// then O += P V subtile by subtile; the S accumulators become P's A fragments in registers.
// `limit[h]`: the keys fragment row frag_row + 8h sees; HALVES: the fragment row halves holding
// real rows (1: rows 8-15 are zero). SUBTILES = 1 is the per-16-key update of the decode kernels;
// more (the shared-tile kernel's SQ_TILE_SOFTMAX) the same attention up to the order of the sums.
template <int HALVES, int SUBTILES>
__device__ __forceinline__ void attend_key_tiles(const unsigned int (&qa)[HEAD_DIM / 16][4], const bf16* k_tile,
                                                 const bf16* v_tile, int token0, const int (&limit)[2],
                                                 float scale_log2, float (&o)[HEAD_DIM / 8][4], float (&m)[2],
                                                 float (&l)[2]) {
    const int lane = threadIdx.x & 31, frag_col = (lane & 3) * 2;
    // ldmatrix lane addresses: K (non-transposed) gives S's B fragments for keys 0-7 | 8-15 of a
    // subtile, V (transposed) gives O's B fragments for two 8-wide dim tiles.
    const int k_row = ((lane >> 4) & 1) * 8 + (lane & 7), k_chunk_lo = (lane >> 3) & 1;
    const int v_row = ((lane >> 3) & 1) * 8 + (lane & 7), v_chunk_lo = lane >> 4;
    float s[2 * SUBTILES][4];
#pragma unroll
    for (int n = 0; n < 2 * SUBTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
        for (int t = 0; t < SUBTILES; ++t) {
            unsigned int b[4];
            ldmatrix_x4(b, k_tile + t * TILE_ELEMS + tile_offset(k_row, 2 * ks + k_chunk_lo));
            mma_bf16_16816(s[2 * t], qa[ks], b[0], b[1]);
            mma_bf16_16816(s[2 * t + 1], qa[ks], b[2], b[3]);
        }
    }
    float row_max[2] = {NEG_BIG, NEG_BIG};
#pragma unroll
    for (int n = 0; n < 2 * SUBTILES; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = token0 + n * 8 + frag_col + (e & 1);
            s[n][e] = key < limit[e >> 1] ? s[n][e] * scale_log2 : -INFINITY;
            row_max[e >> 1] = fmaxf(row_max[e >> 1], s[n][e]);
        }
    }
    float correction[2];
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
        // finite: m starts at NEG_BIG (a short query's row may see none of the keys)
        const float m_new = fmaxf(m[h], row_max[h]);
        correction[h] = exp2f(m[h] - m_new);
        m[h] = m_new;
        l[h] *= correction[h];
    }
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            o[n][2 * h] *= correction[h];
            o[n][2 * h + 1] *= correction[h];
        }
    }
#pragma unroll
    for (int t = 0; t < SUBTILES; ++t) {
        unsigned int pa[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int h = 0; h < HALVES; ++h) {
                const float p0 = exp2f(s[2 * t + n][2 * h] - m[h]), p1 = exp2f(s[2 * t + n][2 * h + 1] - m[h]);
                l[h] += p0 + p1;
                pa[2 * n + h] = pack_bf16x2(p0, p1);  // a0/a1: keys 0-7 rows r/r+8; a2/a3: keys 8-15
            }
        }
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 16; ++j) {
            unsigned int b[4];
            ldmatrix_x4_trans(b, v_tile + t * TILE_ELEMS + tile_offset(v_row, 2 * j + v_chunk_lo));
            mma_bf16_16816(o[2 * j], pa, b[0], b[1]);
            mma_bf16_16816(o[2 * j + 1], pa, b[2], b[3]);
        }
    }
}


// One block's work: KV head `kv_head` of sequence `seq`, split `split` of its keys, for the
// query rows of one mma row block. MULTI_QUERY false (decode): the rows are the GROUP query
// heads of the sequence's one new token. MULTI_QUERY true (short queries): row r is head
// r % GROUP of new token row_block * ROW_TOKENS + r / GROUP, which sees the keys up to its
// own position (causal); `length` then stops at the row block's last token's position + 1.
template <bool MULTI_QUERY>
__device__ __forceinline__ void attend_rows(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                            const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
                                            int max_blocks_per_seq, const int* __restrict__ context_lens,
                                            const int* __restrict__ query_start, bf16* __restrict__ out,
                                            float* __restrict__ partial_out, float* __restrict__ partial_ml,
                                            int num_kv_heads, int block_size, int num_splits, float scale_log2,
                                            int split, int row_block) {
    DECODE_DYNAMIC_SHARED(smem_raw);
    constexpr int ROW_TOKENS = MULTI_QUERY ? 16 / GROUP : 1;  // new tokens per row block
    constexpr int ROWS = ROW_TOKENS * GROUP;                  // real rows of the 16
    constexpr int HALVES = ROWS > 8 ? 2 : 1;                  // fragment row halves holding real rows
    const int kv_head = blockIdx.y, seq = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;  // mma fragment coordinates
    const int num_heads = num_kv_heads * GROUP;
    int length = context_lens[seq];
    // short queries: this block's tokens are query rows first_row .. first_row + block_tokens - 1
    // of the step; the lane's two fragment rows see keys below limit[0] / limit[1]
    int first_row = 0, block_tokens = 1, limit[2] = {length, length};  // decode: every key of the context
    if constexpr (MULTI_QUERY) {
        const int query_begin = query_start[seq], query_len = query_start[seq + 1] - query_begin;
        const int first_token = row_block * ROW_TOKENS;
        if (first_token >= query_len) return;  // the whole block: before any barrier
        block_tokens = min(ROW_TOKENS, query_len - first_token);
        const int first_position = length - query_len + first_token;  // keys the first token sees - 1
        first_row = query_begin + first_token;
        length = first_position + block_tokens;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int token = (frag_row + 8 * h) / GROUP;
            limit[h] = frag_row + 8 * h < ROWS && token < block_tokens ? first_position + token + 1 : 0;
        }
    }
    const int num_tiles = (length + TILE_KEYS - 1) / TILE_KEYS;
    const int tiles_per_split = (num_tiles + num_splits - 1) / num_splits;
    const int tile_begin = min(num_tiles, split * tiles_per_split);
    const int tile_end = min(num_tiles, tile_begin + tiles_per_split);
    // this warp's tiles: tile_begin + warp + i * DECODE_WARPS, i < my_tiles
    const int my_tiles = max(0, (tile_end - tile_begin - warp + DECODE_WARPS - 1) / DECODE_WARPS);

    bf16* my_stages = reinterpret_cast<bf16*>(smem_raw) + warp * DECODE_STAGES * 2 * TILE_ELEMS;
    const int* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const size_t token_stride = (size_t)num_kv_heads * HEAD_DIM;
    const bf16* k_head = k_cache + (size_t)kv_head * HEAD_DIM;
    const bf16* v_head = v_cache + (size_t)kv_head * HEAD_DIM;
    // Block sizes that are multiples of 16 keep a tile inside one block: one table read per tile.
    const bool tile_in_one_block = block_size % TILE_KEYS == 0;
    const int copy_chunk = lane % ROW_CHUNKS, copy_row = lane / ROW_CHUNKS;

    auto tile_token = [&](int i) { return (tile_begin + warp + i * DECODE_WARPS) * TILE_KEYS; };
    auto first_slot = [&](int i) {  // cache slot of tile i's first key (tile_in_one_block only)
        const int token = tile_token(i);
        return table[token / block_size] * block_size + token % block_size;
    };
    auto issue_tile = [&](int i, int slot0) {
        bf16* k_dst = my_stages + (i % DECODE_STAGES) * 2 * TILE_ELEMS;
        bf16* v_dst = k_dst + TILE_ELEMS;
        const int token0 = tile_token(i);
#pragma unroll
        for (int j = 0; j < COPIES_PER_LANE; ++j) {
            const int row = copy_row + j * ROWS_PER_PASS, token = token0 + row;
            const bool valid = token < length;
            size_t offset = 0;
            if (valid) {
                const int slot = tile_in_one_block ? slot0 + row
                                                   : table[token / block_size] * block_size + token % block_size;
                offset = (size_t)slot * token_stride + copy_chunk * 8;
            }
            cp_async16(k_dst + tile_offset(row, copy_chunk), k_head + offset, valid);
            cp_async16(v_dst + tile_offset(row, copy_chunk), v_head + offset, valid);
        }
    };

    // Start the pipeline early: its loads overlap the Q fragment loads below.
    int prologue_slot[DECODE_STAGES];
#pragma unroll
    for (int i = 0; i < DECODE_STAGES; ++i) prologue_slot[i] = tile_in_one_block && i < my_tiles ? first_slot(i) : 0;
#pragma unroll
    for (int i = 0; i < DECODE_STAGES - 1; ++i) {
        if (i < my_tiles) issue_tile(i, prologue_slot[i]);
        commit_copies();
    }
    int next_slot = prologue_slot[DECODE_STAGES - 1];  // first key's slot of the next tile to issue

    // Q as A fragments: decode row r = query head kv_head * GROUP + r (rows >= GROUP are zero);
    // short queries: the rows above (rows of tokens past the query are zero).
    const bf16* q_group = q + ((size_t)seq * num_heads + (size_t)kv_head * GROUP) * HEAD_DIM;
    unsigned int qa[HEAD_DIM / 16][4];
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = frag_row + (e & 1) * 8, col = ks * 16 + (e >> 1) * 8 + frag_col;
            if constexpr (MULTI_QUERY) {
                const bool real = row < ROWS && row / GROUP < block_tokens;
                const bf16* q_row = q + ((size_t)(first_row + row / GROUP) * num_heads + kv_head * GROUP + row % GROUP)
                                            * HEAD_DIM;
                qa[ks][e] = real ? *reinterpret_cast<const unsigned int*>(q_row + col) : 0u;
            } else {
                const bool real = (e & 1) ? HALVES == 2 && row < GROUP : row < GROUP;
                qa[ks][e] = real ? *reinterpret_cast<const unsigned int*>(q_group + row * HEAD_DIM + col) : 0u;
            }
        }
    }
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.f, 0.f};  // rows frag_row and frag_row + 8

    for (int i = 0; i < my_tiles; ++i) {
        const int ahead = i + DECODE_STAGES - 1;
        if (ahead < my_tiles) {
            issue_tile(ahead, next_slot);
            if (tile_in_one_block && ahead + 1 < my_tiles) next_slot = first_slot(ahead + 1);
        }
        commit_copies();
        wait_copies<DECODE_STAGES - 1>();  // tile i has landed (this lane's copies)
        __syncwarp();                      // ... and every lane's
        const bf16* k_tile = my_stages + (i % DECODE_STAGES) * 2 * TILE_ELEMS;
        const bf16* v_tile = k_tile + TILE_ELEMS;

        attend_key_tiles<HALVES, 1>(qa, k_tile, v_tile, tile_token(i), limit, scale_log2, o, m, l);
        __syncwarp();  // every lane has read this stage before it is refilled
    }
    wait_copies<0>();
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }

    // Merge the warps through shared memory (the pipeline stages are free now).
    __syncthreads();
    float* merge_o = reinterpret_cast<float*>(smem_raw);         // [DECODE_WARPS][ROWS][HEAD_DIM]
    float* merge_ml = merge_o + DECODE_WARPS * ROWS * HEAD_DIM;  // [DECODE_WARPS][ROWS][2]
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        const int row = frag_row + h * 8;
        if (row < ROWS) {
            float* dst = merge_o + (warp * ROWS + row) * HEAD_DIM + frag_col;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n)
                *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][2 * h], o[n][2 * h + 1]);
            if ((lane & 3) == 0) {
                merge_ml[(warp * ROWS + row) * 2] = m[h];
                merge_ml[(warp * ROWS + row) * 2 + 1] = l[h];
            }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += DECODE_WARPS * 32) {
        const int row = idx / HEAD_DIM, d = idx % HEAD_DIM;
        if (MULTI_QUERY && row / GROUP >= block_tokens) break;  // rows past the query (idx grows)
        float mm = NEG_BIG;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) mm = fmaxf(mm, merge_ml[(w * ROWS + row) * 2]);
        float ll = 0.f, acc = 0.f;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) {
            const float f = exp2f(merge_ml[(w * ROWS + row) * 2] - mm);
            ll += merge_ml[(w * ROWS + row) * 2 + 1] * f;
            acc += merge_o[(w * ROWS + row) * HEAD_DIM + d] * f;
        }
        // the output / partial row: [step token row, head] (decode: the sequence is the token row)
        const size_t head_row = MULTI_QUERY ? (size_t)(first_row + row / GROUP) * num_heads + kv_head * GROUP + row % GROUP
                                            : (size_t)seq * num_heads + kv_head * GROUP + row;
        if (num_splits == 1) {
            out[head_row * HEAD_DIM + d] = __float2bfloat16_rn(ll > 0.f ? acc / ll : 0.f);
        } else {
            const size_t part = head_row * num_splits + split;
            partial_out[part * HEAD_DIM + d] = acc;
            if (d == 0) {
                partial_ml[part * 2] = mm;
                partial_ml[part * 2 + 1] = ll;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32)
decode_attention_mma(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                     const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
                     int max_blocks_per_seq, const int* __restrict__ context_lens, bf16* __restrict__ out,
                     float* __restrict__ partial_out, float* __restrict__ partial_ml, int num_kv_heads,
                     int block_size, int num_splits, float scale_log2) {
    attend_rows<false>(q, k_cache, v_cache, block_tables, max_blocks_per_seq, context_lens, nullptr, out, partial_out,
                       partial_ml, num_kv_heads, block_size, num_splits, scale_log2, blockIdx.x, 0);
}

// Short queries (a few new tokens per sequence over a long cached context: a warm prefix's last
// block, speculative tokens): the decode kernel's split-KV work split with rows = (token, head)
// pairs. q [T, num_heads, HEAD_DIM] and out [T, num_heads * HEAD_DIM] are the step's token rows
// (query_start [B + 1]); partials [T, num_heads, num_splits, ...] as decode_attention_merge reads
// them with T in place of the sequences. Grid (num_splits * row_blocks, num_kv_heads, num_seqs),
// blockIdx.x = split * row_blocks + row block: a split's row blocks run side by side and read the
// same keys (the later ones from L2). Needs GROUP <= 16.
extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32)
short_query_attention_mma(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                          const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
                          int max_blocks_per_seq, const int* __restrict__ context_lens,
                          const int* __restrict__ query_start, int row_blocks, bf16* __restrict__ out,
                          float* __restrict__ partial_out, float* __restrict__ partial_ml, int num_kv_heads,
                          int block_size, int num_splits, float scale_log2) {
    attend_rows<true>(q, k_cache, v_cache, block_tables, max_blocks_per_seq, context_lens, query_start, out,
                      partial_out, partial_ml, num_kv_heads, block_size, num_splits, scale_log2,
                      blockIdx.x / row_blocks, blockIdx.x % row_blocks);
}

// ---- Short queries with the block's KV tiles shared by its warps -----------------------------
// short_query_attention_shared: grid (num_splits * row_groups, num_kv_heads, num_seqs), 4 warps.
// A block owns one KV head of one sequence, one split of the keys and up to 4 mma row blocks of
// query rows (warp w: tokens row_group * 4 * ROW_TOKENS + w * ROW_TOKENS .. + ROW_TOKENS - 1 of
// the sequence's new tokens, ROW_TOKENS = 16 / GROUP, each with its GROUP heads). All 128 threads
// copy each SQ_TILE_KEYS-key K/V tile of the split into a SQ_STAGES-deep cp.async ring, and every
// warp runs its rows over the whole tile (attend_key_tiles), so a tile is read from
// HBM once for up to 64 query rows (16 tokens of a GQA-4 model), where short_query_attention_mma
// reads it once per 16 rows. Each warp owns all of its rows' keys of the split: it writes its
// output (one split) or partials (several; decode_attention_merge) from registers, no block merge.
//
// Shared memory, per stage: [ K tile: SQ_TILE_KEYS keys x HEAD_DIM | V tile: the same ], bf16,
// 16-byte chunks swizzled by tile_offset (key row r's chunk c at c ^ (r & 7)).
constexpr int SQ_WARPS = 4;
constexpr int SQ_THREADS = SQ_WARPS * 32;
constexpr int SQ_TILE_KEYS = HEAD_DIM <= 128 ? 64 : 32;  // 32 KiB of K + V per stage at HEAD_DIM 128 and 256
constexpr int SQ_STAGES = 3;
#ifndef SQ_TILE_SOFTMAX  // 1: one softmax update per SQ_TILE_KEYS keys, 0: per 16 (attend_key_tiles SUBTILES)
#define SQ_TILE_SOFTMAX 0
#endif
constexpr int SQ_TILE_ELEMS = SQ_TILE_KEYS * HEAD_DIM;
constexpr int SQ_ROWS_PER_PASS = SQ_THREADS / ROW_CHUNKS;  // key rows one block-wide copy covers
constexpr int SQ_PASSES = SQ_TILE_KEYS / SQ_ROWS_PER_PASS;
static_assert(SQ_TILE_KEYS % SQ_ROWS_PER_PASS == 0 && SQ_TILE_KEYS % TILE_KEYS == 0, "tile copy shape");

extern "C" __global__ void __launch_bounds__(SQ_THREADS)
short_query_attention_shared(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                             const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
                             int max_blocks_per_seq, const int* __restrict__ context_lens,
                             const int* __restrict__ query_start, int row_groups, bf16* __restrict__ out,
                             float* __restrict__ partial_out, float* __restrict__ partial_ml, int num_kv_heads,
                             int block_size, int num_splits, float scale_log2) {
    DECODE_DYNAMIC_SHARED(smem_raw);
    constexpr int ROW_TOKENS = 16 / GROUP;  // new tokens of one warp
    constexpr int ROWS = ROW_TOKENS * GROUP;
    constexpr int HALVES = ROWS > 8 ? 2 : 1;
    constexpr int BLOCK_TOKENS = SQ_WARPS * ROW_TOKENS;
    const int split = blockIdx.x / row_groups, row_group = blockIdx.x % row_groups;
    const int kv_head = blockIdx.y, seq = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
    const int num_heads = num_kv_heads * GROUP;
    const int query_begin = query_start[seq], query_len = query_start[seq + 1] - query_begin;
    const int block_first_token = row_group * BLOCK_TOKENS;
    if (block_first_token >= query_len) return;  // the whole block: before any barrier
    const int cached = context_lens[seq] - query_len;  // new token t sees keys 0 .. cached + t
    // the block loads the keys its last token sees; a warp computes on those its own rows see
    const int length = cached + min(query_len, block_first_token + BLOCK_TOKENS);
    const int warp_first_token = block_first_token + warp * ROW_TOKENS;
    const int warp_tokens = max(0, min(ROW_TOKENS, query_len - warp_first_token));
    const int warp_length = warp_tokens > 0 ? cached + warp_first_token + warp_tokens : 0;
    int limit[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = frag_row + 8 * h, token = row / GROUP;
        limit[h] = row < ROWS && token < warp_tokens ? cached + warp_first_token + token + 1 : 0;
    }

    const int num_tiles = (length + SQ_TILE_KEYS - 1) / SQ_TILE_KEYS;
    const int tiles_per_split = (num_tiles + num_splits - 1) / num_splits;
    const int tile_begin = min(num_tiles, split * tiles_per_split);
    const int my_tiles = min(num_tiles, tile_begin + tiles_per_split) - tile_begin;

    bf16* stages = reinterpret_cast<bf16*>(smem_raw);
    const int* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const size_t token_stride = (size_t)num_kv_heads * HEAD_DIM;
    const bf16* k_head = k_cache + (size_t)kv_head * HEAD_DIM;
    const bf16* v_head = v_cache + (size_t)kv_head * HEAD_DIM;
    const int copy_chunk = threadIdx.x % ROW_CHUNKS, copy_row = threadIdx.x / ROW_CHUNKS;

    // cache slots of this thread's key rows of tile i (-1 past the keys), read one tile ahead of
    // their copies so that the block-table loads stay off the loop's critical path
    auto tile_slots = [&](int i, int (&slots)[SQ_PASSES]) {
#pragma unroll
        for (int j = 0; j < SQ_PASSES; ++j) {
            const int token = (tile_begin + i) * SQ_TILE_KEYS + copy_row + j * SQ_ROWS_PER_PASS;
            slots[j] = i < my_tiles && token < length ? table[token / block_size] * block_size + token % block_size : -1;
        }
    };
    auto issue_tile = [&](int i, const int (&slots)[SQ_PASSES]) {
        bf16* k_dst = stages + (i % SQ_STAGES) * 2 * SQ_TILE_ELEMS;
        bf16* v_dst = k_dst + SQ_TILE_ELEMS;
#pragma unroll
        for (int j = 0; j < SQ_PASSES; ++j) {
            const int row = copy_row + j * SQ_ROWS_PER_PASS;
            const size_t offset = slots[j] >= 0 ? (size_t)slots[j] * token_stride + copy_chunk * 8 : 0;
            cp_async16(k_dst + tile_offset(row, copy_chunk), k_head + offset, slots[j] >= 0);
            cp_async16(v_dst + tile_offset(row, copy_chunk), v_head + offset, slots[j] >= 0);
        }
    };
    int slots[SQ_PASSES];
#pragma unroll
    for (int i = 0; i < SQ_STAGES - 1; ++i) {
        tile_slots(i, slots);
        if (i < my_tiles) issue_tile(i, slots);
        commit_copies();
    }
    tile_slots(SQ_STAGES - 1, slots);

    // Q as A fragments: row r = head r % GROUP of the warp's token r / GROUP (rows past its
    // tokens are zero)
    unsigned int qa[HEAD_DIM / 16][4];
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = frag_row + (e & 1) * 8, col = ks * 16 + (e >> 1) * 8 + frag_col;
            const bool real = row < ROWS && row / GROUP < warp_tokens;
            const bf16* q_row = q + ((size_t)(query_begin + warp_first_token + row / GROUP) * num_heads
                                     + kv_head * GROUP + row % GROUP) * HEAD_DIM;
            qa[ks][e] = real ? *reinterpret_cast<const unsigned int*>(q_row + col) : 0u;
        }
    }
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.f, 0.f};  // rows frag_row and frag_row + 8

    for (int i = 0; i < my_tiles; ++i) {
        wait_copies<SQ_STAGES - 2>();  // tile i has landed (this thread's copies) ...
        __syncthreads();               // ... every thread's; and tile i - 1's stage is read by all
        if (i + SQ_STAGES - 1 < my_tiles) issue_tile(i + SQ_STAGES - 1, slots);
        commit_copies();
        tile_slots(i + SQ_STAGES, slots);
        const bf16* k_tile = stages + (i % SQ_STAGES) * 2 * SQ_TILE_ELEMS;
        const int token0 = (tile_begin + i) * SQ_TILE_KEYS;
#if SQ_TILE_SOFTMAX && HEAD_DIM <= 128  // (at 256 its S and O spill)
        if (token0 < warp_length)  // warp-uniform: keys some row of the warp sees
            attend_key_tiles<HALVES, SQ_TILE_KEYS / TILE_KEYS>(qa, k_tile, k_tile + SQ_TILE_ELEMS, token0, limit,
                                                               scale_log2, o, m, l);
#else
#pragma unroll
        for (int t = 0; t < SQ_TILE_KEYS / TILE_KEYS; ++t) {
            if (token0 + t * TILE_KEYS < warp_length)  // warp-uniform: keys some row of the warp sees
                attend_key_tiles<HALVES, 1>(qa, k_tile + t * TILE_ELEMS, k_tile + SQ_TILE_ELEMS + t * TILE_ELEMS,
                                            token0 + t * TILE_KEYS, limit, scale_log2, o, m, l);
        }
#endif
    }
    wait_copies<0>();
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        const int row = frag_row + 8 * h;
        if (row >= ROWS || row / GROUP >= warp_tokens) continue;
        const size_t head_row = (size_t)(query_begin + warp_first_token + row / GROUP) * num_heads
                                + kv_head * GROUP + row % GROUP;
        if (num_splits == 1) {
            const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                bf16* dst = out + head_row * HEAD_DIM + n * 8 + frag_col;
                dst[0] = __float2bfloat16_rn(o[n][2 * h] * inv);
                dst[1] = __float2bfloat16_rn(o[n][2 * h + 1] * inv);
            }
        } else {
            const size_t part = head_row * num_splits + split;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n)
                *reinterpret_cast<float2*>(partial_out + part * HEAD_DIM + n * 8 + frag_col) =
                    make_float2(o[n][2 * h], o[n][2 * h + 1]);
            if ((lane & 3) == 0) {
                partial_ml[part * 2] = m[h];
                partial_ml[part * 2 + 1] = l[h];
            }
        }
    }
}

// out[seq, head, :] = the splits' partials merged; a sequence with no keys gets zeros.
// Grid (num_heads, num_seqs), blockDim a multiple of 32; num_splits <= MERGE_MAX_SPLITS.
extern "C" __global__ void decode_attention_merge(const float* __restrict__ partial_out,
                                                  const float* __restrict__ partial_ml, bf16* __restrict__ out,
                                                  int num_heads, int num_splits) {
    __shared__ float weight[MERGE_MAX_SPLITS];
    __shared__ float inv_sum;
    const int head = blockIdx.x, seq = blockIdx.y;
    const size_t row0 = ((size_t)seq * num_heads + head) * num_splits;
    if (threadIdx.x < 32) {
        const int s = threadIdx.x;
        const float ms = s < num_splits ? partial_ml[(row0 + s) * 2] : NEG_BIG;
        const float mm = warp_max(ms);
        const float w = s < num_splits ? exp2f(ms - mm) : 0.f;
        const float ll = warp_sum(s < num_splits ? partial_ml[(row0 + s) * 2 + 1] * w : 0.f);
        weight[s] = w;
        if (s == 0) inv_sum = ll > 0.f ? 1.f / ll : 0.f;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < num_splits; ++s) acc += partial_out[(row0 + s) * HEAD_DIM + d] * weight[s];
        out[((size_t)seq * num_heads + head) * HEAD_DIM + d] = __float2bfloat16_rn(acc * inv_sum);
    }
}
