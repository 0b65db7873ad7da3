// Runs core's decode_attention_mma.cu (the decode kernel, or the short-query kernel, then the
// split merge) on the CPU (tests/helpers/cuda_host) on arrays read from a directory written by
// tests/core/test_attention_kernels_emulated.py; writes `out.bin` back there. Build with -DHEAD_DIM
// and -DGROUP as the CUDA loader does. Besides harness.h's mma stand-in, this file emulates the
// PTX-only helpers the kernel uses: ldmatrix (.x4 and .x4.trans) as warp collectives, cp.async as
// an immediate 16-byte copy, __syncwarp as the warp's barrier.
#define MMA_HOST_STANDIN  // mma.cuh: no PTX; harness.h defines mma_bf16_16816
#define DECODE_DYNAMIC_SHARED(name) alignas(16) static uint4 name[1 << 15]
#include "common.cuh"

using std::max;
inline float2 make_float2(float x, float y) { return {x, y}; }
void ldmatrix_x4(unsigned* r, const bf16* p);
void ldmatrix_x4_trans(unsigned* r, const bf16* p);
void cp_async16(bf16* smem, const bf16* gmem, bool valid);
void __syncwarp(unsigned mask = 0xffffffffu);

#include "decode_attention_mma.cu"
#include "harness.h"

void __syncwarp(unsigned) { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

void cp_async16(bf16* smem, const bf16* gmem, bool valid) {
    if (valid) std::memcpy(smem, gmem, 16);
    else std::memset(smem, 0, 16);
}

// ldmatrix .m8n8.x4(.trans).b16: lanes 8i .. 8i+7 give the row addresses of 8x8 matrix i; lane l
// receives in register i the pair (row l/4, columns 2(l%4), 2(l%4)+1) of matrix i, or with .trans
// the pair (rows 2(l%4), 2(l%4)+1, column l/4) — the low half holding the first element.
static const bf16* ldmatrix_rows[1024];

static void ldmatrix(unsigned* r, const bf16* p, bool transposed) {
    const unsigned t = threadIdx.x, base = t & ~31u, lane = t & 31u;
    std::barrier<>& warp = *warp_barriers[t / 32];
    ldmatrix_rows[t] = p;
    warp.arrive_and_wait();
    for (unsigned i = 0; i < 4; ++i) {
        uint16_t first, second;
        if (transposed) {
            first = ldmatrix_rows[base + 8 * i + 2 * (lane % 4)][lane / 4].bits;
            second = ldmatrix_rows[base + 8 * i + 2 * (lane % 4) + 1][lane / 4].bits;
        } else {
            first = ldmatrix_rows[base + 8 * i + lane / 4][2 * (lane % 4)].bits;
            second = ldmatrix_rows[base + 8 * i + lane / 4][2 * (lane % 4) + 1].bits;
        }
        r[i] = static_cast<unsigned>(first) | (static_cast<unsigned>(second) << 16);
    }
    warp.arrive_and_wait();  // every lane has read before any address is overwritten
}

void ldmatrix_x4(unsigned* r, const bf16* p) { ldmatrix(r, p, false); }
void ldmatrix_x4_trans(unsigned* r, const bf16* p) { ldmatrix(r, p, true); }

int main(int argc, char** argv) {
    const std::string dir = argv[1];
    // params: short_query (0 decode, 1 short_query_attention_mma, 2 short_query_attention_shared) num_seqs num_tokens num_kv_heads block_size max_blocks splits row_blocks
    auto params = load<int>(dir, "params.bin");
    const int short_query = params[0], num_seqs = params[1], num_tokens = params[2], num_kv_heads = params[3];
    const int block_size = params[4], max_blocks = params[5], splits = params[6], row_blocks = params[7];
    const int num_heads = num_kv_heads * GROUP;
    const float scale_log2 = load<float>(dir, "scale_log2.bin")[0];
    auto q = load<bf16>(dir, "q.bin");
    auto k_cache = load<bf16>(dir, "k_cache.bin");
    auto v_cache = load<bf16>(dir, "v_cache.bin");
    auto tables = load<int>(dir, "block_tables.bin");
    auto context_lens = load<int>(dir, "context_lens.bin");
    auto query_start = load<int>(dir, "query_start.bin");
    std::vector<bf16> out(size_t(num_tokens) * num_heads * HEAD_DIM, bf16{0x7FC0});  // NaN: unwritten shows
    std::vector<float> partial_out(size_t(num_tokens) * num_heads * splits * HEAD_DIM);
    std::vector<float> partial_ml(size_t(num_tokens) * num_heads * splits * 2);
    if (short_query == 2) {  // row_blocks: the shared-tile kernel's row groups
        launch(splits * row_blocks, num_kv_heads, num_seqs, SQ_THREADS, [&] {
            short_query_attention_shared(q.data(), k_cache.data(), v_cache.data(), tables.data(), max_blocks,
                                         context_lens.data(), query_start.data(), row_blocks, out.data(),
                                         partial_out.data(), partial_ml.data(), num_kv_heads, block_size, splits,
                                         scale_log2);
        });
    } else if (short_query) {
        launch(splits * row_blocks, num_kv_heads, num_seqs, DECODE_WARPS * 32, [&] {
            short_query_attention_mma(q.data(), k_cache.data(), v_cache.data(), tables.data(), max_blocks,
                                      context_lens.data(), query_start.data(), row_blocks, out.data(),
                                      partial_out.data(), partial_ml.data(), num_kv_heads, block_size, splits,
                                      scale_log2);
        });
    } else {
        launch(splits, num_kv_heads, num_seqs, DECODE_WARPS * 32, [&] {
            decode_attention_mma(q.data(), k_cache.data(), v_cache.data(), tables.data(), max_blocks,
                                 context_lens.data(), out.data(), partial_out.data(), partial_ml.data(),
                                 num_kv_heads, block_size, splits, scale_log2);
        });
    }
    if (splits > 1)
        launch(num_heads, num_tokens, 1, std::min(128, HEAD_DIM), [&] {
            decode_attention_merge(partial_out.data(), partial_ml.data(), out.data(), num_heads, splits);
        });
    save(dir, "out.bin", out);
    return 0;
}
