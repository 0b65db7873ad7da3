// Runs the kernels of dsv4.cu on the CPU (the host stand-in for the CUDA built-ins is
// tests/helpers/cuda_host, plus std::max) on arrays read from a directory
// written by test_dsv4_cuda_emulated.py, and writes the outputs back there. One kernel per invocation:
//   harness DIR compress  S d rd W rows eps
//   harness DIR indexer   T heads dim max_entries rate block_size stride k entries_per_block
//   harness DIR attention T heads dim window rate block_size wstride estride num_selected mode rd scale splits
//                         (splits > 1: the split-over-keys runs, then dsv4_attention_combine)
//   harness DIR hc        T hc dim iters hc_eps norm_eps splits
//   harness DIR quant     N in out fp4
//   harness DIR compressor rate dim overlap rope_dim eps steps stride block_size slots
//                          (dsv4_token_seq, dsv4_compress_step and dsv4_compress_state over a schedule
//                           of steps, each of the same 2 sequences, state carried between steps)
#include <cuda_bf16.h>

using std::max;
struct float4 {  // CUDA's 16-byte vector (dsv4_hc_mix's loads); the host stand-in lacks it
    float x, y, z, w;
};

#include "dsv4.cu"

#include "harness.h"

static int arg(char** argv, int i) { return std::atoi(argv[i]); }
static float farg(char** argv, int i) { return static_cast<float>(std::atof(argv[i])); }

int main(int argc, char** argv) {
    if (argc < 3) { std::fprintf(stderr, "usage: harness DIR KERNEL ARGS...\n"); return 1; }
    const std::string dir = argv[1], which = argv[2];
    const unsigned threads = 128;
    if (which == "compress") {
        const int slots = arg(argv, 3), dim = arg(argv, 4), rope_dim = arg(argv, 5), windows = arg(argv, 6);
        const int rows = arg(argv, 7);
        const float eps = farg(argv, 8);
        auto kv = load<float>(dir, "slot_kv.bin");
        auto gate = load<float>(dir, "slot_gate.bin");
        auto norm = load<float>(dir, "norm.bin");
        auto inv_freq = load<float>(dir, "inv_freq.bin");
        auto positions = load<int>(dir, "positions.bin");
        auto dest = load<long long>(dir, "dest.bin");
        std::vector<bf16> cache(static_cast<size_t>(rows) * dim);
        launch(windows, 1, 1, threads, [&] {
            dsv4_compress_entries(kv.data(), gate.data(), norm.data(), inv_freq.data(), positions.data(), dest.data(),
                                  cache.data(), slots, dim, rope_dim, eps);
        });
        save(dir, "cache.bin", cache);
    } else if (which == "indexer") {
        const int tokens = arg(argv, 3), heads = arg(argv, 4), dim = arg(argv, 5), max_entries = arg(argv, 6);
        const int rate = arg(argv, 7), block_size = arg(argv, 8), stride = arg(argv, 9), k = arg(argv, 10);
        const int per_block = arg(argv, 11);
        auto q = load<bf16>(dir, "q.bin");
        auto weights = load<float>(dir, "head_weights.bin");
        auto keys = load<bf16>(dir, "keys.bin");
        auto tables = load<int>(dir, "tables.bin");
        auto token_seq = load<int>(dir, "token_seq.bin");
        auto positions = load<int>(dir, "positions.bin");
        std::vector<float> scores(static_cast<size_t>(tokens) * max_entries);
        std::vector<int> selected(static_cast<size_t>(tokens) * k, -7);  // dsv4_topk must write every slot
        launch(tokens, (max_entries + per_block - 1) / per_block, 1, threads, [&] {
            dsv4_indexer_scores(q.data(), weights.data(), keys.data(), tables.data(), stride, block_size,
                                token_seq.data(), positions.data(), rate, scores.data(), heads, dim, max_entries,
                                per_block);
        });
        launch(tokens, 1, 1, threads, [&] {
            dsv4_topk(scores.data(), positions.data(), rate, max_entries, k, selected.data());
        });
        save(dir, "scores.bin", scores);
        save(dir, "selected.bin", selected);
    } else if (which == "attention") {
        const int tokens = arg(argv, 3), heads = arg(argv, 4), dim = arg(argv, 5), window = arg(argv, 6);
        const int rate = arg(argv, 7), block_size = arg(argv, 8), wstride = arg(argv, 9), estride = arg(argv, 10);
        const int num_selected = arg(argv, 11), mode = arg(argv, 12), rope_dim = arg(argv, 13);
        const float scale = farg(argv, 14);
        auto q = load<bf16>(dir, "q.bin");
        auto window_cache = load<bf16>(dir, "window_cache.bin");
        auto window_tables = load<int>(dir, "window_tables.bin");
        auto entry_cache = load<bf16>(dir, "entry_cache.bin");
        auto entry_tables = load<int>(dir, "entry_tables.bin");
        auto selected = load<int>(dir, "selected.bin");
        auto token_seq = load<int>(dir, "token_seq.bin");
        auto positions = load<int>(dir, "positions.bin");
        auto sinks = load<float>(dir, "sinks.bin");
        auto inv_freq = load<float>(dir, "inv_freq.bin");
        const int splits = argc > 15 ? arg(argv, 15) : 1;
        const bool d512 = argc > 16 && arg(argv, 16) != 0;  // dsv4_sparse_attention_d512 (dim must be 512)
        std::vector<bf16> out(q.size());
        std::vector<float> partial(static_cast<size_t>(tokens) * heads * splits * (dim + 2));
        const unsigned head_blocks = (heads + threads / 32 - 1) / (threads / 32);
        launch(tokens, head_blocks, splits, threads, [&] {  // a warp per head
            (d512 ? dsv4_sparse_attention_d512 : dsv4_sparse_attention)(q.data(), window_cache.data(), window_tables.data(), wstride,
                                  mode == 0 ? nullptr : entry_cache.data(), entry_tables.data(), estride,
                                  mode == 2 ? selected.data() : nullptr, num_selected, rate, token_seq.data(),
                                  positions.data(), sinks.data(), inv_freq.data(), rope_dim, out.data(), heads, dim,
                                  window, block_size, scale, splits > 1 ? partial.data() : nullptr);
        });
        if (splits > 1)
            launch(tokens, head_blocks, 1, threads, [&] {
                dsv4_attention_combine(partial.data(), splits, positions.data(), inv_freq.data(), rope_dim,
                                       out.data(), heads, dim);
            });
        save(dir, "out.bin", out);
    } else if (which == "hc") {
        const int tokens = arg(argv, 3), hc = arg(argv, 4), dim = arg(argv, 5), iters = arg(argv, 6);
        const float hc_eps = farg(argv, 7), norm_eps = farg(argv, 8);
        const int splits = arg(argv, 9);  // slices of each mixing dot product (dsv4_hc_mix's grid z)
        auto streams = load<float>(dir, "streams.bin");
        auto y = load<bf16>(dir, "y.bin");
        std::vector<bf16> x(static_cast<size_t>(tokens) * dim), head_x(x.size());
        std::vector<float> post(static_cast<size_t>(tokens) * hc), comb(static_cast<size_t>(tokens) * hc * hc);
        std::vector<float> expanded(streams.size());
        auto fn = load<float>(dir, "fn.bin");
        auto base = load<float>(dir, "base.bin");
        auto scale = load<float>(dir, "scale.bin");
        auto head_fn = load<float>(dir, "head_fn.bin");
        auto head_base = load<float>(dir, "head_base.bin");
        auto head_scale = load<float>(dir, "head_scale.bin");
        const int num_mix = (2 + hc) * hc, x_blocks = (dim + threads - 1) / threads;
        std::vector<float> mix(static_cast<size_t>(tokens) * (num_mix + 1) * splits);
        std::vector<float> head_mix(static_cast<size_t>(tokens) * (hc + 1) * splits);
        launch(tokens, num_mix, splits, threads, [&] {
            dsv4_hc_mix(streams.data(), fn.data(), mix.data(), hc * dim, num_mix);
        });
        launch(tokens, x_blocks, 1, threads, [&] {
            dsv4_hc_collapse(streams.data(), mix.data(), splits, base.data(), scale.data(), x.data(), post.data(),
                             comb.data(), hc, dim, 0, iters, hc_eps, norm_eps);
        });
        launch(tokens, hc, splits, threads, [&] {
            dsv4_hc_mix(streams.data(), head_fn.data(), head_mix.data(), hc * dim, hc);
        });
        launch(tokens, x_blocks, 1, threads, [&] {
            dsv4_hc_collapse(streams.data(), head_mix.data(), splits, head_base.data(), head_scale.data(),
                             head_x.data(), nullptr, nullptr, hc, dim, 1, iters, hc_eps, norm_eps);
        });
        launch(tokens, (dim + threads - 1) / threads, 1, threads, [&] {
            dsv4_hc_expand(streams.data(), y.data(), post.data(), comb.data(), expanded.data(), hc, dim);
        });
        save(dir, "x.bin", x);
        save(dir, "head_x.bin", head_x);
        save(dir, "post.bin", post);
        save(dir, "comb.bin", comb);
        save(dir, "expanded.bin", expanded);
    } else if (which == "quant") {
        const int rows = arg(argv, 3), in_features = arg(argv, 4), out_features = arg(argv, 5), fp4 = arg(argv, 6);
        auto x = load<bf16>(dir, "x.bin");
        auto weight = load<unsigned char>(dir, "weight.bin");
        auto scales = load<unsigned char>(dir, "scales.bin");
        std::vector<bf16> y(static_cast<size_t>(rows) * out_features);
        const unsigned groups = threads / 32;
        launch((out_features + groups - 1) / groups, rows, 1, threads, [&] {
            if (fp4) dsv4_fp4_linear(x.data(), weight.data(), scales.data(), y.data(), in_features, out_features);
            else dsv4_fp8_linear(x.data(), weight.data(), scales.data(), y.data(), in_features, out_features);
        });
        save(dir, "y.bin", y);
    } else if (which == "compressor") {
        const int rate = arg(argv, 3), dim = arg(argv, 4), overlap = arg(argv, 5), rope_dim = arg(argv, 6);
        const float eps = farg(argv, 7);
        const int steps = arg(argv, 8), stride = arg(argv, 9), block_size = arg(argv, 10), slots = arg(argv, 11);
        const int width = (overlap ? 2 : 1) * dim, seqs = 2;
        auto kv = load<bf16>(dir, "kv.bin");
        auto gate = load<bf16>(dir, "gate.bin");
        auto ape = load<float>(dir, "ape.bin");
        auto norm = load<float>(dir, "norm.bin");
        auto inv_freq = load<float>(dir, "inv_freq.bin");
        auto positions = load<int>(dir, "positions.bin");
        auto step_tokens = load<int>(dir, "step_tokens.bin");  // [steps + 1] offsets into the token rows
        auto query_start = load<int>(dir, "query_start.bin");  // [steps, seqs + 1], relative to the step
        auto tables = load<int>(dir, "tables.bin");
        auto state_slots = load<int>(dir, "state_slots.bin");
        std::vector<bf16> state_kv(static_cast<size_t>(slots) * rate * width), state_gate(state_kv.size());
        std::vector<bf16> overlap_kv(static_cast<size_t>(slots) * rate * dim), overlap_gate(overlap_kv.size());
        std::vector<bf16> cache(static_cast<size_t>(seqs) * stride * block_size * dim);
        std::vector<int> token_seq(positions.size());
        for (int s = 0; s < steps; ++s) {
            const int first = step_tokens[s], tokens = step_tokens[s + 1] - first;
            const int* starts = query_start.data() + s * (seqs + 1);
            const int* pos = positions.data() + first;
            const bf16* kv_rows = kv.data() + static_cast<size_t>(first) * width;
            const bf16* gate_rows = gate.data() + static_cast<size_t>(first) * width;
            launch(seqs, 1, 1, threads, [&] { dsv4_token_seq(starts, token_seq.data()); });
            launch(tokens, 1, 1, threads, [&] {
                dsv4_compress_step(kv_rows, gate_rows, ape.data(), state_kv.data(), state_gate.data(),
                                   overlap ? overlap_kv.data() : nullptr, overlap ? overlap_gate.data() : nullptr,
                                   norm.data(), inv_freq.data(), rope_dim, eps, token_seq.data(), pos, starts,
                                   state_slots.data(), cache.data(), tables.data(), stride, block_size, rate, dim,
                                   overlap);
            });
            launch(seqs, 1, 1, threads, [&] {
                dsv4_compress_state(kv_rows, gate_rows, ape.data(), state_kv.data(), state_gate.data(),
                                    overlap ? overlap_kv.data() : nullptr, overlap ? overlap_gate.data() : nullptr, pos,
                                    starts, state_slots.data(), rate, dim, overlap);
            });
        }
        save(dir, "cache.bin", cache);
    } else {
        std::fprintf(stderr, "unknown kernel %s\n", which.c_str());
        return 1;
    }
    return 0;
}
