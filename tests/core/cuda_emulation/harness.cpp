// Runs core's MoE (moe.cu, USE_MMA=0) or MLA (mla.cu) kernels on the CPU (tests/helpers/cuda_host)
// on arrays read from a directory written by tests/core/test_kimi_kernels_emulated.py; writes the
// outputs back there. Build with -DMOE, -DMLA, -DMLA_PREFILL or -DMLA_COMBINE_EXPAND (and the kernel's own
// defines).
#define MMA_HOST_STANDIN  // mma.cuh: no PTX; harness.h defines mma_bf16_16816
#ifdef MOE
#include "moe.cu"
#include "moe_routing.cu"  // the grouping kernels (one block per expert)
#if WEIGHT_FORMAT == 0 && defined(PIPE_STAGES)  // bf16: moe_pipelined.cu's grouped GEMM too
#define PIPE_DYNAMIC_SHARED(name) alignas(16) static bf16 name[PIPE_STAGES * PIPE_STAGE_ELEMS]
#include "moe_pipelined.cu"
#endif
#else
// the vector types and intrinsics mla_combine_splits_flat and mla_combine_expand use that the stand-in lacks
#include "common.cuh"
struct float4 {
    float x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float __fmul_rn(float a, float b) { return a * b; }  // a product never fused into an add (fmaf is explicit)
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
    // routing as the GPU runs it (logits spread over blocks first), and all in one block per token
    std::vector<float> logits(size_t(T) * E), inline_weights(slots);
    std::vector<int> inline_ids(slots);
    launch(T, (E + ROUTER_WARPS - 1) / ROUTER_WARPS, 1, ROUTER_WARPS * 32, [&] {
        moe_router_logits(x.data(), gate.data(), H, E, logits.data());
    });
    launch(T, 1, 1, 64, [&] {  // the kernels take any multiple of 32 threads; fewer emulate faster
        moe_route(x.data(), gate.data(), logits.data(), use_bias ? bias.data() : nullptr, H, E, k, scoring, groups,
                  topk_groups, group_max, norm_topk, scaling, nullptr, nullptr, ids.data(), weights.data());
    });
    launch(T, 1, 1, 64, [&] {
        moe_route(x.data(), gate.data(), nullptr, use_bias ? bias.data() : nullptr, H, E, k, scoring, groups,
                  topk_groups, group_max, norm_topk, scaling, nullptr, nullptr, inline_ids.data(), inline_weights.data());
    });
    save(dir, "inline_ids.bin", inline_ids);
    save(dir, "inline_weights.bin", inline_weights);
    launch(1, 1, 1, 256, [&] {
        moe_sort(ids.data(), slots, E, counts.data(), offsets.data(), sorted.data(), pos.data(), tile_expert.data(),
                 tile_row.data(), num_tiles.data(), max_tiles);
    });
    // moe_sort's layout (offsets, sorted slots, slot positions, tile experts, tile rows, tile count),
    // then moe_sort_parallel's with 4 threads (two experts per thread) and with 256
    {
        std::vector<int> layout(offsets);
        for (const auto* part : {&sorted, &pos, &tile_expert, &tile_row, &num_tiles})
            layout.insert(layout.end(), part->begin(), part->end());
        save(dir, "serial_sort.bin", layout.data(), layout.size());
    }
    for (const unsigned threads : {4u, 256u}) {
        std::vector<int> p_offsets(E + 1), p_sorted(slots), p_pos(slots), p_tile_expert(max_tiles), p_tile_row(max_tiles),
            p_num_tiles(1);
        launch(1, 1, 1, threads, [&] {
            moe_sort_parallel(ids.data(), slots, E, p_offsets.data(), p_sorted.data(), p_pos.data(),
                              p_tile_expert.data(), p_tile_row.data(), p_num_tiles.data(), max_tiles);
        });
        std::vector<int> layout(p_offsets);
        for (const auto* part : {&p_sorted, &p_pos, &p_tile_expert, &p_tile_row, &p_num_tiles})
            layout.insert(layout.end(), part->begin(), part->end());
        save(dir, threads == 4 ? "parallel_sort_4.bin" : "parallel_sort_256.bin", layout.data(), layout.size());
    }
    // moe_expert_counts + moe_place_slots (a block per expert; the kernels need E <= threads)
    for (const unsigned threads : {32u, 64u}) {
        std::vector<int> b_counts(E), b_offsets(E + 1), b_sorted(slots), b_pos(slots), b_tile_expert(max_tiles),
            b_tile_row(max_tiles), b_num_tiles(1);
        launch(E, 1, 1, threads, [&] { moe_expert_counts(ids.data(), slots, b_counts.data()); });
        launch(E, 1, 1, threads, [&] {
            moe_place_slots(ids.data(), slots, E, b_counts.data(), b_offsets.data(), b_sorted.data(), b_pos.data(),
                            b_tile_expert.data(), b_tile_row.data(), b_num_tiles.data(), max_tiles);
        });
        std::vector<int> layout(b_offsets);
        for (const auto* part : {&b_sorted, &b_pos, &b_tile_expert, &b_tile_row, &b_num_tiles})
            layout.insert(layout.end(), part->begin(), part->end());
        save(dir, threads == 32 ? "block_sort_32.bin" : "block_sort_64.bin", layout.data(), layout.size());
    }
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
    std::vector<bf16> out_wide(size_t(T) * H);  // a token's columns over 3 blocks of 32 threads
    launch(T, 3, 1, 32, [&] { moe_combine(y.data(), pos.data(), weights.data(), nullptr, k, H, out_wide.data()); });
    save(dir, "out_wide.bin", out_wide);
    // dense mode on the first expert's gate_up weight, element-wise (unvectorised) loads
    std::vector<bf16> dense(size_t(T) * N1);
    launch((T + BM - 1) / BM, (N1 + BN - 1) / BN, 1, GEMM_THREADS, [&] {
        moe_grouped_gemm(x.data(), nullptr, 1, w1.data(), s1.data(), nullptr, nullptr, nullptr, nullptr, T,
                         dense.data(), N1, H, 0);
    });
    // decode kernels: moe_gemv over the same tiles (gathering token rows) and in dense mode, and
    // the whole first expert dequantised to bf16
    std::vector<bf16> h_gemv(size_t(slots) * N1), dense_gemv(size_t(T) * N1), w1_bf16(size_t(N1) * H);
    launch((N1 + GEMV_WARPS - 1) / GEMV_WARPS, max_tiles, 1, GEMV_WARPS * 32, [&] {
        moe_gemv(x.data(), sorted.data(), k, w1.data(), s1.data(), tile_expert.data(), tile_row.data(),
                 num_tiles.data(), offsets.data(), 0, h_gemv.data(), N1, H);
    });
    launch((N1 + GEMV_WARPS - 1) / GEMV_WARPS, (T + GEMV_ROWS - 1) / GEMV_ROWS, 1, GEMV_WARPS * 32, [&] {
        moe_gemv(x.data(), nullptr, 1, w1.data(), s1.data(), nullptr, nullptr, nullptr, nullptr, T, dense_gemv.data(),
                 N1, H);
    });
    // moe_gemv_wide on the same tiles (one block row: it loops over a tile's rows) and in dense
    // mode (one block row over all T rows)
    std::vector<bf16> h_gemv_wide(size_t(slots) * N1), dense_gemv_wide(size_t(T) * N1);
    const unsigned wide_columns = WIDE_WARPS * WIDE_COLUMNS;
    launch((N1 + wide_columns - 1) / wide_columns, max_tiles, 1, WIDE_WARPS * 32, [&] {
        moe_gemv_wide(x.data(), sorted.data(), k, w1.data(), s1.data(), tile_expert.data(), tile_row.data(),
                      num_tiles.data(), offsets.data(), 0, h_gemv_wide.data(), N1, H);
    });
    launch((N1 + wide_columns - 1) / wide_columns, 1, 1, WIDE_WARPS * 32, [&] {
        moe_gemv_wide(x.data(), nullptr, 1, w1.data(), s1.data(), nullptr, nullptr, nullptr, nullptr, T,
                      dense_gemv_wide.data(), N1, H);
    });
    save(dir, "h_gemv_wide.bin", h_gemv_wide);
    save(dir, "dense_gemv_wide.bin", dense_gemv_wide);
    // moe_gemv_mma on the same tiles, in dense mode, and in dense mode on the first N1 - 8 rows of
    // the weight (a warp whose 16 columns run past N)
    std::vector<bf16> h_gemv_mma(size_t(slots) * N1), dense_gemv_mma(size_t(T) * N1), narrow_gemv_mma(size_t(T) * (N1 - 8));
    const unsigned mma_columns = MMA_GEMV_BLOCK_COLUMNS;
    launch((N1 + mma_columns - 1) / mma_columns, max_tiles, 1, MMA_GEMV_WARPS * 32, [&] {
        moe_gemv_mma(x.data(), sorted.data(), k, w1.data(), s1.data(), tile_expert.data(), tile_row.data(),
                     num_tiles.data(), offsets.data(), 0, h_gemv_mma.data(), N1, H);
    });
    launch((N1 + mma_columns - 1) / mma_columns, 1, 1, MMA_GEMV_WARPS * 32, [&] {
        moe_gemv_mma(x.data(), nullptr, 1, w1.data(), s1.data(), nullptr, nullptr, nullptr, nullptr, T,
                     dense_gemv_mma.data(), N1, H);
    });
    launch((N1 - 8 + mma_columns - 1) / mma_columns, 1, 1, MMA_GEMV_WARPS * 32, [&] {
        moe_gemv_mma(x.data(), nullptr, 1, w1.data(), s1.data(), nullptr, nullptr, nullptr, nullptr, T,
                     narrow_gemv_mma.data(), N1 - 8, H);
    });
#if WEIGHT_FORMAT == 0 && defined(PIPE_STAGES)
    // moe_grouped_gemm_pipelined on the same tiles: gate_up (gathering token rows; PIPE_FUSE_SILU:
    // silu(gate)·up, [slots, K2]) and down on the per-tile GEMM's activations
    {
        const int gate_up_columns = PIPE_FUSE_SILU ? K2 : N1;
        std::vector<bf16> h_pipe(size_t(slots) * gate_up_columns), y_pipe(size_t(slots) * N2);
        launch(max_tiles, (gate_up_columns + PIPE_OUT_N - 1) / PIPE_OUT_N, 1, PIPE_WARPS * 32, [&] {
            moe_grouped_gemm_pipelined(x.data(), sorted.data(), k, reinterpret_cast<const bf16*>(w1.data()),
                                       tile_expert.data(), tile_row.data(), num_tiles.data(), offsets.data(), 0,
                                       h_pipe.data(), N1, H);
        });
        if (!PIPE_FUSE_SILU)
            launch(max_tiles, (N2 + PIPE_OUT_N - 1) / PIPE_OUT_N, 1, PIPE_WARPS * 32, [&] {
                moe_grouped_gemm_pipelined(act.data(), nullptr, k, reinterpret_cast<const bf16*>(w2.data()),
                                           tile_expert.data(), tile_row.data(), num_tiles.data(), offsets.data(), 0,
                                           y_pipe.data(), N2, K2);
            });
        save(dir, "h_pipe.bin", h_pipe);
        save(dir, "y_pipe.bin", y_pipe);
        save(dir, "act.bin", act);
        save(dir, "y.bin", y);
    }
#endif
#if WEIGHT_FORMAT == 1 && GROUP == 32
    // moe_gemv_mma_staged (INT4 group 32, K whole stages) on the same tiles and in dense mode
    if (H % (STAGED_CHUNKS * 4 * WEIGHT_CHUNK) == 0) {
        std::vector<bf16> h_gemv_staged(size_t(slots) * N1), dense_gemv_staged(size_t(T) * N1);
        const unsigned staged_columns = STAGED_WARPS * 16;
        launch((N1 + staged_columns - 1) / staged_columns, max_tiles, 1, STAGED_WARPS * 32, [&] {
            moe_gemv_mma_staged(x.data(), sorted.data(), k, w1.data(), s1.data(), tile_expert.data(), tile_row.data(),
                                num_tiles.data(), offsets.data(), 0, h_gemv_staged.data(), N1, H);
        });
        launch((N1 + staged_columns - 1) / staged_columns, 1, 1, STAGED_WARPS * 32, [&] {
            moe_gemv_mma_staged(x.data(), nullptr, 1, w1.data(), s1.data(), nullptr, nullptr, nullptr, nullptr, T,
                                dense_gemv_staged.data(), N1, H);
        });
        save(dir, "h_gemv_staged.bin", h_gemv_staged);
        save(dir, "dense_gemv_staged.bin", dense_gemv_staged);
    }
#endif
    save(dir, "h_gemv_mma.bin", h_gemv_mma);
    save(dir, "dense_gemv_mma.bin", dense_gemv_mma);
    save(dir, "narrow_gemv_mma.bin", narrow_gemv_mma);
    launch(4, 1, 1, 64, [&] { moe_dequantize(w1.data(), s1.data(), N1, H, w1_bf16.data()); });
    save(dir, "h.bin", h);
    save(dir, "h_gemv.bin", h_gemv);
    save(dir, "dense_gemv.bin", dense_gemv);
    save(dir, "w1_bf16.bin", w1_bf16);
    save(dir, "ids.bin", ids.data(), ids.size());
    save(dir, "weights.bin", weights.data(), weights.size());
    save(dir, "offsets.bin", offsets.data(), offsets.size());
    save(dir, "out.bin", out.data(), out.size());
    save(dir, "dense.bin", dense.data(), dense.size());
#elif defined(MLA_PREFILL)
    // params: T heads num_prefill_seqs context_rows num_tiles max_blocks block_size
    const int T = params[0], heads = params[1], num_seqs = params[2], rows = params[3], tiles = params[4];
    const int max_blocks = params[5], block_size = params[6];
    const float scale = load<float>(dir, "scale.bin")[0];
    auto cache = load<bf16>(dir, "cache.bin");
    auto tables = load<int>(dir, "tables.bin");
    auto seqs = load<int>(dir, "seqs.bin");
    auto q = load<bf16>(dir, "q.bin");
    auto k_nope = load<bf16>(dir, "k_nope.bin");
    auto values = load<bf16>(dir, "values.bin");
    auto tile_seq = load<int>(dir, "tile_seq.bin");
    auto tile_query = load<int>(dir, "tile_query.bin");
    std::vector<bf16> c_kv(size_t(rows) * KV_LORA), k_pe(size_t(rows) * ROPE_DIM), out(size_t(T) * heads * V_DIM);
    launch(rows, 1, 1, 64, [&] {
        mla_gather_context(cache.data(), tables.data(), max_blocks, block_size, seqs.data(), num_seqs, c_kv.data(),
                           k_pe.data());
    });
    launch(tiles, heads, 1, PREFILL_THREADS, [&] {
        mla_prefill_attention(q.data(), k_nope.data(), k_pe.data(), values.data(), seqs.data(), tile_seq.data(),
                              tile_query.data(), heads, scale, out.data());
    });
    save(dir, "c_kv.bin", c_kv);
    save(dir, "k_pe.bin", k_pe);
    save(dir, "out.bin", out);
#elif defined(MLA_COMBINE_EXPAND)
    // params: T heads num_splits. The split combine then W_UV (mla_combine_splits_flat + mla_expand_small) and
    // both in one launch (mla_combine_expand, built with COMBINE_EXPAND_COLUMNS) on the same partials; o_latent
    // holds the rows written whole by their one split (split 0's max = +inf).
    const int T = params[0], heads = params[1], splits = params[2];
    auto partial_o = load<float>(dir, "partial_o.bin");
    auto partial_ml = load<float>(dir, "partial_ml.bin");
    auto o_latent = load<bf16>(dir, "o_latent.bin");
    auto w_uv = load<bf16>(dir, "w_uv.bin");
    std::vector<bf16> combined(o_latent), out(size_t(T) * heads * V_DIM), out_fused(size_t(T) * heads * V_DIM);
    const unsigned rows = T * heads, flat_blocks = (rows * (KV_LORA / 4) + COMBINE_FLAT_THREADS - 1) / COMBINE_FLAT_THREADS;
    launch(flat_blocks, 1, 1, COMBINE_FLAT_THREADS, [&] {
        mla_combine_splits_flat(partial_o.data(), partial_ml.data(), splits, rows, combined.data());
    });
    launch(heads, V_DIM / EXPAND_COLUMNS, 1, 32 * EXPAND_WARPS, [&] {
        mla_expand_small(combined.data(), w_uv.data(), T, heads, out.data());
    });
    launch(heads, V_DIM / COMBINE_EXPAND_COLUMNS, 1, COMBINE_EXPAND_THREADS, [&] {
        mla_combine_expand(partial_o.data(), partial_ml.data(), splits, o_latent.data(), w_uv.data(), T, heads,
                           out_fused.data());
    });
    save(dir, "combined.bin", combined);
    save(dir, "out.bin", out);
    save(dir, "out_fused.bin", out_fused);
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
    launch(T, splits, 1, 128, [&] {  // q_pe spread over `splits` blocks per token (1: one block does all)
        mla_write_latent(latent.data(), LATENT, norm.data(), 1e-6f, q.data(), heads, q_stride, q_pe_offset,
                         positions.data(), slots.data(), cos_table.data(), sin_table.data(), cache.data());
    });
    std::vector<bf16> out(size_t(T) * heads * KV_LORA);
    std::vector<float> partial_o(size_t(T) * heads * splits * KV_LORA), partial_ml(size_t(T) * heads * splits * 2);
    launch(T, (heads + HEADS_PER_BLOCK - 1) / HEADS_PER_BLOCK, splits, MLA_THREADS, [&] {
        mla_attention(q_latent.data(), q.data(), q_stride, q_pe_offset, cache.data(), tables.data(), max_blocks,
                      block_size, query_start.data(), num_seqs, positions.data(), heads, scale, out.data(), splits,
                      partial_o.data(), partial_ml.data(), nullptr);
    });
    if (splits > 1) launch(T * heads, 1, 1, 32, [&] { mla_combine_splits(partial_o.data(), partial_ml.data(), splits, out.data()); });
    // the tensor-core absorbed kernel on the same inputs (after the latent write, like the GPU)
    std::vector<bf16> out_mma(size_t(T) * heads * KV_LORA);
    launch(T, MMA_DECODE_HEAD_CHUNKS(heads), splits, MMA_DECODE_THREADS, [&] {
        mla_attention_mma(q_latent.data(), q.data(), q_stride, q_pe_offset, cache.data(), tables.data(), max_blocks,
                          block_size, query_start.data(), num_seqs, positions.data(), heads, scale, out_mma.data(),
                          splits, partial_o.data(), partial_ml.data(), nullptr);
    });
    if (splits > 1) launch(T * heads, 1, 1, 32, [&] { mla_combine_splits(partial_o.data(), partial_ml.data(), splits, out_mma.data()); });
    // the same partials combined by mla_combine_splits_shared (two warps: one walks the dims twice)
    std::vector<bf16> out_mma_shared(out_mma);
    if (splits > 1) launch(T * heads, 1, 1, 64, [&] { mla_combine_splits_shared(partial_o.data(), partial_ml.data(), splits, out_mma_shared.data()); });
    save(dir, "out_mma_shared.bin", out_mma_shared);
    save(dir, "out_mma.bin", out_mma);
    save(dir, "q_out.bin", q.data(), size_t(T) * heads * q_stride);
    save(dir, "cache_out.bin", cache);
    save(dir, "out.bin", out.data(), out.size());
#endif
    return 0;
}
