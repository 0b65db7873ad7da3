// Grouped expert GEMM for bf16 experts on Hopper (sm_90a): wgmma from shared memory, a TMA +
// cp.async producer warpgroup, an mbarrier ring of SM90_STAGES k-tiles, a persistent grid.
//   out[p, n] = Σ_k A[row(p), k] · W_e(p)[n, k],  row(p) = sorted_slots[p] / top_k (gather) or p,
// p over the slots in expert order (moe_sort's offsets: expert e owns slots offsets[e] .. offsets[e+1]).
//
// Work: tiles of 128 slots of one expert x 256 weight rows (SM90_FUSE_SILU: 128 gate rows and the
// same 128 up rows), numbered m-tile-major (the CTAs resident at once share A rows and one or two
// experts' weights in L2); CTA b takes tiles b, b + gridDim.x, ... An expert's m-tiles are counted
// from `offsets` on the device (no host read: the launch can be captured in a CUDA graph).
// One CTA = 3 warpgroups:
//   warpgroup 0 (producer): per k-tile, the 128 gathered A rows by cp.async (zeros past the
//     expert's rows or past K) and the 256 weight rows as two TMA boxes [128 rows x 64] of the
//     weight's tensor map (rows past the expert are the next expert's or TMA's zeros: never stored);
//     both land on the stage's "full" mbarrier (128 cp.async arrivals + thread 0's byte count).
//   warpgroups 1, 2 (consumers): 64 rows each, D[64 x 256] += A·B^T by wgmma m64n256k16, both
//     operands K-major in 128-byte-swizzled shared memory; a stage is released (its "empty"
//     mbarrier, one arrival per warp) once the next stage's wgmmas are issued and its own retired.
//     A warpgroup whose 64 rows hold no slot of the tile skips the math (still waits and releases).
//     Epilogue from registers: fp32 -> bf16 (fused: silu(gate)·up, gate / up / silu each rounded to
//     bf16 as grouped_gemm -> silu_mul rounds them), while the producer fills the next tile's stages.
//
// SM90_MULTICAST=1: clusters of 2 CTAs take 256-slot units of one expert, 128 slots each, against the
// same 256 weight rows: CTA r copies box r by TMA multicast into both CTAs' stage, so each weight
// tile crosses from L2 once per pair (a 128 x 256 tile reads 768 bytes from L2 per k for 64 K of
// MMA work; the pair 512 per CTA). A stage is free once the consumers of both CTAs release it (16
// arrivals); a CTA with no slot in its half of the unit still copies its box and computes zeros.
//
//   smem: [stage s: A 128 x 128 B | B 256 x 128 B] x SM90_STAGES, [full, empty mbarriers] (1024-aligned)
//
// Small steps (a few slots per expert: every tile mostly padding, the weight stream all that counts):
// SM90_TILE_M=64 keeps one consumer warpgroup (256 threads, no register rebalancing; the A stage
// halves, so 5 stages fit) and SM90_TILE_N=128 halves the weight rows per tile (two 64-row boxes,
// wgmma m64n128k16), doubling the work units so the last wave of a persistent launch idles fewer SMs.
//
// Needs K % 8 == 0, 16-byte aligned rows of A, N even (fused: N = 2 I, I even); at most
// SM90_MAX_EXPERTS experts.
#include "mma.cuh"  // pack_bf16x2, round_bf16
#include "sm90.cuh"
#include "wgmma.cuh"  // wgmma_ss_n128

#ifndef SM90_STAGES
#define SM90_STAGES 4
#endif
#ifndef SM90_FUSE_SILU
#define SM90_FUSE_SILU 0
#endif
#ifndef SM90_MULTICAST
#define SM90_MULTICAST 0
#endif
// SM90_PDL=1: programmatic dependent launch. Every CTA lets the next kernel of the stream launch at once
// (griddepcontrol.launch_dependents): a launch made with the programmatic-serialization attribute (the
// down projection after gate_up) then takes each SM this one leaves during its last wave. The producer
// issues its first tile's weight boxes (up to SM90_STAGES k-tiles: weights and the routing's offsets,
// which the kernel before the previous one wrote, never the previous kernel's output) before
// griddepcontrol.wait, and every read of A or write of `out` comes after it. Launched plainly, the wait
// returns at once.
// SM90_PDL=2 (the gate_up projection launched right after the routing's grouping, OPENINFER_MOE_GATE_UP_PDL): the
// grouping (offsets, sorted slots) is the previous kernel's output, so every thread waits (griddepcontrol.wait) before
// reading anything, then lets the next kernel launch (down's SM90_PDL=1 prefetch reads these offsets: they are
// complete by then); only the launch, the shared-memory carve-up and the barrier set-up overlap the previous kernel.
#ifndef SM90_PDL
#define SM90_PDL 0
#endif
#if SM90_PDL != 0 && SM90_PDL != 1 && SM90_PDL != 2
#error "SM90_PDL is 0, 1 (weights before the wait) or 2 (wait first)"
#endif
#if SM90_PDL && SM90_MULTICAST
#error "SM90_PDL is built for single CTAs only"
#endif
// SM90_STREAM_K=1: the CTAs split the launch's units x k-tiles evenly (CTA b: iterations b W .. b W + W - 1,
// W = ceil(units x k_tiles / CTAs)) instead of taking whole units round-robin, so no last wave leaves
// SMs idle. A unit cut by a CTA boundary is finished by the CTA holding its first k-tile (the "owner",
// which reaches it last: at the end of its range); each later part is written by its CTA (at the start
// of that CTA's range) to partials[CTA] in fp32, fragment order, and flagged (flags[CTA] = 1, release);
// the owner waits for the flags (acquire), adds the parts in CTA order, sets the flags back to 0 (each
// is awaited by one owner: the buffer is all zeros again after every launch, so one buffer serves every
// launch and graph replay) and runs the epilogue. Deterministic; the sum order differs from whole
// units (within fp32 rounding).
#ifndef SM90_STREAM_K
#define SM90_STREAM_K 0
#endif
#if SM90_STREAM_K && SM90_MULTICAST
#error "SM90_STREAM_K is built for single CTAs only"
#endif
#ifndef SM90_SKIP_EMPTY
#define SM90_SKIP_EMPTY 0  // 1: a consumer warpgroup whose 64 rows hold no slot issues no wgmma (waits, releases)
#endif
#ifndef SM90_TILE_M
#define SM90_TILE_M 128   // slots per tile: 64 per consumer warpgroup
#endif
#ifndef SM90_TILE_N
#define SM90_TILE_N 256   // weight rows per tile: two TMA boxes (fused: gate box, up box)
#endif
#if (SM90_TILE_M != 64 && SM90_TILE_M != 128) || (SM90_TILE_N != 128 && SM90_TILE_N != 256)
#error "SM90_TILE_M must be 64 or 128 and SM90_TILE_N 128 or 256"
#endif
#define SM90_CLUSTER (SM90_MULTICAST ? 2 : 1)
#define SM90_CONSUMERS (SM90_TILE_M / 64)  // consumer warpgroups
#define SM90_THREADS (128 * (1 + SM90_CONSUMERS))
#define SM90_BOX_ROWS (SM90_TILE_N / 2)
#define SM90_ACC (SM90_TILE_N / 2)  // accumulator floats per consumer thread: 64 rows x TILE_N / 128 threads
#define SM90_TILE_K 64    // one 128-byte swizzle row of bf16
// SM90_K_SUB=2: a stage holds two 64-wide k sub-tiles side by side (each operand's rows 256 contiguous
// bytes per stage, where one sub-tile reads 128 bytes of each weight row; DRAM sees longer runs per row)
#ifndef SM90_K_SUB
#define SM90_K_SUB 1
#endif
#if SM90_K_SUB > 1 && SM90_MULTICAST
#error "SM90_K_SUB > 1 is built for single CTAs only"
#endif
#define SM90_STAGE_K (SM90_TILE_K * SM90_K_SUB)
#define SM90_A_SUB_BYTES (SM90_TILE_M * 128)
#define SM90_B_SUB_BYTES (SM90_TILE_N * 128)
#define SM90_UNIT_M (SM90_TILE_M * SM90_CLUSTER)  // slots of one expert per work unit (a CTA or a pair)
#define SM90_A_BYTES (SM90_K_SUB * SM90_A_SUB_BYTES)
#define SM90_B_BYTES (SM90_K_SUB * SM90_B_SUB_BYTES)
#define SM90_STAGE_BYTES (SM90_A_BYTES + SM90_B_BYTES)
#define SM90_BARRIER_OFFSET (SM90_STAGES * SM90_STAGE_BYTES)
// + 1024 so the tiles can start on a 1024-byte boundary (the swizzle atom)
#define SM90_SHARED_BYTES (SM90_BARRIER_OFFSET + 16 * SM90_STAGES + 1024)
#define SM90_MAX_EXPERTS 512
#define SM90_PRODUCER_REGS 72
#define SM90_CONSUMER_REGS 216  // two consumer warpgroups: 128 * 72 + 256 * 216 <= 65536
#if SM90_FUSE_SILU
#define SM90_OUT_TILE_N (SM90_TILE_N / 2)  // output columns per tile
#else
#define SM90_OUT_TILE_N SM90_TILE_N
#endif

// SM90_ROTATE=S: the work units take the last S experts (fused shared experts, every token's) first, then the rest
// in order (each unit the same arithmetic: the same bits): their weights, pulled into L2 during the layer's attention
// (OPENINFER_MOE_L2_PREFETCH), are read in the first wave, before the routed experts' stream can evict them.
#ifndef SM90_ROTATE
#define SM90_ROTATE 0
#endif
// The expert at place j of the launch's unit order.
__device__ __forceinline__ int sm90_expert_at(int j, int num_experts) {
#if SM90_ROTATE
    const int shift = num_experts - SM90_ROTATE;
    return j + shift < num_experts ? j + shift : j + shift - num_experts;
#else
    (void)num_experts;
    return j;
#endif
}

// SM90_L2_AHEAD=P (OPENINFER_MOE_SM90_L2_AHEAD; single CTAs, whole units): while issuing the weight boxes of its
// k-tile s, the producer's thread 0 also asks L2 for those of its k-tile s + P (the next unit's once s + P passes
// this one: the work order is known from the offsets), so the HBM reads run up to P stages ahead of the shared-memory
// ring (whose refills wait for the consumers' releases) and a unit's first stages are already on their way when it
// starts. A hint: the numbers never change.
#ifndef SM90_L2_AHEAD
#define SM90_L2_AHEAD 0
#endif
#if SM90_L2_AHEAD && (SM90_MULTICAST || SM90_STREAM_K)
#error "SM90_L2_AHEAD is built for single CTAs over whole units"
#endif
// SM90_B_FIRST=1 (OPENINFER_MOE_SM90_B_FIRST): each k-tile's weight boxes are issued before its gathered A rows (whose
// addresses wait on the unit's sorted-slot loads at a unit's start), not after. The same numbers.
#ifndef SM90_B_FIRST
#define SM90_B_FIRST 0
#endif

__device__ __forceinline__ void tma_prefetch_l2_3d(const void* map, int x, int y, int z) {
    asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n"
                 ::"l"(map), "r"(x), "r"(y), "r"(z) : "memory");
}

struct ExpertTile {
    int expert, row_begin, rows, column;  // rows: the CTA's slots (<= 0: none); column: first output column
};

// Work unit `tile` of the launch: m-unit tile / n_tiles (expert e's m-units of SM90_UNIT_M slots are
// tile_start[e] .. tile_start[e + 1] - 1), output column block tile % n_tiles; cluster CTA `rank`
// takes the unit's 128-slot part `rank`.
__device__ __forceinline__ ExpertTile expert_tile(int tile, int n_tiles, const int* tile_start, const int* offsets,
                                                  int num_experts, int rank) {
    const int m = tile / n_tiles;
    int lo = 0, hi = num_experts - 1;  // the last expert whose first m-tile is <= m (it has tiles)
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tile_start[mid] <= m) lo = mid;
        else hi = mid - 1;
    }
    ExpertTile w;
    w.expert = sm90_expert_at(lo, num_experts);
    w.row_begin = offsets[w.expert] + (m - tile_start[lo]) * SM90_UNIT_M + rank * SM90_TILE_M;
    w.rows = min(SM90_TILE_M, offsets[w.expert + 1] - w.row_begin);
    w.column = (tile % n_tiles) * SM90_OUT_TILE_N;
    return w;
}

// A consumer warp is done reading a stage. SM90_MULTICAST: the next copies into it come from both
// CTAs of the pair, so both CTAs' empty barriers hear of it.
__device__ __forceinline__ void release_stage(u32 bar, int lane) {
    __syncwarp();
#if SM90_MULTICAST
    if (lane == 0) {
        mbar_arrive_cluster(bar, 0);
        mbar_arrive_cluster(bar, 1);
    }
#else
    if (lane == 0) mbar_arrive(bar);
#endif
}

#if SM90_MULTICAST
#define SM90_CLUSTER_ATTRIBUTE __cluster_dims__(2, 1, 1)
#else
#define SM90_CLUSTER_ATTRIBUTE
#endif
extern "C" __global__ void __launch_bounds__(SM90_THREADS, 1) SM90_CLUSTER_ATTRIBUTE
moe_grouped_gemm_sm90(const bf16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                      const __grid_constant__ TensorMap weight_map, const int* __restrict__ offsets, int num_experts,
                      bf16* __restrict__ out, int N, int K
#if SM90_STREAM_K
                      , float* __restrict__ partials, int* __restrict__ flags /* [gridDim.x], zeros; left zeros */
#endif
                      ) {
    extern __shared__ uint4 smem_raw[];
    __shared__ int expert_offsets[SM90_MAX_EXPERTS + 1];
    __shared__ int tile_start[SM90_MAX_EXPERTS + 1];
    const u32 base = ((u32)__cvta_generic_to_shared(smem_raw) + 1023) & ~1023u;
    const u32 bar_full = base + SM90_BARRIER_OFFSET;      // [SM90_STAGES]
    const u32 bar_empty = bar_full + 8 * SM90_STAGES;     // [SM90_STAGES]

#if SM90_PDL == 2
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the grouping (offsets, sorted slots): the previous kernel's
#endif
    for (int e = threadIdx.x; e <= num_experts; e += SM90_THREADS) expert_offsets[e] = offsets[e];
    if (threadIdx.x == 0) {
        for (int s = 0; s < SM90_STAGES; ++s) {
            mbar_init(bar_full + 8 * s, 128 + 1);  // every producer thread's copies + thread 0's TMA bytes
            mbar_init(bar_empty + 8 * s, 4 * SM90_CONSUMERS * SM90_CLUSTER);  // one arrival per consumer warp (of the pair)
        }
        mbar_init_fence();
    }
#if SM90_MULTICAST
    cluster_sync();  // the pair's barriers are ready before either's copies or releases reach them
    const int rank = (int)cluster_cta_rank();
#else
    __syncthreads();
    const int rank = 0;
#endif
#if SM90_PDL
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    const int unit0 = blockIdx.x / SM90_CLUSTER, units_stride = gridDim.x / SM90_CLUSTER;
    if (threadIdx.x < 32) {  // tile_start: exclusive scan of the experts' m-tile counts, 32 experts a pass
        const int lane = threadIdx.x;
        int carry = 0;
        if (lane == 0) tile_start[0] = 0;
        for (int first = 0; first < num_experts; first += 32) {
            const int e = first + lane;
            const int x = e < num_experts ? sm90_expert_at(e, num_experts) : 0;  // place e's expert
            int count = e < num_experts ? (expert_offsets[x + 1] - expert_offsets[x] + SM90_UNIT_M - 1) / SM90_UNIT_M : 0;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int below = __shfl_up_sync(0xffffffffu, count, d);
                if (lane >= d) count += below;
            }
            if (e < num_experts) tile_start[e + 1] = carry + count;
            carry += __shfl_sync(0xffffffffu, count, 31);
        }
    }
    __syncthreads();
#if SM90_FUSE_SILU
    const int out_features = N / 2;
#else
    const int out_features = N;
#endif
    const int n_tiles = (out_features + SM90_OUT_TILE_N - 1) / SM90_OUT_TILE_N;
    const int num_tiles = tile_start[num_experts] * n_tiles;
    const int k_tiles = (K + SM90_STAGE_K - 1) / SM90_STAGE_K;
    const int warpgroup = threadIdx.x / 128;
#if SM90_STREAM_K
    // This CTA's work as segments: k-tiles k_begin .. k_end - 1 of unit `unit`; segment 0 starts at
    // first_iteration, later ones at whole units (without stream-K: whole units unit0, unit0 + stride, ...)
    const long long total_iterations = (long long)num_tiles * k_tiles;
    const long long per_cta = (total_iterations + gridDim.x - 1) / gridDim.x;
    const long long first_iteration = min(total_iterations, (long long)blockIdx.x * per_cta);
    const long long end_iteration = min(total_iterations, first_iteration + per_cta);
    auto segment = [&](int index, int& unit, int& k_begin, int& k_end) -> bool {
        const long long start = index == 0 ? first_iteration : (first_iteration / k_tiles + index) * k_tiles;
        if (start >= end_iteration) return false;
        unit = (int)(start / k_tiles);
        k_begin = (int)(start % k_tiles);
        k_end = (int)min((long long)k_tiles, end_iteration - (long long)unit * k_tiles);
        return true;
    };
#define SM90_FOR_EACH_SEGMENT \
    int unit, k_begin, k_end; \
    for (int index = 0; segment(index, unit, k_begin, k_end); ++index)
#else
#define SM90_FOR_EACH_SEGMENT \
    const int k_begin = 0, k_end = k_tiles; \
    for (int unit = unit0; unit < num_tiles; unit += units_stride)
#endif

    if (warpgroup == 0) {
        // ---------------- producer ----------------
#if SM90_CONSUMERS == 2  // one consumer warpgroup: 256 threads get all the registers they can use anyway
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(SM90_PRODUCER_REGS));
#endif
        const int t = threadIdx.x, chunk = t & 7, row0 = t >> 3;  // rows row0 + 16 i, 16-byte chunk `chunk`
        if (t == 0) prefetch_tensor_map(&weight_map);
        int step = 0;  // k-tiles produced so far (ring position)
#if SM90_PDL == 1
        int prefetched = 0;  // of them, k-tiles whose weight boxes went out before griddepcontrol.wait
        {  // the first segment's weights
#if SM90_STREAM_K
        int unit, k_begin, k_end;
        if (segment(0, unit, k_begin, k_end)) {
#else
        if (unit0 < num_tiles) {
            const int unit = unit0, k_begin = 0, k_end = k_tiles;
#endif
            const ExpertTile w = expert_tile(unit, n_tiles, tile_start, expert_offsets, num_experts, rank);
            const int first_row = w.expert * N + w.column;
#if SM90_FUSE_SILU
            const int second_row = first_row + N / 2;
#else
            const int second_row = first_row + SM90_BOX_ROWS;
#endif
            prefetched = min(k_end - k_begin, SM90_STAGES);
            if (t == 0)
                for (int s = 0; s < prefetched; ++s) {  // stages 0 .. prefetched - 1: free at the start
                    const int kt = k_begin + s;
                    const u32 b_smem = base + s * SM90_STAGE_BYTES + SM90_A_BYTES, full = bar_full + 8 * s;
                    mbar_arrive_expect_bytes(full, SM90_B_BYTES);
#pragma unroll
                    for (int sub = 0; sub < SM90_K_SUB; ++sub) {
                        const int k0 = kt * SM90_STAGE_K + sub * SM90_TILE_K;
                        tma_load_3d(b_smem + sub * SM90_B_SUB_BYTES, &weight_map, k0, 0, first_row, full);
                        tma_load_3d(b_smem + sub * SM90_B_SUB_BYTES + SM90_BOX_ROWS * 128, &weight_map, k0, 0, second_row, full);
                    }
                }
        }
        }
        asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the previous kernel (A's writer) completed
#endif
        SM90_FOR_EACH_SEGMENT {
            const ExpertTile w = expert_tile(unit, n_tiles, tile_start, expert_offsets, num_experts, rank);
            int source[SM90_TILE_M / 16];  // A row of each of this thread's tile rows, -1: past the expert
#pragma unroll
            for (int i = 0; i < SM90_TILE_M / 16; ++i) {
                const int r = row0 + 16 * i;
                source[i] = r < w.rows ? (sorted_slots ? sorted_slots[w.row_begin + r] / top_k : w.row_begin + r) : -1;
            }
            const int first_row = w.expert * N + w.column;  // weight rows of box 0; box 1 follows:
#if SM90_FUSE_SILU
            const int second_row = first_row + N / 2;  // the up rows of the same columns
#else
            const int second_row = first_row + SM90_BOX_ROWS;
#endif
            for (int kt = k_begin; kt < k_end; ++kt, ++step) {
                const int stage = step % SM90_STAGES;
                if (step >= SM90_STAGES) mbar_wait(bar_empty + 8 * stage, ((step / SM90_STAGES) - 1) & 1);
                const u32 a_smem = base + stage * SM90_STAGE_BYTES, b_smem = a_smem + SM90_A_BYTES;
                const u32 full = bar_full + 8 * stage;
                // this k-tile's weight boxes (thread 0; under SM90_PDL=1 the first stages went out before the wait)
                auto issue_weights = [&]() {
#if SM90_PDL == 1
                    if (t != 0 || step < prefetched) return;
#else
                    if (t != 0) return;
#endif
                    mbar_arrive_expect_bytes(full, SM90_B_BYTES);  // both boxes land here (SM90_MULTICAST: one from each CTA)
#if SM90_MULTICAST
                    tma_load_3d_multicast(b_smem + rank * SM90_BOX_ROWS * 128, &weight_map, kt * SM90_TILE_K, 0,
                                          rank ? second_row : first_row, full, 3);
#elif SM90_K_SUB == 1
                    tma_load_3d(b_smem, &weight_map, kt * SM90_TILE_K, 0, first_row, full);
                    tma_load_3d(b_smem + SM90_BOX_ROWS * 128, &weight_map, kt * SM90_TILE_K, 0, second_row, full);
#else
#pragma unroll
                    for (int sub = 0; sub < SM90_K_SUB; ++sub) {
                        const int k0 = kt * SM90_STAGE_K + sub * SM90_TILE_K;
                        tma_load_3d(b_smem + sub * SM90_B_SUB_BYTES, &weight_map, k0, 0, first_row, full);
                        tma_load_3d(b_smem + sub * SM90_B_SUB_BYTES + SM90_BOX_ROWS * 128, &weight_map, k0, 0, second_row, full);
                    }
#endif
                };
#if SM90_L2_AHEAD
                if (t == 0) {  // k-tile step + P of this CTA's work (whole units of k_tiles each), if any
                    const int ahead = step + SM90_L2_AHEAD;
                    const int ahead_unit = unit0 + (ahead / k_tiles) * units_stride, ahead_kt = ahead % k_tiles;
                    if (ahead_unit < num_tiles) {
                        const ExpertTile v = expert_tile(ahead_unit, n_tiles, tile_start, expert_offsets, num_experts, rank);
                        const int row = v.expert * N + v.column;
#if SM90_FUSE_SILU
                        const int row2 = row + N / 2;
#else
                        const int row2 = row + SM90_BOX_ROWS;
#endif
#pragma unroll
                        for (int sub = 0; sub < SM90_K_SUB; ++sub) {
                            const int k0 = ahead_kt * SM90_STAGE_K + sub * SM90_TILE_K;
                            tma_prefetch_l2_3d(&weight_map, k0, 0, row);
                            tma_prefetch_l2_3d(&weight_map, k0, 0, row2);
                        }
                    }
                }
#endif
#if SM90_B_FIRST
                issue_weights();
#endif
#if SM90_K_SUB == 1
                const int k = kt * SM90_TILE_K + chunk * 8;
#pragma unroll
                for (int i = 0; i < SM90_TILE_M / 16; ++i) {
                    const bool valid = source[i] >= 0 && k < K;
                    cp_async16(a_smem + swizzled(row0 + 16 * i, chunk), valid ? a + (size_t)source[i] * K + k : a, valid);
                }
#else
#pragma unroll
                for (int sub = 0; sub < SM90_K_SUB; ++sub) {
                    const int k = kt * SM90_STAGE_K + sub * SM90_TILE_K + chunk * 8;
#pragma unroll
                    for (int i = 0; i < SM90_TILE_M / 16; ++i) {
                        const bool valid = source[i] >= 0 && k < K;
                        cp_async16(a_smem + sub * SM90_A_SUB_BYTES + swizzled(row0 + 16 * i, chunk),
                                   valid ? a + (size_t)source[i] * K + k : a, valid);
                    }
                }
#endif
                mbar_arrive_on_copies(full);
#if !SM90_B_FIRST
                issue_weights();
#endif
            }
        }
        cp_async_wait_all();
    } else {
        // ---------------- consumers ----------------
#if SM90_CONSUMERS == 2
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(SM90_CONSUMER_REGS));
#endif
        const int wg = warpgroup - 1, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
        const int g = lane >> 2, q = (lane & 3) * 2;
        float acc[SM90_ACC];
#pragma unroll
        for (int i = 0; i < SM90_ACC; ++i) acc[i] = 0.f;
        int step = 0;
        SM90_FOR_EACH_SEGMENT {
            const ExpertTile w = expert_tile(unit, n_tiles, tile_start, expert_offsets, num_experts, rank);
            // warpgroup-uniform: its rows 64 wg .. 64 wg + 63 all past the expert's slots (a small step's
            // second warpgroup) would only multiply padding, sharing the tensor cores with the first
            const bool idle = SM90_SKIP_EMPTY && 64 * wg >= w.rows;
            for (int kt = k_begin; kt < k_end; ++kt, ++step) {
                const int stage = step % SM90_STAGES;
                mbar_wait(bar_full + 8 * stage, (step / SM90_STAGES) & 1);
                if (idle) {
                    release_stage(bar_empty + 8 * stage, lane);
                    continue;
                }
                fence_proxy_async_shared();  // the gathered A rows came by cp.async (generic proxy)
                const u32 a_smem = base + stage * SM90_STAGE_BYTES + wg * 64 * 128, b_smem = base + stage * SM90_STAGE_BYTES + SM90_A_BYTES;
                wgmma_fence();
#if SM90_K_SUB == 1
#pragma unroll
                for (int kk = 0; kk < SM90_TILE_K / 16; ++kk) {  // 16-wide k steps: 32 bytes along the swizzled rows
#if SM90_TILE_N == 256
                    wgmma_ss_n256(acc, smem_desc(a_smem + kk * 32, 16, 1024), smem_desc(b_smem + kk * 32, 16, 1024),
                                  kt > k_begin || kk > 0);
#else
                    wgmma_ss_n128(acc, smem_desc(a_smem + kk * 32, 16, 1024), smem_desc(b_smem + kk * 32, 16, 1024),
                                  kt > k_begin || kk > 0);
#endif
                }
#else
#pragma unroll
                for (int kk = 0; kk < SM90_STAGE_K / 16; ++kk) {  // sub-tile kk / 4, its 16-wide k step kk % 4
                    const u32 a_at = a_smem + (kk / 4) * SM90_A_SUB_BYTES + (kk % 4) * 32;
                    const u32 b_at = b_smem + (kk / 4) * SM90_B_SUB_BYTES + (kk % 4) * 32;
#if SM90_TILE_N == 256
                    wgmma_ss_n256(acc, smem_desc(a_at, 16, 1024), smem_desc(b_at, 16, 1024), kt > k_begin || kk > 0);
#else
                    wgmma_ss_n128(acc, smem_desc(a_at, 16, 1024), smem_desc(b_at, 16, 1024), kt > k_begin || kk > 0);
#endif
                }
#endif
                wgmma_commit();
                wgmma_wait<1>();  // the previous stage's wgmmas retired: release it
                if (kt > k_begin) release_stage(bar_empty + 8 * ((step - 1) % SM90_STAGES), lane);
            }
            if (!idle) {
                wgmma_wait<0>();
                release_stage(bar_empty + 8 * ((step - 1) % SM90_STAGES), lane);
            }
#if SM90_STREAM_K
            // fragment i of consumer thread c of warpgroup wg at partials[((CTA * CONSUMERS + wg) * ACC + i) * 128 + c]
            const int consumer = threadIdx.x & 127;
            if (k_begin > 0) {  // a later part of a unit cut by this CTA's start: to its owner
                if (!idle) {
                    float* part = partials + (size_t)(blockIdx.x * SM90_CONSUMERS + wg) * SM90_ACC * 128 + consumer;
#pragma unroll
                    for (int i = 0; i < SM90_ACC; ++i) part[i * 128] = acc[i];
                    __threadfence();
                }
                asm volatile("bar.sync 1, %0;\n" ::"n"(128 * SM90_CONSUMERS) : "memory");  // every part written
                if (threadIdx.x == 128)
                    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flags + blockIdx.x), "r"(1) : "memory");
                continue;
            }
            if (k_end < k_tiles) {  // the owner of a cut unit: add the later CTAs' parts in CTA order
                const long long last_iteration = (long long)unit * k_tiles + k_tiles - 1;
                if (!idle)
                    for (int cta = blockIdx.x + 1; (long long)cta * per_cta <= last_iteration; ++cta) {
                        int ready = 0;
                        do {
                            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(ready) : "l"(flags + cta) : "memory");
                        } while (!ready);
                        const float* part = partials + (size_t)(cta * SM90_CONSUMERS + wg) * SM90_ACC * 128 + consumer;
#pragma unroll
                        for (int i = 0; i < SM90_ACC; ++i) acc[i] += __ldcg(part + i * 128);
                    }
                asm volatile("bar.sync 1, %0;\n" ::"n"(128 * SM90_CONSUMERS) : "memory");  // every wait is over
                if (threadIdx.x == 128)
                    for (int cta = blockIdx.x + 1; (long long)cta * per_cta <= last_iteration; ++cta) flags[cta] = 0;
            }
#endif
            // lane (g, q) of warp `warp` holds rows 16 warp + g (+ 8), columns 8 j + q (+ 1) in acc[4 j + 2 half (+ 1)]
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = 64 * wg + 16 * warp + g + 8 * half;
                if (r >= w.rows) continue;
                bf16* out_row = out + (size_t)(w.row_begin + r) * out_features;
#if SM90_FUSE_SILU
#pragma unroll
                for (int j = 0; j < SM90_TILE_N / 16; ++j) {  // gate column block j, its up block j + TILE_N / 16
                    const int c = w.column + 8 * j + q;
                    float o[2];
#pragma unroll
                    for (int v = 0; v < 2; ++v) {
                        const float gate = round_bf16(acc[4 * j + 2 * half + v]);
                        const float up = round_bf16(acc[4 * (j + SM90_TILE_N / 16) + 2 * half + v]);
                        o[v] = round_bf16(gate / (1.f + __expf(-gate))) * up;
                    }
                    if (c + 1 < out_features) *reinterpret_cast<unsigned*>(out_row + c) = pack_bf16x2(o[0], o[1]);
                    else if (c < out_features) out_row[c] = __float2bfloat16_rn(o[0]);
                }
#else
#pragma unroll
                for (int j = 0; j < SM90_TILE_N / 8; ++j) {
                    const int c = w.column + 8 * j + q;
                    if (c + 1 < out_features)
                        *reinterpret_cast<unsigned*>(out_row + c) = pack_bf16x2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
                    else if (c < out_features) out_row[c] = __float2bfloat16_rn(acc[4 * j + 2 * half]);
                }
#endif
            }
        }
    }
#if SM90_MULTICAST
    cluster_sync();  // neither CTA of the pair exits while the other may still arrive on its barriers
#endif
}
