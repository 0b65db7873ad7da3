// A decode step's MoE routing in one launch (a few tokens): router logits, scores and top-k, and
// the grouping by expert, where moe.cu runs moe_router_logits, moe_route and moe_sort_parallel one
// after the other (three launches: at batch 1 each is mostly its own launch and ramp).
//
//   grid (E): block e computes expert e's logits for every token (its 256 threads split the hidden
//             row, 16-byte loads, a block sum) into logits [T, E], then counts itself in `arrival`;
//   the last block to arrive: each token's route_token (moe_route's body, same ids and weights),
//             then the grouping (moe_sort_parallel's offsets / tiles; slots placed in slot order,
//             where moe_sort_parallel takes the order its atomics hand out: rows are independent,
//             so the values do not depend on it), and resets `arrival` to 0 for the next launch.
//
// `arrival` is one int per device, zero between launches; two launches must not run concurrently
// (a layer's routing runs on the main stream, one after another). At most DECODE_ROUTE_MAX_TOKENS
// tokens (the caller checks) and MAX_EXPERTS experts; hidden % 8 == 0, 16-byte aligned rows.
#include "moe_route.cuh"

#define DECODE_ROUTE_THREADS 256
#define DECODE_ROUTE_MAX_TOKENS 8
#ifndef TILE_ROWS
#define TILE_ROWS 64  // moe.cu BM: rows of one expert per GEMM tile
#endif

extern "C" __global__ void __launch_bounds__(DECODE_ROUTE_THREADS)
moe_route_decode(const bf16* __restrict__ x, const bf16* __restrict__ gate, int num_tokens, int hidden,
                 int num_experts, const float* __restrict__ bias /* [E] or null */, int top_k, int scoring,
                 int num_groups, int topk_groups, int group_score_max, int norm_topk, float scaling,
                 float* __restrict__ logits /* [T, E] scratch */, unsigned* __restrict__ arrival,
                 int* __restrict__ ids, float* __restrict__ weights, int* __restrict__ offsets /* [E+1] */,
                 int* __restrict__ sorted_slots, int* __restrict__ slot_pos, int* __restrict__ tile_expert,
                 int* __restrict__ tile_row, int* __restrict__ num_tiles, int max_tiles) {
    __shared__ RouteShared shared;
    __shared__ float partial[DECODE_ROUTE_MAX_TOKENS][DECODE_ROUTE_THREADS / 32];
    __shared__ int count[MAX_EXPERTS];
    __shared__ int is_last;
    const int e = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // 1. expert e's logits: thread tid takes the 8-value pieces tid, tid + 256, ... of the row
    float acc[DECODE_ROUTE_MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < DECODE_ROUTE_MAX_TOKENS; ++t) acc[t] = 0.f;
    const bf16* w = gate + (long long)e * hidden;
    for (int i = tid * 8; i < hidden; i += DECODE_ROUTE_THREADS * 8) {
        float b[8];
        load8(w + i, b);
#pragma unroll
        for (int t = 0; t < DECODE_ROUTE_MAX_TOKENS; ++t) {
            if (t >= num_tokens) break;
            float a[8];
            load8(x + (long long)t * hidden + i, a);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[t] += a[j] * b[j];
        }
    }
#pragma unroll
    for (int t = 0; t < DECODE_ROUTE_MAX_TOKENS; ++t) {
        if (t >= num_tokens) break;
        const float sum = warp_sum(acc[t]);
        if (lane == 0) partial[t][warp] = sum;
    }
    __syncthreads();
    if (tid < num_tokens) {
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < DECODE_ROUTE_THREADS / 32; ++v) sum += partial[tid][v];
        logits[(long long)tid * num_experts + e] = sum;
    }
    // 2. the last block to arrive routes: every block's logits are visible to it (fence, then count)
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(arrival, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int t = 0; t < num_tokens; ++t) {
        for (int i = tid; i < num_experts; i += blockDim.x)
            shared.score[i] = __ldcg(logits + (long long)t * num_experts + i);  // L2: other blocks' stores
        __syncthreads();
        route_token(shared, bias, num_experts, top_k, scoring, num_groups, topk_groups, group_score_max, norm_topk,
                    scaling, nullptr, ids + t * top_k, weights + t * top_k);
        __syncthreads();  // thread 0 wrote ids; shared is reused by the next token
    }
    // 3. grouping: rows per expert; each thread a run of consecutive experts, a block scan of (rows,
    // tiles) gives each its offset and first tile (moe_sort_parallel's layout); slots in slot order
    const int num_slots = num_tokens * top_k;
    for (int i = tid; i < num_experts; i += blockDim.x) count[i] = 0;
    __syncthreads();
    for (int s = tid; s < num_slots; s += blockDim.x) atomicAdd(&count[__ldcg(ids + s)], 1);
    __syncthreads();
    const int per_thread = (num_experts + DECODE_ROUTE_THREADS - 1) / DECODE_ROUTE_THREADS;
    const int first = min(num_experts, tid * per_thread), last = min(num_experts, first + per_thread);
    int rows = 0, tiles = 0;
    for (int i = first; i < last; ++i) {
        rows += count[i];
        tiles += (count[i] + TILE_ROWS - 1) / TILE_ROWS;
    }
    int rows_before = rows, tiles_before = tiles;  // inclusive scans within the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int r = __shfl_up_sync(0xffffffffu, rows_before, o), t = __shfl_up_sync(0xffffffffu, tiles_before, o);
        if (lane >= o) {
            rows_before += r;
            tiles_before += t;
        }
    }
    __shared__ int warp_rows[DECODE_ROUTE_THREADS / 32], warp_tiles[DECODE_ROUTE_THREADS / 32];
    if (lane == 31) {
        warp_rows[warp] = rows_before;
        warp_tiles[warp] = tiles_before;
    }
    __syncthreads();
    int row = rows_before - rows, tile = tiles_before - tiles;  // exclusive, then plus the warps before
    for (int v = 0; v < warp; ++v) {
        row += warp_rows[v];
        tile += warp_tiles[v];
    }
    if (tid == DECODE_ROUTE_THREADS - 1) {
        offsets[num_experts] = row + rows;
        *num_tiles = min(tile + tiles, max_tiles);
    }
    for (int i = first; i < last; ++i) {
        const int n = count[i];
        offsets[i] = row;
        for (int r = 0; r < n; r += TILE_ROWS, ++tile)
            if (tile < max_tiles) {
                tile_expert[tile] = i;
                tile_row[tile] = row + r;
            }
        count[i] = row;  // the expert's first row
        row += n;
    }
    __syncthreads();
    for (int s = tid; s < num_slots; s += blockDim.x) {  // after the slots of its expert before it
        const int expert = __ldcg(ids + s);
        int p = count[expert];
        for (int before = 0; before < s; ++before) p += __ldcg(ids + before) == expert;
        sorted_slots[p] = s;
        slot_pos[s] = p;
    }
    if (tid == 0) *arrival = 0u;  // ready for the next launch (stream order makes it visible to it)
}
