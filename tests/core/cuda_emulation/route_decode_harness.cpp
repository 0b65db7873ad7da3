// Runs moe_routing.cu's moe_route_decode on the CPU (tests/helpers/cuda_host), for
// tests/core/test_moe_routing_decode_emulated.py: the reference first — moe.cu moe_router_logits' sum (a warp per
// token and expert, lane l the 16-byte pieces l, l + 32, ... in order, then warp_sum; its body copied here, as
// moe.cu does not build beside moe_routing.cu) and moe_route_sort on those logits — then moe_route_decode twice in
// a row on one ticket counter. Build with the ROUTE_DECODE_* shape and -DROUTE_SHARED_EXPERTS=S.
#define MMA_HOST_STANDIN  // mma.cuh: no PTX; harness.h defines mma_bf16_16816
#include "moe_routing.cu"

#include "harness.h"

// moe.cu moe_router_logits for one block of 8 warps (grid: tokens x ⌈E / 8⌉)
static void reference_logits(const bf16* x, const bf16* gate, int hidden, int num_experts, float* logits) {
    const int t = blockIdx.x, e = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const bf16* row = x + (long long)t * hidden;
    const bf16* w = gate + (long long)(e < num_experts ? e : 0) * hidden;
    float acc = 0.f;
    for (int i = lane * 8; i < hidden; i += 32 * 8) {
        float a[8], b[8];
        load8(row + i, a);
        load8(w + i, b);
        for (int j = 0; j < 8; ++j) acc += a[j] * b[j];
    }
    acc = warp_sum(acc);  // every warp takes part (the shuffles meet at its barrier)
    if (lane == 0 && e < num_experts) logits[(long long)t * num_experts + e] = acc;
}

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    auto params = load<int>(dir, "params.bin");  // T H E k scoring norm_topk use_bias max_tiles grid
    const int T = params[0], H = params[1], E = params[2], k = params[3], scoring = params[4];
    const int norm_topk = params[5], use_bias = params[6], max_tiles = params[7];
    const unsigned grid = params[8];
    const float scaling = load<float>(dir, "scaling.bin")[0];
    auto x = load<bf16>(dir, "x.bin");
    auto gate = load<bf16>(dir, "gate.bin");
    auto bias = load<float>(dir, "bias.bin");
    const float* b = use_bias ? bias.data() : nullptr;
    const int width = k + ROUTE_SHARED_EXPERTS, slots = T * width, grouped = E + ROUTE_SHARED_EXPERTS;
    std::vector<float> logits(size_t(T) * E);
    launch(T, (E + 7) / 8, 1, 256, [&] { reference_logits(x.data(), gate.data(), H, E, logits.data()); });
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
    run("route_sort.bin", [&](int* ids, float* weights, int* offsets, int* sorted, int* pos, int* te, int* tr,
                              int* nt) {
        launch(1, 1, 1, 512, [&] {
            moe_route_sort(logits.data(), b, T, E, k, scoring, norm_topk, scaling, ids, weights, offsets, sorted, pos,
                           te, tr, nt, max_tiles);
        });
    });
    unsigned done = 0;
    std::vector<float> decode_logits(size_t(T) * E);
    for (const char* name : {"decode_0.bin", "decode_1.bin"})
        run(name, [&](int* ids, float* weights, int* offsets, int* sorted, int* pos, int* te, int* tr, int* nt) {
            launch(grid, 1, 1, ROUTE_DECODE_WARPS * 32, [&] {
                moe_route_decode(x.data(), gate.data(), T, H, decode_logits.data(), &done, b, E, k, scoring,
                                 norm_topk, scaling, ids, weights, offsets, sorted, pos, te, tr, nt, max_tiles);
            });
        });
    save(dir, "decode_logits.bin", decode_logits);
    save(dir, "done.bin", &done, 1);
    return 0;
}
