"""Expert parallel MoE: each rank holds ``num_experts / ep`` routed experts; tokens reach the
rank holding their experts and come back summed.

Two layouts of the tokens entering the MoE::

    replicated (attention replicated or tensor-parallel: every rank has all T tokens)
        route (same on every rank) → my experts' share of every token → all-reduce
        shared experts: rank 0 adds them into its share (computed once, not ep times)

    token-sharded (data-parallel attention: rank r has its own T_r tokens)
        all-gather tokens (padded to the largest T_r) → route → my experts' share of every
        token → reduce-scatter: rank r gets back the sums of its own T_r rows

Routing is deterministic (host fp32), so every rank picks the same experts for a token and
nothing but activations crosses ranks. A rank's ``MoEWeights.experts`` holds ``None`` for the
experts of other ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from openinfer.moe import MoEWeights, group_by_expert, route, router_logits, swiglu
from openinfer.parallel.communicator import Communicator


def local_expert_outputs(ops: Any, x: np.ndarray, layer: MoEWeights, token_ids: np.ndarray | None,
                         experts: slice) -> np.ndarray:
    """This rank's experts' weighted outputs for every token of ``x`` (zeros where a token's
    experts all live elsewhere)."""
    weights, ids = route(router_logits(x, layer.gate, ops), layer.router, layer.correction_bias,
                         token_ids if layer.tid2eid is not None else None, layer.tid2eid)
    grouping = group_by_expert(ids, layer.router.num_experts)
    out = np.zeros_like(x)
    flat_weights = weights.reshape(-1)
    token_rows = grouping.token_rows
    for expert in grouping.active_experts():
        if not experts.start <= expert < experts.stop:
            continue
        held = layer.experts[expert]
        if held is None:
            raise ValueError(f"expert {expert} is in this rank's range {experts} but was not loaded")
        begin, end = grouping.offsets[expert], grouping.offsets[expert + 1]
        slots, rows = grouping.order[begin:end], token_rows[begin:end]
        y = ops.linear(swiglu(ops.linear(x[rows], held.gate_up), layer.swiglu_limit), held.down)
        y *= flat_weights[slots][:, None]
        np.add.at(out, rows, y)
    return out


def _shared(ops: Any, x: np.ndarray, layer: MoEWeights) -> np.ndarray:
    shared = layer.shared
    return ops.linear(swiglu(ops.linear(x, shared.gate_up), layer.swiglu_limit), shared.down)


def expert_parallel_moe(ops: Any, x: np.ndarray, layer: MoEWeights, token_ids: np.ndarray | None,
                        comm: Communicator, experts: slice) -> np.ndarray:
    """The MoE block over replicated tokens: my experts' share, rank 0 adds the shared experts,
    one all-reduce completes it on every rank. On cuda, ``layer.stacked`` is the rank's
    ``DeviceMoE`` (its experts stacked, the whole router): ``expert_cuda``, graph-capturable."""
    if getattr(ops, "name", "") == "cuda":
        from openinfer.parallel.expert_cuda import expert_parallel_moe_device

        return expert_parallel_moe_device(ops, x, layer.stacked, layer.shared, token_ids, comm, experts)
    out = local_expert_outputs(ops, x, layer, token_ids, experts)
    if layer.shared is not None and comm.rank == 0:
        out += _shared(ops, x, layer)
    return comm.all_reduce(out)


def expert_parallel_moe_sharded(ops: Any, x: np.ndarray, layer: MoEWeights, token_ids: np.ndarray | None,
                                comm: Communicator, experts: slice) -> np.ndarray:
    """The MoE block over token-sharded inputs (data-parallel attention): all-gather every rank's
    tokens (padded to the largest count), my experts' share of all of them, reduce-scatter back
    to the owners. The shared experts run on each rank's own tokens."""
    counts = comm.all_gather(np.array([x.shape[0]], np.int64))
    width = int(counts.max())
    padded = np.zeros((width, x.shape[1]), x.dtype)
    padded[: x.shape[0]] = x
    ids = np.zeros(width, np.int64)
    if token_ids is not None:
        ids[: x.shape[0]] = token_ids
    everyone = comm.all_gather(padded)  # [ep * width, H], rank r's rows at r*width
    every_id = comm.all_gather(ids)
    real = np.concatenate([np.arange(r * width, r * width + int(n)) for r, n in enumerate(counts)])
    partial = np.zeros_like(everyone)
    partial[real] = local_expert_outputs(ops, everyone[real], layer, every_id[real] if token_ids is not None
                                         else None, experts)
    mine = comm.reduce_scatter(partial)[: x.shape[0]]
    if layer.shared is not None:
        mine = mine + _shared(ops, x, layer)
    return mine
