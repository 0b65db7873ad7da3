// Runs moe_decode.cu's one-launch decode routing (moe_route_decode) on the CPU (tests/helpers/cuda_host)
// next to what it replaces, moe.cu's moe_router_logits + moe_route + moe_sort_parallel, for
// tests/core/test_moe_decode_emulated.py. params: T hidden E k scoring groups topk_groups group_max
// norm_topk use_bias; scaling.bin, x.bin [T, hidden] bf16, gate.bin [E, hidden] bf16, bias.bin [E] fp32.
#define MMA_HOST_STANDIN
#include "moe.cu"
#include "moe_decode.cu"

#include "harness.h"

static void save_grouping(const std::string& dir, const char* name, const std::vector<int>& ids,
                          const std::vector<float>& weights, const std::vector<int>& offsets, const std::vector<int>& sorted,
                          const std::vector<int>& pos, const std::vector<int>& tile_expert,
                          const std::vector<int>& tile_row, const std::vector<int>& num_tiles) {
    std::vector<int> layout(ids);
    for (const auto* part : {&offsets, &sorted, &pos, &tile_expert, &tile_row, &num_tiles})
        layout.insert(layout.end(), part->begin(), part->end());
    save(dir, (std::string(name) + "_layout.bin").c_str(), layout.data(), layout.size());
    save(dir, (std::string(name) + "_weights.bin").c_str(), weights);
}

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    auto params = load<int>(dir, "params.bin");
    const int T = params[0], H = params[1], E = params[2], k = params[3], scoring = params[4], groups = params[5];
    const int topk_groups = params[6], group_max = params[7], norm_topk = params[8], use_bias = params[9];
    const float scaling = load<float>(dir, "scaling.bin")[0];
    auto x = load<bf16>(dir, "x.bin");
    auto gate = load<bf16>(dir, "gate.bin");
    auto bias = load<float>(dir, "bias.bin");
    const float* bias_ptr = use_bias ? bias.data() : nullptr;
    const int slots = T * k, max_tiles = (slots + BM - 1) / BM + std::min(E, slots);
    // what ships: three launches
    std::vector<float> logits(size_t(T) * E), weights(slots);
    std::vector<int> ids(slots), offsets(E + 1), sorted(slots), pos(slots), tile_expert(max_tiles),
        tile_row(max_tiles), num_tiles(1);
    launch(T, (E + ROUTER_WARPS - 1) / ROUTER_WARPS, 1, ROUTER_WARPS * 32, [&] {
        moe_router_logits(x.data(), gate.data(), H, E, logits.data());
    });
    launch(T, 1, 1, 64, [&] {
        moe_route(x.data(), gate.data(), logits.data(), bias_ptr, H, E, k, scoring, groups, topk_groups, group_max,
                  norm_topk, scaling, nullptr, nullptr, ids.data(), weights.data());
    });
    launch(1, 1, 1, 256, [&] {
        moe_sort_parallel(ids.data(), slots, E, offsets.data(), sorted.data(), pos.data(), tile_expert.data(),
                          tile_row.data(), num_tiles.data(), max_tiles);
    });
    save_grouping(dir, "three", ids, weights, offsets, sorted, pos, tile_expert, tile_row, num_tiles);
    // one launch, twice (the arrival counter must come back to 0)
    unsigned arrival = 0;
    for (int round = 0; round < 2; ++round) {
        std::vector<float> d_logits(size_t(T) * E), d_weights(slots);
        std::vector<int> d_ids(slots), d_offsets(E + 1), d_sorted(slots), d_pos(slots), d_tile_expert(max_tiles),
            d_tile_row(max_tiles), d_num_tiles(1);
        launch(E, 1, 1, DECODE_ROUTE_THREADS, [&] {
            moe_route_decode(x.data(), gate.data(), T, H, E, bias_ptr, k, scoring, groups, topk_groups, group_max,
                             norm_topk, scaling, d_logits.data(), &arrival, d_ids.data(), d_weights.data(),
                             d_offsets.data(), d_sorted.data(), d_pos.data(), d_tile_expert.data(), d_tile_row.data(),
                             d_num_tiles.data(), max_tiles);
        });
        save_grouping(dir, round ? "one_again" : "one", d_ids, d_weights, d_offsets, d_sorted, d_pos, d_tile_expert,
                      d_tile_row, d_num_tiles);
    }
    save(dir, "arrival.bin", std::vector<unsigned>{arrival});
    return 0;
}
