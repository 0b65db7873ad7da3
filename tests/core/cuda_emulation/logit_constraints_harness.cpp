// Runs core's apply_logit_constraints or apply_logit_constraints_tiled (logit_constraints.cu) on the CPU (tests/helpers/cuda_host)
// on arrays written by tests/core/test_logit_constraints_emulated.py; writes the logits back.
#include "logit_constraints.cu"

#include "harness.h"

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    auto params = load<int>(dir, "params.bin");  // rows vocab words threads tiled
    const int rows = params[0], vocab = params[1], words = params[2], threads = params[3], tiled = params[4];
    auto logits = load<bf16>(dir, "logits.bin");
    auto bias_start = load<int>(dir, "bias_start.bin");
    auto bias_ids = load<int>(dir, "bias_ids.bin");
    auto bias_values = load<float>(dir, "bias_values.bin");
    auto bitmask = load<int>(dir, "bitmask.bin");
    auto mask_row = load<int>(dir, "mask_row.bin");
    if (tiled) {
        const int tile = threads * TOKENS_PER_THREAD;
        launch(rows, (vocab + tile - 1) / tile, 1, threads, [&] {
            apply_logit_constraints_tiled(logits.data(), vocab, bias_start.data(), bias_ids.data(),
                                          bias_values.data(), bitmask.data(), words, mask_row.data());
        });
    } else {
        launch(rows, 1, 1, threads, [&] {
            apply_logit_constraints(logits.data(), vocab, bias_start.data(), bias_ids.data(), bias_values.data(),
                                    bitmask.data(), words, mask_row.data());
        });
    }
    save(dir, "out.bin", logits);
    return 0;
}
