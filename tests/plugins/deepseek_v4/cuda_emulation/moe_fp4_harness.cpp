// Runs core's FP4 expert GEMMs and the FP8 stream linear (kernels/moe_fp4.cu) on the CPU
// (tests/helpers/cuda_host, with the warp-collective mma stand-in) on arrays read from a directory
// written by test_dsv4_cuda_emulated.py, and writes the output rows back there:
//   moe_fp4_harness DIR tiles|stream N K top_k gather max_tiles
// Inputs: a [*, K] bf16, sorted_slots, weight [E, N, K/2], scale [E, N, K/32], tile_expert,
// tile_row, num_tiles [1], offsets [E+1] (moe_sort's layout); output out.bin [slots, N] bf16.
//   moe_fp4_harness DIR fp8 N K M splits
// Inputs: a [M, K] bf16, weight [N, K] e4m3, scale [⌈N/128⌉, ⌈K/128⌉] e8m0; output out.bin [M, N] bf16.
// Build with -DSTREAM_CHUNKS=n to pick the stream kernel's column blocks per pass.
#define MMA_HOST_STANDIN  // mma.cuh: no PTX; harness.h defines mma_bf16_16816
#include "moe_fp4.cu"

#include "harness.h"

int main(int argc, char** argv) {
    if (argc < 8 && !(argc == 7 && std::string(argv[2]) == "fp8")) {
        std::fprintf(stderr, "usage: moe_fp4_harness DIR tiles|stream N K top_k gather max_tiles | DIR fp8 N K M splits\n");
        return 1;
    }
    const std::string dir = argv[1], which = argv[2];
    if (which == "fp8") {
        const int N = std::atoi(argv[3]), K = std::atoi(argv[4]), M = std::atoi(argv[5]), splits = std::atoi(argv[6]);
        auto a = load<bf16>(dir, "a.bin");
        auto weight = load<unsigned char>(dir, "weight.bin");
        auto scale = load<unsigned char>(dir, "scale.bin");
        std::vector<bf16> out(static_cast<size_t>(M) * N);
        std::vector<float> partial(splits > 1 ? static_cast<size_t>(splits) * M * N : 0);
        float* partial_rows = splits > 1 ? partial.data() : nullptr;
        launch((N + STREAM_N - 1) / STREAM_N, (M + STREAM_TOKENS - 1) / STREAM_TOKENS, splits, STREAM_THREADS, [&] {
            fp8_stream_linear(a.data(), weight.data(), scale.data(), out.data(), partial_rows, M, N, K);
        });
        if (splits > 1)
            launch(3, 1, 1, 256, [&] { fp8_stream_reduce(partial.data(), out.data(), (long long)M * N, splits); });
        save(dir, "out.bin", out);
        return 0;
    }
    const int N = std::atoi(argv[3]), K = std::atoi(argv[4]), top_k = std::atoi(argv[5]);
    const bool gather = std::atoi(argv[6]) != 0;
    const unsigned max_tiles = static_cast<unsigned>(std::atoi(argv[7]));
    auto a = load<bf16>(dir, "a.bin");
    auto sorted_slots = load<int>(dir, "sorted_slots.bin");
    auto weight = load<unsigned char>(dir, "weight.bin");
    auto scale = load<unsigned char>(dir, "scale.bin");
    auto tile_expert = load<int>(dir, "tile_expert.bin");
    auto tile_row = load<int>(dir, "tile_row.bin");
    auto num_tiles = load<int>(dir, "num_tiles.bin");
    auto offsets = load<int>(dir, "offsets.bin");
    std::vector<bf16> out(sorted_slots.size() * static_cast<size_t>(N));
    const int* slots = gather ? sorted_slots.data() : nullptr;
    if (which == "tiles") {
        launch(max_tiles, (N + TILE - 1) / TILE, 1, THREADS, [&] {
            moe_fp4_grouped_gemm(a.data(), slots, top_k, weight.data(), scale.data(), tile_expert.data(), tile_row.data(),
                                 num_tiles.data(), offsets.data(), out.data(), N, K);
        });
    } else if (which == "stream") {
        launch((N + STREAM_N - 1) / STREAM_N, max_tiles, 1, STREAM_THREADS, [&] {
            moe_fp4_stream_gemm(a.data(), slots, top_k, weight.data(), scale.data(), tile_expert.data(), tile_row.data(),
                                num_tiles.data(), offsets.data(), out.data(), N, K);
        });
    } else {
        std::fprintf(stderr, "unknown kernel %s\n", which.c_str());
        return 1;
    }
    save(dir, "out.bin", out);
    return 0;
}
