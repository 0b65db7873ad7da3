// The in-step prefix-cache snapshot of the default chunked chain on the CPU (tests/helpers/cuda_host):
// gdn_conv1d and gdn_chunk_prepare_grouped_mma over a chunk layout cut at each snapshot's boundary, then
// each state walk three ways from the same slots — its *_snapshot entry point (the state entering the
// boundary's chunk stored into the snapshot slot), its plain entry point over the same layout (the live
// slots' final states without snapshots) and its plain entry point over only the chunks before each
// boundary, ending in the snapshot slot (a run that stops there: the reference) — and gdn_conv_snapshot.
// Arrays from test_qwen35_cuda_emulated.py: ChunkedPrefillInputs' (the cut layout) and snapshot_chunk,
// snapshot_slot (per sequence), snapshots ([S][3] sequence, rows before the boundary, slot), head_chunk_start,
// head_chunk_len, head_seq_chunks, head_slots, head_fresh (the stopping run's layout over the snapshotted
// sequences).
#include "kernel_standins.h"

#include "gated_deltanet.cu"
#include "gdn_chunked.cu"

#include "harness.h"
#include "chunked_prefill_inputs.h"

int main(int argc, char** argv) {
    ChunkedPrefillInputs in(argc, argv, /*with_eps=*/false);
    const std::string& dir = in.dir;
    const int nk = in.nk, nv = in.nv, dv = in.dv, width = in.width, conv_dim = in.conv_dim;
    const int proj_stride = in.proj_stride, num_seqs = in.num_seqs, num_chunks = in.num_chunks;
    auto snapshot_chunk = load<int>(dir, "snapshot_chunk.bin"), snapshot_slot = load<int>(dir, "snapshot_slot.bin");
    auto snapshots = load<int>(dir, "snapshots.bin");
    auto head_start = load<int>(dir, "head_chunk_start.bin"), head_len = load<int>(dir, "head_chunk_len.bin");
    auto head_seq_chunks = load<int>(dir, "head_seq_chunks.bin"), head_slots = load<int>(dir, "head_slots.bin");
    auto head_fresh = load<int>(dir, "head_fresh.bin");
    const int num_snapshots = static_cast<int>(snapshots.size() / 3), num_heads = static_cast<int>(head_slots.size());
    const std::vector<bf16> conv_out = in.conv1d();
    ChunkOperands<bf16, CHUNK> prepared(in);
    auto &qn = prepared.qn, &kn = prepared.kn, &w = prepared.w, &u = prepared.u, &p = prepared.p;
    auto& cum = prepared.cum;
    launch(num_chunks, nk, 1, 128, [&] {
        gdn_chunk_prepare_grouped_mma(conv_out.data(), in.proj.data(), proj_stride, in.neg_decay_rate.data(),
                                      in.dt_bias.data(), in.chunk_start.data(), in.chunk_len.data(), qn.data(),
                                      kn.data(), w.data(), u.data(), p.data(), cum.data(), nk, nv, dv);
    });
    int warps = 8;
    while ((dv / 16) % warps) warps /= 2;
    for (int walk = 0; walk < 2; ++walk) {  // gdn_chunk_states, gdn_chunk_states_registers
        for (int run = 0; run < 3; ++run) {  // with snapshots, plain, stopping at the boundaries
            auto ssm = load<float>(dir, "ssm_state.bin");
            std::vector<bf16> states(static_cast<size_t>(num_chunks) * nv * dv * DK), v_new(u.size());
            const bool head = run == 2;
            const int* starts = head ? head_start.data() : in.chunk_start.data();
            const int* lens = head ? head_len.data() : in.chunk_len.data();
            const int* seq_chunks = head ? head_seq_chunks.data() : in.seq_chunks.data();
            const int* slots = head ? head_slots.data() : in.slots.data();
            const int* fresh = head ? head_fresh.data() : in.fresh.data();
            const int seqs = head ? num_heads : num_seqs;
            if (walk == 0)
                launch(seqs, nv, dv / SCAN_TILE, 128, [&] {
                    if (run == 0)
                        gdn_chunk_states_snapshot(kn.data(), w.data(), u.data(), cum.data(), starts, lens, seq_chunks,
                                                  slots, fresh, ssm.data(), states.data(), v_new.data(), nk, nv, dv,
                                                  snapshot_chunk.data(), snapshot_slot.data());
                    else
                        gdn_chunk_states(kn.data(), w.data(), u.data(), cum.data(), starts, lens, seq_chunks, slots,
                                         fresh, ssm.data(), states.data(), v_new.data(), nk, nv, dv);
                });
            else
                launch(seqs, nv, dv / (16 * warps), 32 * warps, [&] {
                    if (run == 0)
                        gdn_chunk_states_registers_snapshot(kn.data(), w.data(), u.data(), cum.data(), starts, lens,
                                                            seq_chunks, slots, fresh, ssm.data(), states.data(),
                                                            v_new.data(), nk, nv, dv, snapshot_chunk.data(),
                                                            snapshot_slot.data());
                    else
                        gdn_chunk_states_registers(kn.data(), w.data(), u.data(), cum.data(), starts, lens, seq_chunks,
                                                   slots, fresh, ssm.data(), states.data(), v_new.data(), nk, nv, dv);
                });
            const char* names[2][3] = {{"shared_snapshot_ssm.bin", "shared_plain_ssm.bin", "shared_head_ssm.bin"},
                                       {"registers_snapshot_ssm.bin", "registers_plain_ssm.bin",
                                        "registers_head_ssm.bin"}};
            save(dir, names[walk][run], ssm);
        }
    }
    auto conv = load<bf16>(dir, "conv_state.bin");
    launch(1, 1, 1, 64, [&] {
        gdn_conv_snapshot(in.proj.data(), proj_stride, conv.data(), in.query_start.data(), in.slots.data(),
                          in.fresh.data(), snapshots.data(), num_snapshots, conv_dim, width);
    });
    save(dir, "snapshot_conv_state.bin", conv);
    return 0;
}
