// Programmatic dependent launch for the one-row decode GEMVs (gemv.cu), the decode routers (moe_routing.cu) and
// the lane-groups INT4 GEMV (moe_int4.cu): DECODE_PDL=1 (core's $OPENINFER_DECODE_PDL; the host launches such a
// kernel with programmatic stream serialization, pdl_launch.launch(after_previous=True)).
// Every CTA issues its loads of weights — which no kernel of the step writes — then waits in griddepcontrol.wait
// for the previous grid to end and its writes to be visible, before its first read of an activation and its
// first global write; only then does it let the stream's next kernel launch (griddepcontrol.launch_dependents:
// once every CTA of this grid is past its wait, so whatever the next kernel reads of the kernels before this
// one is complete too; its CTAs then take the SMs this grid leaves). So a weight stream starts during the
// previous kernel's tail instead of after it. Launched plainly the wait returns at once. Off (and on the host
// stand-in): nothing.
#pragma once

#ifndef DECODE_PDL
#define DECODE_PDL 0
#endif

__device__ __forceinline__ void decode_pdl_launch_dependents() {
#if DECODE_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void decode_pdl_wait() {
#if DECODE_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// A 16-byte weight load meant to issue BEFORE decode_pdl_wait. ptxas schedules griddepcontrol.wait (SASS ACQBULK)
// above plain or ld.global.nc loads that precede it in the source (delaying a load past the wait is legal, and it
// does: sm_90a SASS of gemv_m1 with DECODE_PDL=1 had ACQBULK before all eight weight LDGs, so no weight byte moved
// before the previous kernel ended). A relaxed gpu-scope load (LDG.E.128.STRONG.GPU, L1 bypassed: a weight word is
// read once) stays where it is written. The same word either way; off (and on the host stand-in): a plain load.
__device__ __forceinline__ uint4 decode_pdl_load_early(const void* p) {
#if DECODE_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint4 v;
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}
