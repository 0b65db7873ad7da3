// Runs core's rms_norm.cu (block-per-row rms_norm / add_rms_norm and the one-warp-per-row
// rms_norm_rows / add_rms_norm_rows) and qk_norm_rope.cu (the warp-per-head qk_norm_rope_write_kv and
// the 16-byte qk_norm_rope_write_kv_vec) on the CPU (tests/helpers/cuda_host), for
// tests/core/test_norm_qkv_kernels_emulated.py. Build with -DHEAD_DIM and -DVECS_PER_LANE.
#include <cuda_bf16.h>
void __syncwarp();  // qk_norm_rope_write_kv's; defined below on the harness's per-warp barrier
#include "rms_norm.cu"
#include "qk_norm_rope.cu"

#include "harness.h"

void __syncwarp() { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    // rows features block_threads | tokens num_heads num_kv_heads rotary_dim with_norm vec_threads
    auto params = load<int>(dir, "params.bin");
    const int rows = params[0], features = params[1], block_threads = params[2];
    const int tokens = params[3], num_heads = params[4], num_kv_heads = params[5], rotary_dim = params[6];
    const int with_norm = params[7], vec_threads = params[8];
    const float eps = 1e-6f;

    auto x = load<bf16>(dir, "x.bin");
    auto residual = load<bf16>(dir, "residual.bin");
    auto weight = load<bf16>(dir, "weight.bin");
    const size_t n = size_t(rows) * features;
    std::vector<bf16> block_norm(n), rows_norm(n), block_add(n), block_sum(n), rows_add(n), rows_sum(n);
    launch(rows, 1, 1, block_threads, [&] { rms_norm(x.data(), weight.data(), block_norm.data(), features, eps); });
    launch(rows, 1, 1, block_threads, [&] {
        add_rms_norm(x.data(), residual.data(), weight.data(), block_add.data(), block_sum.data(), features, eps);
    });
    const unsigned norm_blocks = (rows + NORM_ROWS_PER_BLOCK - 1) / NORM_ROWS_PER_BLOCK;
    launch(norm_blocks, 1, 1, 32 * NORM_ROWS_PER_BLOCK, [&] {
        rms_norm_rows(x.data(), weight.data(), rows_norm.data(), rows, features, eps);
    });
    launch(norm_blocks, 1, 1, 32 * NORM_ROWS_PER_BLOCK, [&] {
        add_rms_norm_rows(x.data(), residual.data(), weight.data(), rows_add.data(), rows_sum.data(), rows, features, eps);
    });
    save(dir, "block_norm.bin", block_norm);
    save(dir, "rows_norm.bin", rows_norm);
    save(dir, "block_add.bin", block_add);
    save(dir, "block_sum.bin", block_sum);
    save(dir, "rows_add.bin", rows_add);
    save(dir, "rows_sum.bin", rows_sum);

    auto qkv = load<bf16>(dir, "qkv.bin");
    auto q_norm = load<bf16>(dir, "q_norm.bin");
    auto k_norm = load<bf16>(dir, "k_norm.bin");
    auto cos_table = load<float>(dir, "cos.bin");
    auto sin_table = load<float>(dir, "sin.bin");
    auto positions = load<int>(dir, "positions.bin");
    auto slots = load<int>(dir, "slots.bin");
    auto cache_init = load<bf16>(dir, "cache.bin");  // [slots, num_kv_heads, HEAD_DIM]: k and v start alike
    const float* cos_arg = rotary_dim ? cos_table.data() : nullptr;
    const float* sin_arg = rotary_dim ? sin_table.data() : nullptr;
    const bf16* qn = with_norm ? q_norm.data() : nullptr;
    const bf16* kn = with_norm ? k_norm.data() : nullptr;
    const int heads = num_heads + 2 * num_kv_heads;
    std::vector<bf16> warp_q(size_t(tokens) * num_heads * HEAD_DIM), vec_q(warp_q.size());
    std::vector<bf16> warp_k(cache_init), warp_v(cache_init), vec_k(cache_init), vec_v(cache_init);
    const unsigned tasks = tokens * heads;
    launch((tasks + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK, 1, 1, WARPS_PER_BLOCK * 32, [&] {
        qk_norm_rope_write_kv(qkv.data(), warp_q.data(), warp_k.data(), warp_v.data(), qn, kn, eps, cos_arg, sin_arg,
                              rotary_dim, positions.data(), slots.data(), tokens, num_heads, num_kv_heads);
    });
    const unsigned lanes = heads * LANES_PER_HEAD;
    launch(tokens, (lanes + vec_threads - 1) / vec_threads, 1, vec_threads, [&] {
        qk_norm_rope_write_kv_vec(qkv.data(), vec_q.data(), vec_k.data(), vec_v.data(), qn, kn, eps, cos_arg, sin_arg,
                                  rotary_dim, positions.data(), slots.data(), num_heads, num_kv_heads);
    });
    save(dir, "warp_q.bin", warp_q);
    save(dir, "warp_k.bin", warp_k);
    save(dir, "warp_v.bin", warp_v);
    save(dir, "vec_q.bin", vec_q);
    save(dir, "vec_k.bin", vec_k);
    save(dir, "vec_v.bin", vec_v);
    return 0;
}
