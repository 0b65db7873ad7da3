// The arrays of one chunked prefill step that test_qwen35_cuda_emulated.py writes (DIR/NAME.bin) and the step's
// shapes, loaded the same way for every harness that runs the chunked kernels (fast_paths_harness.cpp,
// operand_format_harness.cpp, fp32_chunked_harness.cpp). Include after harness.h (load<>) and the kernels.
#pragma once
#include <string>
#include <vector>

struct ChunkedPrefillInputs {
    // shapes (DK compiled in): heads, value head dim, conv width, and what they give
    int nk, nv, dv, width, key_dim, value_dim, conv_dim, proj_stride;
    // the layer's weights and the step (every array as the test wrote it; conv_state / ssm_state are the
    // slots before the step: harnesses that run several chains load fresh copies of those per chain)
    std::vector<bf16> conv_weight, proj, conv_state;
    std::vector<float> neg_decay_rate, dt_bias;
    std::vector<int> query_start, slots, fresh, token_seq, chunk_start, chunk_len, seq_chunks;
    int num_tokens, num_seqs, num_chunks;

    ChunkedPrefillInputs(const std::string& dir, int nk_, int nv_, int dv_, int width_)
        : nk(nk_), nv(nv_), dv(dv_), width(width_), key_dim(nk_ * DK), value_dim(nv_ * dv_),
          conv_dim(2 * key_dim + value_dim), proj_stride(conv_dim + value_dim + 2 * nv_),
          conv_weight(load<bf16>(dir, "conv_weight.bin")), proj(load<bf16>(dir, "proj.bin")),
          conv_state(load<bf16>(dir, "conv_state.bin")), neg_decay_rate(load<float>(dir, "neg_decay_rate.bin")),
          dt_bias(load<float>(dir, "dt_bias.bin")), query_start(load<int>(dir, "query_start.bin")),
          slots(load<int>(dir, "slots.bin")), fresh(load<int>(dir, "fresh.bin")),
          token_seq(load<int>(dir, "token_seq.bin")), chunk_start(load<int>(dir, "chunk_start.bin")),
          chunk_len(load<int>(dir, "chunk_len.bin")), seq_chunks(load<int>(dir, "seq_chunks.bin")),
          num_tokens(static_cast<int>(token_seq.size())), num_seqs(static_cast<int>(slots.size())),
          num_chunks(static_cast<int>(chunk_start.size())) {}
};
