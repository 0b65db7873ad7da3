// Routing and grouping kernels for prefill-sized MoE steps (thousands of tokens); moe.cu's
// moe_router_logits (one warp per token and expert: every block re-reads its token's row and the
// router rows) and moe_sort_parallel (one block, shared-memory atomics on a few counters) are
// built for decode steps.
//
// moe_router_logits_mma: logits [T, E] fp32 = x [T, H] bf16 · gate [E, H]^T, 64 tokens x 64 experts
//   per block on tensor cores (mma.cuh's 64x64 tile, fp32 accumulate), ROUTER_STAGES k-tiles of x and
//   of the router rows in flight by cp.async; x is read once.
// moe_expert_counts + moe_place_slots: moe_sort's layout (offsets [E+1], sorted_slots, slot_pos, the
//   64-row GEMM tile list) over one block per expert and no atomics: block e counts the slots routed
//   to e, then (second launch) every block scans the counts and block e writes e's slots in slot
//   order (a stable, deterministic placement), its offsets entry and its tiles.
// Needs hidden % 8 == 0 and 16-byte aligned rows for the router (the caller checks).
#include "mma.cuh"
#include "moe_route.cuh"  // route_score; the grouping's expert_run, lay_out_expert_run, place_slots

#ifndef ROUTER_STAGES
#define ROUTER_STAGES 4
#endif
#define ROUTER_TILE MMA_TILE  // 64 tokens x 64 experts x 64-wide k-tiles
#define ROUTER_LD (ROUTER_TILE + 8)
#define GROUP_TILE_ROWS 64   // moe.cu's BM: rows of one expert per GEMM tile
#define GROUP_THREADS 1024
#define GROUP_MAX_EXPERTS 512

#ifndef MMA_HOST_STANDIN  // cp.async: GPU only (the host emulation runs the grouping kernels below)
extern "C" __global__ void __launch_bounds__(MMA_TILE_THREADS)
moe_router_logits_mma(const bf16* __restrict__ x, const bf16* __restrict__ gate, int num_tokens, int hidden,
                      int num_experts, float* __restrict__ logits) {
    extern __shared__ __align__(16) bf16 router_smem[];  // ROUTER_STAGES x (x tile, gate tile) [64][ROUTER_LD]
    typedef bf16(*Tile)[ROUTER_LD];
    const int t0 = blockIdx.x * ROUTER_TILE, e0 = blockIdx.y * ROUTER_TILE;
    const int k_tiles = (hidden + ROUTER_TILE - 1) / ROUTER_TILE;
    auto stage_tile = [&](int stage, int which) {
        return reinterpret_cast<Tile>(router_smem + (2 * stage + which) * ROUTER_TILE * ROUTER_LD);
    };
    auto issue = [&](int kt) {  // k-tile kt of both operands, zeros past the tokens, experts or hidden
        const int stage = kt % ROUTER_STAGES, k0 = kt * ROUTER_TILE;
        Tile a_tile = stage_tile(stage, 0), b_tile = stage_tile(stage, 1);
        for (int i = threadIdx.x; i < ROUTER_TILE * ROUTER_TILE / 8; i += MMA_TILE_THREADS) {
            const int r = i / (ROUTER_TILE / 8), c = (i % (ROUTER_TILE / 8)) * 8, k = k0 + c;
            const bool a_valid = t0 + r < num_tokens && k < hidden, b_valid = e0 + r < num_experts && k < hidden;
            cp_async16(&a_tile[r][c], a_valid ? x + (long long)(t0 + r) * hidden + k : x, a_valid);
            cp_async16(&b_tile[r][c], b_valid ? gate + (long long)(e0 + r) * hidden + k : gate, b_valid);
        }
    };
#pragma unroll
    for (int s = 0; s + 1 < ROUTER_STAGES; ++s) {  // every turn commits a group, empty or not
        if (s < k_tiles) issue(s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    const MmaTileLane lane = mma_tile_lane();
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
    for (int kt = 0; kt < k_tiles; ++kt) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(ROUTER_STAGES - 2));
        __syncthreads();  // k-tile kt landed for every thread; the stage refilled below was read by every warp
        if (kt + ROUTER_STAGES - 1 < k_tiles) issue(kt + ROUTER_STAGES - 1);
        asm volatile("cp.async.commit_group;\n" ::);
        mma_tile_step<ROUTER_LD>(acc, stage_tile(kt % ROUTER_STAGES, 0), stage_tile(kt % ROUTER_STAGES, 1), lane);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int t = t0 + lane.warp_m + 16 * i + lane.group + 8 * (v >> 1);
                const int e = e0 + lane.warp_n + 8 * j + lane.pair + (v & 1);
                if (t < num_tokens && e < num_experts) logits[(long long)t * num_experts + e] = acc[i][j][v];
            }
}
#endif

// Exclusive scan of one value per thread over the block (GROUP_THREADS threads); `scratch` holds
// 32 ints. Returns this thread's exclusive prefix; *total the block's sum.
__device__ __forceinline__ int block_exclusive_scan(int value, int* scratch, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int inclusive = value;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int below = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += below;
    }
    if (lane == 31) scratch[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int w = lane < warps ? scratch[lane] : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int below = __shfl_up_sync(0xffffffffu, w, d);
            if (lane >= d) w += below;
        }
        scratch[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int warp_base = warp > 0 ? scratch[warp - 1] : 0;
    *total = scratch[warps - 1];
    __syncthreads();  // scratch free for the next scan
    return warp_base + inclusive - value;
}

// Slots base .. base + 7 of `ids` (-1 past num_slots): two 16-byte loads where whole and aligned.
__device__ __forceinline__ void load_eight_ids(const int* __restrict__ ids, int base, int num_slots, bool aligned,
                                               int (&v)[8]) {
    if (aligned && base + 8 <= num_slots) {
        const uint4 lo = *reinterpret_cast<const uint4*>(ids + base), hi = *reinterpret_cast<const uint4*>(ids + base + 4);
        v[0] = (int)lo.x, v[1] = (int)lo.y, v[2] = (int)lo.z, v[3] = (int)lo.w;
        v[4] = (int)hi.x, v[5] = (int)hi.y, v[6] = (int)hi.z, v[7] = (int)hi.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = base + j < num_slots ? ids[base + j] : -1;
    }
}

// Grid (E): counts[e] = the slots routed to expert e (8 slots per thread and pass, loads in flight together).
extern "C" __global__ void __launch_bounds__(GROUP_THREADS)
moe_expert_counts(const int* __restrict__ ids, int num_slots, int* __restrict__ counts) {
    __shared__ int scratch[32];
    const int e = blockIdx.x;
    const bool aligned = ((size_t)ids & 15) == 0;
    int mine = 0;
    for (int base = threadIdx.x * 8; base < num_slots; base += blockDim.x * 8) {
        int v[8];
        load_eight_ids(ids, base, num_slots, aligned, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) mine += v[j] == e;
    }
    int total;
    block_exclusive_scan(mine, scratch, &total);
    if (threadIdx.x == 0) counts[e] = total;
}

// Grid (E), after moe_expert_counts: the same offsets, tile list and num_tiles as moe_sort; expert
// e's slots in slot order: passes over blockDim x 8 slots, thread t taking slots 8t .. 8t + 7 of the
// pass, a block scan of the matches placing them.
extern "C" __global__ void __launch_bounds__(GROUP_THREADS)
moe_place_slots(const int* __restrict__ ids, int num_slots, int num_experts, const int* __restrict__ counts,
                int* __restrict__ offsets /* [E+1] */, int* __restrict__ sorted_slots, int* __restrict__ slot_pos,
                int* __restrict__ tile_expert, int* __restrict__ tile_row, int* __restrict__ num_tiles,
                int max_tiles) {
    __shared__ int scratch[32];
    __shared__ int expert_row, expert_tile;
    const int e = blockIdx.x, tid = threadIdx.x;
    // experts' first rows and first tiles: thread i holds expert i (E <= MAX_EXPERTS <= threads)
    const int count = tid < num_experts ? counts[tid] : 0;
    int rows_total, tiles_total;
    const int row_before = block_exclusive_scan(count, scratch, &rows_total);
    const int tile_before = block_exclusive_scan((count + GROUP_TILE_ROWS - 1) / GROUP_TILE_ROWS, scratch, &tiles_total);
    if (tid == e) {
        expert_row = row_before;
        expert_tile = tile_before;
    }
    if (e == 0) {
        if (tid < num_experts) offsets[tid] = row_before;
        if (tid == 0) {
            offsets[num_experts] = rows_total;
            *num_tiles = min(tiles_total, max_tiles);
        }
    }
    __syncthreads();
    const int first_row = expert_row, first_tile = expert_tile, rows = counts[e];
    for (int r = tid * GROUP_TILE_ROWS; r < rows; r += blockDim.x * GROUP_TILE_ROWS) {
        const int tile = first_tile + r / GROUP_TILE_ROWS;
        if (tile < max_tiles) {
            tile_expert[tile] = e;
            tile_row[tile] = first_row + r;
        }
    }
    if (rows == 0) return;  // block-uniform
    const bool aligned = ((size_t)ids & 15) == 0;
    int placed = first_row;
    for (int pass = 0; pass < num_slots; pass += blockDim.x * 8) {
        const int base = pass + tid * 8;
        int v[8];
        load_eight_ids(ids, base, num_slots, aligned, v);
        int mine = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) mine += v[j] == e;
        int total;
        int p = placed + block_exclusive_scan(mine, scratch, &total);
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (v[j] == e) {
                sorted_slots[p] = base + j;
                slot_pos[base + j] = p;
                ++p;
            }
        placed += total;
        if (placed == first_row + rows) break;  // block-uniform: every slot of e placed
    }
}

// ---------------------------------------------------------------------------------------------
// The warp router (moe_route_sort): moe_route's scores and top-k for routers without expert
// groups (n_group 1: Moonlight, Kimi-K2), a warp per token. Lane l holds experts l + 32 i in registers; top-k by
// repeated warp argmax, lowest index on ties, the picks' scores summed in pick order: the same ids and (sigmoid,
// sqrt-softplus) the same weights as moe_route.
// ---------------------------------------------------------------------------------------------
#define ROUTE_PER_LANE (GROUP_MAX_EXPERTS / 32)
#ifndef ROUTE_SHARED_EXPERTS
#define ROUTE_SHARED_EXPERTS 0  // as moe.cu's moe_route: rows of k + S, the last S the fused shared experts (weight 1)
#endif
#if ROUTE_SHARED_EXPERTS < 0 || ROUTE_SHARED_EXPERTS > 16
#error "ROUTE_SHARED_EXPERTS must be in 0 .. 16"
#endif
// One token's scores in place from the lane's logits (score[i] of expert lane + 32 i, -inf past the experts):
// route_score of each, softmax's max and sum over the warp. The first step of both warp routers (warp_route_token,
// warp_route_token_keys): their scores are one computation.
template <int R>
__device__ __forceinline__ void warp_route_scores(float (&score)[R], int num_experts, int scoring) {
    const int lane = threadIdx.x & 31;
    float logit_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < R; ++i) logit_max = fmaxf(logit_max, score[i]);
    if (scoring == 0) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) logit_max = fmaxf(logit_max, __shfl_xor_sync(0xffffffffu, logit_max, o));
    }
    float local_sum = 0.f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int e = lane + 32 * i;
        if (e >= num_experts) continue;
        const float s = route_score(score[i], logit_max, scoring);
        if (scoring == 0) local_sum += s;
        score[i] = s;
    }
    if (scoring == 0) {
        const float total = warp_sum(local_sum);
#pragma unroll
        for (int i = 0; i < R; ++i) score[i] /= total;
    }
}

// The calling lane's entry of the token's row once the k picks are made (lane j < k holds pick j: my_id, my_score;
// total: the picks' scores summed in pick order): the last step of both warp routers. Lane j < k + S gets entry j
// (*id, *weight; the last S the fused shared experts, weight 1), other lanes *id = -1.
__device__ __forceinline__ void warp_route_entry(int my_id, float my_score, float total, int num_experts, int top_k,
                                                 int norm_topk, float scaling, int* id, float* weight) {
    const int lane = threadIdx.x & 31;
    const float norm = norm_topk ? 1.f / (total + 1e-20f) : 1.f;
    *id = -1;
    if (lane < top_k) {
        *id = my_id;
        *weight = my_score * norm * scaling;
    } else if (lane < top_k + ROUTE_SHARED_EXPERTS) {
        *id = num_experts + lane - top_k;
        *weight = 1.f;
    }
}

// One token's routing by the calling warp (the body of moe_route_sort): lane j < k + S
// gets its row's entry j (*id, *weight; the last S the fused shared experts), other lanes *id = -1.
__device__ __forceinline__ void warp_route_token(const float* __restrict__ row, const float* __restrict__ bias,
                                                 int num_experts, int top_k, int scoring, int norm_topk,
                                                 float scaling, int* id, float* weight) {
    const int lane = threadIdx.x & 31;
    float score[ROUTE_PER_LANE], choice[ROUTE_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        score[i] = e < num_experts ? row[e] : -INFINITY;
    }
    warp_route_scores(score, num_experts, scoring);
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        choice[i] = e < num_experts ? score[i] + (bias ? bias[e] : 0.f) : -INFINITY;
    }
    unsigned taken = 0u;  // bit i: this lane's expert lane + 32 i is picked
    int my_id = 0;        // lane j < top_k: pick j
    float my_score = 0.f, total = 0.f;
    for (int j = 0; j < top_k; ++j) {
        int arg = -1;
        float best = -INFINITY;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (e < num_experts && !((taken >> i) & 1u) && (arg < 0 || choice[i] > best)) {
                best = choice[i];
                arg = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float other_best = __shfl_xor_sync(0xffffffffu, best, o);
            const int other_arg = __shfl_sync(0xffffffffu, arg, lane ^ o);  // the xor lane's (host emulation: int shfl)
            if (other_arg >= 0 && (arg < 0 || other_best > best || (other_best == best && other_arg < arg))) {
                best = other_best;
                arg = other_arg;
            }
        }
        float picked = 0.f;  // the owner lane's score of `arg` (a register picked by a compare, not an index)
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i)
            if ((arg >> 5) == i) picked = score[i];
        picked = __int_as_float(__shfl_sync(0xffffffffu, __float_as_int(picked), arg & 31));
        if ((arg & 31) == lane) taken |= 1u << (arg >> 5);
        total += picked;  // in pick order, as moe_route's thread 0
        if (lane == j) {
            my_id = arg;
            my_score = picked;
        }
    }
    warp_route_entry(my_id, my_score, total, num_experts, top_k, norm_topk, scaling, id, weight);
}

// ---------------------------------------------------------------------------------------------
// moe_route_sort: a decode step's top-k and grouping in one block (one launch where moe_route +
// moe_sort_parallel take two), over router_logits' output, for routers without expert groups. Each
// of ROUTE_SORT_WARPS warps routes tokens w, w + ROUTE_SORT_WARPS, ... (warp_route_token), keeping the step's ids in shared memory; then, after a block barrier,
// moe_sort_parallel's layout (offsets [E'+1], the 64-row tile list, num_tiles, sorted_slots / slot_pos
// by shared-memory atomics) over E' = E + S experts. Nothing crosses blocks: nothing to reset between
// graph replays. At most ROUTE_SORT_MAX_SLOTS slots (T·(k+S)) and GROUP_MAX_EXPERTS experts (the caller checks).
// ---------------------------------------------------------------------------------------------
#define ROUTE_SORT_WARPS 16
#define ROUTE_SORT_MAX_SLOTS 2048
// The grouping's steps shared by moe_route_sort (route_sort_block: a block) and moe_route_decode (its last block, one
// warp scanning), and by moe.cu's moe_sort_parallel: moe_route.cuh's expert_run, lay_out_expert_run and place_slots.

// moe_route_sort's body for the calling block (ROUTE_SORT_WARPS warps, at least E' threads): `logits` the
// step's [T, E] rows (global or shared memory), `slot_expert` room for T·(k+S) ints, `count` GROUP_MAX_EXPERTS
// ints, `scratch` 32 ints (the caller's shared memory).
__device__ __forceinline__ void route_sort_block(const float* logits, const float* __restrict__ bias, int num_tokens,
                                                 int num_experts, int top_k, int scoring, int norm_topk,
                                                 float scaling, int* __restrict__ ids, float* __restrict__ weights,
                                                 int* __restrict__ offsets, int* __restrict__ sorted_slots,
                                                 int* __restrict__ slot_pos, int* __restrict__ tile_expert,
                                                 int* __restrict__ tile_row, int* __restrict__ num_tiles,
                                                 int max_tiles, int* slot_expert, int* count, int* scratch) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row_width = top_k + ROUTE_SHARED_EXPERTS, grouped = num_experts + ROUTE_SHARED_EXPERTS;
    const int num_slots = num_tokens * row_width;
    for (int e = tid; e < grouped; e += blockDim.x) count[e] = 0;
    for (int t = warp; t < num_tokens; t += blockDim.x >> 5) {  // warp-uniform
        int id;
        float weight;
        warp_route_token(logits + (long long)t * num_experts, bias, num_experts, top_k, scoring, norm_topk, scaling,
                         &id, &weight);
        if (lane < row_width) {
            ids[t * row_width + lane] = id;
            weights[t * row_width + lane] = weight;
            slot_expert[t * row_width + lane] = id;
        }
    }
    __syncthreads();
    for (int i = tid; i < num_slots; i += blockDim.x) atomicAdd(&count[slot_expert[i]], 1);
    __syncthreads();
    // experts' first rows and first tiles: thread tid holds a run of experts (one each where the block has E'
    // threads: moe_route_sort's 512), a block scan of the runs' rows and tiles, then each run laid out in order
    const ExpertRun run = expert_run<GROUP_TILE_ROWS>(count, grouped, tid, (int)blockDim.x);
    int rows_total, tiles_total;
    const int row_before = block_exclusive_scan(run.rows, scratch, &rows_total);
    const int tile_before = block_exclusive_scan(run.tiles, scratch, &tiles_total);
    lay_out_expert_run<GROUP_TILE_ROWS>(run, row_before, tile_before, count, offsets, tile_expert, tile_row, max_tiles);
    if (tid == 0) {
        offsets[grouped] = rows_total;
        *num_tiles = min(tiles_total, max_tiles);
    }
    __syncthreads();
    place_slots(num_slots, slot_expert, count, sorted_slots, slot_pos);
}

extern "C" __global__ void __launch_bounds__(ROUTE_SORT_WARPS * 32)
moe_route_sort(const float* __restrict__ logits, const float* __restrict__ bias /* [E] or null */, int num_tokens,
               int num_experts, int top_k, int scoring, int norm_topk, float scaling, int* __restrict__ ids,
               float* __restrict__ weights, int* __restrict__ offsets /* [E'+1] */, int* __restrict__ sorted_slots,
               int* __restrict__ slot_pos, int* __restrict__ tile_expert, int* __restrict__ tile_row,
               int* __restrict__ num_tiles, int max_tiles) {
    __shared__ int slot_expert[ROUTE_SORT_MAX_SLOTS];
    __shared__ int count[GROUP_MAX_EXPERTS];  // slots per expert, then each expert's next free row
    __shared__ int scratch[32];
    route_sort_block(logits, bias, num_tokens, num_experts, top_k, scoring, norm_topk, scaling, ids, weights, offsets,
                     sorted_slots, slot_pos, tile_expert, tile_row, num_tiles, max_tiles, slot_expert, count, scratch);
}

// ---------------------------------------------------------------------------------------------
// moe_route_decode: a decode step's whole routing in one launch — router logits, scores, top-k and the grouping
// (moe_route_sort's outputs) — for routers without expert groups, ordered to be short on the critical path:
//   logits   a warp per (expert, group of ROUTE_DECODE_TOKENS tokens): the block's tokens' x rows staged once in
//            shared memory, the warp's router row loaded whole up front (ROUTE_DECODE_CHUNKS 16-byte chunks a lane,
//            one round trip to memory), then each token's sum exactly as moe.cu's moe_router_logits (lane l the
//            chunks l, l + 32, ... in order, then warp_sum): the same logits bits, spread over ⌈E / warps⌉ blocks
//            per token group (moe_router_logits: a warp walks its row one load at a time, 8 warps a block);
//   top-k    the last block to finish (a ticket from `done`, zeroed by the caller per call and put back to zero)
//            gives each warp a token: scores as warp_route_token, then k picks of the best remaining choice by two
//            warp reductions (redux.sync max of an order-preserving key, min of the index among the lanes holding
//            it: lowest index on ties, as warp_route_token's argmax) and one update of the owner lane's best; the
//            picks' scores summed in pick order: warp_route_token's ids and weights;
//   grouping counts by shared-memory atomics as the picks land, one warp scans the experts' rows and tiles
//            (route_sort_block's offsets and tile list), then the slots placed by atomics (each expert's slots in
//            the order they hand out, as moe_route_sort).
// Compile-time shape (the caller's defines): ROUTE_DECODE_WARPS a block, ROUTE_DECODE_TOKENS a token group,
// ROUTE_DECODE_CHUNKS = ⌈hidden / 256⌉, ROUTE_DECODE_PER_LANE = ⌈E / 32⌉, ROUTE_DECODE_X_BYTES the staged rows
// (at least ROUTE_DECODE_TOKENS · hidden · 2 and the slots' ints). hidden % 8 == 0, 16-byte aligned rows,
// E + S <= GROUP_MAX_EXPERTS, k + S <= 32, k <= E (the caller checks).
// ---------------------------------------------------------------------------------------------
#ifndef ROUTE_DECODE_WARPS
#define ROUTE_DECODE_WARPS 4
#endif
#ifndef ROUTE_DECODE_TOKENS
#define ROUTE_DECODE_TOKENS 2
#endif
#ifndef ROUTE_DECODE_CHUNKS
#define ROUTE_DECODE_CHUNKS 28
#endif
#ifndef ROUTE_DECODE_PER_LANE
#define ROUTE_DECODE_PER_LANE 16
#endif
#ifndef ROUTE_DECODE_X_BYTES
#define ROUTE_DECODE_X_BYTES (ROUTE_DECODE_TOKENS * 7168 * 2)
#endif
#if ROUTE_DECODE_PER_LANE * 32 > GROUP_MAX_EXPERTS || ROUTE_DECODE_X_BYTES > 44 * 1024 || ROUTE_DECODE_X_BYTES % 16
#error "moe_route_decode: at most GROUP_MAX_EXPERTS experts, 44 KB of staged rows in whole 16-byte pieces"
#endif

// An order-preserving key of a choice: a > b as floats (not NaN) iff key(a) > key(b); -0 and +0 one key. 0 is below
// every float's key: "nothing left".
__device__ __forceinline__ unsigned choice_key(float v) {
    const unsigned bits = __float_as_uint(v + 0.f);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ unsigned warp_max_key(unsigned v) {
#ifdef MMA_HOST_STANDIN
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned other = (unsigned)__shfl_sync(0xffffffffu, (int)v, (threadIdx.x & 31) ^ o);
        v = other > v ? other : v;
    }
    return v;
#else
    unsigned out;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;\n" : "=r"(out) : "r"(v));
    return out;
#endif
}

__device__ __forceinline__ int warp_min_int(int v) {
#ifdef MMA_HOST_STANDIN
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_sync(0xffffffffu, v, (threadIdx.x & 31) ^ o));
    return v;
#else
    int out;
    asm volatile("redux.sync.min.s32 %0, %1, 0xffffffff;\n" : "=r"(out) : "r"(v));
    return out;
#endif
}

// The lane's logits of one token's `row` (logit[i] of expert lane + 32 i, -inf past the experts), written by other
// blocks of this grid: read from L2.
__device__ __forceinline__ void load_lane_logits(const float* row, int num_experts, float (&logit)[ROUTE_DECODE_PER_LANE]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < ROUTE_DECODE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        logit[i] = e < num_experts ? __ldcg(row + e) : -INFINITY;
    }
}

// One token's routing by the calling warp from its lane logits (load_lane_logits) and the lane's correction biases
// (bias_lane[i] of expert lane + 32 i, 0 without a bias), warp_route_token's results: lane j < k + S gets entry j
// (*id, *weight), other lanes *id = -1.
__device__ __forceinline__ void warp_route_token_keys(const float (&logit)[ROUTE_DECODE_PER_LANE],
                                                      const float (&bias_lane)[ROUTE_DECODE_PER_LANE],
                                                      int num_experts, int top_k, int scoring, int norm_topk,
                                                      float scaling, int* id, float* weight) {
    constexpr int R = ROUTE_DECODE_PER_LANE;
    const int lane = threadIdx.x & 31;
    float score[R];
    unsigned key[R];
#pragma unroll
    for (int i = 0; i < R; ++i) score[i] = logit[i];
    warp_route_scores(score, num_experts, scoring);
    // the lane's best remaining choice: highest key, lowest index on ties (i ascending, strictly greater)
    unsigned best_key = 0u;
    int best_index = 0x7fffffff;
    float best_score = 0.f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int e = lane + 32 * i;
        key[i] = e < num_experts ? choice_key(score[i] + bias_lane[i]) : 0u;  // warp_route_token's score + bias
        if (key[i] > best_key) {
            best_key = key[i];
            best_index = e;
            best_score = score[i];
        }
    }
    unsigned taken = 0u;  // bit i: this lane's expert lane + 32 i is picked
    int my_id = 0;
    float my_score = 0.f, total = 0.f;
    for (int j = 0; j < top_k; ++j) {
        const unsigned top = warp_max_key(best_key);
        const int arg = warp_min_int(best_key == top ? best_index : 0x7fffffff);
        const float picked = __int_as_float(__shfl_sync(0xffffffffu, __float_as_int(best_score), arg & 31));
        total += picked;  // in pick order, as warp_route_token
        if (lane == j) {
            my_id = arg;
            my_score = picked;
        }
        if ((arg & 31) == lane) {  // the owner: that choice gone, its next best (keys stay put: registers)
            taken |= 1u << (arg >> 5);
            best_key = 0u;
            best_index = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < R; ++i) {
                if (!((taken >> i) & 1u) && key[i] > best_key) {
                    best_key = key[i];
                    best_index = lane + 32 * i;
                    best_score = score[i];
                }
            }
        }
    }
    warp_route_entry(my_id, my_score, total, num_experts, top_k, norm_topk, scaling, id, weight);
}

// moe_route_decode's counter zeroed per call by a kernel node (a memset node may run on a copy engine: ~6 us of gap
// before each moe_route_decode in s13 D3's Moonlight trace).
extern "C" __global__ void __launch_bounds__(32) moe_route_decode_ticket(unsigned* done) {
    if (threadIdx.x == 0) *done = 0u;
}

extern "C" __global__ void __launch_bounds__(ROUTE_DECODE_WARPS * 32)
moe_route_decode(const bf16* __restrict__ x, const bf16* __restrict__ gate, int num_tokens, int hidden,
                 float* logits /* [T, E] scratch */, unsigned* done, const float* __restrict__ bias /* [E] or null */,
                 int num_experts, int top_k, int scoring, int norm_topk, float scaling, int* __restrict__ ids,
                 float* __restrict__ weights, int* __restrict__ offsets /* [E'+1] */, int* __restrict__ sorted_slots,
                 int* __restrict__ slot_pos, int* __restrict__ tile_expert, int* __restrict__ tile_row,
                 int* __restrict__ num_tiles, int max_tiles) {
    __shared__ __align__(16) unsigned char staged[ROUTE_DECODE_X_BYTES];  // x rows, then the slots' experts
    __shared__ int count[GROUP_MAX_EXPERTS];  // slots per expert, then each expert's next free row
    __shared__ int last;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row_width = top_k + ROUTE_SHARED_EXPERTS, grouped = num_experts + ROUTE_SHARED_EXPERTS;
    const int blocks_per_group = (num_experts + ROUTE_DECODE_WARPS - 1) / ROUTE_DECODE_WARPS;
    const int t0 = (blockIdx.x / blocks_per_group) * ROUTE_DECODE_TOKENS;
    const int e = (blockIdx.x % blocks_per_group) * ROUTE_DECODE_WARPS + warp;
    const int tokens = min(ROUTE_DECODE_TOKENS, num_tokens - t0);
    // the warp's router row, whole, in registers before anything waits
    const bf16* w = gate + (long long)min(e, num_experts - 1) * hidden;
    uint4 chunk[ROUTE_DECODE_CHUNKS];
#pragma unroll
    for (int c = 0; c < ROUTE_DECODE_CHUNKS; ++c) {
        const int i = (lane + 32 * c) * 8;
        if (i < hidden) chunk[c] = *reinterpret_cast<const uint4*>(w + i);
    }
    uint4* xs = reinterpret_cast<uint4*>(staged);
    const int pieces = hidden / 8;
    for (int p = tid; p < tokens * pieces; p += blockDim.x) {  // the group's x rows, every piece in flight at once
#ifdef MMA_HOST_STANDIN
        xs[p] = *reinterpret_cast<const uint4*>(x + (long long)t0 * hidden + (long long)p * 8);
#else
        cp_async16(reinterpret_cast<bf16*>(xs + p), x + (long long)t0 * hidden + (long long)p * 8, true);
#endif
    }
#ifndef MMA_HOST_STANDIN
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
#endif
    for (int g = tid; g < grouped; g += blockDim.x) count[g] = 0;  // used by the last block only
    float bias_lane[ROUTE_DECODE_PER_LANE];  // the top-k's biases, loaded with the router row (the last block's)
#pragma unroll
    for (int i = 0; i < ROUTE_DECODE_PER_LANE; ++i) {
        const int expert = lane + 32 * i;
        bias_lane[i] = bias && expert < num_experts ? bias[expert] : 0.f;
    }
    __syncthreads();
    if (e < num_experts) {
        float acc[ROUTE_DECODE_TOKENS];
#pragma unroll
        for (int t = 0; t < ROUTE_DECODE_TOKENS; ++t) acc[t] = 0.f;
#pragma unroll
        for (int c = 0; c < ROUTE_DECODE_CHUNKS; ++c) {
            const int i = (lane + 32 * c) * 8;
            if (i >= hidden) break;
            float b[8];
            const uint4 piece = chunk[c];
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&piece);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 f = __bfloat1622float2(h[j]);
                b[2 * j] = f.x;
                b[2 * j + 1] = f.y;
            }
#pragma unroll
            for (int t = 0; t < ROUTE_DECODE_TOKENS; ++t) {
                if (t < tokens) {
                    float a[8];
                    load8(reinterpret_cast<const bf16*>(xs + t * pieces) + i, a);
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[t] += a[j] * b[j];  // moe_router_logits' sum, in its order
                }
            }
        }
#pragma unroll
        for (int t = 0; t < ROUTE_DECODE_TOKENS; ++t) {
            const float v = warp_sum(acc[t]);
            if (t < tokens && lane == 0) logits[(long long)(t0 + t) * num_experts + e] = v;
        }
    }
    // the last block to get here routes the step: the others' logits are visible to it after their fences
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (tid == 0) *done = 0u;
    int* slot_expert = reinterpret_cast<int*>(staged);  // the staged rows are spent
    float next[ROUTE_DECODE_PER_LANE];  // the warp's next token's logits, in flight while it routes this one
    if (warp < num_tokens) load_lane_logits(logits + (long long)warp * num_experts, num_experts, next);
    for (int t = warp; t < num_tokens; t += ROUTE_DECODE_WARPS) {  // warp-uniform
        float logit[ROUTE_DECODE_PER_LANE];
#pragma unroll
        for (int i = 0; i < ROUTE_DECODE_PER_LANE; ++i) logit[i] = next[i];
        if (t + ROUTE_DECODE_WARPS < num_tokens)
            load_lane_logits(logits + (long long)(t + ROUTE_DECODE_WARPS) * num_experts, num_experts, next);
        int id;
        float weight;
        warp_route_token_keys(logit, bias_lane, num_experts, top_k, scoring, norm_topk, scaling, &id, &weight);
        if (lane < row_width) {
            ids[t * row_width + lane] = id;
            weights[t * row_width + lane] = weight;
            slot_expert[t * row_width + lane] = id;
            atomicAdd(&count[id], 1);
        }
    }
    __syncthreads();
    if (warp == 0) {  // experts' rows and tiles: lane l a run of experts, a warp scan of the runs, runs laid out
        const ExpertRun run = expert_run<GROUP_TILE_ROWS>(count, grouped, lane, 32);
        int rows_through = run.rows, tiles_through = run.tiles;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int r = __shfl_up_sync(0xffffffffu, rows_through, d), s = __shfl_up_sync(0xffffffffu, tiles_through, d);
            if (lane >= d) {
                rows_through += r;
                tiles_through += s;
            }
        }
        lay_out_expert_run<GROUP_TILE_ROWS>(run, rows_through - run.rows, tiles_through - run.tiles, count, offsets,
                                            tile_expert, tile_row, max_tiles);
        if (lane == 31) {
            offsets[grouped] = rows_through;
            *num_tiles = min(tiles_through, max_tiles);
        }
    }
    __syncthreads();
    place_slots(num_tokens * row_width, slot_expert, count, sorted_slots, slot_pos);
}

#ifndef MMA_HOST_STANDIN  // GPU only (the host emulation runs the routing and grouping kernels above)
// ---------------------------------------------------------------------------------------------
// moe_combine_vec8: moe_combine (out[t] = sum_j weights[t, j] y[slot_pos[t k + j]] (+ shared[t])) with
// 8 columns per thread: 16-byte loads of all k expert rows in flight before the sums (moe_combine: a
// 2-byte load per column and slot). The same sums in the same order: the same bits. Grid (T,
// ceil(hidden / 8 / blockDim)); needs hidden % 8 == 0 and 16-byte aligned y, shared and out.
// ---------------------------------------------------------------------------------------------
#define COMBINE_MAX_TOPK 16
extern "C" __global__ void __launch_bounds__(256)
moe_combine_vec8(const bf16* __restrict__ y, const int* __restrict__ slot_pos, const float* __restrict__ weights,
                 const bf16* __restrict__ shared, int top_k, int hidden, bf16* __restrict__ out) {
    const int t = blockIdx.x, c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c >= hidden) return;
    uint4 rows[COMBINE_MAX_TOPK];
#pragma unroll
    for (int j = 0; j < COMBINE_MAX_TOPK; ++j)
        if (j < top_k) rows[j] = *reinterpret_cast<const uint4*>(y + (long long)slot_pos[t * top_k + j] * hidden + c);
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < COMBINE_MAX_TOPK; ++j) {
        if (j >= top_k) break;
        const float w = weights[t * top_k + j];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&rows[j]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 v = __bfloat1622float2(h[i]);
            sum[2 * i] += w * v.x;
            sum[2 * i + 1] += w * v.y;
        }
    }
    if (shared) {
        float s[8];
        load8(shared + (long long)t * hidden + c, s);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[i] = round_bf16(sum[i]) + s[i];
    }
    store8(out + (long long)t * hidden + c, sum);
}

// ---------------------------------------------------------------------------------------------
// moe_l2_prefetch: pull up to two byte ranges of weights (a MoE layer's shared experts, routed every
// token) into L2 while the layer's attention runs (latency-bound: HBM mostly idle), so the expert GEMM
// later finds them there. Nothing is written: a hint only, any outcome is correct. Hopper: TMA bulk
// prefetches of PREFETCH_CHUNK bytes, one per thread and chunk; older GPUs: one prefetch per 128-byte
// line. evict_last (L2 eviction priority "last") keeps the lines past the routed experts' stream, which
// the GEMM reads before the shared experts (their slots come last in expert order). Grid-stride over
// the chunks; needs 16-byte aligned ranges (a tail under 16 bytes is left out).
// ---------------------------------------------------------------------------------------------
#define PREFETCH_CHUNK 16384
extern "C" __global__ void __launch_bounds__(128)
moe_l2_prefetch(const char* __restrict__ first, long long first_bytes, const char* __restrict__ second,
                long long second_bytes, int evict_last) {
    const long long first_chunks = (first_bytes + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK;
    const long long chunks = first_chunks + (second_bytes + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < chunks;
         i += (long long)gridDim.x * blockDim.x) {
        const bool in_first = i < first_chunks;
        const long long offset = (in_first ? i : i - first_chunks) * PREFETCH_CHUNK;
        const char* p = (in_first ? first : second) + offset;
        const long long left = (in_first ? first_bytes : second_bytes) - offset;
        const unsigned size = (unsigned)(left < PREFETCH_CHUNK ? left : PREFETCH_CHUNK) & ~15u;
        if (size == 0) continue;
#if __CUDA_ARCH__ >= 900
        unsigned long long policy;
        if (evict_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
        else asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;\n"
                     ::"l"(p), "r"(size), "l"(policy) : "memory");
#elif __CUDA_ARCH__ >= 800
        for (unsigned b = 0; b < size; b += 128) {
            if (evict_last) asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(p + b));
            else asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + b));
        }
#endif
    }
}
#endif
