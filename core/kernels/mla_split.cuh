// The absorbed MLA decode kernels' shared parts (mla.cu's mla_attention / _mma / _mma_shared and
// mla_decode_sm90.cu's mla_attention_tma): which sequence a step token belongs to and which slice of
// its causal context one split covers; the online softmax of one key tile of mma fragments.
#pragma once

// The block table of step token `step_token`'s sequence (query_start[s] <= step_token <
// query_start[s + 1], binary search) and this split's slice [begin, end) of its causal context
// (positions[step_token] + 1 tokens), in whole TILE-key steps.
template <int TILE>
__device__ __forceinline__ const int* mla_split_context(const int* __restrict__ query_start, int num_seqs,
                                                        const int* __restrict__ block_tables, int max_blocks_per_seq,
                                                        const int* __restrict__ positions, int step_token,
                                                        int num_splits, int split, int& begin, int& end) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (query_start[mid] <= step_token) lo = mid; else hi = mid - 1;
    }
    const int context = positions[step_token] + 1;
    const int per_split = ((context + num_splits - 1) / num_splits + TILE - 1) / TILE * TILE;
    begin = split * per_split;
    end = min(context, begin + per_split);
    return block_tables + (long long)lo * max_blocks_per_seq;
}

// One key tile of a warp's online softmax over m16n8 mma fragments: s[n][v] is the score of row
// group (v < 2) or group + 8 and key key0 + 8n + pair + (v & 1). Scales the scores, masks keys past
// `end`, takes each row's maximum over its quad (lanes sharing `group`), turns the scores into
// exp(s - running max), and rescales the running row sums and the output accumulators acc by the
// change of the maximum. The caller then adds P · V into acc.
template <int KEY_TILES, int OUT_TILES>
__device__ __forceinline__ void mla_online_softmax_tile(float (&s)[KEY_TILES][4], float (&acc)[OUT_TILES][4],
                                                        float (&row_max)[2], float (&row_sum)[2], int key0,
                                                        int pair, int end, float scale) {
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const int key = key0 + 8 * n + pair + (v & 1);
            s[n][v] = key < end ? s[n][v] * scale : -INFINITY;
            tile_max[v >> 1] = fmaxf(tile_max[v >> 1], s[n][v]);
        }
    float correction[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_max = fmaxf(row_max[r], tile_max[r]);
        correction[r] = new_max == -INFINITY ? 1.f : __expf(row_max[r] - new_max);
        row_max[r] = new_max;
    }
    float tile_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            s[n][v] = s[n][v] == -INFINITY ? 0.f : __expf(s[n][v] - row_max[v >> 1]);
            tile_sum[v >> 1] += s[n][v];
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tile_sum[r] += __shfl_xor_sync(0xffffffffu, tile_sum[r], 1);
        tile_sum[r] += __shfl_xor_sync(0xffffffffu, tile_sum[r], 2);
        row_sum[r] = row_sum[r] * correction[r] + tile_sum[r];
    }
#pragma unroll
    for (int j = 0; j < OUT_TILES; ++j) {
        acc[j][0] *= correction[0];
        acc[j][1] *= correction[0];
        acc[j][2] *= correction[1];
        acc[j][3] *= correction[1];
    }
}
