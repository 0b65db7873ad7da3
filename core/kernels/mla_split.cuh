// The absorbed MLA decode kernels' context split (mla.cu's mla_attention / _mma / _mma_shared and
// mla_decode_sm90.cu's mla_attention_tma): which sequence a step token belongs to and which slice of
// its causal context one split covers.
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
