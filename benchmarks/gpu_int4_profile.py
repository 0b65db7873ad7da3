"""One Kimi-K2 routed-expert step at batch 1 (384 INT4 experts top-8, lane-groups layout): gate_up (SiLU·mul fused, as
a batch-1 step runs it) then down, by each decode GEMV named on the command line, a few times over, so that a profiler
(Nsight Compute: ``ncu --kernel-name moe_gemv_int4_groups ...``) can take the kernels apart. Prints each kernel's
order. Not a timing (the GEMV benchmarks are ``gpu_kimi.py gemv`` / ``layer``).

    ncu --kernel-name moe_gemv_int4_groups --launch-skip 4 python benchmarks/gpu_int4_profile.py groups_norot,groups_xs
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import cupy
    from gpu_kimi import KIMI_LAYER, random_int4

    from openinfer.backend.cuda import CudaBackend, moe_routing
    from openinfer.backend.cuda import moe as cuda_moe

    kernels = sys.argv[1].split(",") if len(sys.argv) > 1 else ["groups_norot"]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    backend = CudaBackend()
    experts, top_k, hidden, inter = KIMI_LAYER["experts"], KIMI_LAYER["top_k"], KIMI_LAYER["hidden"], KIMI_LAYER["inter"]
    gate_up = cuda_moe.tiled_int4(random_int4(backend, experts, 2 * inter, hidden), "lane_groups")
    down = cuda_moe.tiled_int4(random_int4(backend, experts, hidden, inter), "lane_groups")
    rng = np.random.default_rng(0)
    ids = rng.choice(experts, top_k, replace=False)[None].astype(np.int32)
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), experts)
    x = backend.upload(rng.standard_normal((1, hidden)).astype(np.float32))
    order = []
    for _ in range(repeats):
        for name in kernels:
            h = cuda_moe.gate_up_silu_gemv(x, gate_up, grouping, name)
            cuda_moe.grouped_gemm(h, down, grouping, gather=False, gemv=True, gemv_kernel=name)
            order += [f"{name} gate_up+silu", f"{name} down"]
    cupy.cuda.Device().synchronize()
    for i, what in enumerate(order):
        print(f"launch {i}: {what}")


if __name__ == "__main__":
    main()
