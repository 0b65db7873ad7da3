// moe_gemv_int4_groups: the decode GEMV for INT4 expert weights with group-32 scales in the
// lane-groups layout (core/quant.py ``tile_int4(..., lane_groups=True)``; moe.cu INT4_TILED 2), for
// steps of few token rows per expert (a batch-1 decode step: one). Same arguments, tile list and
// output as moe.cu's decode GEMVs.
//
// Why another kernel: moe_gemv_int4_tiled issues ~275 instructions per KB of weights at one token, so
// a batch-1 step is bound by issue, not by HBM (Kimi-K2 layer, s10: gate_up 59.6 us where the bytes
// need ~31). This one's steady loop (sm_90a SASS, nvcc 13, register ring of 4) issues 135 per KB: per
// lane 2 weight and 2 scale loads, 4 activation loads, 56 conversions (lop3, and a shift, per bf16 pair), 16
// byte permutes, 16 mma (8 with the -136 operand), 4 scale FMAs, ~35 address, scale unpacking and loop. D2 (H200,
// benchmarks/results/kimi_gemv_int4d_d2_h200.json, 1 token): gate_up / down 58.4 / 36.4 -> 42.4 / 26.2 us.
//
// The trick: the mma's 8 N columns, useless at one token, carry the groups. A warp owns 16 output rows;
// per 128-k chunk (1 KB, contiguous) lane (g, t) holds one whole group — group t of the chunk — of row g
// (16 bytes) and of row g + 8 (16 bytes). In every mma step it feeds its A slots (2t, 2t+1 | 2t+8, 2t+9)
// from those two groups, so A column slots of quad position t always carry group t. The activations
// go into B only on lane (g = t, t) (token A; lane (g = t + 4, t): token B), every other lane's B is
// zero: so D column t sums only group t's products, column t + 4 token B's. After the chunk's 8 steps
// each lane's accumulators are whole group sums — rows g, g + 8 × groups 2t', 2t' + 1 (t' = t & 1) of
// token A (t < 2) or token B (t >= 2) — which take their group scale in one FMA each: 4 FMAs per lane
// per chunk instead of 4 per group. Conversion as moe_gemv_int4_tiled: nibbles or-ed into bf16 128 + q
// (a shift and a lop3 per pair, exact), a second mma with the constant A = -136 removes the bias
// (Σ (128 + q)·x - 136·Σ x = Σ (q - 8)·x; products exact in the tensor cores, sums in fp32).
//
// Step 2w + h of a chunk (w: the lane's word, 8 weights k0 + 8w .. k0 + 8w + 7 of its group) takes
// nibbles (2h, 2h + 4) into slots (2t, 2t + 1) and (2h + 1, 2h + 5) into (2t + 8, 2t + 9); the B lane
// takes the matching activations by two byte permutes of one 16-byte load.
// Needs N % 16 == 0, K % 128 == 0 (the layout's shapes; the caller checks) and 16-byte aligned rows.
#include "mma.cuh"

#ifndef GROUPS_DEPTH
#define GROUPS_DEPTH 4  // chunks per lane in a ring of registers: one multiplied, the rest loading
#endif
#ifndef GROUPS_PAIRS
#define GROUPS_PAIRS 1  // token pairs per pass over the weights (a pass streams every chunk once)
#endif
#ifndef GROUPS_STREAM_LOADS
#define GROUPS_STREAM_LOADS 1  // weight loads past L1 (read once), L2 asked for 256-byte lines
#endif
#ifndef GROUPS_ROTATE
#define GROUPS_ROTATE 1  // each warp starts its chunk stream at its own place (37 chunks per row block on)
#endif
#if GROUPS_DEPTH % 2
#error "GROUPS_DEPTH must be even (the activations' double buffer is indexed by chunk parity)"
#endif
// A stage of the shared-memory ring: the chunk's 1 KB of words as in HBM, then each lane's two scale pairs
// (8 bytes at 1024 + 8 * lane); every lane copies and reads only its own bytes, so it waits only for its own
// cp.async groups and the warp never synchronises.
#define GROUPS_STAGE_BYTES 1280

#ifndef GROUPS_FUSE_SILU
#define GROUPS_FUSE_SILU 0  // 1: gate_up with SiLU·mul fused (out [rows, N / 2]; see moe_gemv_int4_groups)
#endif
#ifndef GROUPS_STAGES
#define GROUPS_STAGES 0  // > 0: the chunk ring in shared memory, this many chunks deep, filled by cp.async
#endif                   // (GROUPS_DEPTH unused): more bytes in flight per warp than registers hold
#ifndef GROUPS_PROBE
#define GROUPS_PROBE 0  // measuring only (wrong results): 1 loads every chunk but skips its arithmetic (the memory
#endif                  // stream alone); 2 multiplies every chunk but loads chunk 0 each time (the arithmetic alone)
#ifndef GROUPS_XSMEM
#define GROUPS_XSMEM 0  // 1 / 2: the pass's activations staged by the block in dynamic shared memory as the mma's B
#endif                  // registers beside each group's sum (the -136 term: one mma a chunk instead of eight), for
                        // passes of that many token rows (1: a batch-1 step's tiles, half the shared memory; a tile
                        // of more rows streams its weights once a row); one token pair. See groups_stage_activations
#define GROUPS_PASS_ROWS (GROUPS_XSMEM == 1 ? 1 : 2 * GROUPS_PAIRS)  // token rows a pass over the weights
#define GROUPS_XSMEM_RECORD 80  // bytes a (chunk, group, token) record: 16 B registers (64), the sum's 2 (8), pad
#if GROUPS_XSMEM && (GROUPS_PAIRS != 1 || GROUPS_STAGES || GROUPS_PROBE)
#error "GROUPS_XSMEM: the register ring, one token pair a pass"
#endif
#ifndef GROUPS_DYNAMIC_SHARED  // the host emulation supplies a static buffer
#define GROUPS_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif
#ifndef GROUPS_KSPLIT
#define GROUPS_KSPLIT 1  // warps of a block sharing one row block, each over a slice of K (shared-memory ring only)
#endif
#ifndef GROUPS_ACC_CHAINS
#define GROUPS_ACC_CHAINS 1  // independent mma accumulator chains a chunk (1, 2 or 4; see groups_chunk)
#endif
#if GROUPS_ACC_CHAINS != 1 && GROUPS_ACC_CHAINS != 2 && GROUPS_ACC_CHAINS != 4
#error "GROUPS_ACC_CHAINS must be 1, 2 or 4"
#endif
#ifndef GROUPS_ROW_BLOCKS
#define GROUPS_ROW_BLOCKS 1  // column blocks per block: blockIdx.x, + gridDim.x, ... (the host's grid x: ceil(blocks / this))
#endif                       // so a short-K projection of many row blocks (Kimi-K2's down) runs as one wave
#ifndef GROUPS_ROW_STREAM
#define GROUPS_ROW_STREAM 0  // 1: a warp's GROUPS_ROW_BLOCKS column blocks walked as ONE chunk stream (the register ring
#endif                       // never drains between them, the pass's activations staged once; the plain form, unrotated)
#if GROUPS_ROW_STREAM && (GROUPS_STAGES || GROUPS_KSPLIT > 1 || GROUPS_ROTATE || GROUPS_FUSE_SILU)
#error "GROUPS_ROW_STREAM: the register ring, unrotated, plain (not fused), without K split"
#endif
#ifndef GROUPS_MIN_BLOCKS
#define GROUPS_MIN_BLOCKS 4  // resident blocks per SM asked of ptxas (4: at most 128 registers, 16 warps per SM)
#endif
#define GROUPS_WARPS 4
#define GROUPS_TILE_ROWS 64
#if GROUPS_KSPLIT > 1 && (!GROUPS_STAGES || GROUPS_WARPS % GROUPS_KSPLIT)
#error "GROUPS_KSPLIT needs the shared-memory ring and must divide GROUPS_WARPS"
#endif
#if GROUPS_STAGES
static_assert(GROUPS_WARPS * GROUPS_STAGES * GROUPS_STAGE_BYTES <= 48 * 1024, "static shared memory");
#endif  // rows of a grouped tile: moe.cu BM (moe.py TILE_M)
#define GROUPS_NEG136 0xC308C308u  // bf16 -136, twice

struct GroupsChunk {
    uint4 lo, hi;        // this lane's group of row g and of row g + 8 (4 words each)
    unsigned s_lo, s_hi; // bf16 scales of groups 2t', 2t' + 1 of row g and of row g + 8
};

// Where the warp's 8 "rows g" and 8 "rows g + 8" start: the first chunk's 512-byte half holding them,
// from this lane's 16 bytes on (`w_*`), and that half's scale pair of this lane (`s_*`). Plain: the two
// halves of one 16-row block; SiLU·mul fused: 8 gate rows and the 8 matching up rows (two blocks).
struct GroupsRows {
    const unsigned char *w_lo, *s_lo;
#if GROUPS_FUSE_SILU  // the up rows' half: this many bytes further (within one expert: 32 bits)
    unsigned w_hi, s_hi;
#endif
};

__device__ __forceinline__ uint4 groups_weight_load(const uint4* p) {
#if GROUPS_STREAM_LOADS && !defined(MMA_HOST_STANDIN)
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *p;
#endif
}

// Chunk `c` of the warp's row block: this lane's share. `w`: the block's first chunk's words from this
// lane's 16 bytes on; `s`: its first chunk's scales from this lane's (row g, groups 2t', 2t' + 1) pair on
// (bf16 at ((row % 8) * 2 + half) * 4 + group, as 32-bit pairs: row g at 4g + t', row g + 8 two further).
// (Unsigned byte offsets: one wide multiply-add per address.)
__device__ __forceinline__ GroupsChunk groups_load(const GroupsRows& rows, int c) {
#if GROUPS_PROBE == 2  // the arithmetic alone: chunks 0 and 1 again and again (cache hits)
    c &= 1;
#endif
    const unsigned long long w = (unsigned long long)(unsigned)c * 1024u, s = (unsigned long long)(unsigned)c * 128u;
    GroupsChunk chunk;
    const unsigned char *w_lo = rows.w_lo + w, *s_lo = rows.s_lo + s;
#if GROUPS_FUSE_SILU
    const unsigned char *w_hi = w_lo + rows.w_hi, *s_hi = s_lo + rows.s_hi;
#else  // the block's other half: 512 bytes on, its scales 8 bytes on
    const unsigned char *w_hi = w_lo + 512, *s_hi = s_lo + 8;
#endif
    chunk.lo = groups_weight_load(reinterpret_cast<const uint4*>(w_lo));
    chunk.hi = groups_weight_load(reinterpret_cast<const uint4*>(w_hi));
    chunk.s_lo = *reinterpret_cast<const unsigned*>(s_lo);
    chunk.s_hi = *reinterpret_cast<const unsigned*>(s_hi);
    return chunk;
}

#if GROUPS_STAGES
// cp.async copies of `bytes` (16: L2 asked for 256-byte lines, past L1; 4: the scales) and their groups
template <int BYTES>
__device__ __forceinline__ void groups_copy(unsigned char* smem, const unsigned char* gmem) {
#ifdef MMA_HOST_STANDIN
    for (int i = 0; i < BYTES; ++i) smem[i] = gmem[i];
#else
    const unsigned at = (unsigned)__cvta_generic_to_shared(smem);
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(at), "l"(gmem));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(at), "l"(gmem), "n"(BYTES));
#endif
}
__device__ __forceinline__ void groups_commit() {
#ifndef MMA_HOST_STANDIN
    asm volatile("cp.async.commit_group;");
#endif
}
template <int PENDING>
__device__ __forceinline__ void groups_wait() {
#ifndef MMA_HOST_STANDIN
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
#endif
}

// Chunk `c` of the warp's rows into `stage` (this lane's 16 + 16 + 4 + 4 bytes).
__device__ __forceinline__ void groups_issue(const GroupsRows& rows, int c, unsigned char* stage, int lane) {
    const unsigned long long w = (unsigned long long)(unsigned)c * 1024u, s = (unsigned long long)(unsigned)c * 128u;
    const unsigned char *w_lo = rows.w_lo + w, *s_lo = rows.s_lo + s;
#if GROUPS_FUSE_SILU
    const unsigned char *w_hi = w_lo + rows.w_hi, *s_hi = s_lo + rows.s_hi;
#else
    const unsigned char *w_hi = w_lo + 512, *s_hi = s_lo + 8;
#endif
    groups_copy<16>(stage + 16 * lane, w_lo);
    groups_copy<16>(stage + 512 + 16 * lane, w_hi);
    groups_copy<4>(stage + 1024 + 8 * lane, s_lo);
    groups_copy<4>(stage + 1028 + 8 * lane, s_hi);
}

#endif

#if GROUPS_STAGES
// This lane's share of the chunk in a stage: its 16 bytes of each half (at 16 * lane, 512 + 16 * lane) and its
// two scale pairs at `s_lo`, `s_hi` bytes into the stage.
__device__ __forceinline__ GroupsChunk groups_read_at(const unsigned char* stage, int lane, int s_lo, int s_hi) {
    GroupsChunk c;
    c.lo = *reinterpret_cast<const uint4*>(stage + 16 * lane);
    c.hi = *reinterpret_cast<const uint4*>(stage + 512 + 16 * lane);
    c.s_lo = *reinterpret_cast<const unsigned*>(stage + s_lo);
    c.s_hi = *reinterpret_cast<const unsigned*>(stage + s_hi);
    return c;
}
#endif

// Nibbles s and s + 4 of v → the bf16 pair (128 + q_s, 128 + q_{s+4}); `magic`: 0x43004300 (bf16 128, twice).
__device__ __forceinline__ unsigned groups_pair(unsigned v, int s, unsigned magic) {
#ifdef MMA_HOST_STANDIN
    return ((v >> (4 * s)) & 0x000F000Fu) | magic;
#else
    unsigned biased;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(biased) : "r"(v >> (4 * s)), "n"(0x000F000F), "r"(magic));
    return biased;
#endif
}

// (lo half of a, lo half of b) and (hi half of a, hi half of b): the B registers of one step.
__device__ __forceinline__ unsigned groups_low_halves(unsigned a, unsigned b) {
#ifdef MMA_HOST_STANDIN
    return (a & 0xFFFFu) | (b << 16);
#else
    return __byte_perm(a, b, 0x5410);
#endif
}
__device__ __forceinline__ unsigned groups_high_halves(unsigned a, unsigned b) {
#ifdef MMA_HOST_STANDIN
    return (a >> 16) | (b & 0xFFFF0000u);
#else
    return __byte_perm(a, b, 0x7632);
#endif
}

__device__ __forceinline__ float groups_bf16_low(unsigned pair) { return __int_as_float((int)(pair << 16)); }
__device__ __forceinline__ float groups_bf16_high(unsigned pair) { return __int_as_float((int)(pair & 0xFFFF0000u)); }

// 16-byte words of a lane's activations a chunk: its group's 32 bf16 (XSMEM: as the 8 steps' B registers, then
// the group's sum as two more)
#define GROUPS_X_WORDS (GROUPS_XSMEM ? 5 : 4)

// What the lanes off the B columns read as their activations: zeros (a load of its own address every
// chunk, stride 0, so the activation loads need no predicate and no register copies).
__device__ uint4 groups_zero_activations[4];

// The activations this lane puts into B for chunk c: group t of the chunk of its token rows
// (x_at[p] + c * x_stride[p]; zeros for a lane off the B columns, x_stride 0).
__device__ __forceinline__ void groups_x_load(uint4 (&xv)[GROUPS_PAIRS][GROUPS_X_WORDS],
                                              const unsigned char* const (&x_at)[GROUPS_PAIRS],
                                              const unsigned (&x_stride)[GROUPS_PAIRS], int c) {
#pragma unroll
    for (int p = 0; p < GROUPS_PAIRS; ++p) {
        const uint4* at = reinterpret_cast<const uint4*>(x_at[p] + (unsigned long long)(unsigned)c * x_stride[p]);
#if GROUPS_XSMEM  // shared memory: the record's 4 words of B registers, then the sum's two registers
#pragma unroll
        for (int w = 0; w < 4; ++w) xv[p][w] = at[w];
        const unsigned* sum = reinterpret_cast<const unsigned*>(at + 4);
        xv[p][4] = make_uint4(sum[0], sum[1], 0u, 0u);
#else
#pragma unroll
        for (int w = 0; w < 4; ++w) {
#ifdef MMA_HOST_STANDIN
            xv[p][w] = at[w];
#else
            xv[p][w] = __ldg(at + w);
#endif
        }
#endif
    }
}

#if GROUPS_XSMEM
// The pass's activations into `xs` by the whole block (between two __syncthreads of the caller): for each of its
// `rows` token rows, chunk c and group q (32 weights of K), a record at ((token * chunks + c) * 4 + q) * 80 bytes:
// the 16 B registers lane (q, q) of a warp (token 1: lane (q + 4, q)) feeds the 8 steps of the chunk, as
// groups_chunk built them from the group's 16 bytes (step 2w + h: b0 = x[8w + 2h], x[8w + 2h + 4], b1 = x[8w + 2h + 1],
// x[8w + 2h + 5]), then the group's sum Σx (fp32, k in order) as four bf16 (hi + lo twice: the fp32 sum to ~32 bits)
// whose mma with the -136 operand gives every row's -136 Σx at once. Then 80 zero bytes (the lanes off the B columns).
__device__ __forceinline__ void groups_stage_activations(unsigned char* xs, const bf16* __restrict__ a,
                                                         const int* __restrict__ sorted_slots, int top_k, int pass,
                                                         int rows, int chunks, int K) {
    const int units = rows * chunks * 4;
    for (int unit = threadIdx.x; unit < units + GROUPS_XSMEM_RECORD / 16; unit += blockDim.x) {
        if (unit >= units) {  // the zero record
            reinterpret_cast<uint4*>(xs + (long long)GROUPS_PASS_ROWS * chunks * 4 * GROUPS_XSMEM_RECORD)[unit - units] =
                make_uint4(0u, 0u, 0u, 0u);
            continue;
        }
        const int token = unit / (chunks * 4), cq = unit - token * chunks * 4;
        const int slot = pass + token;
        const uint4* row = reinterpret_cast<const uint4*>(
            a + (long long)(sorted_slots ? sorted_slots[slot] / top_k : slot) * K + 32 * cq);
        uint4 v[4], b[4];
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
#ifdef MMA_HOST_STANDIN
            v[w] = row[w];
#else
            v[w] = __ldg(row + w);
#endif
            const unsigned x[4] = {v[w].x, v[w].y, v[w].z, v[w].w};
            b[w] = make_uint4(groups_low_halves(x[0], x[2]), groups_high_halves(x[0], x[2]),
                              groups_low_halves(x[1], x[3]), groups_high_halves(x[1], x[3]));
#pragma unroll
            for (int i = 0; i < 4; ++i) sum += groups_bf16_low(x[i]) + groups_bf16_high(x[i]);
        }
        unsigned char* record = xs + ((long long)token * chunks * 4 + cq) * GROUPS_XSMEM_RECORD;
#pragma unroll
        for (int w = 0; w < 4; ++w) reinterpret_cast<uint4*>(record)[w] = b[w];
        const float hi1 = round_bf16(sum), r1 = sum - hi1, lo1 = round_bf16(r1), r2 = r1 - lo1;
        const float hi2 = round_bf16(r2), lo2 = round_bf16(r2 - hi2);
        reinterpret_cast<unsigned*>(record + 64)[0] = pack_bf16x2(hi1, lo1);
        reinterpret_cast<unsigned*>(record + 64)[1] = pack_bf16x2(hi2, lo2);
    }
}

// A pass's staging by the whole block (block-uniform: every warp of the block calls it), then this lane's records:
// its token's (chunk stride 4 records) on a B column, else the zero record.
__device__ __forceinline__ void groups_stage_pass(unsigned char* xs, const bf16* __restrict__ a,
                                                  const int* __restrict__ sorted_slots, int top_k, int pass, int rows,
                                                  int chunks, int K, int token_of_lane, int t,
                                                  const unsigned char* (&x_at)[GROUPS_PAIRS],
                                                  unsigned (&x_stride)[GROUPS_PAIRS]) {
    __syncthreads();  // every warp past its reads of the last pass's records
    groups_stage_activations(xs, a, sorted_slots, top_k, pass, rows, chunks, K);
    __syncthreads();
    const bool on = token_of_lane >= 0 && token_of_lane < rows;
    x_at[0] = xs + (on ? ((long long)token_of_lane * chunks * 4 + t) * GROUPS_XSMEM_RECORD
                       : (long long)GROUPS_PASS_ROWS * chunks * 4 * GROUPS_XSMEM_RECORD);
    x_stride[0] = on ? 4 * GROUPS_XSMEM_RECORD : 0;
}
#endif

// acc[p] += chunk c times token pair p's activations xv[p] (this lane's B, zeros off its column).
__device__ __forceinline__ void groups_chunk(float (&acc)[GROUPS_PAIRS][4], const GroupsChunk& c,
                                             const uint4 (&xv)[GROUPS_PAIRS][GROUPS_X_WORDS], const unsigned (&neg136)[4],
                                             unsigned magic) {
#if GROUPS_PROBE == 1  // the memory stream alone: every loaded word kept live, no arithmetic
    unsigned bits = c.lo.x ^ c.lo.y ^ c.lo.z ^ c.lo.w ^ c.hi.x ^ c.hi.y ^ c.hi.z ^ c.hi.w ^ c.s_lo ^ c.s_hi;
#pragma unroll
    for (int p = 0; p < GROUPS_PAIRS; ++p) bits ^= xv[p][0].x ^ xv[p][1].y ^ xv[p][2].z ^ xv[p][3].w;
    acc[0][0] += __int_as_float((int)(bits & 0x007FFFFFu));
    (void)neg136;
    (void)magic;
    return;
#endif
    const unsigned lo[4] = {c.lo.x, c.lo.y, c.lo.z, c.lo.w}, hi[4] = {c.hi.x, c.hi.y, c.hi.z, c.hi.w};
    // GROUPS_ACC_CHAINS independent accumulator sets (1: one chain of 16 dependent mma a chunk; 2: the -136 mma
    // apart from the weights' (two chains of 8); 4: each also split by h (four of 4)), added at the chunk's end
    float sum[GROUPS_ACC_CHAINS][GROUPS_PAIRS][4];
#pragma unroll
    for (int a = 0; a < GROUPS_ACC_CHAINS; ++a)
#pragma unroll
        for (int p = 0; p < GROUPS_PAIRS; ++p)
#pragma unroll
            for (int v = 0; v < 4; ++v) sum[a][p][v] = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            unsigned a[4];  // slots (2t, 2t+1): nibbles 2h, 2h+4; (2t+8, 2t+9): 2h+1, 2h+5; rows g (a0, a2), g+8 (a1, a3)
            a[0] = groups_pair(lo[w], 2 * h, magic);
            a[1] = groups_pair(hi[w], 2 * h, magic);
            a[2] = groups_pair(lo[w], 2 * h + 1, magic);
            a[3] = groups_pair(hi[w], 2 * h + 1, magic);
#pragma unroll
            for (int p = 0; p < GROUPS_PAIRS; ++p) {
                constexpr int weights_chain = GROUPS_ACC_CHAINS > 1 ? 1 : 0;
                const int h_chain = GROUPS_ACC_CHAINS > 2 ? 2 * h : 0;
#if GROUPS_XSMEM  // the step's B registers as staged; the -136 term once a chunk (below)
                const unsigned b0 = h ? xv[p][w].z : xv[p][w].x, b1 = h ? xv[p][w].w : xv[p][w].y;
                mma_bf16_16816(sum[h_chain + weights_chain][p], a, b0, b1);
#else
                const unsigned x[4] = {xv[p][w].x, xv[p][w].y, xv[p][w].z, xv[p][w].w};
                // x[8w + 2h], x[8w + 2h + 4] | x[8w + 2h + 1], x[8w + 2h + 5]
                const unsigned b0 = groups_low_halves(x[h], x[h + 2]), b1 = groups_high_halves(x[h], x[h + 2]);
                mma_bf16_16816(sum[h_chain][p], neg136, b0, b1);
                mma_bf16_16816(sum[h_chain + weights_chain][p], a, b0, b1);
#endif
            }
        }
    }
#if GROUPS_XSMEM  // -136 Σx of each group (its sum's four bf16 in the group's column): every row at once
#pragma unroll
    for (int p = 0; p < GROUPS_PAIRS; ++p) mma_bf16_16816(sum[0][p], neg136, xv[p][4].x, xv[p][4].y);
#endif
#pragma unroll
    for (int chain = 1; chain < GROUPS_ACC_CHAINS; ++chain)
#pragma unroll
        for (int p = 0; p < GROUPS_PAIRS; ++p)
#pragma unroll
            for (int v = 0; v < 4; ++v) sum[0][p][v] += sum[chain][p][v];
    const float s0 = groups_bf16_low(c.s_lo), s1 = groups_bf16_high(c.s_lo);
    const float s2 = groups_bf16_low(c.s_hi), s3 = groups_bf16_high(c.s_hi);
#pragma unroll
    for (int p = 0; p < GROUPS_PAIRS; ++p) {
        acc[p][0] += s0 * sum[0][p][0];
        acc[p][1] += s1 * sum[0][p][1];
        acc[p][2] += s2 * sum[0][p][2];
        acc[p][3] += s3 * sum[0][p][3];
    }
}

extern "C" __global__ void __launch_bounds__(GROUPS_WARPS * 32, GROUPS_MIN_BLOCKS)
moe_gemv_int4_groups(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                     const void* __restrict__ weight, const void* __restrict__ scale,
                     const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                     const int* __restrict__ num_tiles, const int* __restrict__ offsets, int dense_rows,
                     bf16* __restrict__ out, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if GROUPS_XSMEM
    GROUPS_DYNAMIC_SHARED(groups_xs);  // the pass's staged activations (groups_stage_activations)
#endif
    // GROUPS_ROW_BLOCKS column blocks in turn (a block-uniform loop: the KSPLIT barriers stay matched); streamed
    // (GROUPS_ROW_STREAM): one turn, the warp's walk running on through its further column blocks
    for (int row_block = 0; row_block < (GROUPS_ROW_STREAM ? 1 : GROUPS_ROW_BLOCKS); ++row_block) {
        const int bx = blockIdx.x + row_block * gridDim.x;
        // split K: the block's warps in groups of GROUPS_KSPLIT share a row block, warp `slice` its slice of K
        const int slice = warp % GROUPS_KSPLIT, column_warp = bx * (GROUPS_WARPS / GROUPS_KSPLIT) + warp / GROUPS_KSPLIT;
#if GROUPS_FUSE_SILU  // output columns n0 .. n0 + 7: gate rows n0 + g ("rows g"), up rows N / 2 + n0 + g ("g + 8")
        const int out_columns = N / 2, warp_columns = 8;
#else  // rows n0 .. n0 + 15 of one 16-row block
        const int out_columns = N, warp_columns = 16;
#endif
        if (bx * (GROUPS_WARPS / GROUPS_KSPLIT) * warp_columns >= out_columns) return;  // block-uniform: past N
#if GROUPS_KSPLIT > 1 || GROUPS_XSMEM  // a warp past the columns still meets the block's barriers (its rows clamped,
        const bool past_columns = column_warp * warp_columns >= out_columns;
        const int n0 = past_columns ? out_columns - warp_columns : column_warp * warp_columns;
#else
        const int n0 = column_warp * warp_columns;
        if (n0 >= out_columns) return;  // whole warps only: the mma is warp-collective
        (void)slice;
#endif
#if GROUPS_FUSE_SILU
        const int row_lo = n0, row_hi = out_columns + n0;
#else
        const int row_lo = n0, row_hi = n0 + 8;
#endif
        int expert, row_begin, row_end;
        if (tile_expert) {  // grouped: tile blockIdx.y's expert and slots (moe.cu gemv_block_rows)
            if ((int)blockIdx.y >= *num_tiles) return;
            expert = tile_expert[blockIdx.y];
            row_begin = tile_row[blockIdx.y];
            row_end = min(row_begin + GROUPS_TILE_ROWS, offsets[expert + 1]);
        } else {  // dense: expert 0, every row (one block row loops over them: the weight read once per pass)
            expert = 0;
            row_begin = 0;
            row_end = dense_rows;
        }
        const int chunks = K / 128;
        // the first chunk of the row block holding row n, and the offset of n's 8-row half in it (words; scales:
        // this lane's pair, bf16 at ((row % 8) * 2 + half) * 4 + group)
        const auto first_chunk = [&](int n) { return ((long long)expert * (N / 16) + n / 16) * chunks; };
        const unsigned char* words = reinterpret_cast<const unsigned char*>(weight);
        const unsigned char* scales = reinterpret_cast<const unsigned char*>(scale);
        const int scale_pair = 4 * (4 * g + (t & 1));
        const long long w_lo = first_chunk(row_lo) * 1024 + ((row_lo >> 3) & 1) * 512;
        const long long s_lo = first_chunk(row_lo) * 128 + ((row_lo >> 3) & 1) * 8;
        const GroupsRows rows_of_warp = {words + w_lo + 16 * lane, scales + s_lo + scale_pair
#if GROUPS_FUSE_SILU
                                         , (unsigned)(first_chunk(row_hi) * 1024 + ((row_hi >> 3) & 1) * 512 - w_lo),
                                         (unsigned)(first_chunk(row_hi) * 128 + ((row_hi >> 3) & 1) * 8 - s_lo)
#endif
        };
        (void)row_hi;
        // the warp walks its chunks from `start` on, wrapping (warps in lockstep would otherwise read addresses
        // a row block's stride apart)
        // (by the row block within its half of N where N is whole 32-row pairs: a gate row block and its up row
        // block start alike, so the fused SiLU·mul form sums each row in the order the plain form does)
        const int half_block = (N % 32 == 0 ? row_lo % (N / 2) : row_lo) / 16;
        // this warp's chunks: [c_begin, c_end) (its slice of K; whole K without the split), walked from `start`
#if GROUPS_KSPLIT > 1
        const int slice_chunks = (chunks + GROUPS_KSPLIT - 1) / GROUPS_KSPLIT;
        const int c_begin = min(chunks, slice * slice_chunks), c_end = min(chunks, c_begin + slice_chunks);
#else
        const int c_begin = 0, c_end = chunks;
#endif
#if GROUPS_ROW_STREAM  // the warp's column blocks bx, bx + gridDim.x, ... holding rows: `streamed` of them, one walk;
        // its 16-row blocks lie gridDim.x * GROUPS_WARPS row blocks apart (words and scales), its outputs as many x 16
        int streamed = 0;
        while (streamed < GROUPS_ROW_BLOCKS &&
               (column_warp + streamed * (int)gridDim.x * GROUPS_WARPS) * warp_columns < out_columns)
            ++streamed;
        const unsigned long long stream_chunks = (unsigned long long)gridDim.x * GROUPS_WARPS * chunks;
        const int stream_columns = (int)gridDim.x * GROUPS_WARPS * warp_columns;
        const int count = streamed * (c_end - c_begin);
#else
        const int count = c_end - c_begin;
#endif
        const int start = c_begin + (GROUPS_ROTATE && count ? (int)(half_block * 37LL % count) : 0);
        const auto next_chunk = [&](int c) { return c + 1 == c_end ? c_begin : c + 1; };
        // a walk's next chunk: wrapping within [c_begin, c_end); streamed, a wrap moves on to the next column block
        const auto walk_on = [&](int& c, GroupsRows& at) {
            c = next_chunk(c);
#if GROUPS_ROW_STREAM
            if (c == c_begin) {
                at.w_lo += stream_chunks * 1024;
                at.s_lo += stream_chunks * 128;
            }
#else
            (void)at;
#endif
        };
        // the -136 operand and the bf16 magic, opaque to the compiler (which would otherwise rebuild the
        // constants before each use)
        unsigned neg136[4], magic = 0x43004300u;
    #pragma unroll
        for (int i = 0; i < 4; ++i) neg136[i] = GROUPS_NEG136;
#ifndef MMA_HOST_STANDIN
        asm volatile("mov.b32 %0, %4; mov.b32 %1, %4; mov.b32 %2, %4; mov.b32 %3, %4;"
                     : "=r"(neg136[0]), "=r"(neg136[1]), "=r"(neg136[2]), "=r"(neg136[3]) : "n"(GROUPS_NEG136));
        asm volatile("mov.b32 %0, %1;" : "=r"(magic) : "n"(0x43004300));
#endif
        // this lane's B column: token 2p of the pass (g == t) or token 2p + 1 (g == t + 4); else zeros
        const int token_of_lane = g == t ? 0 : g == t + 4 ? 1 : -1;
        for (int pass = row_begin; pass < row_end; pass += GROUPS_PASS_ROWS) {
            const int rows = min(GROUPS_PASS_ROWS, row_end - pass);  // warp-uniform
            const unsigned char* x_at[GROUPS_PAIRS];
            unsigned x_stride[GROUPS_PAIRS];
    #pragma unroll
            for (int p = 0; p < GROUPS_PAIRS; ++p) {
                const int r = 2 * p + token_of_lane;
                if (token_of_lane >= 0 && r < rows) {  // group t of each 128-k chunk (256 bytes) of the token row
                    const int slot = pass + r;
                    x_at[p] = reinterpret_cast<const unsigned char*>(
                        a + (long long)(sorted_slots ? sorted_slots[slot] / top_k : slot) * K + 32 * t);
                    x_stride[p] = 256;
                } else {
                    x_at[p] = reinterpret_cast<const unsigned char*>(groups_zero_activations);
                    x_stride[p] = 0;
                }
            }
            float acc[GROUPS_PAIRS][4];
    #pragma unroll
            for (int p = 0; p < GROUPS_PAIRS; ++p)
    #pragma unroll
                for (int v = 0; v < 4; ++v) acc[p][v] = 0.f;
            // the pass's rows of output columns `at` .. at + warp_columns - 1 from acc: lane (g, t) holds rows g (acc 0,
            // 1: groups 2t', 2t'+1) and g + 8 (acc 2, 3) of token 2p + (t >= 2); the two lanes t', t' ^ 1 of a token
            // hold its four group parities
            const auto store = [&](int at) {
    #pragma unroll
                for (int p = 0; p < GROUPS_PAIRS; ++p) {
                    float row_g = acc[p][0] + acc[p][1], row_g8 = acc[p][2] + acc[p][3];
                    row_g += __shfl_xor_sync(0xFFFFFFFFu, row_g, 1);
                    row_g8 += __shfl_xor_sync(0xFFFFFFFFu, row_g8, 1);
                    const int r = 2 * p + (t >> 1);
                    if ((t & 1) == 0 && r < rows) {
                        bf16* o = out + (long long)(pass + r) * out_columns + at + g;
#if GROUPS_FUSE_SILU  // elementwise.cu's silu_mul on the bf16-rounded gate and up: the unfused pair's bits
                        const float gate = round_bf16(row_g), up = round_bf16(row_g8);
                        o[0] = __float2bfloat16_rn(round_bf16(gate / (1.f + __expf(-gate))) * up);
#else
                        o[0] = __float2bfloat16_rn(row_g);
                        o[8] = __float2bfloat16_rn(row_g8);
#endif
                    }
                }
            };
#if GROUPS_STAGES
            __shared__ __align__(16) unsigned char groups_ring[GROUPS_WARPS][GROUPS_STAGES][GROUPS_STAGE_BYTES];
            unsigned char(*ring)[GROUPS_STAGE_BYTES] = groups_ring[warp];
            int load_chunk = start;  // the next chunk the ring loads
    #pragma unroll
            for (int d = 0; d + 1 < GROUPS_STAGES; ++d) {  // every turn commits a group, empty or not
                if (d < count) {
                    groups_issue(rows_of_warp, load_chunk, ring[d], lane);
                    load_chunk = next_chunk(load_chunk);
                }
                groups_commit();
            }
            int x_chunk = start;  // the chunk whose activations load next
            int stage_read = 0, stage_fill = GROUPS_STAGES - 1;
            for (int c = 0; c < count; ++c) {
                if (c + GROUPS_STAGES - 1 < count) {  // into the stage read last turn
                    groups_issue(rows_of_warp, load_chunk, ring[stage_fill], lane);
                    load_chunk = next_chunk(load_chunk);
                }
                groups_commit();
                uint4 xv[GROUPS_PAIRS][GROUPS_X_WORDS];  // L1-resident: in before the chunk's bytes are
                groups_x_load(xv, x_at, x_stride, x_chunk);
                x_chunk = next_chunk(x_chunk);
                groups_wait<GROUPS_STAGES - 1>();  // chunk c landed (this lane's copies)
                groups_chunk(acc, groups_read_at(ring[stage_read], lane, 1024 + 8 * lane, 1028 + 8 * lane), xv, neg136, magic);
                stage_read = stage_read + 1 == GROUPS_STAGES ? 0 : stage_read + 1;
                stage_fill = stage_fill + 1 == GROUPS_STAGES ? 0 : stage_fill + 1;
            }
#else
            GroupsChunk ring[GROUPS_DEPTH];
            int load_chunk = start;  // the next chunk the ring loads (of the column block at load_rows)
            GroupsRows load_rows = rows_of_warp;
            // the ring's next chunk
            const auto load_next = [&]() {
                const GroupsChunk chunk = groups_load(load_rows, load_chunk);
                walk_on(load_chunk, load_rows);
                return chunk;
            };
    #pragma unroll
            for (int d = 0; d + 1 < GROUPS_DEPTH; ++d)
                if (d < count) ring[d] = load_next();
            // the activations of the c-th chunk walked in xv[c % 2] (GROUPS_DEPTH even: a static index in the ring)
#if GROUPS_XSMEM  // the pass's activations into shared memory (the ring's first chunks in flight meanwhile)
            groups_stage_pass(groups_xs, a, sorted_slots, top_k, pass, rows, chunks, K, token_of_lane, t, x_at, x_stride);
#endif
            uint4 xv[2][GROUPS_PAIRS][GROUPS_X_WORDS];
#if GROUPS_ROW_STREAM  // the chunks left of the column block being summed, and its first output column
            int chunks_left = c_end - c_begin, stream_n0 = n0;
#endif
            // acc += a chunk; streamed, a column block's last chunk stores its rows and starts the next block's sums
            const auto consume = [&](const GroupsChunk& chunk, const uint4 (&x)[GROUPS_PAIRS][GROUPS_X_WORDS]) {
                groups_chunk(acc, chunk, x, neg136, magic);
#if GROUPS_ROW_STREAM
                if (--chunks_left == 0) {
                    store(stream_n0);
                    stream_n0 += stream_columns;
                    chunks_left = c_end - c_begin;
    #pragma unroll
                    for (int p = 0; p < GROUPS_PAIRS; ++p)
    #pragma unroll
                        for (int v = 0; v < 4; ++v) acc[p][v] = 0.f;
                }
#endif
            };
            groups_x_load(xv[0], x_at, x_stride, start);
            int x_chunk = next_chunk(start);  // the chunk whose activations load next
            int c0 = 0;
            for (; c0 + 2 * GROUPS_DEPTH - 1 <= count; c0 += GROUPS_DEPTH) {  // every load of the turn in range
    #pragma unroll
                for (int d = 0; d < GROUPS_DEPTH; ++d) {
                    ring[(d + GROUPS_DEPTH - 1) % GROUPS_DEPTH] = load_next();  // the slot used last
                    groups_x_load(xv[(d + 1) % 2], x_at, x_stride, x_chunk);
                    x_chunk = next_chunk(x_chunk);
                    consume(ring[d], xv[d % 2]);
                }
            }
            for (; c0 < count; c0 += GROUPS_DEPTH) {  // the last turns (warp-uniform branches)
    #pragma unroll
                for (int d = 0; d < GROUPS_DEPTH; ++d) {
                    const int c = c0 + d;
                    if (c + GROUPS_DEPTH - 1 < count) ring[(d + GROUPS_DEPTH - 1) % GROUPS_DEPTH] = load_next();
                    if (c < count) {
                        if (c + 1 < count) {
                            groups_x_load(xv[(d + 1) % 2], x_at, x_stride, x_chunk);
                            x_chunk = next_chunk(x_chunk);
                        }
                        consume(ring[d], xv[d % 2]);
                    }
                }
            }
#endif
#if GROUPS_KSPLIT > 1  // the slices' sums meet in shared memory; slice 0 adds them in slice order
            __shared__ float groups_partial[GROUPS_WARPS][GROUPS_PAIRS][4][32];
            if (slice) {
    #pragma unroll
                for (int p = 0; p < GROUPS_PAIRS; ++p)
    #pragma unroll
                    for (int v = 0; v < 4; ++v) groups_partial[warp][p][v][lane] = acc[p][v];
            }
            __syncthreads();
            if (slice == 0) {
    #pragma unroll
                for (int other = 1; other < GROUPS_KSPLIT; ++other)
    #pragma unroll
                    for (int p = 0; p < GROUPS_PAIRS; ++p)
    #pragma unroll
                        for (int v = 0; v < 4; ++v) acc[p][v] += groups_partial[warp + other][p][v][lane];
            }
            __syncthreads();  // read before the next pass writes
            if (slice || past_columns) continue;
#elif GROUPS_XSMEM
            if (past_columns) continue;
#endif
#if !GROUPS_ROW_STREAM  // (streamed: each column block's rows stored as its last chunk was summed)
            store(n0);
#endif
        }
    }
}
