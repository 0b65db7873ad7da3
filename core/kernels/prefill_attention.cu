// Causal flash attention over the paged KV cache on tensor cores (mma.sync m16n8k16 bf16,
// fp32 accumulation): varlen batches and chunked prefill. The new tokens' K/V are already in
// the cache (qk_norm_rope_write_kv runs first), so a sequence's n queries at positions
// L-n .. L-1 attend to cache slots 0 .. L-1 with the causal limit key <= query position.
//
// Grid (2 * num_tiles, num_heads), 4 warps; the batch's tiles are 128 queries of one sequence
// (tile_seq[i], first query tile_query[i] counted from the sequence's first new token) and each
// block takes one BLOCK_M = 64 half of one. Hopper GPUs run prefill_attention_sm90.cu instead.
// Each warp owns 16 query rows. Shared memory: the Q tile and two stages of K/V tiles, rows
// padded by 8 bf16 so the fragment loads and ldmatrix hit 32 distinct banks. K/V tiles arrive
// by cp.async one tile ahead of the one being computed on.
#include "mma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define BLOCK_M 64
#define BLOCK_N 64
#define NUM_THREADS 128
#define SMEM_ROW (HEAD_DIM + 8)
static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
prefill_attention(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                  const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
                  int max_blocks_per_seq, const int* __restrict__ query_start,
                  const int* __restrict__ context_lens, const int* __restrict__ tile_seq,
                  const int* __restrict__ tile_query, bf16* __restrict__ out, int num_heads,
                  int num_kv_heads, int block_size, float scale_log2) {
    extern __shared__ uint4 smem_raw[];
    bf16* q_tile = reinterpret_cast<bf16*>(smem_raw);
    bf16* kv_stages = q_tile + BLOCK_M * SMEM_ROW;  // [stage][K | V][BLOCK_N][SMEM_ROW]
    constexpr int VECS = HEAD_DIM / 8;

    const int tile = blockIdx.x >> 1, head = blockIdx.y;
    const int seq = tile_seq[tile], q0 = tile_query[tile] + (blockIdx.x & 1) * BLOCK_M;
    const int first_token = query_start[seq];
    const int num_new = query_start[seq + 1] - first_token;
    if (q0 >= num_new) return;  // the second half of a sequence's last, short tile
    const int length = context_lens[seq];
    const int kv_head = head / (num_heads / num_kv_heads);
    const int rows = min(BLOCK_M, num_new - q0);
    const int* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const size_t token_stride = (size_t)num_kv_heads * HEAD_DIM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    for (int i = threadIdx.x; i < BLOCK_M * VECS; i += NUM_THREADS) {
        const int r = i / VECS, c = (i % VECS) * 8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < rows)
            val = *reinterpret_cast<const uint4*>(q + ((size_t)(first_token + q0 + r) * num_heads + head) * HEAD_DIM + c);
        *reinterpret_cast<uint4*>(q_tile + r * SMEM_ROW + c) = val;
    }
    __syncthreads();

    const int fr = lane >> 2, fc = (lane & 3) * 2;  // fragment row / column of this lane
    unsigned int qa[HEAD_DIM / 16][4];
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const bf16* p = q_tile + (warp * 16 + fr) * SMEM_ROW + kk * 16 + fc;
        qa[kk][0] = *reinterpret_cast<const unsigned int*>(p);
        qa[kk][1] = *reinterpret_cast<const unsigned int*>(p + 8 * SMEM_ROW);
        qa[kk][2] = *reinterpret_cast<const unsigned int*>(p + 8);
        qa[kk][3] = *reinterpret_cast<const unsigned int*>(p + 8 * SMEM_ROW + 8);
    }
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int query_pos0 = length - num_new + q0 + warp * 16 + fr;  // rows fr and fr + 8
    const int kv_end = length - num_new + q0 + rows;                 // last query position + 1

    auto load_kv_tile = [&](int k0, int stage) {
        bf16* k_dst = kv_stages + stage * 2 * BLOCK_N * SMEM_ROW;
        bf16* v_dst = k_dst + BLOCK_N * SMEM_ROW;
        for (int i = threadIdx.x; i < BLOCK_N * VECS; i += NUM_THREADS) {
            const int r = i / VECS, c = (i % VECS) * 8, t = k0 + r;
            const bool valid = t < kv_end;
            const size_t off = valid ? ((size_t)table[t / block_size] * block_size + t % block_size) * token_stride +
                                           (size_t)kv_head * HEAD_DIM + c
                                     : 0;
            cp_async16(k_dst + r * SMEM_ROW + c, k_cache + off, valid);
            cp_async16(v_dst + r * SMEM_ROW + c, v_cache + off, valid);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    load_kv_tile(0, 0);
    for (int k0 = 0, stage = 0; k0 < kv_end; k0 += BLOCK_N, stage ^= 1) {
        if (k0 + BLOCK_N < kv_end) {
            load_kv_tile(k0 + BLOCK_N, stage ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        const bf16* k_tile = kv_stages + stage * 2 * BLOCK_N * SMEM_ROW;
        const bf16* v_tile = k_tile + BLOCK_N * SMEM_ROW;

        float s[BLOCK_N / 8][4];
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
                const bf16* p = k_tile + (nt * 8 + fr) * SMEM_ROW + kk * 16 + fc;
                mma_bf16_16816(s[nt], qa[kk], *reinterpret_cast<const unsigned int*>(p),
                         *reinterpret_cast<const unsigned int*>(p + 8));
            }
        }
        // scale, causal mask, online softmax (each row's 64 scores live in 4 lanes)
        float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + nt * 8 + fc + (e & 1);
                const int qpos = query_pos0 + (e >> 1) * 8;
                const float v = key <= qpos ? s[nt][e] * scale_log2 : -INFINITY;
                s[nt][e] = v;
                row_max[e >> 1] = fmaxf(row_max[e >> 1], v);
            }
        }
        float correction[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
            row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
            const float m_new = fmaxf(m[h], row_max[h]);  // finite: key 0 is visible to every row
            correction[h] = exp2f(m[h] - m_new);
            m[h] = m_new;
            l[h] *= correction[h];
        }
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d) {
            o[d][0] *= correction[0];
            o[d][1] *= correction[0];
            o[d][2] *= correction[1];
            o[d][3] *= correction[1];
        }
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[nt][e] - m[e >> 1]);
                s[nt][e] = p;
                l[e >> 1] += p;
            }
        }
        // O += P V: two adjacent score tiles form one A fragment (k = 16 keys)
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            unsigned int pa[4];
            pa[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int d = 0; d < HEAD_DIM / 8; ++d) {
                unsigned int b0, b1;
                ldmatrix_x2_trans(b0, b1, v_tile + (kk * 16 + (lane & 15)) * SMEM_ROW + d * 8);
                mma_bf16_16816(o[d], pa, b0, b1);
            }
        }
        __syncthreads();  // this stage is refilled two tiles from now
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + fr + h * 8;
        if (r >= rows) continue;
        const float inv = 1.f / l[h];
        bf16* dst = out + ((size_t)(first_token + q0 + r) * num_heads + head) * HEAD_DIM + fc;
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d)
            *reinterpret_cast<__nv_bfloat162*>(dst + d * 8) =
                __floats2bfloat162_rn(o[d][2 * h] * inv, o[d][2 * h + 1] * inv);
    }
}
