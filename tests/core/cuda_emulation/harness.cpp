// Runs core's MoE (moe.cu, USE_MMA=0) or MLA (mla.cu) kernels on the CPU (tests/helpers/cuda_host)
// on arrays read from a directory written by tests/core/test_kimi_kernels_emulated.py; writes the
// outputs back there. Build with -DMOE or -DMLA (and the kernel's own defines).
#ifdef MOE
#include "moe.cu"
#else
#include "mla.cu"
#endif

#include "harness.h"

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    auto params = load<int>(dir, "params.bin");
#ifdef MOE
    // params: T hidden E k scoring groups topk_groups group_max norm_topk N1 K1(=hidden) N2(=hidden) K2 use_bias
    const int T = params[0], H = params[1], E = params[2], k = params[3], scoring = params[4], groups = params[5];
    const int topk_groups = params[6], group_max = params[7], norm_topk = params[8];
    const int N1 = params[9], N2 = params[10], K2 = params[11], use_bias = params[12];
    const float scaling = load<float>(dir, "scaling.bin")[0];
    auto x = load<bf16>(dir, "x.bin");
    auto gate = load<bf16>(dir, "gate.bin");
    auto bias = load<float>(dir, "bias.bin");
    auto w1 = load<unsigned char>(dir, "w1.bin");
    auto s1 = load<unsigned char>(dir, "s1.bin");
    auto w2 = load<unsigned char>(dir, "w2.bin");
    auto s2 = load<unsigned char>(dir, "s2.bin");
    const int slots = T * k;
    std::vector<int> ids(slots), counts(E), offsets(E + 1), sorted(slots), pos(slots);
    std::vector<float> weights(slots);
    const int max_tiles = (slots + BM - 1) / BM + std::min(E, slots);
    std::vector<int> tile_expert(max_tiles), tile_row(max_tiles), num_tiles(1);
    launch(T, 1, 1, 64, [&] {  // the kernels take any multiple of 32 threads; fewer emulate faster
        moe_route(x.data(), gate.data(), use_bias ? bias.data() : nullptr, H, E, k, scoring, groups, topk_groups,
                  group_max, norm_topk, scaling, nullptr, nullptr, ids.data(), weights.data());
    });
    launch(1, 1, 1, 256, [&] {
        moe_sort(ids.data(), slots, E, counts.data(), offsets.data(), sorted.data(), pos.data(), tile_expert.data(),
                 tile_row.data(), num_tiles.data(), max_tiles);
    });
    std::vector<bf16> h(size_t(slots) * N1), act(size_t(slots) * K2), y(size_t(slots) * N2), out(size_t(T) * H);
    launch(max_tiles, (N1 + BN - 1) / BN, 1, GEMM_THREADS, [&] {
        moe_grouped_gemm(x.data(), sorted.data(), k, w1.data(), s1.data(), tile_expert.data(), tile_row.data(),
                         num_tiles.data(), offsets.data(), 0, h.data(), N1, H, 1);
    });
    for (int r = 0; r < slots; ++r)  // silu_mul as elementwise.cu computes it
        for (int c = 0; c < K2; ++c) {
            const float g = __bfloat162float(h[size_t(r) * N1 + c]), u = __bfloat162float(h[size_t(r) * N1 + K2 + c]);
            act[size_t(r) * K2 + c] = __float2bfloat16_rn(round_bf16(g / (1.f + std::exp(-g))) * u);
        }
    launch(max_tiles, (N2 + BN - 1) / BN, 1, GEMM_THREADS, [&] {
        moe_grouped_gemm(act.data(), nullptr, k, w2.data(), s2.data(), tile_expert.data(), tile_row.data(),
                         num_tiles.data(), offsets.data(), 0, y.data(), N2, K2, 1);
    });
    launch(T, 1, 1, 64, [&] { moe_combine(y.data(), pos.data(), weights.data(), nullptr, k, H, out.data()); });
    // dense mode on the first expert's gate_up weight, element-wise (unvectorised) loads
    std::vector<bf16> dense(size_t(T) * N1);
    launch((T + BM - 1) / BM, (N1 + BN - 1) / BN, 1, GEMM_THREADS, [&] {
        moe_grouped_gemm(x.data(), nullptr, 1, w1.data(), s1.data(), nullptr, nullptr, nullptr, nullptr, T,
                         dense.data(), N1, H, 0);
    });
    save(dir, "ids.bin", ids.data(), ids.size());
    save(dir, "weights.bin", weights.data(), weights.size());
    save(dir, "offsets.bin", offsets.data(), offsets.size());
    save(dir, "out.bin", out.data(), out.size());
    save(dir, "dense.bin", dense.data(), dense.size());
#else
    // params: T heads q_stride q_pe_offset num_seqs max_blocks block_size num_splits
    const int T = params[0], heads = params[1], q_stride = params[2], q_pe_offset = params[3], num_seqs = params[4];
    const int max_blocks = params[5], block_size = params[6], splits = params[7];
    const float scale = load<float>(dir, "scale.bin")[0];
    auto latent = load<bf16>(dir, "latent.bin");
    auto norm = load<bf16>(dir, "norm.bin");
    auto q = load<bf16>(dir, "q.bin");
    auto q_latent = load<bf16>(dir, "q_latent.bin");
    auto cache = load<bf16>(dir, "cache.bin");
    auto positions = load<int>(dir, "positions.bin");
    auto slots = load<int>(dir, "slots.bin");
    auto tables = load<int>(dir, "tables.bin");
    auto query_start = load<int>(dir, "query_start.bin");
    auto cos_table = load<float>(dir, "cos.bin");
    auto sin_table = load<float>(dir, "sin.bin");
    launch(T, 1, 1, 128, [&] {
        mla_write_latent(latent.data(), LATENT, norm.data(), 1e-6f, q.data(), heads, q_stride, q_pe_offset,
                         positions.data(), slots.data(), cos_table.data(), sin_table.data(), cache.data());
    });
    std::vector<bf16> out(size_t(T) * heads * KV_LORA);
    std::vector<float> partial_o(size_t(T) * heads * splits * KV_LORA), partial_ml(size_t(T) * heads * splits * 2);
    launch(T, (heads + HEADS_PER_BLOCK - 1) / HEADS_PER_BLOCK, splits, MLA_THREADS, [&] {
        mla_attention(q_latent.data(), q.data(), q_stride, q_pe_offset, cache.data(), tables.data(), max_blocks,
                      block_size, query_start.data(), num_seqs, positions.data(), heads, scale, out.data(), splits,
                      partial_o.data(), partial_ml.data());
    });
    if (splits > 1) launch(T * heads, 1, 1, 32, [&] { mla_combine_splits(partial_o.data(), partial_ml.data(), splits, out.data()); });
    save(dir, "q_out.bin", q.data(), size_t(T) * heads * q_stride);
    save(dir, "cache_out.bin", cache);
    save(dir, "out.bin", out.data(), out.size());
#endif
    return 0;
}
