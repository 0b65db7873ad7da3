// The arrays of one chunked prefill step that test_qwen35_cuda_emulated.py writes (DIR/NAME.bin), the step's shapes
// from the command line, and what every harness running the chunked kernels does with them alike (fast_paths_,
// operand_format_, fp32_chunked_ and snapshot_walk_harness.cpp). Include after kernel_standins.h, the kernels and
// harness.h (load<>, save<>, launch).
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

void __syncwarp(unsigned) { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

struct ChunkedPrefillInputs {
    std::string dir;
    // shapes (DK compiled in): heads, value head dim, conv width (and eps when the harness takes it), and what they give
    int nk, nv, dv, width;
    float eps;
    int key_dim, value_dim, conv_dim, proj_stride;
    // the layer's weights and the step (every array as the test wrote it; conv_state / ssm_state are the
    // slots before the step: harnesses that run several chains load fresh copies of those per chain)
    std::vector<bf16> conv_weight, proj, conv_state;
    std::vector<float> neg_decay_rate, dt_bias;
    std::vector<int> query_start, slots, fresh, token_seq, chunk_start, chunk_len, seq_chunks;
    int num_tokens, num_seqs, num_chunks;

    // argv: DIR nk nv dv width, then eps when ``with_eps``; a wrong count exits with the usage
    ChunkedPrefillInputs(int argc, char** argv, bool with_eps)
        : dir(arguments(argc, argv, with_eps)), nk(std::atoi(argv[2])), nv(std::atoi(argv[3])), dv(std::atoi(argv[4])),
          width(std::atoi(argv[5])), eps(with_eps ? static_cast<float>(std::atof(argv[6])) : 0.f), key_dim(nk * DK),
          value_dim(nv * dv), conv_dim(2 * key_dim + value_dim), proj_stride(conv_dim + value_dim + 2 * nv),
          conv_weight(load<bf16>(dir, "conv_weight.bin")), proj(load<bf16>(dir, "proj.bin")),
          conv_state(load<bf16>(dir, "conv_state.bin")), neg_decay_rate(load<float>(dir, "neg_decay_rate.bin")),
          dt_bias(load<float>(dir, "dt_bias.bin")), query_start(load<int>(dir, "query_start.bin")),
          slots(load<int>(dir, "slots.bin")), fresh(load<int>(dir, "fresh.bin")),
          token_seq(load<int>(dir, "token_seq.bin")), chunk_start(load<int>(dir, "chunk_start.bin")),
          chunk_len(load<int>(dir, "chunk_len.bin")), seq_chunks(load<int>(dir, "seq_chunks.bin")),
          num_tokens(static_cast<int>(token_seq.size())), num_seqs(static_cast<int>(slots.size())),
          num_chunks(static_cast<int>(chunk_start.size())) {}

    // gdn_conv1d over the step (conv_state as loaded): the conv output every chain starts from
    std::vector<bf16> conv1d() {
        std::vector<bf16> conv_out(static_cast<size_t>(num_tokens) * conv_dim);
        launch(1, 1, 1, 1, [&] {
            gdn_conv1d(proj.data(), proj_stride, conv_weight.data(), conv_state.data(), query_start.data(),
                       slots.data(), fresh.data(), token_seq.data(), conv_out.data(), num_tokens, conv_dim, width);
        });
        return conv_out;
    }

  private:
    static std::string arguments(int argc, char** argv, bool with_eps) {
        if (argc != (with_eps ? 7 : 6)) {
            std::fprintf(stderr, "usage: harness DIR nk nv dv width%s\n", with_eps ? " eps" : "");
            std::exit(1);
        }
        return argv[1];
    }
};

// what a chunk prepare kernel writes: q / k normed, W, U, P (ROWS x ROWS a chunk and value head) as T (bf16, or
// fp32 for gdn_chunked_fp32.cu), and the cumulative decay c
template <class T, int ROWS>
struct ChunkOperands {
    std::vector<T> qn, kn, w, u, p;
    std::vector<float> cum;

    explicit ChunkOperands(const ChunkedPrefillInputs& in)
        : qn(static_cast<size_t>(in.num_tokens) * in.key_dim), kn(qn.size()),
          w(static_cast<size_t>(in.num_tokens) * in.nv * DK), u(static_cast<size_t>(in.num_tokens) * in.value_dim),
          p(static_cast<size_t>(in.num_chunks) * in.nv * ROWS * ROWS), cum(static_cast<size_t>(in.num_tokens) * in.nv) {}
};

template <class A, class B>
bool bits_equal(const A& a, const B& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
}

template <class T, int ROWS>
bool bits_equal(const ChunkOperands<T, ROWS>& a, const ChunkOperands<T, ROWS>& b) {
    return bits_equal(a.qn, b.qn) && bits_equal(a.kn, b.kn) && bits_equal(a.w, b.w) && bits_equal(a.u, b.u) &&
           bits_equal(a.p, b.p) && bits_equal(a.cum, b.cum);
}

// a yes / no for the test: one int32, 1 or 0
inline void save_flag(const std::string& dir, const std::string& name, bool value) {
    std::vector<int> flag{value ? 1 : 0};
    save(dir, name.c_str(), flag);
}
