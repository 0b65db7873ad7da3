// Runs the kernels of gated_deltanet.cu on the CPU (tests/helpers/cuda_host) on arrays read from
// a directory written by test_qwen35_cuda_emulated.py, and writes the outputs back there.
#include <cuda_bf16.h>
#undef __launch_bounds__
#define __launch_bounds__(...)  // the norms name a minimum of blocks per SM too

#include "gated_deltanet.cu"

#include "harness.h"

int main(int argc, char** argv) {
    if (argc != 8) { std::fprintf(stderr, "usage: harness DIR nk nv dv width eps gate_features\n"); return 1; }
    const std::string dir = argv[1];
    const int nk = std::atoi(argv[2]), nv = std::atoi(argv[3]), dv = std::atoi(argv[4]), width = std::atoi(argv[5]);
    const float eps = static_cast<float>(std::atof(argv[6]));
    const int gate_features = std::atoi(argv[7]);
    const int key_dim = nk * DK, value_dim = nv * dv, conv_dim = 2 * key_dim + value_dim;
    const int proj_stride = conv_dim + value_dim + 2 * nv;
    auto proj = load<bf16>(dir, "proj.bin");
    auto weight = load<bf16>(dir, "conv_weight.bin");
    auto conv_state = load<bf16>(dir, "conv_state.bin");
    auto ssm = load<float>(dir, "ssm_state.bin");
    auto rate = load<float>(dir, "neg_decay_rate.bin");
    auto bias = load<float>(dir, "dt_bias.bin");
    auto norm = load<bf16>(dir, "norm.bin");
    auto query_start = load<int>(dir, "query_start.bin");
    auto slots = load<int>(dir, "slots.bin");
    auto fresh = load<int>(dir, "fresh.bin");
    auto token_seq = load<int>(dir, "token_seq.bin");
    const int num_tokens = static_cast<int>(token_seq.size()), num_seqs = static_cast<int>(slots.size());
    std::vector<bf16> conv_out(static_cast<size_t>(num_tokens) * conv_dim), out(static_cast<size_t>(num_tokens) * value_dim);

    launch(1, 1, 1, 1, [&] {
        gdn_conv1d(proj.data(), proj_stride, weight.data(), conv_state.data(), query_start.data(), slots.data(),
                   fresh.data(), token_seq.data(), conv_out.data(), num_tokens, conv_dim, width);
    });
    launch(1, 1, 1, 1, [&] {
        gdn_conv_state(proj.data(), proj_stride, conv_state.data(), query_start.data(), slots.data(), fresh.data(),
                       num_seqs, conv_dim, width);
    });
    const int tile_dv = dv < 32 ? dv : 32;  // as cuda_ops.TILE_DV
    std::vector<bf16> core(out.size());
    launch(num_seqs, nv, (dv + tile_dv - 1) / tile_dv, static_cast<unsigned>((tile_dv * SPLIT + 31) / 32 * 32), [&] {
        gdn_delta_rule(proj.data(), proj_stride, conv_out.data(), ssm.data(), rate.data(), bias.data(),
                       query_start.data(), slots.data(), fresh.data(), core.data(), nk, nv, dv, tile_dv);
    });
    launch(num_tokens, nv, 1, static_cast<unsigned>((dv + 31) / 32 * 32 < 256 ? (dv + 31) / 32 * 32 : 256), [&] {
        gdn_gated_norm(core.data(), proj.data(), proj_stride, norm.data(), out.data(), conv_dim, value_dim, dv, eps);
    });
    save(dir, "out.bin", out);
    save(dir, "conv_state_out.bin", conv_state);
    save(dir, "ssm_state_out.bin", ssm);

    auto x = load<bf16>(dir, "gate_x.bin");
    auto gate = load<bf16>(dir, "gate_wide.bin");  // rows of 2 * gate_features: gate in the right half
    const long long rows = static_cast<long long>(x.size()) / gate_features;
    std::vector<bf16> gated(x.size());
    launch(1, 1, 1, 1, [&] {
        sigmoid_mul(x.data(), gate.data() + gate_features, 2 * gate_features, gated.data(), rows, gate_features);
    });
    save(dir, "gated.bin", gated);

    // the norms: rows held in registers (80 features, 64 threads) and rows too wide for them
    // (400 features, 32 threads: more than ROW_REGS a thread), which re-read
    for (const auto& [prefix, threads] : {std::pair<std::string, unsigned>{"norm", 64u}, {"wide", 32u}}) {
        auto norm_x = load<bf16>(dir, (prefix + "_x.bin").c_str());
        auto norm_residual = load<bf16>(dir, (prefix + "_residual.bin").c_str());
        auto norm_w = load<float>(dir, (prefix + "_weight.bin").c_str());  // 1 + w, fp32
        const int features = static_cast<int>(norm_w.size());
        const unsigned norm_rows = static_cast<unsigned>(norm_x.size() / features);
        std::vector<bf16> plain(norm_x.size()), normed(norm_x.size()), summed(norm_x.size());
        launch(norm_rows, 1, 1, threads, [&] {
            zero_centred_rms_norm(norm_x.data(), norm_w.data(), plain.data(), features, eps);
        });
        launch(norm_rows, 1, 1, threads, [&] {
            zero_centred_add_rms_norm(norm_x.data(), norm_residual.data(), norm_w.data(), normed.data(),
                                      summed.data(), features, eps);
        });
        save(dir, (prefix + "_plain.bin").c_str(), plain);
        save(dir, (prefix + "_out.bin").c_str(), normed);
        save(dir, (prefix + "_sum.bin").c_str(), summed);
    }
    return 0;
}
