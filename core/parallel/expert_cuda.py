"""Expert parallel MoE on the cuda backend, over replicated tokens (every rank has all T tokens).

A rank holds its experts ``start .. start + E_local`` stacked (``DeviceMoE.gate_up`` / ``down``
with E_local experts) and the whole router. Every rank routes every token over all E experts —
the same kernel on the same inputs, so the same choice everywhere — and keeps its own slots::

    moe_route (all E)           ids [T, k], weights [T, k]
    local ids                   id - start for my experts; the sentinel E_local for the others,
                                whose weights become 0
    moe_sort (E_local + 1)      my slots grouped by expert, the sentinel's segment last, so its
                                GEMM tiles are the last ones: num_tiles is cut before them
    gate_up GEMM → SwiGLU → down GEMM over my tiles only
    rows of the sentinel's slots zeroed (never written by a GEMM), moe_combine (+ the shared
    experts' output on rank 0 only) → all_reduce: the full MoE output on every rank

Nothing is read back on the host, so the step (all-reduce included) can be captured in a CUDA
graph. The sum crosses ranks in bf16 (one rounding per rank's share).
"""

from __future__ import annotations

from typing import Any

import cupy

from openinfer.backend.cuda import moe as device_moe
from openinfer.backend.cuda import moe_routing
from openinfer.parallel.communicator import Communicator


def local_grouping(ids: cupy.ndarray, weights: cupy.ndarray, experts: slice) -> moe_routing.ExpertGroupingDevice:
    """The grouping of this rank's slots among the step's ``ids`` (global expert ids) for the
    experts ``experts``: other ranks' slots go to a sentinel group whose tiles are dropped and
    whose weights are 0."""
    num_local = experts.stop - experts.start
    local = ids - experts.start
    held = (local >= 0) & (local < num_local)
    local_ids = cupy.where(held, local, num_local).astype(cupy.int32)
    local_weights = cupy.where(held, weights, 0).astype(cupy.float32)
    grouping = moe_routing.group_by_expert(local_ids, local_weights, num_local + 1)
    # moe_sort lays the tiles out in expert order: the sentinel's are the last ones
    first = cupy.arange(grouping.max_tiles, dtype=cupy.int32)
    mine = (first < grouping.num_tiles[0]) & (grouping.tile_expert[: grouping.max_tiles] < num_local)
    grouping.num_tiles[...] = mine.sum(dtype=cupy.int32)
    return grouping


def zero_other_slots(y: cupy.ndarray, grouping: moe_routing.ExpertGroupingDevice, num_local: int) -> cupy.ndarray:
    """Rows of the sentinel's slots (sorted after every local expert's) set to 0: no GEMM wrote
    them, and moe_combine multiplies them by a 0 weight (0 · NaN would still be NaN)."""
    rows = cupy.arange(y.shape[0], dtype=cupy.int32)[:, None]
    return cupy.where(rows < grouping.offsets[num_local], y, cupy.zeros((), y.dtype))  # bf16 bits 0: +0.0


def shared_expert_output(backend: Any, x: cupy.ndarray, shared: Any) -> cupy.ndarray:
    """The shared experts' SwiGLU (``shared``: ``ExpertWeights`` of bf16 or quantized linears)."""

    def linear(a: cupy.ndarray, weight: Any) -> cupy.ndarray:
        if isinstance(weight, device_moe.ExpertLinear):
            return device_moe.quantized_linear(a, weight, backend.blas)
        return backend.linear(a, weight)

    return linear(backend.silu_mul(linear(x, shared.gate_up)), shared.down)


def expert_parallel_moe_device(backend: Any, x: cupy.ndarray, layer: device_moe.DeviceMoE, shared: Any,
                               token_ids: cupy.ndarray | None, comm: Communicator, experts: slice) -> cupy.ndarray:
    """The MoE block on this rank's ``experts`` (``layer`` holds just those, stacked), summed over
    the ranks. ``shared``: the layer's shared experts (``ExpertWeights`` or None), run on rank 0."""
    x = cupy.ascontiguousarray(x)
    num_local = experts.stop - experts.start
    if layer.gate_up.num_experts != num_local:
        raise ValueError(f"rank {comm.rank} holds {layer.gate_up.num_experts} stacked experts, its range "
                         f"{experts.start}..{experts.stop} has {num_local}")
    ids, weights = moe_routing.route(x, layer.gate, layer.router, layer.correction_bias, token_ids, layer.tid2eid)
    grouping = local_grouping(ids, weights, experts)
    hidden = device_moe.grouped_gemm(x, layer.gate_up, grouping, gather=True)
    y = device_moe.grouped_gemm(backend.silu_mul(hidden), layer.down, grouping, gather=False)
    y = zero_other_slots(y, grouping, num_local)
    shared_out = shared_expert_output(backend, x, shared) if shared is not None and comm.rank == 0 else None
    return comm.all_reduce(device_moe.combine(y, grouping, shared_out, int(x.shape[1])))
