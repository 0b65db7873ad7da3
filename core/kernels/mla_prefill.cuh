// The decompressed MLA prefill's work items, shared by its attention kernels (mla.cu's
// mla_prefill_attention and mla_prefill_attention_pipelined, mla_prefill_sm90.cu's wgmma kernel).
//
// prefill_seqs [S, PREFILL_SEQ_FIELDS] int32 (core/mla.py DecompressedPrefill), one row per sequence:
//   table row (its row of block_tables), first query token in the step, query count n, context length L
//   (cached + new), first row of its context in c_kv / k_pe / k_nope / values.
// Query i of a sequence sits at position L - n + i and sees context rows 0 ..= L - n + i. A launch's
// block x takes query tile tile_seq[x] / tile_query[x] (the tile's row of prefill_seqs and first query).
#pragma once
#include "common.cuh"

#define PREFILL_SEQ_FIELDS 5

// Tile `tile` of the launch (block_m queries at most): its sequence's row of prefill_seqs, decoded.
struct MlaPrefillTile {
    int q_first;        // the sequence's first query row in the step
    int tile_q;         // the tile's first query (of the sequence)
    int rows;           // queries in the tile
    int offset;         // position of the sequence's query 0
    int key_end;        // keys the tile sees: up to its last query's position
    long long ctx_first;  // the sequence's first context row in k_nope / k_pe / values
};

__device__ __forceinline__ MlaPrefillTile mla_prefill_tile(const int* __restrict__ prefill_seqs,
                                                           const int* __restrict__ tile_seq,
                                                           const int* __restrict__ tile_query, int tile, int block_m) {
    const int* seq = prefill_seqs + tile_seq[tile] * PREFILL_SEQ_FIELDS;
    MlaPrefillTile w;
    w.q_first = seq[1];
    w.tile_q = tile_query[tile];
    w.rows = min(block_m, seq[2] - w.tile_q);
    w.offset = seq[3] - seq[2];
    w.key_end = min(seq[3], w.offset + w.tile_q + w.rows);
    w.ctx_first = seq[4];
    return w;
}

