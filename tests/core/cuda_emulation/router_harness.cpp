// Runs moe_routing.cu's decode routers on the CPU (tests/helpers/cuda_host), for
// tests/core/test_router_kernels_emulated.py: moe_router_logits_blocks (a block per expert), then
// moe_route_sort on those logits (the two-launch path), then moe_router_route_sort (the same logits, the
// last block routing) twice in a row on one ticket counter. Build with -DROUTE_SHARED_EXPERTS=S.
#define MMA_HOST_STANDIN  // mma.cuh: no PTX; harness.h defines mma_bf16_16816
#include "moe_routing.cu"

#include "harness.h"

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    auto params = load<int>(dir, "params.bin");  // T H E k scoring norm_topk use_bias threads max_tiles
    const int T = params[0], H = params[1], E = params[2], k = params[3], scoring = params[4];
    const int norm_topk = params[5], use_bias = params[6], max_tiles = params[8];
    const unsigned threads = params[7];
    const float scaling = load<float>(dir, "scaling.bin")[0];
    auto x = load<bf16>(dir, "x.bin");
    auto gate = load<bf16>(dir, "gate.bin");
    auto bias = load<float>(dir, "bias.bin");
    const float* b = use_bias ? bias.data() : nullptr;
    const int width = k + ROUTE_SHARED_EXPERTS, slots = T * width, grouped = E + ROUTE_SHARED_EXPERTS;
    std::vector<float> logits(size_t(T) * E);
    launch(E, 1, 1, threads, [&] { moe_router_logits_blocks(x.data(), gate.data(), T, H, E, logits.data()); });
    save(dir, "logits.bin", logits);
    // each run: ids, weights (as int bits), offsets, sorted_slots, slot_pos, tile_expert, tile_row, num_tiles
    auto run = [&](const char* name, auto&& body) {
        std::vector<int> ids(slots), offsets(grouped + 1), sorted(slots), pos(slots), tile_expert(max_tiles, -1),
            tile_row(max_tiles, -1), num_tiles(1);
        std::vector<float> weights(slots);
        body(ids.data(), weights.data(), offsets.data(), sorted.data(), pos.data(), tile_expert.data(),
             tile_row.data(), num_tiles.data());
        std::vector<int> out(ids);
        for (float w : weights) out.push_back(*reinterpret_cast<int*>(&w));
        for (const auto* part : {&offsets, &sorted, &pos, &tile_expert, &tile_row, &num_tiles})
            out.insert(out.end(), part->begin(), part->end());
        save(dir, name, out.data(), out.size());
    };
    run("two_launches.bin", [&](int* ids, float* weights, int* offsets, int* sorted, int* pos, int* te, int* tr,
                                int* nt) {
        launch(1, 1, 1, threads, [&] {
            moe_route_sort(logits.data(), b, T, E, k, scoring, norm_topk, scaling, ids, weights, offsets, sorted, pos,
                           te, tr, nt, max_tiles);
        });
    });
    run("one_warp.bin", [&](int* ids, float* weights, int* offsets, int* sorted, int* pos, int* te, int* tr, int* nt) {
        launch(1, 1, 1, 32, [&] {  // one warp: each lane a run of experts (the decode launch's shape)
            moe_route_sort(logits.data(), b, T, E, k, scoring, norm_topk, scaling, ids, weights, offsets, sorted, pos,
                           te, tr, nt, max_tiles);
        });
    });
    unsigned done = 0;
    std::vector<float> fused_logits(size_t(T) * E);
    for (const char* name : {"fused_0.bin", "fused_1.bin"})
        run(name, [&](int* ids, float* weights, int* offsets, int* sorted, int* pos, int* te, int* tr, int* nt) {
            launch(E, 1, 1, threads, [&] {
                moe_router_route_sort(x.data(), gate.data(), T, H, fused_logits.data(), &done, b, E, k, scoring,
                                      norm_topk, scaling, ids, weights, offsets, sorted, pos, te, tr, nt, max_tiles);
            });
        });
    save(dir, "fused_logits.bin", fused_logits);
    save(dir, "done.bin", &done, 1);
    return 0;
}
