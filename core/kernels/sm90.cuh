// Hopper (sm_90a) building blocks for warp-specialised kernels: mbarriers, cp.async and TMA copies
// into shared memory, wgmma shared-memory descriptors and the wgmma fence / commit / wait steps.
// Tiles use the 128-byte swizzle wgmma and TMA agree on: a tile of R rows x 64 bf16 (128 bytes) is
// R / 8 atoms of 1024 bytes; inside an atom the 16-byte chunk c of row r sits at chunk c ^ (r % 8).
// Built with NVRTC for sm_90a only (loader.arch_kernel); moe_sm90.cu uses it.
#pragma once
#include "common.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

// Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile.
__device__ __forceinline__ u32 swizzled(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// 16-byte global -> shared copy to a shared-window address; a false `valid` writes zeros, reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the barriers' initialisation visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}

// One arrival (counted in the barrier's initial count) once all this thread's earlier cp.async copies landed.
__device__ __forceinline__ void mbar_arrive_on_copies(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// One arrival; the current phase also waits for `bytes` more bytes of TMA copies.
__device__ __forceinline__ void mbar_arrive_expect_bytes(u32 bar, u32 bytes) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// Until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// Orders this thread's view of shared memory (cp.async's writes, acquired through an mbarrier)
// before its later async-proxy reads of it (wgmma operands).
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A CUtensorMap (cuda.h's opaque 128 bytes), passed by value as a __grid_constant__ kernel parameter.
struct alignas(64) TensorMap {
    u64 opaque[16];
};

__device__ __forceinline__ void prefetch_tensor_map(const void* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// One TMA box of a 3-d tensor map into shared memory at `dst`, its bytes counted on `bar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const void* map, int x, int y, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}

// The same box into the same shared-memory offset of every CTA in `cta_mask` (of this cluster),
// each copy counted on the mbarrier at `bar`'s offset in its CTA.
__device__ __forceinline__ void tma_load_3d_multicast(u32 dst, const void* map, int x, int y, int z, u32 bar,
                                                      unsigned short cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar), "h"(cta_mask)
        : "memory");
}

// One arrival on the mbarrier at `bar`'s offset in cluster CTA `cta`.
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(cta)
        : "memory");
}

// Every thread of every CTA of the cluster.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

__device__ __forceinline__ u32 cluster_cta_rank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}

// Shared-memory matrix descriptor of a K-major, 128-byte-swizzled operand: start address, leading /
// stride byte offsets (stride: 1024, one 8-row atom to the next).
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 leading_bytes, u32 stride_bytes) {
    return (u64)((addr >> 4) & 0x3FFF) | ((u64)((leading_bytes >> 4) & 0x3FFF) << 16) |
           ((u64)((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// The accumulator operands of a wgmma asm statement, read and written.
#define SM90_ACC8(d, i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define SM90_ACC32(d, i) SM90_ACC8(d, i), SM90_ACC8(d, i + 8), SM90_ACC8(d, i + 16), SM90_ACC8(d, i + 24)
#define SM90_ACC128(d) SM90_ACC32(d, 0), SM90_ACC32(d, 32), SM90_ACC32(d, 64), SM90_ACC32(d, 96)

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256], A and B K-major in shared memory; scale_d == 0 overwrites D.
// Lane (g, q) of warp w holds D[16 w + g (+ 8)][8 j + 2 q (+ 1)] in d[4 j (+ 2) (+ 1)].
__device__ __forceinline__ void wgmma_ss_n256(float (&d)[128], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n}\n"
        : SM90_ACC128(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
