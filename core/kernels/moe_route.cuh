// One token's expert choice from its router logits, the body of moe.cu's moe_route (route_score is
// shared with moe_routing.cu's warp router): scores (SCORING 0 softmax, 1 sigmoid, 2 sqrt(softplus));
// choice = score + bias; group-limited top-k (group score: sum of the best two, or the best one
// when group_score_max); weights = chosen scores, renormalised (norm_topk) and scaled. Every
// thread of the block calls it; the caller has filled shared.score with the logits and synced.
#pragma once
#include "common.cuh"

#ifndef MAX_TOPK
#define MAX_TOPK 16
#endif
#ifndef MAX_EXPERTS
#define MAX_EXPERTS 512
#endif

struct RouteShared {
    float score[MAX_EXPERTS];   // logits in, scores out
    float choice[MAX_EXPERTS];
    float scratch[32];
    float group_value[64];
    int chosen[MAX_TOPK];
};

// One expert's routing score from its logit: softmax's numerator exp(l - max) (the caller divides by the
// sum), sigmoid, or sqrt(softplus) (SCORING 0 / 1 / 2). Shared by route_token and moe_routing.cu's warp router.
__device__ __forceinline__ float route_score(float logit, float logit_max, int scoring) {
    if (scoring == 0) return __expf(logit - logit_max);
    if (scoring == 1) return 1.f / (1.f + __expf(-logit));
    return sqrtf(logit > 20.f ? logit : log1pf(__expf(logit)));
}

// hash_experts: the token's row of a tid2eid table (its k experts), or null (top-k by choice).
// Writes ids[0..k) and weights[0..k) (thread 0).
__device__ __forceinline__ void route_token(RouteShared& shared, const float* __restrict__ bias, int num_experts,
                                            int top_k, int scoring, int num_groups, int topk_groups,
                                            int group_score_max, int norm_topk, float scaling,
                                            const long long* __restrict__ hash_experts, int* __restrict__ ids,
                                            float* __restrict__ weights) {
    float* score = shared.score;
    float* choice = shared.choice;
    float* scratch = shared.scratch;
    float* group_value = shared.group_value;
    int* chosen = shared.chosen;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float local_max = -INFINITY;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) local_max = fmaxf(local_max, score[e]);
    const float logit_max = block_max(local_max, scratch);
    float local_sum = 0.f;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        const float s = route_score(score[e], logit_max, scoring);
        if (scoring == 0) local_sum += s;
        score[e] = s;
    }
    if (scoring == 0) {
        const float total = block_sum(local_sum, scratch);
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) score[e] /= total;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) choice[e] = score[e] + (bias ? bias[e] : 0.f);
    __syncthreads();
    if (num_groups > 1) {
        const int per_group = num_experts / num_groups;
        if (threadIdx.x < num_groups) {
            float best = -INFINITY, second = -INFINITY;
            for (int i = 0; i < per_group; ++i) {
                const float v = choice[threadIdx.x * per_group + i];
                if (v > best) { second = best; best = v; } else if (v > second) { second = v; }
            }
            group_value[threadIdx.x] = group_score_max ? best : best + second;
        }
        __syncthreads();
        if (threadIdx.x == 0) {  // keep the topk_groups best groups: mark the rest with -inf
            for (int kept = 0; kept < topk_groups; ++kept) {
                int arg = -1;
                float best = -INFINITY;
                for (int g = 0; g < num_groups; ++g)
                    if (group_value[g] != INFINITY && (arg < 0 || group_value[g] > best)) { best = group_value[g]; arg = g; }
                group_value[arg] = INFINITY;  // taken
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
            if (group_value[e / per_group] != INFINITY) choice[e] = -INFINITY;
        __syncthreads();
    }
    if (warp == 0) {  // top-k by repeated argmax over the warp (k ≤ 16), or the hash table's experts
        // bit m: this lane's expert lane + 32·m is taken (MAX_EXPERTS / 32 bits; a register, where a
        // list of the picks, scanned per expert, lived in local memory)
        unsigned taken = 0u;
        for (int j = 0; j < top_k; ++j) {
            int arg = -1;
            if (hash_experts) {
                arg = (int)hash_experts[j];
            } else {
                // each lane's best untaken expert (lowest index on ties), then the warp's
                float best = -INFINITY;
                for (int e = lane, m = 0; e < num_experts; e += 32, ++m) {
                    if (!((taken >> m) & 1u) && (arg < 0 || choice[e] > best)) {
                        best = choice[e];
                        arg = e;
                    }
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const float other_best = __shfl_xor_sync(0xffffffffu, best, o);
                    const int other_arg = (int)__shfl_xor_sync(0xffffffffu, (float)arg, o);  // exact below 2^24
                    if (other_arg >= 0 && (arg < 0 || other_best > best || (other_best == best && other_arg < arg))) {
                        best = other_best;
                        arg = other_arg;
                    }
                }
            }
            // every lane ends each round with the same pick: no warp sync needed
            if (arg >= 0 && (arg & 31) == lane) taken |= 1u << (arg >> 5);
            if (lane == 0) chosen[j] = arg;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int j = 0; j < top_k; ++j) total += score[chosen[j]];
        const float norm = norm_topk ? 1.f / (total + 1e-20f) : 1.f;
        for (int j = 0; j < top_k; ++j) {
            ids[j] = chosen[j];
            weights[j] = score[chosen[j]] * norm * scaling;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The grouping's layout steps, shared by moe.cu's moe_sort_parallel and moe_routing.cu's moe_route_sort and
// moe_route_decode: each part of `parts` (a thread, a lane) takes a run of consecutive experts [first, last) of the
// `grouped` ones and counts its rows and TILE_ROWS-row GEMM tiles (expert_run); the caller's scan over the parts gives
// the rows and tiles before each run, which is laid out in order (lay_out_expert_run: offsets, the tile list, then
// count[e] = e's first row); after a barrier every slot is placed by an atomic on its expert's next row (place_slots:
// each expert's slots in the order the atomics hand out).
// ---------------------------------------------------------------------------------------------
struct ExpertRun {
    int first, last, rows, tiles;
};

template <int TILE_ROWS>
__device__ __forceinline__ ExpertRun expert_run(const int* count, int grouped, int part, int parts) {
    const int per_part = (grouped + parts - 1) / parts;
    ExpertRun run;
    run.first = min(grouped, part * per_part);
    run.last = min(grouped, run.first + per_part);
    run.rows = 0;
    run.tiles = 0;
    for (int e = run.first; e < run.last; ++e) {
        run.rows += count[e];
        run.tiles += (count[e] + TILE_ROWS - 1) / TILE_ROWS;
    }
    return run;
}

// `row_before` / `tile_before`: the rows and tiles of the runs before this one; tiles past `max_tiles` not written.
template <int TILE_ROWS>
__device__ __forceinline__ void lay_out_expert_run(const ExpertRun& run, int row_before, int tile_before, int* count,
                                                   int* __restrict__ offsets, int* __restrict__ tile_expert,
                                                   int* __restrict__ tile_row, int max_tiles) {
    for (int e = run.first; e < run.last; ++e) {
        const int expert_rows = count[e];
        offsets[e] = row_before;
        for (int r = 0; r < expert_rows; r += TILE_ROWS, ++tile_before)
            if (tile_before < max_tiles) {
                tile_expert[tile_before] = e;
                tile_row[tile_before] = row_before + r;
            }
        count[e] = row_before;
        row_before += expert_rows;
    }
}

// After lay_out_expert_run and a barrier: slot i (expert slot_expert[i]) to its row, by the block's threads.
__device__ __forceinline__ void place_slots(int num_slots, const int* slot_expert, int* count,
                                            int* __restrict__ sorted_slots, int* __restrict__ slot_pos) {
    for (int i = threadIdx.x; i < num_slots; i += blockDim.x) {
        const int p = atomicAdd(&count[slot_expert[i]], 1);
        sorted_slots[p] = i;
        slot_pos[i] = p;
    }
}
