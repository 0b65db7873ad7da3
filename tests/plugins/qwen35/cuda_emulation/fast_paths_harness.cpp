// Runs the chunked prefill (gdn_chunked.cu) and the fused decode step (gdn_decode.cu: the plain,
// early-loads, coalesced and vec4 kernels on the same inputs) on the CPU
// (tests/helpers/cuda_host) on arrays written by test_qwen35_cuda_emulated.py, and writes the
// outputs back. The tensor-core mma is emulated lane by lane: each lane publishes its fragment
// registers at its warp's barrier and computes its own four outputs from the 16x16 and 16x8
// tiles they describe — so the fragment layouts the kernels assume are checked too.
#define MMA_HOST_STANDIN  // core's mma.cuh: no PTX; harness.h defines mma_bf16_16816
#define GDN_DYNAMIC_SHARED(name) alignas(16) static unsigned char name[1 << 18]
#include <cuda_bf16.h>  // the host stand-ins (__threadfence, a variadic __launch_bounds__ among them)
#include <cstring>  // gdn_decode_step_bulk's host stand-in copies
struct alignas(16) float4 {  // CUDA's vector type (gdn_decode_step_vec4's 16-byte state accesses)
    float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
void __syncwarp(unsigned mask = 0xffffffffu);  // the calling thread's warp meets (defined after harness.h)

#include "gated_deltanet.cu"
#include "gdn_chunked.cu"
#include "gdn_decode.cu"

#include "harness.h"
#include "chunked_prefill_inputs.h"

void __syncwarp(unsigned) { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

#include <cstring>

int main(int argc, char** argv) {
    if (argc != 7) { std::fprintf(stderr, "usage: harness DIR nk nv dv width eps\n"); return 1; }
    const std::string dir = argv[1];
    const int nk = std::atoi(argv[2]), nv = std::atoi(argv[3]), dv = std::atoi(argv[4]), width = std::atoi(argv[5]);
    const float eps = static_cast<float>(std::atof(argv[6]));
    ChunkedPrefillInputs in(dir, nk, nv, dv, width);
    const int key_dim = in.key_dim, value_dim = in.value_dim, conv_dim = in.conv_dim, proj_stride = in.proj_stride;
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
        std::vector<bf16> conv_out(static_cast<size_t>(num_tokens) * conv_dim);
        std::vector<bf16> qn(static_cast<size_t>(num_tokens) * key_dim), kn(qn.size());
        std::vector<bf16> w(static_cast<size_t>(num_tokens) * nv * DK), u(static_cast<size_t>(num_tokens) * value_dim);
        std::vector<bf16> p(static_cast<size_t>(num_chunks) * nv * CHUNK * CHUNK);
        std::vector<float> cum(static_cast<size_t>(num_tokens) * nv);
        std::vector<bf16> core(static_cast<size_t>(num_tokens) * value_dim), out(core.size());
        launch(1, 1, 1, 1, [&] {
            gdn_conv1d(proj.data(), proj_stride, weight.data(), conv_state.data(), query_start.data(), slots.data(),
                       fresh.data(), token_seq.data(), conv_out.data(), num_tokens, conv_dim, width);
        });
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
        std::vector<bf16> s_qn(qn.size()), s_kn(kn.size()), s_w(w.size()), s_u(u.size()), s_p(p.size());
        std::vector<float> s_cum(cum.size());
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_prepare_staged(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                     chunk_start.data(), chunk_len.data(), s_qn.data(), s_kn.data(), s_w.data(),
                                     s_u.data(), s_p.data(), s_cum.data(), nk, nv, dv);
        });
        auto bits_equal = [](const auto& a, const auto& b) {
            return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
        };
        const bool same = bits_equal(s_qn, qn) && bits_equal(s_kn, kn) && bits_equal(s_w, w) && bits_equal(s_u, u) &&
                          bits_equal(s_p, p) && bits_equal(s_cum, cum);
        std::vector<bf16> warp_out(out.size());
        launch(static_cast<unsigned>(num_tokens), static_cast<unsigned>((nv + 3) / 4), 1, 128, [&] {
            gdn_gated_norm_warp(core.data(), proj.data(), proj_stride, norm.data(), warp_out.data(), conv_dim,
                                value_dim, nv, dv, eps);
        });
        std::vector<int> staged_same{same && bits_equal(vec_conv_out, conv_out) && bits_equal(warp_out, out) ? 1 : 0};
        save(dir, "staged_prepare_same.bin", staged_same);
        // the 8-channel gated norm (gdn_gated_norm_vec) on the same O: for the test to compare
        std::vector<bf16> vec_norm_out(out.size());
        launch(static_cast<unsigned>(num_tokens), static_cast<unsigned>((value_dim / 8 + 127) / 128), 1, 128, [&] {
            gdn_gated_norm_vec(core.data(), proj.data(), proj_stride, norm.data(), vec_norm_out.data(), conv_dim,
                               value_dim, nv, dv, eps);
        });
        save(dir, "vec_norm_out.bin", vec_norm_out);

        // the blocked triangular solve (gdn_chunk_prepare_blocked) on the same conv output: qn, kn,
        // P and c bit for bit (the solve comes after them), W and U (from T) for the test to compare
        std::vector<bf16> b_qn(qn.size()), b_kn(kn.size()), b_w(w.size()), b_u(u.size()), b_p(p.size());
        std::vector<float> b_cum(cum.size());
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_prepare_blocked(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                      chunk_start.data(), chunk_len.data(), b_qn.data(), b_kn.data(), b_w.data(),
                                      b_u.data(), b_p.data(), b_cum.data(), nk, nv, dv);
        });
        std::vector<int> blocked_same{bits_equal(b_qn, qn) && bits_equal(b_kn, kn) && bits_equal(b_p, p) &&
                                      bits_equal(b_cum, cum) ? 1 : 0};
        save(dir, "blocked_prepare_same.bin", blocked_same);
        save(dir, "prepare_w.bin", w);
        save(dir, "prepare_u.bin", u);
        save(dir, "blocked_w.bin", b_w);
        save(dir, "blocked_u.bin", b_u);

        // the grouped prepare (a block per chunk and key head, gdn_chunk_prepare_grouped) on the same
        // conv output: every array for the test to compare with blocked's
        std::vector<bf16> g_qn(qn.size()), g_kn(kn.size()), g_w(w.size()), g_u(u.size()), g_p(p.size());
        std::vector<float> g_cum(cum.size());
        launch(num_chunks, nk, 1, 128, [&] {
            gdn_chunk_prepare_grouped(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                      chunk_start.data(), chunk_len.data(), g_qn.data(), g_kn.data(), g_w.data(),
                                      g_u.data(), g_p.data(), g_cum.data(), nk, nv, dv);
        });
        save(dir, "blocked_qn.bin", b_qn);
        save(dir, "blocked_kn.bin", b_kn);
        save(dir, "blocked_p.bin", b_p);
        save(dir, "blocked_cum.bin", b_cum);
        save(dir, "grouped_qn.bin", g_qn);
        save(dir, "grouped_kn.bin", g_kn);
        save(dir, "grouped_w.bin", g_w);
        save(dir, "grouped_u.bin", g_u);
        save(dir, "grouped_p.bin", g_p);
        save(dir, "grouped_cum.bin", g_cum);
        // the same with the solve's block products on tensor cores (gdn_chunk_prepare_grouped_mma)
        std::vector<bf16> m_qn(qn.size()), m_kn(kn.size()), m_w(w.size()), m_u(u.size()), m_p(p.size());
        std::vector<float> m_cum(cum.size());
        launch(num_chunks, nk, 1, 128, [&] {
            gdn_chunk_prepare_grouped_mma(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                          chunk_start.data(), chunk_len.data(), m_qn.data(), m_kn.data(), m_w.data(),
                                          m_u.data(), m_p.data(), m_cum.data(), nk, nv, dv);
        });
        std::vector<int> grouped_mma_same{bits_equal(m_qn, g_qn) && bits_equal(m_kn, g_kn) && bits_equal(m_p, g_p) &&
                                          bits_equal(m_cum, g_cum) ? 1 : 0};
        save(dir, "grouped_mma_same.bin", grouped_mma_same);
        // the same with each key head's value heads split over blocks (grid z: a small step): its bits
        {
            std::vector<bf16> z_qn(qn.size()), z_kn(kn.size()), z_w(w.size()), z_u(u.size()), z_p(p.size());
            std::vector<float> z_cum(cum.size());
            launch(num_chunks, nk, nv / nk, 128, [&] {
                gdn_chunk_prepare_grouped_mma(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                              chunk_start.data(), chunk_len.data(), z_qn.data(), z_kn.data(),
                                              z_w.data(), z_u.data(), z_p.data(), z_cum.data(), nk, nv, dv);
            });
            std::vector<int> split_same{bits_equal(z_qn, m_qn) && bits_equal(z_kn, m_kn) && bits_equal(z_w, m_w) &&
                                        bits_equal(z_u, m_u) && bits_equal(z_p, m_p) && bits_equal(z_cum, m_cum)
                                        ? 1 : 0};
            save(dir, "grouped_split_same.bin", split_same);
        }
        // W / U staged through shared memory, 16-byte row stores (gdn_chunk_prepare_grouped_coalesced): its bits
        {
            std::vector<bf16> c_qn(qn.size()), c_kn(kn.size()), c_w(w.size()), c_u(u.size()), c_p(p.size());
            std::vector<float> c_cum(cum.size());
            launch(num_chunks, nk, 1, 128, [&] {
                gdn_chunk_prepare_grouped_coalesced(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                                    chunk_start.data(), chunk_len.data(), c_qn.data(), c_kn.data(),
                                                    c_w.data(), c_u.data(), c_p.data(), c_cum.data(), nk, nv, dv);
            });
            std::vector<int> coalesced_same{bits_equal(c_qn, m_qn) && bits_equal(c_kn, m_kn) && bits_equal(c_w, m_w) &&
                                            bits_equal(c_u, m_u) && bits_equal(c_p, m_p) && bits_equal(c_cum, m_cum)
                                            ? 1 : 0};
            save(dir, "grouped_coalesced_same.bin", coalesced_same);
        }
        // the conv fused in (gdn_chunk_prepare_grouped_conv) on the projection and the windows as they were
        // before gdn_conv_state: grouped_mma's arrays bit for bit; the one-token rows' conv alone
        // (gdn_conv1d_vec_rows) gives conv_out's rows
        {
            auto old_conv_state = load<bf16>(dir, "conv_state.bin");
            std::vector<bf16> f_qn(qn.size()), f_kn(kn.size()), f_w(w.size()), f_u(u.size()), f_p(p.size());
            std::vector<float> f_cum(cum.size());
            launch(num_chunks, nk, 1, 128, [&] {
                gdn_chunk_prepare_grouped_conv(proj.data(), proj_stride, weight.data(), old_conv_state.data(),
                                               query_start.data(), slots.data(), fresh.data(), token_seq.data(), width,
                                               rate.data(), bias.data(), chunk_start.data(), chunk_len.data(),
                                               f_qn.data(), f_kn.data(), f_w.data(), f_u.data(), f_p.data(),
                                               f_cum.data(), nk, nv, dv);
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
            std::vector<int> grouped_conv_same{bits_equal(f_qn, m_qn) && bits_equal(f_kn, m_kn) && bits_equal(f_w, m_w) &&
                                               bits_equal(f_u, m_u) && bits_equal(f_p, m_p) && bits_equal(f_cum, m_cum)
                                               ? 1 : 0};
            std::vector<int> conv_rows_same{rows_same ? 1 : 0};
            save(dir, "grouped_conv_same.bin", grouped_conv_same);
            save(dir, "conv_rows_same.bin", conv_rows_same);
        }
        save(dir, "grouped_mma_w.bin", m_w);
        save(dir, "grouped_mma_u.bin", m_u);

        // the split scan (gdn_chunk_states, then gdn_chunk_output) from the same slots: the scan's
        // core output and final states
        auto split_ssm = load<float>(dir, "ssm_state.bin");
        std::vector<bf16> states(static_cast<size_t>(num_chunks) * nv * dv * DK), v_new(core.size());
        std::vector<bf16> split_core(core.size());
        launch(num_seqs, nv, dv / SCAN_TILE, 128, [&] {
            gdn_chunk_states(s_kn.data(), s_w.data(), s_u.data(), s_cum.data(), chunk_start.data(), chunk_len.data(),
                             seq_chunks.data(), slots.data(), fresh.data(), split_ssm.data(), states.data(),
                             v_new.data(), nk, nv, dv);
        });
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_output(s_qn.data(), s_p.data(), s_cum.data(), states.data(), v_new.data(), chunk_start.data(),
                             chunk_len.data(), split_core.data(), nk, nv, dv);
        });
        std::vector<int> split_same{bits_equal(split_core, core) && bits_equal(split_ssm, ssm) ? 1 : 0};
        save(dir, "split_scan_same.bin", split_same);

        // the walk with the state in registers (gdn_chunk_states_registers, 16 channels a warp, as
        // many warps as dv / 16 allows up to 8) from the same slots: its S^T per chunk, V', the
        // core output and the final states
        auto reg_ssm = load<float>(dir, "ssm_state.bin");
        std::vector<bf16> reg_states(states.size()), reg_v_new(v_new.size()), reg_core(core.size());
        int warps = 8;
        while ((dv / 16) % warps) warps /= 2;
        launch(num_seqs, nv, dv / (16 * warps), 32 * warps, [&] {
            gdn_chunk_states_registers(s_kn.data(), s_w.data(), s_u.data(), s_cum.data(), chunk_start.data(),
                                       chunk_len.data(), seq_chunks.data(), slots.data(), fresh.data(),
                                       reg_ssm.data(), reg_states.data(), reg_v_new.data(), nk, nv, dv);
        });
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_output(s_qn.data(), s_p.data(), s_cum.data(), reg_states.data(), reg_v_new.data(),
                             chunk_start.data(), chunk_len.data(), reg_core.data(), nk, nv, dv);
        });
        // the output kernel with all of a block's operands loaded at once (gdn_chunk_output_staged)
        std::vector<bf16> staged_core(core.size());
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_output_staged(s_qn.data(), s_p.data(), s_cum.data(), reg_states.data(), reg_v_new.data(),
                                    chunk_start.data(), chunk_len.data(), staged_core.data(), nk, nv, dv);
        });
        std::vector<int> output_staged_same{bits_equal(staged_core, reg_core) ? 1 : 0};
        save(dir, "output_staged_same.bin", output_staged_same);
        std::vector<int> registers_same{bits_equal(reg_states, states) && bits_equal(reg_v_new, v_new) &&
                                        bits_equal(reg_core, core) && bits_equal(reg_ssm, ssm) ? 1 : 0};
        save(dir, "registers_states_same.bin", registers_same);
        save(dir, "registers_core.bin", reg_core);
        save(dir, "registers_ssm.bin", reg_ssm);

        // the output kernel with the gated norm fused in (gdn_chunk_output_norm) from the same walk:
        // the layer's output rows (every row of this step is chunked: no one-token rows)
        std::vector<bf16> fused_out(out.size());
        launch(num_chunks, nv, 1, 128, [&] {
            gdn_chunk_output_norm(s_qn.data(), s_p.data(), s_cum.data(), reg_states.data(), reg_v_new.data(),
                                  chunk_start.data(), chunk_len.data(), fused_out.data(), nk, nv, dv, proj.data(),
                                  proj_stride, conv_dim, norm.data(), eps);
        });
        save(dir, "fused_out.bin", fused_out);
    }

    // decode: one fused kernel
    {
        auto proj = load<bf16>(dir, "decode_proj.bin");
        auto conv_state = load<bf16>(dir, "decode_conv_state.bin");
        auto ssm = load<float>(dir, "decode_ssm_state.bin");
        auto query_start = load<int>(dir, "decode_query_start.bin");
        auto slots = load<int>(dir, "decode_slots.bin");
        auto fresh = load<int>(dir, "decode_fresh.bin");
        const int num_seqs = static_cast<int>(slots.size());
        std::vector<int> arrivals(static_cast<size_t>(num_seqs) * nk, 0);
        std::vector<bf16> out(static_cast<size_t>(num_seqs) * value_dim);
        const int threads = std::max(dv * SPLIT, 2 * DK + dv);
        launch(num_seqs, nv, 1, static_cast<unsigned>((threads + 31) / 32 * 32), [&] {
            gdn_decode_step(proj.data(), proj_stride, weight.data(), conv_state.data(), ssm.data(), rate.data(),
                            bias.data(), norm.data(), query_start.data(), slots.data(), fresh.data(), arrivals.data(),
                            out.data(), nk, nv, dv, width, eps);
        });
        save(dir, "decode_out.bin", out);
        save(dir, "decode_conv_state_out.bin", conv_state);
        save(dir, "decode_ssm_state_out.bin", ssm);
        save(dir, "decode_arrivals.bin", arrivals);

        // the early-loads kernel on the same inputs
        auto e_conv_state = load<bf16>(dir, "decode_conv_state.bin");
        auto e_ssm = load<float>(dir, "decode_ssm_state.bin");
        std::vector<bf16> e_out(out.size());
        launch(num_seqs, nv, 1, static_cast<unsigned>((threads + 31) / 32 * 32), [&] {
            gdn_decode_step_early_loads(proj.data(), proj_stride, weight.data(), e_conv_state.data(), e_ssm.data(),
                                        rate.data(), bias.data(), norm.data(), query_start.data(), slots.data(),
                                        fresh.data(), arrivals.data(), e_out.data(), nk, nv, dv, width, eps);
        });
        save(dir, "early_loads_out.bin", e_out);
        save(dir, "early_loads_conv_state_out.bin", e_conv_state);
        save(dir, "early_loads_ssm_state_out.bin", e_ssm);
        save(dir, "early_loads_arrivals.bin", arrivals);

        // the coalesced kernel (a column's threads dv apart) on the same inputs
        auto c_conv_state = load<bf16>(dir, "decode_conv_state.bin");
        auto c_ssm = load<float>(dir, "decode_ssm_state.bin");
        std::vector<bf16> c_out(out.size());
        launch(num_seqs, nv, 1, static_cast<unsigned>((threads + 31) / 32 * 32), [&] {
            gdn_decode_step_coalesced(proj.data(), proj_stride, weight.data(), c_conv_state.data(), c_ssm.data(),
                                      rate.data(), bias.data(), norm.data(), query_start.data(), slots.data(),
                                      fresh.data(), arrivals.data(), c_out.data(), nk, nv, dv, width, eps);
        });
        save(dir, "coalesced_out.bin", c_out);
        save(dir, "coalesced_conv_state_out.bin", c_conv_state);
        save(dir, "coalesced_ssm_state_out.bin", c_ssm);

        // the vec4 kernel (16-byte state accesses, 16 partial sums a column) on the same inputs
        auto v_conv_state = load<bf16>(dir, "decode_conv_state.bin");
        auto v_ssm = load<float>(dir, "decode_ssm_state.bin");
        std::vector<bf16> v_out(out.size());
        launch(num_seqs, nv, 1, static_cast<unsigned>((threads + 31) / 32 * 32), [&] {
            gdn_decode_step_vec4(proj.data(), proj_stride, weight.data(), v_conv_state.data(), v_ssm.data(),
                                 rate.data(), bias.data(), norm.data(), query_start.data(), slots.data(),
                                 fresh.data(), arrivals.data(), v_out.data(), nk, nv, dv, width, eps);
        });
        save(dir, "vec4_out.bin", v_out);
        save(dir, "vec4_conv_state_out.bin", v_conv_state);
        save(dir, "vec4_ssm_state_out.bin", v_ssm);
        save(dir, "vec4_arrivals.bin", arrivals);

        // the bulk kernel (the state tile moved by bulk copies, both passes through shared memory)
        auto b_conv_state = load<bf16>(dir, "decode_conv_state.bin");
        auto b_ssm = load<float>(dir, "decode_ssm_state.bin");
        std::vector<bf16> b_out(out.size());
        launch(num_seqs, nv, 1, static_cast<unsigned>((threads + 31) / 32 * 32), [&] {
            gdn_decode_step_bulk(proj.data(), proj_stride, weight.data(), b_conv_state.data(), b_ssm.data(),
                                 rate.data(), bias.data(), norm.data(), query_start.data(), slots.data(),
                                 fresh.data(), arrivals.data(), b_out.data(), nk, nv, dv, width, eps);
        });
        auto same_bits = [](const auto& a, const auto& b) {
            return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
        };
        std::vector<int> bulk_same{
            same_bits(b_out, v_out) && same_bits(b_conv_state, v_conv_state) && same_bits(b_ssm, v_ssm) ? 1 : 0};
        save(dir, "bulk_same.bin", bulk_same);
        save(dir, "bulk_arrivals.bin", arrivals);

    }
    return 0;
}
