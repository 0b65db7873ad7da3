// Runs core's elementwise.cu silu_mul (one element per thread), silu_mul_vec8 (8 per thread,
// 16-byte accesses) and silu_mul_rows (a (row, chunk) grid, two vectors per thread) on the CPU (tests/helpers/cuda_host) over gate_up.bin [rows, 2 * half] bf16
// from tests/core/test_elementwise_kernels_emulated.py; writes the outputs back.
#include "elementwise.cu"

#include "harness.h"

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    auto params = load<int>(dir, "params.bin");  // rows half blocks
    const int rows = params[0], half = params[1], blocks = params[2];
    auto gate_up = load<bf16>(dir, "gate_up.bin");
    std::vector<bf16> scalar(size_t(rows) * half), vectorised(size_t(rows) * half);
    // few blocks of 64 threads: every grid-stride loop runs several rounds
    launch(blocks, 1, 1, 64, [&] { silu_mul(gate_up.data(), scalar.data(), rows, half); });
    launch(blocks, 1, 1, 64, [&] { silu_mul_vec8(gate_up.data(), vectorised.data(), rows * half / 8, half / 8); });
    // 32 threads per block (the backend takes 128): a chunk of 64 vectors, so rows of several chunks
    std::vector<bf16> by_rows(size_t(rows) * half);
    const int vectors_per_row = half / 8, chunks = (vectors_per_row + 63) / 64;
    launch(rows, chunks, 1, 32, [&] { silu_mul_rows(gate_up.data(), by_rows.data(), vectors_per_row); });
    save(dir, "by_rows.bin", by_rows);
    save(dir, "scalar.bin", scalar);
    save(dir, "vectorised.bin", vectorised);
    return 0;
}
