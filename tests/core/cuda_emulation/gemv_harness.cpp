// Runs core's gemv.cu fused decode GEMVs (gemv_m1_add_rms_norm, gemv_m1_silu_mul) on the CPU
// (tests/helpers/cuda_host) at several grid sizes (each block builds its input row once, then loops
// over column tiles), next to the unfused kernels they replace (rms_norm.cu add_rms_norm /
// rms_norm and elementwise.cu silu_mul, then gemv_m1), for tests/core/test_gemv_kernels_emulated.py.
#define GEMV_DYNAMIC_SHARED(name) alignas(16) static unsigned char name[49152]
#include "gemv.cu"
#include "rms_norm.cu"
#include "elementwise.cu"

#include "harness.h"

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    auto params = load<int>(dir, "params.bin");  // K N norm_threads with_residual grid0 grid1 grid2
    const int K = params[0], N = params[1], norm_threads = params[2], with_residual = params[3];
    const float eps = 1e-6f;
    auto x = load<bf16>(dir, "x.bin");                  // [K]
    auto residual = load<bf16>(dir, "residual.bin");    // [K]
    auto norm = load<bf16>(dir, "norm.bin");            // [K]
    auto gate_up = load<bf16>(dir, "gate_up.bin");      // [2K]
    auto w = load<bf16>(dir, "w.bin");                  // [N, K]
    const int tiles = (N + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
    const int m1_tiles = (N + WARPS_PER_BLOCK * GEMV_M1_COLS - 1) / (WARPS_PER_BLOCK * GEMV_M1_COLS);  // gemv_m1's grid
    const unsigned threads = WARPS_PER_BLOCK * 32;
    const bf16* res = with_residual ? residual.data() : nullptr;

    // unfused: the norm (or SiLU·mul) kernel, then gemv_m1 over its output
    std::vector<bf16> h(K), residual_sum(K), y_norm(N), act(K), y_silu(N);
    if (with_residual)
        launch(1, 1, 1, norm_threads, [&] { add_rms_norm(x.data(), res, norm.data(), h.data(), residual_sum.data(), K, eps); });
    else
        launch(1, 1, 1, norm_threads, [&] { rms_norm(x.data(), norm.data(), h.data(), K, eps); });
    launch(m1_tiles, 1, 1, threads, [&] { gemv_m1(h.data(), w.data(), nullptr, y_norm.data(), 1, N, K); });
    launch(1, 1, 1, 64, [&] { silu_mul(gate_up.data(), act.data(), 1, K); });
    launch(m1_tiles, 1, 1, threads, [&] { gemv_m1(act.data(), w.data(), nullptr, y_silu.data(), 1, N, K); });
    save(dir, "unfused_norm.bin", y_norm);
    save(dir, "unfused_residual.bin", with_residual ? residual_sum : x);
    save(dir, "unfused_silu.bin", y_silu);
    std::vector<bf16> y_plain(N), y_scaled(N);
    launch(m1_tiles, 1, 1, threads, [&] { gemv_m1(x.data(), w.data(), nullptr, y_plain.data(), 1, N, K); });
    launch(tiles, 1, 1, threads, [&] {
        gemv_m1_rms_scaled(x.data(), norm.data(), eps, w.data(), nullptr, y_scaled.data(), N, K);
    });
    save(dir, "gemv_m1.bin", y_plain);
    save(dir, "rms_scaled.bin", y_scaled);

    for (int g = 0; g < 3; ++g) {
        const unsigned grid = params[4 + g];
        std::vector<bf16> fused_norm(N), fused_residual(K), fused_silu(N);
        launch(grid, 1, 1, threads, [&] {
            gemv_m1_add_rms_norm(x.data(), res, norm.data(), eps, norm_threads, w.data(), nullptr, fused_norm.data(),
                                 with_residual ? fused_residual.data() : nullptr, N, K, 4096);
        });
        launch(grid, 1, 1, threads, [&] { gemv_m1_silu_mul(gate_up.data(), w.data(), nullptr, fused_silu.data(), N, K, 0); });
        save(dir, ("fused_norm_" + std::to_string(g) + ".bin").c_str(), fused_norm);
        save(dir, ("fused_residual_" + std::to_string(g) + ".bin").c_str(), with_residual ? fused_residual : x);
        save(dir, ("fused_silu_" + std::to_string(g) + ".bin").c_str(), fused_silu);
    }
    return 0;
}
