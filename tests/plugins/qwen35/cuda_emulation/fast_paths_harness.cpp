// Runs the chunked prefill (gdn_chunked.cu) and the fused decode step (gdn_decode.cu: the plain,
// early-loads, coalesced, vec4 and bulk kernels on the same inputs) on the CPU
// (tests/helpers/cuda_host) on arrays written by test_qwen35_cuda_emulated.py, and writes the
// outputs back. The tensor-core mma is emulated lane by lane: each lane publishes its fragment
// registers at its warp's barrier and computes its own four outputs from the 16x16 and 16x8
// tiles they describe — so the fragment layouts the kernels assume are checked too.
#include "kernel_standins.h"

#include "gated_deltanet.cu"
#include "gdn_chunked.cu"
#include "gdn_decode.cu"

#include "harness.h"
#include "chunked_prefill_inputs.h"

int main(int argc, char** argv) {
    ChunkedPrefillInputs in(argc, argv, /*with_eps=*/true);
    const std::string& dir = in.dir;
    const int nk = in.nk, nv = in.nv, dv = in.dv, width = in.width, value_dim = in.value_dim;
    const int conv_dim = in.conv_dim, proj_stride = in.proj_stride;
    const float eps = in.eps;
    auto& weight = in.conv_weight;
    auto &rate = in.neg_decay_rate, &bias = in.dt_bias;
    auto norm = load<bf16>(dir, "norm.bin");

    // prefill: conv → conv window → chunk prepare → chunk scan → gated norm
    {
        auto &proj = in.proj, &conv_state = in.conv_state;
        auto ssm = load<float>(dir, "ssm_state.bin");
        auto &query_start = in.query_start, &slots = in.slots, &fresh = in.fresh, &token_seq = in.token_seq;
        auto &chunk_start = in.chunk_start, &chunk_len = in.chunk_len, &seq_chunks = in.seq_chunks;
        const int num_tokens = in.num_tokens, num_seqs = in.num_seqs, num_chunks = in.num_chunks;
        const std::vector<bf16> conv_out = in.conv1d();
        ChunkOperands<bf16, CHUNK> plain(in);
        auto &qn = plain.qn, &kn = plain.kn, &w = plain.w, &u = plain.u, &p = plain.p;
        auto& cum = plain.cum;
        std::vector<bf16> core(static_cast<size_t>(num_tokens) * value_dim), out(core.size());
        // the 8-channel conv (run before the window update, as the launcher does): the same conv_out
        std::vector<bf16> vec_conv_out(conv_out.size());
        launch(static_cast<unsigned>((num_tokens + CONV_TOKENS - 1) / CONV_TOKENS),
               static_cast<unsigned>((conv_dim + 1023) / 1024), 1, 128, [&] {
            gdn_conv1d_vec(proj.data(), proj_stride, weight.data(), conv_state.data(), query_start.data(),
                           slots.data(), fresh.data(), token_seq.data(), vec_conv_out.data(), num_tokens, conv_dim,
                           width);
        });
        launch(1, 1, 1, 1, [&] {
            gdn_conv_state(proj.data(), proj_stride, conv_state.data(), query_start.data(), slots.data(),
                           fresh.data(), num_seqs, conv_dim, width);
        });
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_prepare(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(), chunk_start.data(),
                              chunk_len.data(), qn.data(), kn.data(), w.data(), u.data(), p.data(), cum.data(), nk,
                              nv, dv);
        });
        launch(num_seqs, nv, dv / SCAN_TILE, 128, [&] {
            gdn_chunk_scan(qn.data(), kn.data(), w.data(), u.data(), p.data(), cum.data(), chunk_start.data(),
                           chunk_len.data(), seq_chunks.data(), slots.data(), fresh.data(), ssm.data(), core.data(), nk,
                           nv, dv);
        });
        launch(num_tokens, nv, 1, static_cast<unsigned>((dv + 31) / 32 * 32 < 256 ? (dv + 31) / 32 * 32 : 256), [&] {
            gdn_gated_norm(core.data(), proj.data(), proj_stride, norm.data(), out.data(), conv_dim, value_dim, dv,
                           eps);
        });
        save(dir, "prefill_out.bin", out);
        save(dir, "prefill_conv_state.bin", conv_state);
        save(dir, "prefill_ssm_state.bin", ssm);

        // the staged prepare kernel on the same conv output: the same qn, kn, W, U, P and c
        ChunkOperands<bf16, CHUNK> staged(in);
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_prepare_staged(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                     chunk_start.data(), chunk_len.data(), staged.qn.data(), staged.kn.data(), staged.w.data(),
                                     staged.u.data(), staged.p.data(), staged.cum.data(), nk, nv, dv);
        });
        std::vector<bf16> warp_out(out.size());
        launch(static_cast<unsigned>(num_tokens), static_cast<unsigned>((nv + 3) / 4), 1, 128, [&] {
            gdn_gated_norm_warp(core.data(), proj.data(), proj_stride, norm.data(), warp_out.data(), conv_dim,
                                value_dim, nv, dv, eps);
        });
        save_flag(dir, "staged_prepare_same.bin",
                  bits_equal(staged, plain) && bits_equal(vec_conv_out, conv_out) && bits_equal(warp_out, out));
        // the 8-channel gated norm (gdn_gated_norm_vec) on the same O: for the test to compare
        std::vector<bf16> vec_norm_out(out.size());
        launch(static_cast<unsigned>(num_tokens), static_cast<unsigned>((value_dim / 8 + 127) / 128), 1, 128, [&] {
            gdn_gated_norm_vec(core.data(), proj.data(), proj_stride, norm.data(), vec_norm_out.data(), conv_dim,
                               value_dim, nv, dv, eps);
        });
        save(dir, "vec_norm_out.bin", vec_norm_out);

        // the blocked triangular solve (gdn_chunk_prepare_blocked) on the same conv output: qn, kn,
        // P and c bit for bit (the solve comes after them), W and U (from T) for the test to compare
        ChunkOperands<bf16, CHUNK> blocked(in);
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_prepare_blocked(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                      chunk_start.data(), chunk_len.data(), blocked.qn.data(), blocked.kn.data(), blocked.w.data(),
                                      blocked.u.data(), blocked.p.data(), blocked.cum.data(), nk, nv, dv);
        });
        save_flag(dir, "blocked_prepare_same.bin", bits_equal(blocked.qn, qn) && bits_equal(blocked.kn, kn) &&
                                                       bits_equal(blocked.p, p) && bits_equal(blocked.cum, cum));
        save(dir, "prepare_w.bin", w);
        save(dir, "prepare_u.bin", u);
        save(dir, "blocked_w.bin", blocked.w);
        save(dir, "blocked_u.bin", blocked.u);

        // the grouped prepare (a block per chunk and key head, gdn_chunk_prepare_grouped) on the same
        // conv output: every array for the test to compare with blocked's
        ChunkOperands<bf16, CHUNK> grouped(in);
        launch(num_chunks, nk, 1, 128, [&] {
            gdn_chunk_prepare_grouped(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                      chunk_start.data(), chunk_len.data(), grouped.qn.data(), grouped.kn.data(), grouped.w.data(),
                                      grouped.u.data(), grouped.p.data(), grouped.cum.data(), nk, nv, dv);
        });
        save(dir, "blocked_qn.bin", blocked.qn);
        save(dir, "blocked_kn.bin", blocked.kn);
        save(dir, "blocked_p.bin", blocked.p);
        save(dir, "blocked_cum.bin", blocked.cum);
        save(dir, "grouped_qn.bin", grouped.qn);
        save(dir, "grouped_kn.bin", grouped.kn);
        save(dir, "grouped_w.bin", grouped.w);
        save(dir, "grouped_u.bin", grouped.u);
        save(dir, "grouped_p.bin", grouped.p);
        save(dir, "grouped_cum.bin", grouped.cum);
        // the same with the solve's block products on tensor cores (gdn_chunk_prepare_grouped_mma)
        ChunkOperands<bf16, CHUNK> grouped_mma(in);
        launch(num_chunks, nk, 1, 128, [&] {
            gdn_chunk_prepare_grouped_mma(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                          chunk_start.data(), chunk_len.data(), grouped_mma.qn.data(), grouped_mma.kn.data(), grouped_mma.w.data(),
                                          grouped_mma.u.data(), grouped_mma.p.data(), grouped_mma.cum.data(), nk, nv, dv);
        });
        save_flag(dir, "grouped_mma_same.bin", bits_equal(grouped_mma.qn, grouped.qn) &&
                                                   bits_equal(grouped_mma.kn, grouped.kn) &&
                                                   bits_equal(grouped_mma.p, grouped.p) && bits_equal(grouped_mma.cum, grouped.cum));
        // the same with each key head's value heads split over blocks (grid z: a small step): its bits
        {
            ChunkOperands<bf16, CHUNK> heads_apart(in);
            launch(num_chunks, nk, nv / nk, 128, [&] {
                gdn_chunk_prepare_grouped_mma(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                              chunk_start.data(), chunk_len.data(), heads_apart.qn.data(), heads_apart.kn.data(),
                                              heads_apart.w.data(), heads_apart.u.data(), heads_apart.p.data(), heads_apart.cum.data(), nk, nv, dv);
            });
            save_flag(dir, "grouped_split_same.bin", bits_equal(heads_apart, grouped_mma));
        }
        // W / U staged through shared memory, 16-byte row stores (gdn_chunk_prepare_grouped_coalesced): its bits
        {
            ChunkOperands<bf16, CHUNK> coalesced(in);
            launch(num_chunks, nk, 1, 128, [&] {
                gdn_chunk_prepare_grouped_coalesced(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                                    chunk_start.data(), chunk_len.data(), coalesced.qn.data(), coalesced.kn.data(),
                                                    coalesced.w.data(), coalesced.u.data(), coalesced.p.data(), coalesced.cum.data(), nk, nv, dv);
            });
            save_flag(dir, "grouped_coalesced_same.bin", bits_equal(coalesced, grouped_mma));
        }
        // the conv fused in (gdn_chunk_prepare_grouped_conv) on the projection and the windows as they were
        // before gdn_conv_state: grouped_mma's arrays bit for bit; the one-token rows' conv alone
        // (gdn_conv1d_vec_rows) gives conv_out's rows
        {
            auto old_conv_state = load<bf16>(dir, "conv_state.bin");
            ChunkOperands<bf16, CHUNK> conv_fused(in);
            launch(num_chunks, nk, 1, 128, [&] {
                gdn_chunk_prepare_grouped_conv(proj.data(), proj_stride, weight.data(), old_conv_state.data(),
                                               query_start.data(), slots.data(), fresh.data(), token_seq.data(), width,
                                               rate.data(), bias.data(), chunk_start.data(), chunk_len.data(),
                                               conv_fused.qn.data(), conv_fused.kn.data(), conv_fused.w.data(), conv_fused.u.data(), conv_fused.p.data(),
                                               conv_fused.cum.data(), nk, nv, dv);
            });
            std::vector<int> one_token_rows;
            for (int s = 0; s < num_seqs; ++s)
                if (query_start[s + 1] - query_start[s] == 1) one_token_rows.push_back(query_start[s]);
            std::vector<bf16> rows_conv_out(conv_out.size());
            const int num_rows = static_cast<int>(one_token_rows.size());
            launch(static_cast<unsigned>((num_rows + CONV_TOKENS - 1) / CONV_TOKENS),
                   static_cast<unsigned>((conv_dim + 1023) / 1024), 1, 128, [&] {
                gdn_conv1d_vec_rows(proj.data(), proj_stride, weight.data(), old_conv_state.data(), query_start.data(),
                                    slots.data(), fresh.data(), token_seq.data(), rows_conv_out.data(), num_rows,
                                    conv_dim, width, one_token_rows.data());
            });
            bool rows_same = num_rows > 0;
            for (int t : one_token_rows)
                rows_same = rows_same && std::memcmp(rows_conv_out.data() + (size_t)t * conv_dim,
                                                     conv_out.data() + (size_t)t * conv_dim, conv_dim * sizeof(bf16)) == 0;
            save_flag(dir, "grouped_conv_same.bin", bits_equal(conv_fused, grouped_mma));
            save_flag(dir, "conv_rows_same.bin", rows_same);
        }
        save(dir, "grouped_mma_w.bin", grouped_mma.w);
        save(dir, "grouped_mma_u.bin", grouped_mma.u);

        // the split scan (gdn_chunk_states, then gdn_chunk_output) from the same slots: the scan's
        // core output and final states
        auto split_ssm = load<float>(dir, "ssm_state.bin");
        std::vector<bf16> states(static_cast<size_t>(num_chunks) * nv * dv * DK), v_new(core.size());
        std::vector<bf16> split_core(core.size());
        launch(num_seqs, nv, dv / SCAN_TILE, 128, [&] {
            gdn_chunk_states(staged.kn.data(), staged.w.data(), staged.u.data(), staged.cum.data(), chunk_start.data(), chunk_len.data(),
                             seq_chunks.data(), slots.data(), fresh.data(), split_ssm.data(), states.data(),
                             v_new.data(), nk, nv, dv);
        });
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_output(staged.qn.data(), staged.p.data(), staged.cum.data(), states.data(), v_new.data(), chunk_start.data(),
                             chunk_len.data(), split_core.data(), nk, nv, dv);
        });
        save_flag(dir, "split_scan_same.bin", bits_equal(split_core, core) && bits_equal(split_ssm, ssm));

        // the walk with the state in registers (gdn_chunk_states_registers, 16 channels a warp, as
        // many warps as dv / 16 allows up to 8) from the same slots: its S^T per chunk, V', the
        // core output and the final states
        auto reg_ssm = load<float>(dir, "ssm_state.bin");
        std::vector<bf16> reg_states(states.size()), reg_v_new(v_new.size()), reg_core(core.size());
        int warps = 8;
        while ((dv / 16) % warps) warps /= 2;
        launch(num_seqs, nv, dv / (16 * warps), 32 * warps, [&] {
            gdn_chunk_states_registers(staged.kn.data(), staged.w.data(), staged.u.data(), staged.cum.data(), chunk_start.data(),
                                       chunk_len.data(), seq_chunks.data(), slots.data(), fresh.data(),
                                       reg_ssm.data(), reg_states.data(), reg_v_new.data(), nk, nv, dv);
        });
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_output(staged.qn.data(), staged.p.data(), staged.cum.data(), reg_states.data(), reg_v_new.data(),
                             chunk_start.data(), chunk_len.data(), reg_core.data(), nk, nv, dv);
        });
        // the output kernel with all of a block's operands loaded at once (gdn_chunk_output_staged)
        std::vector<bf16> staged_core(core.size());
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_output_staged(staged.qn.data(), staged.p.data(), staged.cum.data(), reg_states.data(), reg_v_new.data(),
                                    chunk_start.data(), chunk_len.data(), staged_core.data(), nk, nv, dv);
        });
        save_flag(dir, "output_staged_same.bin", bits_equal(staged_core, reg_core));
        save_flag(dir, "registers_states_same.bin", bits_equal(reg_states, states) && bits_equal(reg_v_new, v_new) &&
                                                        bits_equal(reg_core, core) && bits_equal(reg_ssm, ssm));
        save(dir, "registers_core.bin", reg_core);
        save(dir, "registers_ssm.bin", reg_ssm);

        // the output kernel with the gated norm fused in (gdn_chunk_output_norm) from the same walk:
        // the layer's output rows (every row of this step is chunked: no one-token rows)
        std::vector<bf16> fused_out(out.size());
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_output_norm(staged.qn.data(), staged.p.data(), staged.cum.data(), reg_states.data(), reg_v_new.data(),
                                  chunk_start.data(), chunk_len.data(), fused_out.data(), nk, nv, dv, proj.data(),
                                  proj_stride, conv_dim, norm.data(), eps);
        });
        save(dir, "fused_out.bin", fused_out);
    }

    // decode: one fused kernel, each variant on the same inputs
    {
        auto proj = load<bf16>(dir, "decode_proj.bin");
        auto query_start = load<int>(dir, "decode_query_start.bin");
        auto slots = load<int>(dir, "decode_slots.bin");
        auto fresh = load<int>(dir, "decode_fresh.bin");
        const int num_seqs = static_cast<int>(slots.size());
        std::vector<int> arrivals(static_cast<size_t>(num_seqs) * nk, 0);  // each kernel leaves them at zero
        const unsigned threads = static_cast<unsigned>((std::max(dv * SPLIT, 2 * DK + dv) + 31) / 32 * 32);
        struct DecodeRun {
            std::vector<bf16> out, conv_state;
            std::vector<float> ssm;
        };
        // one decode kernel from the saved slots: its output, windows, states and arrival counters as NAME_*.bin
        auto decode = [&](auto kernel, const std::string& name) {
            DecodeRun run{std::vector<bf16>(static_cast<size_t>(num_seqs) * value_dim),
                          load<bf16>(dir, "decode_conv_state.bin"), load<float>(dir, "decode_ssm_state.bin")};
            launch(num_seqs, nv, 1, threads, [&] {
                kernel(proj.data(), proj_stride, weight.data(), run.conv_state.data(), run.ssm.data(), rate.data(),
                       bias.data(), norm.data(), query_start.data(), slots.data(), fresh.data(), arrivals.data(),
                       run.out.data(), nk, nv, dv, width, eps);
            });
            save(dir, (name + "_out.bin").c_str(), run.out);
            save(dir, (name + "_conv_state_out.bin").c_str(), run.conv_state);
            save(dir, (name + "_ssm_state_out.bin").c_str(), run.ssm);
            save(dir, (name + "_arrivals.bin").c_str(), arrivals);
            return run;
        };
        decode(gdn_decode_step, "decode");
        decode(gdn_decode_step_early_loads, "early_loads");  // the gate inputs read beside the state column
        decode(gdn_decode_step_coalesced, "coalesced");  // a column's threads dv apart
        const DecodeRun vec4 = decode(gdn_decode_step_vec4, "vec4");  // 16-byte state accesses, 16 partial sums a column
        // the state tile moved by bulk copies, both passes through shared memory: vec4's bits
        const DecodeRun bulk = decode(gdn_decode_step_bulk, "bulk");
        save_flag(dir, "bulk_same.bin", bits_equal(bulk.out, vec4.out) && bits_equal(bulk.conv_state, vec4.conv_state) &&
                                            bits_equal(bulk.ssm, vec4.ssm));
    }
    return 0;
}
