// Runs the default chunked prefill chain of gdn_chunked.cu (gdn_conv1d -> gdn_chunk_prepare_grouped_mma ->
// gdn_chunk_states / gdn_chunk_states_registers -> gdn_chunk_output_staged -> gdn_gated_norm) on the CPU
// (tests/helpers/cuda_host) in the operand format it is compiled for: bf16, or with GDN_F16_OPERANDS
// (OPENINFER_QWEN35_GDN_PREFILL=grouped_f16) fp16, on arrays written by test_qwen35_cuda_emulated.py,
// and writes the outputs of both state walks back, and those of the token-by-token kernel (gdn_delta_rule,
// fp32: the baseline) on the same conv_out.
#define MMA_HOST_STANDIN  // core's mma.cuh: no PTX; harness.h defines mma_bf16_16816
#define GDN_DYNAMIC_SHARED(name) alignas(16) static unsigned char name[1 << 18]
#include <cuda_bf16.h>
#include <cstring>
inline float2 make_float2(float x, float y) { return {x, y}; }
void __syncwarp(unsigned mask = 0xffffffffu);  // the calling thread's warp meets (defined after harness.h)

#include "gated_deltanet.cu"
#include "gdn_chunked.cu"

#include "harness.h"
#include "chunked_prefill_inputs.h"

void __syncwarp(unsigned) { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

int main(int argc, char** argv) {
    if (argc != 7) { std::fprintf(stderr, "usage: harness DIR nk nv dv width eps\n"); return 1; }
    const std::string dir = argv[1];
    const int nk = std::atoi(argv[2]), nv = std::atoi(argv[3]), dv = std::atoi(argv[4]), width = std::atoi(argv[5]);
    const float eps = static_cast<float>(std::atof(argv[6]));
    ChunkedPrefillInputs in(dir, nk, nv, dv, width);
    const int key_dim = in.key_dim, value_dim = in.value_dim, conv_dim = in.conv_dim, proj_stride = in.proj_stride;
    auto &weight = in.conv_weight, &proj = in.proj, &conv_state = in.conv_state;
    auto &rate = in.neg_decay_rate, &bias = in.dt_bias;
    auto &query_start = in.query_start, &slots = in.slots, &fresh = in.fresh, &token_seq = in.token_seq;
    auto &chunk_start = in.chunk_start, &chunk_len = in.chunk_len, &seq_chunks = in.seq_chunks;
    const int num_tokens = in.num_tokens, num_seqs = in.num_seqs, num_chunks = in.num_chunks;
    auto norm = load<bf16>(dir, "norm.bin");
    std::vector<bf16> conv_out(static_cast<size_t>(num_tokens) * conv_dim);
    std::vector<bf16> qn(static_cast<size_t>(num_tokens) * key_dim), kn(qn.size());
    std::vector<bf16> w(static_cast<size_t>(num_tokens) * nv * DK), u(static_cast<size_t>(num_tokens) * value_dim);
    std::vector<bf16> p(static_cast<size_t>(num_chunks) * nv * CHUNK * CHUNK);
    std::vector<float> cum(static_cast<size_t>(num_tokens) * nv);
    launch(1, 1, 1, 1, [&] {
        gdn_conv1d(proj.data(), proj_stride, weight.data(), conv_state.data(), query_start.data(), slots.data(),
                   fresh.data(), token_seq.data(), conv_out.data(), num_tokens, conv_dim, width);
    });
    launch(num_chunks, nk, 1, 128, [&] {
        gdn_chunk_prepare_grouped_mma(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                      chunk_start.data(), chunk_len.data(), qn.data(), kn.data(), w.data(), u.data(),
                                      p.data(), cum.data(), nk, nv, dv);
    });
    for (int walk = 0; walk < 3; ++walk) {  // gdn_chunk_states, gdn_chunk_states_registers, token by token
        auto ssm = load<float>(dir, "ssm_state.bin");
        std::vector<bf16> states(static_cast<size_t>(num_chunks) * nv * dv * DK), v_new(u.size());
        std::vector<bf16> core(static_cast<size_t>(num_tokens) * value_dim), out(core.size());
        if (walk == 2) {  // gdn_delta_rule (fp32, q / k normed on the fly): the baseline, the same conv_out
            const int tile_dv = dv < 32 ? dv : 32;  // as cuda_ops.TILE_DV
            launch(num_seqs, nv, (dv + tile_dv - 1) / tile_dv, static_cast<unsigned>((tile_dv * SPLIT + 31) / 32 * 32),
                   [&] {
                gdn_delta_rule(proj.data(), proj_stride, conv_out.data(), ssm.data(), rate.data(), bias.data(),
                               query_start.data(), slots.data(), fresh.data(), core.data(), nk, nv, dv, tile_dv);
            });
        } else if (walk == 0) {
            launch(num_seqs, nv, dv / SCAN_TILE, 128, [&] {
                gdn_chunk_states(kn.data(), w.data(), u.data(), cum.data(), chunk_start.data(), chunk_len.data(),
                                 seq_chunks.data(), slots.data(), fresh.data(), ssm.data(), states.data(),
                                 v_new.data(), nk, nv, dv);
            });
        } else {
            int warps = 8;
            while ((dv / 16) % warps) warps /= 2;
            launch(num_seqs, nv, dv / (16 * warps), 32 * warps, [&] {
                gdn_chunk_states_registers(kn.data(), w.data(), u.data(), cum.data(), chunk_start.data(),
                                           chunk_len.data(), seq_chunks.data(), slots.data(), fresh.data(), ssm.data(),
                                           states.data(), v_new.data(), nk, nv, dv);
            });
        }
        if (walk < 2) launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_output_staged(qn.data(), p.data(), cum.data(), states.data(), v_new.data(), chunk_start.data(),
                                    chunk_len.data(), core.data(), nk, nv, dv);
        });
        launch(num_tokens, nv, 1, static_cast<unsigned>((dv + 31) / 32 * 32 < 256 ? (dv + 31) / 32 * 32 : 256), [&] {
            gdn_gated_norm(core.data(), proj.data(), proj_stride, norm.data(), out.data(), conv_dim, value_dim, dv,
                           eps);
        });
        const std::string prefix = walk == 0 ? "shared_" : walk == 1 ? "registers_" : "recurrent_";
        save(dir, (prefix + "core.bin").c_str(), core);
        save(dir, (prefix + "out.bin").c_str(), out);
        save(dir, (prefix + "ssm_state.bin").c_str(), ssm);
    }
    return 0;
}
