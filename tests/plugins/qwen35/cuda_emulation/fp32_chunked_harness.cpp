// Runs the fp32 chunked prefill (gdn_chunked_fp32.cu: gdn_conv1d -> gdn_chunk_prepare_fp32 ->
// gdn_chunk_walk_fp32), the split-operand tensor-core one (gdn_chunked_split.cu: gdn_chunk_prepare_split ->
// gdn_chunk_walk_split, and with fp16 parts: gdn_chunk_prepare_split_f16 -> gdn_chunk_walk_split_f16) on the
// CPU (tests/helpers/cuda_host) and, on the same conv_out, the token-by-token kernel gdn_delta_rule (fp32: the accuracy reference), for
// test_qwen35_cuda_emulated.py; writes their cores (bf16) and final states.
#include "kernel_standins.h"

#include "gated_deltanet.cu"
#include "gdn_chunked_fp32.cu"
#include "gdn_chunked_split.cu"

#include "harness.h"
#include "chunked_prefill_inputs.h"

int main(int argc, char** argv) {
    ChunkedPrefillInputs in(argc, argv, /*with_eps=*/false);
    const std::string& dir = in.dir;
    const int nk = in.nk, nv = in.nv, dv = in.dv, value_dim = in.value_dim, proj_stride = in.proj_stride;
    const int num_tokens = in.num_tokens, num_seqs = in.num_seqs, num_chunks = in.num_chunks;
    auto& proj = in.proj;
    auto &rate = in.neg_decay_rate, &bias = in.dt_bias;
    auto &query_start = in.query_start, &slots = in.slots, &fresh = in.fresh;
    auto &chunk_start = in.chunk_start, &chunk_len = in.chunk_len, &seq_chunks = in.seq_chunks;
    const std::vector<bf16> conv_out = in.conv1d();
    ChunkOperands<float, FP32_CHUNK> prepared(in);  // (the split chains reuse its W, U, P and c)
    auto &qn = prepared.qn, &kn = prepared.kn, &w = prepared.w, &u = prepared.u, &p = prepared.p;
    auto& cum = prepared.cum;
    launch(num_chunks, nv, 1, FP32_THREADS, [&] {
        gdn_chunk_prepare_fp32(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(), chunk_start.data(),
                               chunk_len.data(), qn.data(), kn.data(), w.data(), u.data(), p.data(), cum.data(), nk,
                               nv, dv);
    });
    auto ssm = load<float>(dir, "ssm_state.bin");
    std::vector<bf16> core(static_cast<size_t>(num_tokens) * value_dim);
    launch(num_seqs, nv, dv / FP32_TILE, FP32_THREADS, [&] {
        gdn_chunk_walk_fp32(qn.data(), kn.data(), w.data(), u.data(), p.data(), cum.data(), chunk_start.data(),
                            chunk_len.data(), seq_chunks.data(), slots.data(), fresh.data(), ssm.data(), core.data(), nk,
                            nv, dv);
    });
    save(dir, "fp32_core.bin", core);
    save(dir, "fp32_ssm_state.bin", ssm);
    auto split_ssm = load<float>(dir, "ssm_state.bin");
    std::vector<float> norms(static_cast<size_t>(num_tokens) * nk * 2);
    launch(num_chunks, nv, 1, SPLIT_THREADS, [&] {
        gdn_chunk_prepare_split(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(), chunk_start.data(),
                                chunk_len.data(), norms.data(), w.data(), u.data(), p.data(), cum.data(), nk, nv, dv);
    });
    std::vector<bf16> split_core(core.size());
    launch(dv / SPLIT_TILE, num_seqs, nv, SPLIT_THREADS, [&] {
        gdn_chunk_walk_split(conv_out.data(), norms.data(), w.data(), u.data(), p.data(), cum.data(), chunk_start.data(),
                             chunk_len.data(), seq_chunks.data(), slots.data(), fresh.data(), split_ssm.data(),
                             split_core.data(), nk, nv, dv);
    });
    save(dir, "split_core.bin", split_core);
    save(dir, "split_ssm_state.bin", split_ssm);
    auto split_f16_ssm = load<float>(dir, "ssm_state.bin");
    launch(num_chunks, nv, 1, SPLIT_THREADS, [&] {
        gdn_chunk_prepare_split_f16(conv_out.data(), proj.data(), proj_stride, rate.data(), bias.data(),
                                    chunk_start.data(), chunk_len.data(), norms.data(), w.data(), u.data(), p.data(),
                                    cum.data(), nk, nv, dv);
    });
    std::vector<bf16> split_f16_core(core.size());
    launch(dv / SPLIT_TILE, num_seqs, nv, SPLIT_THREADS, [&] {
        gdn_chunk_walk_split_f16(conv_out.data(), norms.data(), w.data(), u.data(), p.data(), cum.data(),
                                 chunk_start.data(), chunk_len.data(), seq_chunks.data(), slots.data(), fresh.data(),
                                 split_f16_ssm.data(), split_f16_core.data(), nk, nv, dv);
    });
    save(dir, "split_f16_core.bin", split_f16_core);
    save(dir, "split_f16_ssm_state.bin", split_f16_ssm);
    // the snapshot entry: S entering sequence 0's third chunk also into slot 1 (else untouched); then sequence 0's
    // first two chunks walked alone into slot 1 of another copy: the same state
    auto snapshot_ssm = load<float>(dir, "ssm_state.bin");
    std::vector<bf16> snapshot_core(core.size());
    std::vector<int> snapshot_chunk = {seq_chunks[0] + 2, -1}, snapshot_slot = {1, 0};
    launch(dv / SPLIT_TILE, num_seqs, nv, SPLIT_THREADS, [&] {
        gdn_chunk_walk_split_f16_snapshot(conv_out.data(), norms.data(), w.data(), u.data(), p.data(), cum.data(),
                                          chunk_start.data(), chunk_len.data(), seq_chunks.data(), slots.data(),
                                          fresh.data(), snapshot_ssm.data(), snapshot_core.data(), nk, nv, dv,
                                          snapshot_chunk.data(), snapshot_slot.data());
    });
    save(dir, "split_f16_snapshot_core.bin", snapshot_core);
    save(dir, "split_f16_snapshot_ssm_state.bin", snapshot_ssm);
    auto prefix_ssm = load<float>(dir, "ssm_state.bin");
    std::vector<bf16> prefix_core(core.size());
    std::vector<int> prefix_seq_chunks = {seq_chunks[0], seq_chunks[0] + 2}, prefix_slots = {1},
                     prefix_fresh = {fresh[0]};
    launch(dv / SPLIT_TILE, 1, nv, SPLIT_THREADS, [&] {
        gdn_chunk_walk_split_f16(conv_out.data(), norms.data(), w.data(), u.data(), p.data(), cum.data(),
                                 chunk_start.data(), chunk_len.data(), prefix_seq_chunks.data(), prefix_slots.data(),
                                 prefix_fresh.data(), prefix_ssm.data(), prefix_core.data(), nk, nv, dv);
    });
    save(dir, "split_f16_prefix_ssm_state.bin", prefix_ssm);
    auto base_ssm = load<float>(dir, "ssm_state.bin");
    std::vector<bf16> base_core(core.size());
    const int tile_dv = dv < 32 ? dv : 32;  // as cuda_ops.TILE_DV
    launch(num_seqs, nv, (dv + tile_dv - 1) / tile_dv, static_cast<unsigned>((tile_dv * SPLIT + 31) / 32 * 32), [&] {
        gdn_delta_rule(proj.data(), proj_stride, conv_out.data(), base_ssm.data(), rate.data(), bias.data(),
                       query_start.data(), slots.data(), fresh.data(), base_core.data(), nk, nv, dv, tile_dv);
    });
    save(dir, "recurrent_core.bin", base_core);
    save(dir, "recurrent_ssm_state.bin", base_ssm);
    return 0;
}
