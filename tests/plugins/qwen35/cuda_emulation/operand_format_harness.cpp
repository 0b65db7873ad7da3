// Runs the default chunked prefill chain of gdn_chunked.cu (gdn_conv1d -> gdn_chunk_prepare_grouped_mma ->
// gdn_chunk_states / gdn_chunk_states_registers -> gdn_chunk_output_staged -> gdn_gated_norm) on the CPU
// (tests/helpers/cuda_host) in the operand format it is compiled for: bf16, or with GDN_F16_OPERANDS
// (OPENINFER_QWEN35_GDN_PREFILL=grouped_f16) fp16, on arrays written by test_qwen35_cuda_emulated.py,
// and writes the outputs of both state walks back, and those of the token-by-token kernel (gdn_delta_rule,
// fp32: the baseline) on the same conv_out.
#include "kernel_standins.h"

#include "gated_deltanet.cu"
#include "gdn_chunked.cu"

#include "harness.h"
#include "chunked_prefill_inputs.h"

int main(int argc, char** argv) {
    ChunkedPrefillInputs in(argc, argv, /*with_eps=*/true);
    const std::string& dir = in.dir;
    const int nk = in.nk, nv = in.nv, dv = in.dv, value_dim = in.value_dim, conv_dim = in.conv_dim;
    const int proj_stride = in.proj_stride, num_tokens = in.num_tokens, num_seqs = in.num_seqs;
    const int num_chunks = in.num_chunks;
    const float eps = in.eps;
    auto& proj = in.proj;
    auto &rate = in.neg_decay_rate, &bias = in.dt_bias;
    auto &query_start = in.query_start, &slots = in.slots, &fresh = in.fresh;
    auto &chunk_start = in.chunk_start, &chunk_len = in.chunk_len, &seq_chunks = in.seq_chunks;
    auto norm = load<bf16>(dir, "norm.bin");
    const std::vector<bf16> conv_out = in.conv1d();
    ChunkOperands<bf16, CHUNK> prepared(in);
    auto &qn = prepared.qn, &kn = prepared.kn, &w = prepared.w, &u = prepared.u, &p = prepared.p;
    auto& cum = prepared.cum;
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
