// DeepSeek-V4 on the GPU: the compressor's pooling, the indexer's scores and top-k, sparse
// attention over the sliding window + compressed entries with sinks, the mHC collapse/expand,
// and FP4 / FP8 weight GEMMs with in-kernel dequantisation. Each kernel mirrors one NumPy op of
// the plugin (named in its comment), which is the reference the tests compare against.
//
// Activations and caches are bf16, math is fp32, the mHC residual streams stay fp32. Layouts:
//   caches        [rows, D] bf16, row = block_table[seq][i / block_size] * block_size + i % block_size
//                 (i = token position for the sliding window, entry index for compressed caches)
//   block_tables  [B, table_stride] int32;  token_seq [T] sequence of each token;  positions [T]
//   RoPE          interleaved pairs (2i, 2i+1) on the last rope_dim channels, angle = pos · inv_freq[i]
// Every kernel is launched with blockDim.x = a power of two ≤ 1024 (the launchers use 128 or 256).
// bf16, warp_sum and block_sum come from core's common.cuh (the loader puts
// openinfer.backend.cuda.kernel_include_dir() on the include path).
#include "common.cuh"

#define NEG_BIG (-3.0e38f)  // an empty slot / masked logit: exp() of it minus anything is 0
#define MAX_DIM 1024        // head_dim, index head_dim and mHC hidden size handled per block
#define MAX_INDEX_QK 8192   // index heads × index head_dim kept in shared memory
#define MAX_MIX 32          // mHC mixing logits: (2 + hc) · hc ≤ 24 for hc = 4
#define MAX_HC 8

__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + __expf(-x)); }

// RoPE (inverse: sin negated) of channel c of a head held in shared `v`, rope on the last rd.
__device__ __forceinline__ float rotated(const float* v, int c, int dim, int rd, float position,
                                         const float* inv_freq, float sign) {
    const int base = dim - rd;
    if (c < base) return v[c];
    const int offset = c - base;
    const float angle = position * inv_freq[offset >> 1];
    const float cs = cosf(angle), sn = sign * sinf(angle);
    return (offset & 1) ? v[c] * cs + v[c - 1] * sn : v[c] * cs - v[c + 1] * sn;
}

__device__ __forceinline__ long long cache_row(const int* tables, int stride, int seq, int index, int block_size) {
    return (long long)tables[(long long)seq * stride + index / block_size] * block_size + index % block_size;
}

// --- compressor: attention.pool_entries ----------------------------------------------------------
// One block per entry: per channel softmax over the S slots of gate (NEG_BIG = empty), weighted
// sum of kv, RMSNorm × weight, RoPE at positions[w], written to cache row dest[w].
extern "C" __global__ void dsv4_compress_entries(
    const float* __restrict__ slot_kv, const float* __restrict__ slot_gate,  // [W, S, d]
    const float* __restrict__ norm_weight, const float* __restrict__ inv_freq,
    const int* __restrict__ positions, const long long* __restrict__ dest, bf16* __restrict__ cache,
    int num_slots, int dim, int rope_dim, float eps) {
    __shared__ float pooled[MAX_DIM];
    __shared__ float scratch[32];  // block_sum's one slot per warp
    const int w = blockIdx.x;
    float sumsq = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        const float* gate = slot_gate + (long long)w * num_slots * dim + c;
        const float* kv = slot_kv + (long long)w * num_slots * dim + c;
        float peak = NEG_BIG;
        for (int s = 0; s < num_slots; ++s) peak = fmaxf(peak, gate[s * dim]);
        float den = 0.f, num = 0.f;
        for (int s = 0; s < num_slots; ++s) {
            const float e = __expf(gate[s * dim] - peak);
            den += e;
            num += e * kv[s * dim];
        }
        pooled[c] = num / den;
        sumsq += pooled[c] * pooled[c];
    }
    const float inv_rms = rsqrtf(block_sum(sumsq, scratch) / dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) pooled[c] *= inv_rms * norm_weight[c];
    __syncthreads();
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        cache[dest[w] * dim + c] = to_bf(rotated(pooled, c, dim, rope_dim, (float)positions[w], inv_freq, 1.f));
}

// --- indexer scores: attention.index_scores ------------------------------------------------------
// grid (T, ⌈max_entries / entries_per_block⌉). scores[t, s] = Σ_h w[t, h]·relu(q[t, h]·k[s]) for
// the visible entries s < (pos + 1) / rate; NEG_BIG beyond. The token's q sits in shared memory
// transposed ([dim][heads + 1]: the lanes of a warp, one head each, read consecutive words; the
// pad word keeps the transposing stores of consecutive channels off one bank), keys
// come in chunks of INDEX_KEY_FLOATS; each warp scores its own keys of a chunk (no block barrier
// per key), lanes splitting the heads, one warp reduction per key.
#define INDEX_KEY_FLOATS 2048
#define MAX_INDEX_HEADS 256
extern "C" __global__ void dsv4_indexer_scores(
    const bf16* __restrict__ q,            // [T, heads, dim] (RoPE applied)
    const float* __restrict__ head_weights, // [T, heads] (scales folded in)
    const bf16* __restrict__ keys, const int* __restrict__ tables, int table_stride, int block_size,
    const int* __restrict__ token_seq, const int* __restrict__ positions, int rate,
    float* __restrict__ scores, int heads, int dim, int max_entries, int entries_per_block) {
    __shared__ float q_t[MAX_INDEX_QK + MAX_DIM];  // [dim][heads + 1]
    __shared__ float weight[MAX_INDEX_HEADS];
    __shared__ float key_chunk[INDEX_KEY_FLOATS];
    const int t = blockIdx.x, seq = token_seq[t], lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5, visible = (positions[t] + 1) / rate, q_stride = heads + 1;
    const int first = blockIdx.y * entries_per_block, last = min(first + entries_per_block, max_entries);
    if (first >= visible) {  // block-uniform: a captured graph sizes the grid for max_model_len, not this context
        for (int s = first + threadIdx.x; s < last; s += blockDim.x) scores[(long long)t * max_entries + s] = NEG_BIG;
        return;
    }
    for (int i = threadIdx.x; i < heads * dim; i += blockDim.x)
        q_t[(i % dim) * q_stride + i / dim] = to_f(q[(long long)t * heads * dim + i]);
    for (int h = threadIdx.x; h < heads; h += blockDim.x) weight[h] = head_weights[(long long)t * heads + h];
    const int chunk = INDEX_KEY_FLOATS / dim;
    for (int s0 = first; s0 < last; s0 += chunk) {
        const int count = min(chunk, last - s0);
        __syncthreads();  // q_t is loaded; the previous chunk is no longer read
        for (int k = warp; k < count; k += num_warps) {
            if (s0 + k >= visible) continue;  // warp-uniform
            const long long row = cache_row(tables, table_stride, seq, s0 + k, block_size);
            for (int c = lane; c < dim; c += 32) key_chunk[k * dim + c] = to_f(keys[row * dim + c]);
        }
        __syncthreads();
        for (int k = warp; k < count; k += num_warps) {
            const int s = s0 + k;
            float part = 0.f;
            if (s < visible) {  // warp-uniform
                for (int h = lane; h < heads; h += 32) {
                    float dot = 0.f;
                    for (int c = 0; c < dim; ++c) dot += q_t[c * q_stride + h] * key_chunk[k * dim + c];
                    part += fmaxf(dot, 0.f) * weight[h];
                }
            }
            const float total = warp_sum(part);
            if (lane == 0) scores[(long long)t * max_entries + s] = s < visible ? total : NEG_BIG;
        }
    }
}

// --- top-k: attention.top_k_visible --------------------------------------------------------------
// One block per query: the k best of its visible entries (radix select on order-preserving
// keys, 8 bits a pass), written unordered to selected[t, :k]; -1 fills the rest.
__device__ __forceinline__ unsigned order_key(float x) {
    const unsigned u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

extern "C" __global__ void dsv4_topk(const float* __restrict__ scores, const int* __restrict__ positions,
                                     int rate, int max_entries, int k, int* __restrict__ selected) {
    __shared__ int histogram[256];
    __shared__ unsigned prefix_shared;
    __shared__ int wanted_shared, above_count, equal_count;
    const int t = blockIdx.x;
    const int visible = min(max_entries, (positions[t] + 1) / rate);
    const float* row = scores + (long long)t * max_entries;
    int* out = selected + (long long)t * k;
    if (visible <= k) {
        for (int i = threadIdx.x; i < k; i += blockDim.x) out[i] = i < visible ? i : -1;
        return;
    }
    if (threadIdx.x == 0) { prefix_shared = 0u; wanted_shared = k; above_count = 0; equal_count = 0; }
    unsigned mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0;
        __syncthreads();
        const unsigned prefix = prefix_shared;
        for (int i = threadIdx.x; i < visible; i += blockDim.x) {
            const unsigned key = order_key(row[i]);
            if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {  // the bin holding the wanted-th largest of the survivors
            int above = 0, bin = 255;
            for (; bin > 0 && above + histogram[bin] < wanted_shared; --bin) above += histogram[bin];
            wanted_shared -= above;
            prefix_shared = prefix | ((unsigned)bin << shift);
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    const unsigned threshold = prefix_shared;  // the k-th largest key; take wanted_shared of its ties
    const int ties = wanted_shared;
    for (int i = threadIdx.x; i < visible; i += blockDim.x) {
        const unsigned key = order_key(row[i]);
        if (key > threshold) out[atomicAdd(&above_count, 1)] = i;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < visible; i += blockDim.x) {
        if (order_key(row[i]) == threshold) {
            const int slot = atomicAdd(&equal_count, 1);
            if (slot < ties) out[k - ties + slot] = i;
        }
    }
}

// --- sparse attention: attention.attend ----------------------------------------------------------
// grid (T, ⌈heads / warps⌉): one warp per head, the block's heads sharing every key (K = V is one
// head for all of them), so a key row is read once per block from memory. Keys = values: the
// window positions max(0, p-W+1)..p of the sliding cache, then compressed entries e < (p+1)/rate
// — the indexer's picks (selected[t, :num_selected], -1 skipped) for CSA, all of them for HCA
// (selected == nullptr), none without entry_cache. Keys come in chunks through shared memory;
// each warp runs its head's online softmax over them, seeded with the head's sink (it only
// enlarges the denominator); lane l holds channels l + 32j. Then RoPE⁻¹ at p, the (2i, 2i+1)
// partner channel one lane over. dim must be a multiple of 32.
// Split over keys (few tokens: too few blocks to fill the GPU): grid.z = splits, block z takes
// the z-th of splits equal runs of the token's keys (the sink in run 0 only) and writes its
// (peak, denominator, unnormalised acc[dim]) to `partial` [T, heads, splits, dim + 2];
// dsv4_attention_combine merges the runs and writes the output. partial == nullptr: one run,
// written directly.
#define MAX_PER_LANE (MAX_DIM / 32)
#define KEY_CHUNK_ELEMENTS 16384  // bf16 key rows in shared memory per chunk (32 KB)
#define MAX_KEY_CHUNK 512

__device__ __forceinline__ float shuffle_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

// 16 bytes of a key row into shared memory by cp.async (sm_80+): a thread's copies are all in
// flight at once, no registers held. A plain load + store waited out the memory latency once per
// piece, which with the few warps per SM of a batch-1 step was most of the kernel's time.
// The host emulation (no __CUDA_ARCH__) copies directly.
__device__ __forceinline__ void stage_key_piece(bf16* smem, const bf16* gmem) {
#ifdef __CUDA_ARCH__
    const unsigned address = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(gmem));
#else
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}

__device__ __forceinline__ void wait_key_pieces() {  // this thread's copies have landed
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// One head's normalised output (lane l: channels l + 32j) with RoPE⁻¹ at p, to bf16. LANE_VALUES:
// the per-lane count the arrays hold (MAX_PER_LANE, or exactly dim / 32 in a specialised kernel).
template <int LANE_VALUES = MAX_PER_LANE>
__device__ __forceinline__ void write_head(const float* acc, float denom, int per, int lane, int p,
                                           const float* __restrict__ inv_freq, int rope_dim, int dim, bf16* oh) {
    const int base = dim - rope_dim;
#pragma unroll
    for (int j = 0; j < LANE_VALUES; ++j) {
        if (j >= per) continue;  // uniform: every lane has the same per
        const int c = lane + 32 * j;
        const float v = acc[j] / denom;
        const float partner = shuffle_xor(v, 1);  // channel c ^ 1 (c and lane share their parity)
        float o = v;
        if (c >= base) {  // RoPE⁻¹: (even, odd) ← (e·cos + o·sin, o·cos − e·sin)
            const float angle = (float)p * inv_freq[(c - base) >> 1];
            const float cs = cosf(angle), sn = sinf(angle);
            o = (c & 1) ? v * cs - partner * sn : v * cs + partner * sn;
        }
        oh[c] = to_bf(o);
    }
}

// LANE_VALUES: the channels a lane holds, dim / 32 — MAX_PER_LANE for any dim (loops guarded by
// the runtime count: at head_dim 512 half their iterations are predicated off, and the arrays
// spill to local memory) or exactly dim / 32 (dsv4_sparse_attention_d512: no guards, registers).
template <int LANE_VALUES>
__device__ __forceinline__ void sparse_attention(
    const bf16* __restrict__ q,  // [T, heads, dim]
    const bf16* __restrict__ window_cache, const int* __restrict__ window_tables, int window_stride,
    const bf16* __restrict__ entry_cache, const int* __restrict__ entry_tables, int entry_stride,
    const int* __restrict__ selected, int num_selected, int rate,
    const int* __restrict__ token_seq, const int* __restrict__ positions, const float* __restrict__ sinks,
    const float* __restrict__ inv_freq, int rope_dim, bf16* __restrict__ out,
    int heads, int dim, int window, int block_size, float scale, float* __restrict__ partial) {
    __shared__ __align__(16) bf16 key_chunk[KEY_CHUNK_ELEMENTS];
    __shared__ long long key_rows[MAX_KEY_CHUNK];
    const int t = blockIdx.x, seq = token_seq[t], p = positions[t];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    const int per = LANE_VALUES == MAX_PER_LANE ? dim >> 5 : LANE_VALUES;
    const int h = blockIdx.y * num_warps + warp;
    const bool active = h < heads;  // warp-uniform; idle warps still load keys and meet the barriers
    float qr[LANE_VALUES], acc[LANE_VALUES];
#pragma unroll
    for (int j = 0; j < LANE_VALUES; ++j) {
        qr[j] = active && j < per ? to_f(q[((long long)t * heads + h) * dim + lane + 32 * j]) : 0.f;
        acc[j] = 0.f;
    }
    const int split = blockIdx.z, splits = gridDim.z;
    // exp(sink − peak) = 1 in run 0; the other runs start empty (exp(NEG_BIG − anything) = 0)
    float peak = split == 0 ? (active ? sinks[h] : 0.f) : NEG_BIG, denom = split == 0 ? 1.f : 0.f;
    const int lo = max(0, p - window + 1), window_keys = p - lo + 1;
    const int visible = entry_cache != nullptr ? (p + 1) / rate : 0;
    const int total = window_keys + (entry_cache == nullptr ? 0 : (selected != nullptr ? num_selected : visible));
    const int run = (total + splits - 1) / splits, first = min(total, split * run), last = min(total, first + run);
    const int chunk = min(MAX_KEY_CHUNK, KEY_CHUNK_ELEMENTS / dim);
    for (int k0 = first; k0 < last; k0 += chunk) {
        const int count = min(chunk, last - k0);
        __syncthreads();  // the previous chunk is no longer read
        for (int k = threadIdx.x; k < count; k += blockDim.x) {
            const int key = k0 + k;
            long long row = -1;
            if (key < window_keys) {
                row = cache_row(window_tables, window_stride, seq, lo + key, block_size);
            } else {
                const int j = key - window_keys;
                const int e = selected != nullptr ? selected[(long long)t * num_selected + j] : j;
                if (e >= 0 && e < visible) row = -2 - cache_row(entry_tables, entry_stride, seq, e, block_size);
            }
            key_rows[k] = row;  // ≥ 0: a window row; ≤ −2: entry row −2 − r; −1: skipped
        }
        __syncthreads();
        for (int i = threadIdx.x; i < count * (dim / 8); i += blockDim.x) {  // 8 bf16 per 16-byte copy
            const int k = i / (dim / 8), c = (i % (dim / 8)) * 8;
            const long long row = key_rows[k];
            if (row == -1) continue;
            const bf16* src = row >= 0 ? window_cache + row * dim : entry_cache + (-2 - row) * dim;
            stage_key_piece(&key_chunk[k * dim + c], src + c);
        }
        wait_key_pieces();
        __syncthreads();
        if (!active) continue;
        for (int k = 0; k < count; ++k) {
            if (key_rows[k] == -1) continue;  // warp-uniform
            float part = 0.f;
#pragma unroll
            for (int j = 0; j < LANE_VALUES; ++j)
                if (j < per) part += qr[j] * to_f(key_chunk[k * dim + lane + 32 * j]);
            const float logit = warp_sum(part) * scale;
            const float new_peak = fmaxf(peak, logit);
            const float correction = __expf(peak - new_peak), weight = __expf(logit - new_peak);
            denom = denom * correction + weight;
#pragma unroll
            for (int j = 0; j < LANE_VALUES; ++j)
                if (j < per) acc[j] = acc[j] * correction + weight * to_f(key_chunk[k * dim + lane + 32 * j]);
            peak = new_peak;
        }
    }
    if (!active) return;
    if (partial != nullptr) {
        float* run_out = partial + (((long long)t * heads + h) * splits + split) * (dim + 2);
        if (lane == 0) {
            run_out[0] = peak;
            run_out[1] = denom;
        }
#pragma unroll
        for (int j = 0; j < LANE_VALUES; ++j)
            if (j < per) run_out[2 + lane + 32 * j] = acc[j];
        return;
    }
    write_head<LANE_VALUES>(acc, denom, per, lane, p, inv_freq, rope_dim, dim, out + ((long long)t * heads + h) * dim);
}

#define SPARSE_ATTENTION_ARGS                                                                               \
    const bf16 *__restrict__ q, const bf16 *__restrict__ window_cache, const int *__restrict__ window_tables,  \
        int window_stride, const bf16 *__restrict__ entry_cache, const int *__restrict__ entry_tables,       \
        int entry_stride, const int *__restrict__ selected, int num_selected, int rate,                      \
        const int *__restrict__ token_seq, const int *__restrict__ positions, const float *__restrict__ sinks, \
        const float *__restrict__ inv_freq, int rope_dim, bf16 *__restrict__ out, int heads, int dim, int window, \
        int block_size, float scale, float *__restrict__ partial
#define SPARSE_ATTENTION_CALL                                                                                 \
    q, window_cache, window_tables, window_stride, entry_cache, entry_tables, entry_stride, selected,         \
        num_selected, rate, token_seq, positions, sinks, inv_freq, rope_dim, out, heads, dim, window, block_size, \
        scale, partial

extern "C" __global__ void dsv4_sparse_attention(SPARSE_ATTENTION_ARGS) {
    sparse_attention<MAX_PER_LANE>(SPARSE_ATTENTION_CALL);
}

// head_dim 512 exactly (DeepSeek-V4): 16 channels per lane, known at compile time
extern "C" __global__ void dsv4_sparse_attention_d512(SPARSE_ATTENTION_ARGS) {
    sparse_attention<16>(SPARSE_ATTENTION_CALL);
}



// The runs of a split dsv4_sparse_attention merged (rescaled to their common peak), then RoPE⁻¹.
// grid (T, ⌈heads / warps⌉), a warp per head.
extern "C" __global__ void dsv4_attention_combine(const float* __restrict__ partial, int splits,
                                                  const int* __restrict__ positions,
                                                  const float* __restrict__ inv_freq, int rope_dim,
                                                  bf16* __restrict__ out, int heads, int dim) {
    const int t = blockIdx.x, lane = threadIdx.x & 31, per = dim >> 5;
    const int h = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (h >= heads) return;  // warp-uniform
    const float* runs = partial + ((long long)t * heads + h) * splits * (dim + 2);
    float peak = NEG_BIG;
    for (int s = 0; s < splits; ++s) peak = fmaxf(peak, runs[s * (dim + 2)]);
    float denom = 0.f, acc[MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < MAX_PER_LANE; ++j) acc[j] = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float* run = runs + s * (dim + 2);
        const float weight = __expf(run[0] - peak);
        denom += weight * run[1];
#pragma unroll
        for (int j = 0; j < MAX_PER_LANE; ++j)
            if (j < per) acc[j] += weight * run[2 + lane + 32 * j];
    }
    write_head(acc, denom, per, lane, positions[t], inv_freq, rope_dim, dim, out + ((long long)t * heads + h) * dim);
}

// --- mHC: hyper_connection.collapse / collapse_head -----------------------------------------------
// Two launches. dsv4_hc_mix, grid (T, num_mix, splits): block (t, o, z) reduces slice z of the
// token's flat streams against row o of fn, so the 24 dot products of a token (and, at small
// batch, pieces of each) run side by side: a block walking 16k floats waits on memory latency at
// every step (one block per logit: ~10 us per launch at batch 1, H100 W3a). Partials
//   partial[t][o][z]        dot of slice z with fn row o      (o < num_mix)
//   partial[t][num_mix][z]  sum of squares of slice z          (written by the o = 0 blocks)
// dsv4_hc_collapse, grid (T, ⌈dim / blockDim⌉): every block sums the partials into
// m[t, o] = rms(flat)·(flat · fn[o]) and pre; block y = 0 also writes post and Sinkhorn(comb)
// (layers) — the head (head != 0) has pre only; each block writes its slice of x = Σ_j pre_j·H_j.
extern "C" __global__ void dsv4_hc_mix(const float* __restrict__ streams, const float* __restrict__ fn,
                                       float* __restrict__ partial, int n, int num_mix) {
    __shared__ float scratch[32];  // block_sum's one slot per warp
    const int t = blockIdx.x, o = blockIdx.y, z = blockIdx.z, splits = gridDim.z;
    const float* flat = streams + (long long)t * n;
    const float* row = fn + (long long)o * n;
    float sumsq = 0.f, dot = 0.f;
    if ((n & 3) == 0) {  // 16-byte loads (n % 4 == 0 keeps every row 16-byte aligned)
        const int quads = n / 4, per = (quads + splits - 1) / splits, end = min(quads, (z + 1) * per);
        const float4* f4 = reinterpret_cast<const float4*>(flat);
        const float4* w4 = reinterpret_cast<const float4*>(row);
        for (int i = z * per + threadIdx.x; i < end; i += blockDim.x) {
            const float4 a = f4[i], b = w4[i];
            sumsq += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
            dot += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        }
    } else {
        const int per = (n + splits - 1) / splits, end = min(n, (z + 1) * per);
        for (int i = z * per + threadIdx.x; i < end; i += blockDim.x) {
            sumsq += flat[i] * flat[i];
            dot += flat[i] * row[i];
        }
    }
    const float total_sq = block_sum(sumsq, scratch);
    const float total_dot = block_sum(dot, scratch);
    if (threadIdx.x == 0) {
        float* own = partial + (long long)t * (num_mix + 1) * splits;
        own[o * splits + z] = total_dot;
        if (o == 0) own[num_mix * splits + z] = total_sq;
    }
}

extern "C" __global__ void dsv4_hc_collapse(
    const float* __restrict__ streams,  // [T, hc, dim]
    const float* __restrict__ partial,  // [T, num_mix + 1, splits] from dsv4_hc_mix
    int splits, const float* __restrict__ base, const float* __restrict__ scale,
    bf16* __restrict__ x_out, float* __restrict__ post_out, float* __restrict__ comb_out,
    int hc, int dim, int head, int sinkhorn_iters, float hc_eps, float norm_eps) {
    __shared__ float mix[MAX_MIX];
    __shared__ float pre[MAX_HC];
    __shared__ float comb[2][MAX_HC * MAX_HC];  // Sinkhorn ping-pong: read one, write the other
    const int t = blockIdx.x, n = hc * dim, i = threadIdx.x, cells = hc * hc;
    const float* flat = streams + (long long)t * n;
    const int num_mix = head ? hc : (2 + hc) * hc;
    const float* own = partial + (long long)t * (num_mix + 1) * splits;
    if (i <= num_mix) {  // the dot products, and (i = num_mix) the sum of squares, in slice order
        float total = 0.f;
        for (int z = 0; z < splits; ++z) total += own[i * splits + z];
        mix[i] = total;
    }
    __syncthreads();
    if (i < num_mix) mix[i] *= rsqrtf(mix[num_mix] / n + norm_eps);
    __syncthreads();
    if (i < hc) {
        pre[i] = sigmoid_f(mix[i] * scale[0] + base[i]) + hc_eps;
        if (!head && blockIdx.y == 0) post_out[(long long)t * hc + i] = 2.f * sigmoid_f(mix[hc + i] * scale[1] + base[hc + i]);
    }
    if (!head && blockIdx.y == 0) {  // block-uniform: every thread of the block meets the barriers below
        // Sinkhorn with one thread per cell (a single thread doing the 20 iterations' 640 divisions
        // one after another took ~50 us, the whole mHC collapse + expand 68 us at batch 1 on H100).
        // Each cell sums its row / column in index order, as the serial loop (and NumPy) did.
        if (i < hc) {  // row softmax + eps, a thread per row
            const float* logits = mix + 2 * hc + i * hc;
            const float* bias = base + 2 * hc + i * hc;
            float peak = NEG_BIG, total = 0.f, row[MAX_HC];
            for (int c = 0; c < hc; ++c) peak = fmaxf(peak, row[c] = logits[c] * scale[2] + bias[c]);
            for (int c = 0; c < hc; ++c) total += (row[c] = __expf(row[c] - peak));
            for (int c = 0; c < hc; ++c) comb[0][i * hc + c] = row[c] / total + hc_eps;
        }
        __syncthreads();
        int current = 0;
        for (int iter = 0; iter < sinkhorn_iters; ++iter) {  // columns first, then rows + columns
            for (int pass = iter > 0 ? 0 : 1; pass < 2; ++pass) {  // pass 0: rows, 1: columns
                if (i < cells) {
                    const int r = i / hc, c = i % hc;
                    const float* from = comb[current];
                    float total = 0.f;
                    for (int j = 0; j < hc; ++j) total += pass == 0 ? from[r * hc + j] : from[j * hc + c];
                    comb[current ^ 1][i] = from[i] / (total + hc_eps);
                }
                current ^= 1;
                __syncthreads();
            }
        }
        if (i < cells) comb_out[(long long)t * cells + i] = comb[current][i];
    }
    __syncthreads();  // pre
    for (int d = blockIdx.y * blockDim.x + i; d < dim; d += gridDim.y * blockDim.x) {
        float x = 0.f;
        for (int j = 0; j < hc; ++j) x += pre[j] * flat[j * dim + d];
        x_out[(long long)t * dim + d] = to_bf(x);
    }
}

// --- mHC: hyper_connection.expand --------------------------------------------------------------
// grid (T, ⌈dim / blockDim⌉): H'[t, k, d] = post[t, k]·y[t, d] + Σ_j comb[t, j, k]·H[t, j, d]
// (in place allowed: a thread reads its column of every stream before writing it).
extern "C" __global__ void dsv4_hc_expand(const float* streams, const bf16* __restrict__ y,
                                          const float* __restrict__ post, const float* __restrict__ comb,
                                          float* out, int hc, int dim) {
    const int t = blockIdx.x, d = blockIdx.y * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    float column[MAX_HC];  // unrolled to MAX_HC with guards: registers, not a local-memory array
#pragma unroll
    for (int j = 0; j < MAX_HC; ++j) column[j] = j < hc ? streams[((long long)t * hc + j) * dim + d] : 0.f;
    const float value = to_f(y[(long long)t * dim + d]);
    for (int k = 0; k < hc; ++k) {
        float mixed = post[(long long)t * hc + k] * value;
#pragma unroll
        for (int j = 0; j < MAX_HC; ++j)
            if (j < hc) mixed += comb[((long long)t * hc + j) * hc + k] * column[j];
        out[((long long)t * hc + k) * dim + d] = mixed;
    }
}

// --- quantised weights: y = x @ dequant(W)ᵀ --------------------------------------------------------
// grid (⌈out / rows_per_block⌉, N), one output row per thread group of 32; weights decoded in
// registers. FP4: packed [out, in/2] e2m1 (low nibble = even input), e8m0 scales [out, in/32].
// FP8: e4m3 [out, in], e8m0 scales [⌈out/128⌉, ⌈in/128⌉].
__device__ __forceinline__ float e8m0(unsigned char e) { return ldexpf(1.f, (int)e - 127); }

__device__ __forceinline__ float e2m1(unsigned code) {
    const float magnitude[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    return (code & 8u) ? -magnitude[code & 7u] : magnitude[code & 7u];
}

__device__ __forceinline__ float e4m3(unsigned char code) {
    const int exponent = (code >> 3) & 15, mantissa = code & 7;
    const float magnitude = exponent == 0 ? ldexpf((float)mantissa, -9)
                                          : ldexpf(1.f + mantissa / 8.f, exponent - 7);
    return (code & 0x80) ? -magnitude : magnitude;  // 0x7f / 0xff (NaN) never appear in weights
}

template <bool FP4>
__device__ void quant_linear(const bf16* __restrict__ x, const unsigned char* __restrict__ weight,
                             const unsigned char* __restrict__ scales, bf16* __restrict__ y,
                             int in_features, int out_features, float* scratch) {
    const int group = threadIdx.x >> 5, lane = threadIdx.x & 31, groups = blockDim.x >> 5;
    const int o = blockIdx.x * groups + group, n = blockIdx.y;
    const bf16* xn = x + (long long)n * in_features;
    float part = 0.f;
    if (o < out_features) {
        if (FP4) {
            const unsigned char* row = weight + (long long)o * (in_features / 2);
            const unsigned char* row_scales = scales + (long long)o * (in_features / 32);
            for (int b = lane; b < in_features / 2; b += 32) {
                const float s = e8m0(row_scales[(2 * b) / 32]);
                part += (e2m1(row[b] & 15u) * to_f(xn[2 * b]) + e2m1(row[b] >> 4) * to_f(xn[2 * b + 1])) * s;
            }
        } else {
            const unsigned char* row = weight + (long long)o * in_features;
            const unsigned char* row_scales = scales + (long long)(o / 128) * ((in_features + 127) / 128);
            for (int i = lane; i < in_features; i += 32) part += e4m3(row[i]) * e8m0(row_scales[i / 128]) * to_f(xn[i]);
        }
    }
    scratch[threadIdx.x] = part;  // sum each group of 32 through shared memory (uniform barriers)
    __syncthreads();
    for (int stride = 16; stride > 0; stride >>= 1) {
        if (lane < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
        __syncthreads();
    }
    if (lane == 0 && o < out_features) y[(long long)n * out_features + o] = to_bf(scratch[threadIdx.x]);
}

extern "C" __global__ void dsv4_fp4_linear(const bf16* __restrict__ x, const unsigned char* __restrict__ packed,
                                           const unsigned char* __restrict__ scales, bf16* __restrict__ y,
                                           int in_features, int out_features) {
    __shared__ float scratch[1024];
    quant_linear<true>(x, packed, scales, y, in_features, out_features, scratch);
}

extern "C" __global__ void dsv4_fp8_linear(const bf16* __restrict__ x, const unsigned char* __restrict__ codes,
                                           const unsigned char* __restrict__ scales, bf16* __restrict__ y,
                                           int in_features, int out_features) {
    __shared__ float scratch[1024];
    quant_linear<false>(x, codes, scales, y, in_features, out_features, scratch);
}

// ================================================================================================
// The model forward's glue kernels (cuda_model.py). They read the step's layout from the device
// batch — query_start [B+1], positions [T], token_seq [T], state_slots [B], block tables — so a
// decode step touches no host data and can be captured in a CUDA graph.
// ================================================================================================

// token_seq[t] = the sequence of token t. grid (B).
extern "C" __global__ void dsv4_token_seq(const int* __restrict__ query_start, int* __restrict__ token_seq) {
    const int s = blockIdx.x;
    for (int t = query_start[s] + threadIdx.x; t < query_start[s + 1]; t += blockDim.x) token_seq[t] = s;
}

// Per head, in place: optional RMSNorm (weight may be null: unweighted), then RoPE on the last
// rope_dim channels at positions[t] (rope_dim 0: none). grid (T, heads).
extern "C" __global__ void dsv4_head_norm_rope(bf16* __restrict__ x, const bf16* __restrict__ weight, int use_norm,
                                               const float* __restrict__ inv_freq, int rope_dim,
                                               const int* __restrict__ positions, int heads, int dim, float eps) {
    __shared__ float v[MAX_DIM];
    __shared__ float scratch[32];  // block_sum's one slot per warp
    const int t = blockIdx.x;
    bf16* head = x + ((long long)t * heads + blockIdx.y) * dim;
    float sumsq = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        v[c] = to_f(head[c]);
        sumsq += v[c] * v[c];
    }
    const float total = block_sum(sumsq, scratch);  // also the barrier after the loads
    if (use_norm) {
        const float inv_rms = rsqrtf(total / dim + eps);
        for (int c = threadIdx.x; c < dim; c += blockDim.x) v[c] *= inv_rms * (weight ? to_f(weight[c]) : 1.f);
        __syncthreads();
    }
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        head[c] = to_bf(rope_dim ? rotated(v, c, dim, rope_dim, (float)positions[t], inv_freq, 1.f) : v[c]);
}

// The sliding-window cache write: row of (sequence, position) ← kv[t]. grid (T).
extern "C" __global__ void dsv4_write_window(const bf16* __restrict__ kv, bf16* __restrict__ cache,
                                             const int* __restrict__ tables, int table_stride, int block_size,
                                             const int* __restrict__ token_seq, const int* __restrict__ positions,
                                             int dim) {
    const int t = blockIdx.x;
    const long long row = cache_row(tables, table_stride, token_seq[t], positions[t], block_size);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) cache[row * dim + c] = kv[(long long)t * dim + c];
}

// One compressor row (kv, gate + ape) of position q, channel col (of width) for a token of this
// step whose sequence started the step at `start` (first token index `first_token`):
//   q ≥ start                  the step's projections (token first_token + q − start)
//   q in the window open at start   the state slot's pending rows (gate stored without ape)
//   q earlier (CSA overlap only)    the slot's overlap rows: the Ca half, ape included (col < dim)
struct CompressorRows {
    const bf16* kv_proj;
    const bf16* gate_proj;  // [T, width]
    const float* ape;       // [rate, width]
    const bf16* state_kv;
    const bf16* state_gate;  // [slots, rate, width]
    const bf16* overlap_kv;
    const bf16* overlap_gate;  // [slots, rate, dim]
    int rate, width, dim;

    __device__ __forceinline__ void row(int q, int col, int start, int first_token, int slot, float& kv,
                                        float& gate) const {
        const int r = q % rate;
        if (q >= start) {
            const long long i = (long long)(first_token + q - start) * width + col;
            kv = to_f(kv_proj[i]);
            gate = to_f(gate_proj[i]) + ape[r * width + col];
        } else if (q / rate == start / rate) {
            const long long i = ((long long)slot * rate + r) * width + col;
            kv = to_f(state_kv[i]);
            gate = to_f(state_gate[i]) + ape[r * width + col];
        } else {
            const long long i = ((long long)slot * rate + r) * dim + col;
            kv = to_f(overlap_kv[i]);
            gate = to_f(overlap_gate[i]);
        }
    }
};

// attention.compress for the entries closing in this step: token t at position p closes window
// w = p / rate when (p + 1) % rate == 0. Per channel softmax over the window's slots (CSA: the Ca
// half of window w−1, empty for w = 0, then the Cb half of window w), RMSNorm × norm, RoPE at
// w·rate, written to the compressed cache row of entry w. grid (T); other tokens return at once.
extern "C" __global__ void dsv4_compress_step(
    const bf16* __restrict__ kv_proj, const bf16* __restrict__ gate_proj, const float* __restrict__ ape,
    const bf16* __restrict__ state_kv, const bf16* __restrict__ state_gate, const bf16* __restrict__ overlap_kv,
    const bf16* __restrict__ overlap_gate, const float* __restrict__ norm_weight, const float* __restrict__ inv_freq,
    int rope_dim, float eps, const int* __restrict__ token_seq, const int* __restrict__ positions,
    const int* __restrict__ query_start, const int* __restrict__ state_slots, bf16* __restrict__ cache,
    const int* __restrict__ tables, int table_stride, int block_size, int rate, int dim, int overlap) {
    __shared__ float pooled[MAX_DIM];
    __shared__ float scratch[32];  // block_sum's one slot per warp
    const int t = blockIdx.x, p = positions[t];
    if ((p + 1) % rate != 0) return;  // block-uniform
    const int seq = token_seq[t], first_token = query_start[seq], start = positions[first_token];
    const int slot = state_slots[seq], w = p / rate;
    const CompressorRows rows{kv_proj, gate_proj, ape, state_kv, state_gate, overlap_kv, overlap_gate,
                              rate, (overlap ? 2 : 1) * dim, dim};
    float sumsq = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float peak = NEG_BIG, den = 0.f, num = 0.f, kv, gate;
        for (int pass = overlap && w > 0 ? 0 : 1; pass < 2; ++pass) {
            // pass 0: the Ca half (columns 0..dim) of window w−1; pass 1: window w, its Cb half under overlap
            const int first = (w - 1 + pass) * rate, col = pass && overlap ? dim + c : c;
            for (int q = first; q < first + rate; ++q) {
                rows.row(q, col, start, first_token, slot, kv, gate);
                const float new_peak = fmaxf(peak, gate);
                const float correction = __expf(peak - new_peak), e = __expf(gate - new_peak);
                den = den * correction + e;
                num = num * correction + e * kv;
                peak = new_peak;
            }
        }
        pooled[c] = num / den;
        sumsq += pooled[c] * pooled[c];
    }
    const float inv_rms = rsqrtf(block_sum(sumsq, scratch) / dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) pooled[c] *= inv_rms * norm_weight[c];
    __syncthreads();
    const long long row = cache_row(tables, table_stride, seq, w, block_size);
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        cache[row * dim + c] = to_bf(rotated(pooled, c, dim, rope_dim, (float)(w * rate), inv_freq, 1.f));
}

// The compressor's state after the step, per sequence (grid (B), after dsv4_compress_step):
// CSA: when a window closed, the overlap rows ← the Ca half (+ ape) of the last closed window;
// then the pending rows of the window open at the end ← this step's rows of it.
extern "C" __global__ void dsv4_compress_state(
    const bf16* __restrict__ kv_proj, const bf16* __restrict__ gate_proj, const float* __restrict__ ape,
    bf16* __restrict__ state_kv, bf16* __restrict__ state_gate, bf16* __restrict__ overlap_kv,
    bf16* __restrict__ overlap_gate, const int* __restrict__ positions, const int* __restrict__ query_start,
    const int* __restrict__ state_slots, int rate, int dim, int overlap) {
    const int s = blockIdx.x, first_token = query_start[s], count = query_start[s + 1] - first_token;
    if (count <= 0) return;
    const int start = positions[first_token], end = start + count, slot = state_slots[s];
    const int width = (overlap ? 2 : 1) * dim;
    const CompressorRows rows{kv_proj, gate_proj, ape, state_kv, state_gate, overlap_kv, overlap_gate,
                              rate, width, dim};
    if (overlap && end / rate > start / rate) {
        const int first = (end / rate - 1) * rate;
        for (int i = threadIdx.x; i < rate * dim; i += blockDim.x) {
            const int r = i / dim, c = i % dim;
            float kv, gate;
            rows.row(first + r, c, start, first_token, slot, kv, gate);
            overlap_kv[((long long)slot * rate + r) * dim + c] = to_bf(kv);
            overlap_gate[((long long)slot * rate + r) * dim + c] = to_bf(gate);
        }
    }
    __syncthreads();  // the overlap read the pending rows that are overwritten next
    const int open = max(end - end % rate, start);
    for (int i = threadIdx.x; i < (end - open) * width; i += blockDim.x) {
        const int q = open + i / width, c = i % width;
        const long long src = (long long)(first_token + q - start) * width + c;
        const long long dst = ((long long)slot * rate + q % rate) * width + c;
        state_kv[dst] = kv_proj[src];
        state_gate[dst] = gate_proj[src];
    }
}
