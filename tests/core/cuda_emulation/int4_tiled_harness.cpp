// Runs moe.cu's INT4 kernels (USE_MMA=0 tiles GEMM, moe_gemv, moe_gemv_wide, moe_gemv_mma through
// the warp stand-in, moe_dequantize; with INT4_TILED also moe_gemv_int4_tiled) on the CPU over one
// weight, in whichever INT4 layout the build names (INT4_TILED 0: checkpoint rows, 1: the GEMV-tiled
// layout), for
// tests/core/test_int4_tiled_emulated.py. params: T E top_k N K; ids [T, top_k] route the tokens.
#define MMA_HOST_STANDIN  // mma.cuh: no PTX; harness.h defines mma_bf16_16816
#include "moe.cu"

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
    // grouped (token rows gathered per expert tile) and dense (expert 0, all T rows) products
    std::vector<bf16> tiles(size_t(slots) * N), dense_tiles(size_t(T) * N);
    launch(max_tiles, (N + BN - 1) / BN, 1, GEMM_THREADS, [&] {
        moe_grouped_gemm(x.data(), sorted.data(), k, w.data(), s.data(), tile_expert.data(), tile_row.data(),
                         num_tiles.data(), offsets.data(), 0, tiles.data(), N, K, 1);
    });
    launch((T + BM - 1) / BM, (N + BN - 1) / BN, 1, GEMM_THREADS, [&] {  // element-wise loads
        moe_grouped_gemm(x.data(), nullptr, 1, w.data(), s.data(), nullptr, nullptr, nullptr, nullptr, T,
                         dense_tiles.data(), N, K, 0);
    });
    std::vector<bf16> gemv(size_t(slots) * N), wide(size_t(slots) * N), mma(size_t(slots) * N);
    std::vector<bf16> dense_wide(size_t(T) * N), dense_mma(size_t(T) * N), w0(size_t(N) * K);
    launch((N + GEMV_WARPS - 1) / GEMV_WARPS, max_tiles, 1, GEMV_WARPS * 32, [&] {
        moe_gemv(x.data(), sorted.data(), k, w.data(), s.data(), tile_expert.data(), tile_row.data(),
                 num_tiles.data(), offsets.data(), 0, gemv.data(), N, K);
    });
    const unsigned wide_columns = WIDE_WARPS * WIDE_COLUMNS;
    launch((N + wide_columns - 1) / wide_columns, max_tiles, 1, WIDE_WARPS * 32, [&] {
        moe_gemv_wide(x.data(), sorted.data(), k, w.data(), s.data(), tile_expert.data(), tile_row.data(),
                      num_tiles.data(), offsets.data(), 0, wide.data(), N, K);
    });
    launch((N + wide_columns - 1) / wide_columns, 1, 1, WIDE_WARPS * 32, [&] {
        moe_gemv_wide(x.data(), nullptr, 1, w.data(), s.data(), nullptr, nullptr, nullptr, nullptr, T,
                      dense_wide.data(), N, K);
    });
    const unsigned mma_columns = MMA_GEMV_BLOCK_COLUMNS;
    launch((N + mma_columns - 1) / mma_columns, max_tiles, 1, MMA_GEMV_WARPS * 32, [&] {
        moe_gemv_mma(x.data(), sorted.data(), k, w.data(), s.data(), tile_expert.data(), tile_row.data(),
                     num_tiles.data(), offsets.data(), 0, mma.data(), N, K);
    });
    launch((N + mma_columns - 1) / mma_columns, 1, 1, MMA_GEMV_WARPS * 32, [&] {
        moe_gemv_mma(x.data(), nullptr, 1, w.data(), s.data(), nullptr, nullptr, nullptr, nullptr, T,
                     dense_mma.data(), N, K);
    });
    launch(4, 1, 1, 64, [&] { moe_dequantize(w.data(), s.data(), N, K, w0.data()); });
#if INT4_TILED && TILED_FUSE_SILU  // gate_up with SiLU·mul fused: N / 2 outputs per row (saved as tiled_silu)
    std::vector<bf16> tiled_silu(size_t(slots) * N / 2);
    launch((N / 2 + TILED_WARPS * 16 - 1) / (TILED_WARPS * 16), max_tiles, 1, TILED_WARPS * 32, [&] {
        moe_gemv_int4_tiled(x.data(), sorted.data(), k, w.data(), s.data(), tile_expert.data(), tile_row.data(),
                            num_tiles.data(), offsets.data(), 0, tiled_silu.data(), N, K);
    });
    save(dir, "tiled_silu.bin", tiled_silu);
#elif INT4_TILED  // the tiled layout's own GEMV, on the same tiles and in dense mode
    std::vector<bf16> tiled(size_t(slots) * N), dense_tiled(size_t(T) * N);
#ifdef TILED_PAIR  // moe_gemv_int4_tiled_pair: 32 rows per warp
#define TILED_KERNEL moe_gemv_int4_tiled_pair
    const unsigned tiled_columns = TILED_WARPS * 32;
#else
#define TILED_KERNEL moe_gemv_int4_tiled
    const unsigned tiled_columns = TILED_WARPS * 16 * TILED_ROW_BLOCKS;
#endif
    launch((N + tiled_columns - 1) / tiled_columns, max_tiles, 1, TILED_WARPS * 32, [&] {
        TILED_KERNEL(x.data(), sorted.data(), k, w.data(), s.data(), tile_expert.data(), tile_row.data(),
                     num_tiles.data(), offsets.data(), 0, tiled.data(), N, K);
    });
    launch((N + tiled_columns - 1) / tiled_columns, 1, 1, TILED_WARPS * 32, [&] {
        TILED_KERNEL(x.data(), nullptr, 1, w.data(), s.data(), nullptr, nullptr, nullptr, nullptr, T,
                     dense_tiled.data(), N, K);
    });
    save(dir, "tiled.bin", tiled);
    save(dir, "dense_tiled.bin", dense_tiled);
#endif
    save(dir, "tiles.bin", tiles);
    save(dir, "dense_tiles.bin", dense_tiles);
    save(dir, "gemv.bin", gemv);
    save(dir, "wide.bin", wide);
    save(dir, "dense_wide.bin", dense_wide);
    save(dir, "mma.bin", mma);
    save(dir, "dense_mma.bin", dense_mma);
    save(dir, "w0.bin", w0);
    return 0;
}
