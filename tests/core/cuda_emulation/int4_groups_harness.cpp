// Runs moe_int4.cu's moe_gemv_int4_groups on the CPU (the warp stand-in's mma) over INT4 weights in the
// lane-groups layout (moe.cu INT4_TILED 2), beside moe.cu's moe_gemv_mma reading the same layout, grouped
// (token rows gathered per expert tile) and dense (expert 0, all T rows), for
// tests/core/test_int4_groups_emulated.py. params: T E top_k N K; ids [T, top_k] route the tokens.
#define MMA_HOST_STANDIN  // mma.cuh: no PTX; harness.h defines mma_bf16_16816
// GROUPS_XSMEM's dynamic shared memory: a static buffer (blocks run one after another)
#define GROUPS_DYNAMIC_SHARED(name) static __attribute__((aligned(16))) unsigned char name[64 * 1024]
#include "moe.cu"
#include "moe_int4.cu"

#include "harness.h"

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    auto params = load<int>(dir, "params.bin");
    const int T = params[0], E = params[1], k = params[2], N = params[3], K = params[4];
    auto x = load<bf16>(dir, "x.bin");
    auto ids = load<int>(dir, "ids.bin");
    auto w = load<unsigned char>(dir, "w.bin");
    auto s = load<unsigned char>(dir, "s.bin");
    const int slots = T * k, max_tiles = (slots + BM - 1) / BM + std::min(E, slots);
    std::vector<int> offsets(E + 1), sorted(slots), pos(slots), tile_expert(max_tiles), tile_row(max_tiles), num_tiles(1);
    launch(1, 1, 1, 64, [&] {
        moe_sort_parallel(ids.data(), slots, E, offsets.data(), sorted.data(), pos.data(), tile_expert.data(),
                          tile_row.data(), num_tiles.data(), max_tiles);
    });
    save(dir, "sorted.bin", sorted);
    std::vector<bf16> mma(size_t(slots) * N), groups(size_t(slots) * N), dense_mma(size_t(T) * N),
        dense_groups(size_t(T) * N);
    const unsigned mma_columns = MMA_GEMV_BLOCK_COLUMNS, groups_columns = GROUPS_WARPS * 16;
    launch((N + mma_columns - 1) / mma_columns, max_tiles, 1, MMA_GEMV_WARPS * 32, [&] {
        moe_gemv_mma(x.data(), sorted.data(), k, w.data(), s.data(), tile_expert.data(), tile_row.data(),
                     num_tiles.data(), offsets.data(), 0, mma.data(), N, K);
    });
    launch((N + mma_columns - 1) / mma_columns, 1, 1, MMA_GEMV_WARPS * 32, [&] {
        moe_gemv_mma(x.data(), nullptr, 1, w.data(), s.data(), nullptr, nullptr, nullptr, nullptr, T,
                     dense_mma.data(), N, K);
    });
#if GROUPS_FUSE_SILU  // gate_up with SiLU·mul: N / 2 output columns, 8 per warp (saved in the first N / 2 of each row)
    const int out_columns = N / 2, warp_columns = GROUPS_WARPS / GROUPS_KSPLIT * 8;
#else
    const int out_columns = N, warp_columns = GROUPS_WARPS / GROUPS_KSPLIT * 16;
#endif
    (void)groups_columns;
    // GROUPS_ROW_BLOCKS column blocks per block: the grid that many times narrower
    const unsigned column_blocks = (out_columns + warp_columns - 1) / warp_columns;
    const unsigned grid_x = (column_blocks + GROUPS_ROW_BLOCKS - 1) / GROUPS_ROW_BLOCKS;
    launch(grid_x, max_tiles, 1, GROUPS_WARPS * 32, [&] {
        moe_gemv_int4_groups(x.data(), sorted.data(), k, w.data(), s.data(), tile_expert.data(), tile_row.data(),
                             num_tiles.data(), offsets.data(), 0, groups.data(), N, K);
    });
    launch(grid_x, 1, 1, GROUPS_WARPS * 32, [&] {
        moe_gemv_int4_groups(x.data(), nullptr, 1, w.data(), s.data(), nullptr, nullptr, nullptr, nullptr, T,
                             dense_groups.data(), N, K);
    });
    save(dir, "mma.bin", mma);
    save(dir, "dense_mma.bin", dense_mma);
    save(dir, "groups.bin", groups);
    save(dir, "dense_groups.bin", dense_groups);
    return 0;
}
