"""MoE routing on the GPU: router logits, scores and top-k, and the grouping of a step's slots by expert
(``ExpertGroupingDevice``: offsets, sorted slots, the GEMM tile list), kernels in ``kernels/moe_routing.cu``
and ``kernels/moe.cu``. ``moe.py`` runs the experts on a grouping; callers import these names from here.

Decode steps (a few tokens) are latency-bound: each routing kernel is a few microseconds of one small grid
on the critical path between the attention and the expert GEMVs, so the choices below are about launches and
waits, not bytes. Prefill-sized steps take the tensor-core router and the multi-block grouping.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cupy
import numpy as np

from openinfer.backend.cuda.loader import kernel
from openinfer.moe import RouterSpec

if TYPE_CHECKING:
    from openinfer.backend.cuda.moe import DeviceMoE

ROUTER_WARPS = 8  # moe.cu
# On by default (H200, window D3 of 2026-11-23, one Kimi-K2 layer at 1k context, per-op device time):
# moe_sort_parallel (counts in shared memory, one block-wide scan; moe_sort's thread 0 walks every
# expert through global memory): grouping 32.7 -> 5.6 / 46.0 -> 5.9 / 52.2 -> 7.9 us at batch 1 / 64 /
# 256; moe_combine over a block per 256 columns: 41.5 -> 3.9 / 44.6 -> 7.8 / 46.1 -> 19.1 us; layer step
# at batch 1 379 -> 322 us. OPENINFER_MOE_FAST_ROUTING=0: the single-block kernels. (moe_router_logits
# with 7 gate loads per lane in flight ran with them in that window: no gain at batch 1, route 45 -> 113 /
# 136 -> 351 us at 64 / 256, so that variant was removed: one load per lane.)
FAST_ROUTING_ENV = "OPENINFER_MOE_FAST_ROUTING"
# Prefill-sized steps (moe_routing.cu). On by default since E1 (H200, 2026-11-24; OPENINFER_MOE_ROUTER_MMA=0
# reverts): the router logits of at least ROUTER_MMA_MIN_TOKENS tokens on tensor cores (64 x 64 tiles,
# x read once; moe_router_logits re-reads a token's row per 8 experts) and moe_route in blocks of a
# thread per expert (``select_experts``' narrow). Moonlight's router (64 x 2048): logits 230.8 -> 46.0 /
# 121.6 -> 37.0 / 29.7 -> 23.4 us at 8192 / 4096 / 1024 tokens (behind at 256: 23.6 vs 9.6); top-k
# 59.7 -> 48.9 / 39.6 -> 34.6 / 6.8 -> 7.0 us. Default since E2 (=0 reverts): OPENINFER_MOE_GROUP_BLOCKS groups at least
# GROUP_BLOCKS_MIN_SLOTS slots with one block per expert and no atomics (moe_expert_counts +
# moe_place_slots, 8 slots per thread and pass): E2 (H200) 45.6 vs moe_sort_parallel's 71.9 us at 8192
# tokens x top-6, 41.9 vs 54.6 at 4096, 7.8 vs 10.6 at 1024 (behind at 256: 7.5 vs 6.8).
ROUTER_MMA_ENV, ROUTER_MMA_MIN_TOKENS, ROUTER_STAGES = "OPENINFER_MOE_ROUTER_MMA", 1024, 4
GROUP_BLOCKS_ENV, GROUP_BLOCKS_MIN_SLOTS = "OPENINFER_MOE_GROUP_BLOCKS", 4096
ROUTER_TILE, GROUP_THREADS = 64, 1024  # moe_routing.cu
# Deleted after losing (E1 of 2026-11-24, H200, results/moe_routing_e1_h200.json, graphs): OPENINFER_MOE_ROUTE_WARPS
# (moe_route_warps, a warp per token: route 8.1 -> 11.2 us at 16 tokens, 89.0 -> 96.2 at 8192) and
# OPENINFER_MOE_GROUP_CHUNKS (moe_chunk_counts / _scan / _place: 9.0 vs 5.6 us at 16 tokens, 75.5 vs 65.5 at 8192).
# OPENINFER_MOE_ROUTE_SORT runs a decode step's top-k and grouping (routers without
# expert groups, no hash routing, at most ROUTE_SORT_MAX_TOKENS tokens) as one block, moe_routing.cu's
# moe_route_sort (warp_route_token's picks, then moe_sort_parallel's layout from shared memory): one launch and
# the num_tiles memset fewer than moe_route + moe_sort_parallel. No cross-block state (the deleted one-launch
# moe_decode.cu counted arriving blocks in global memory).
# Unset: on for steps of at most ROUTE_SORT_DEFAULT_MAX_TOKENS tokens (D2 of 2026-11-24, H200,
# results/moe_block_moe13c_d2.json / kimi_layer_moe13c_d2.json: Moonlight's MoE block at 1 token 57.6 -> 54.8 us
# with the shared experts fused (58.7 -> 55.4 without), the Kimi-K2 layer at batch 1 231.9 -> 229.2 us; behind at
# 16 tokens, 254.4 vs 256.8, and far behind at 64, 306.2 vs 331.8: its 16 warps route 4 tokens each in turn);
# =1 up to ROUTE_SORT_MAX_TOKENS, =0 never.
ROUTE_SORT_ENV, ROUTE_SORT_MAX_TOKENS, ROUTE_SORT_DEFAULT_MAX_TOKENS = "OPENINFER_MOE_ROUTE_SORT", 64, 1
ROUTE_SORT_THREADS, ROUTE_SORT_MAX_SLOTS = 512, 2048  # moe_routing.cu ROUTE_SORT_WARPS x 32, ROUTE_SORT_MAX_SLOTS
# Deleted (s12 D2/D3, Kimi-K2 layer b1, benchmarks/GPU.md "Kimi-K2 layer (#13, kimi13)": within noise or slower,
# 202-215 us; then superseded by moe_route_decode): OPENINFER_MOE_ROUTER_BLOCKS (router logits a block per expert),
# OPENINFER_MOE_ROUTER_FUSED (those logits + moe_route_sort's body by the last block), OPENINFER_MOE_ROUTE_SORT_WARP
# (moe_route_sort as one warp).
# OPENINFER_MOE_ROUTE_DECODE (=1 / =0; unset: the default below): ``route_and_group`` of a decode step
# (1..ROUTE_DECODE_MAX_TOKENS tokens, a router without expert groups, no hash routing) in one launch, moe_routing.cu's
# moe_route_decode: the router logits by a warp per (expert, token group) with the warp's router row loaded whole up
# front (the logits bits of moe_router_logits), then the last block's top-k (two warp reductions a pick:
# warp_route_token's ids and weights) and grouping (one warp scans the experts: moe_route_sort's layout), plus the ticket
# counter's memset node (zeroed per call: nothing shared across streams or graphs; the last block also puts it back).
# D3 of 2026-11-25 (H200, RESULTS/D3/route13: moe_routing_route13_d3.json, timeline_moonlight_route13_d3.json; the same
# ids / weights / layout, logits equal): routing alone (graphs of back-to-back calls) Moonlight 10.8 -> 7.2 / 10.7 ->
# 8.9 / 11.2 -> 10.4 us at 1 / 4 / 16 tokens, behind at 64 (12.4 vs 17.7); Kimi-K2 15.2 -> 11.2 / 16.0 -> 14.4 at 1 / 4,
# behind at 16 (22.0 vs 31.5) and 64 (45.7 vs 101.6): on while tokens x experts <= ROUTE_DECODE_DEFAULT_MAX_WORK.
# Moonlight's decode step: b1 / b16 / b64 2.806 -> 2.626 / 8.041 -> 7.818 / 9.815 -> 9.766 ms (1.069 / 1.028 / 1.005x).
# Unset, it is on by default only where no shared experts run beside the routing on the side stream (Moonlight's are
# fused): beside the shared GEMV (Kimi-K2) it is not measured yet, so there =1 (with OPENINFER_MOE_ROUTE_BEFORE_SHARED=1:
# its ~145-register blocks take the SMs before the GEMV's) asks for it.
# OPENINFER_MOE_ROUTE_DECODE_WARPS (4 or 8; unset: 4 up to 4 tokens, else 8): warps a block, the top-k's parallelism.
# (Deleted: OPENINFER_MOE_ROUTE_DECODE_GATE=shared, the router rows in shared memory: D3 of 2026-11-25 alone Kimi-K2
# 11.2 -> 12.2 / 14.4 -> 16.2 us at 1 / 4 tokens; beside the shared GEMV the routing waits on memory, not SM room,
# benchmarks/GPU.md s13 "Kimi-K2 layer": 19.3 us there vs 11.2 alone.)
ROUTE_DECODE_ENV, ROUTE_DECODE_WARPS_ENV = "OPENINFER_MOE_ROUTE_DECODE", "OPENINFER_MOE_ROUTE_DECODE_WARPS"
# Its ticket counter is zeroed per call by a one-thread kernel node (moe_route_decode_ticket): D3b (H200,
# timeline_moonlight_route13_d3b.json, one process, 2 rounds, logits equal) Moonlight step b1 / b16 2.614 -> 2.555 /
# 7.781 -> 7.733 ms over a memset node (a memset node may run on a copy engine: ~6 us of gap before each router). The
# memset and the per-layer counter (2.531 / 7.712, state kept across calls) were opt-in
# (OPENINFER_MOE_ROUTE_DECODE_TICKET=call / layer) and were deleted: the per-layer one's 1.009x was not worth the state.
# Since s16 D3 the per-layer counter is back as the default (moe.py ROUTE_TICKET_ENV): 1.3 us a Kimi-K2 layer at b1.
ROUTE_DECODE_MAX_TOKENS, ROUTE_DECODE_MAX_HIDDEN = 64, 8192  # moe_route_decode: ≤ 32 16-byte chunks a lane
ROUTE_DECODE_X_BYTES = 44 * 1024  # moe_route_decode's staged x rows (static shared memory)
DEFAULT_ROUTE_DECODE = True
# unset: also where shared experts run on the side stream meanwhile, the routing launched first (D3b, H200, Kimi-K2 layer
# b1, kimi_layer_b1_route13_d3b.json: 181.7 us, span 177.4, the experts' GEMVs from t = 105 µs; D3's layer with
# int4's same GEMV and the two-launch routing 189.6, span 187.7, experts from t = 121.5; forked after the shared
# GEMV instead 191.3)
DEFAULT_ROUTE_DECODE_BESIDE_SHARED = True
ROUTE_DECODE_DEFAULT_MAX_WORK = 2048  # the switch unset: steps of at most this many tokens x routed experts
GROUPING_METHODS = ("single", "blocks")
SORT_THREADS = 1024  # moe.cu SORT_MAX_THREADS
SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
MAX_TOPK = 16
MAX_EXPERTS = 512  # moe_route keeps one layer's scores in shared memory
NULL = np.uint64(0)
GROUP_TILE_ROWS = 64  # moe_routing.cu GROUP_TILE_ROWS = moe.cu BM: rows of one expert per GEMM tile


@dataclass
class ExpertGroupingDevice:
    """A step's routing, on the device (see moe.cu): slots grouped by expert, GEMM tiles."""

    ids: cupy.ndarray  # [T, k] int32
    weights: cupy.ndarray  # [T, k] fp32
    sorted_slots: cupy.ndarray  # [T·k]
    slot_pos: cupy.ndarray  # [T·k]
    offsets: cupy.ndarray  # [E+1]
    tile_expert: cupy.ndarray
    tile_row: cupy.ndarray
    num_tiles: cupy.ndarray  # [1]
    max_tiles: int
    top_k: int

    @classmethod
    def empty(cls, num_tokens: int, width: int, num_experts: int) -> ExpertGroupingDevice:
        """Unwritten arrays for a routing kernel to fill: ``num_tokens`` rows of ``width`` slots (top-k plus fused
        shared experts) over ``num_experts`` experts (routed plus shared), room for ``max_tiles`` GEMM tiles."""
        num_slots = num_tokens * width
        tiles = max_tiles(num_slots, num_experts)
        return cls(cupy.empty((num_tokens, width), cupy.int32), cupy.empty((num_tokens, width), cupy.float32),
                   cupy.empty(num_slots, cupy.int32), cupy.empty(num_slots, cupy.int32),
                   cupy.empty(num_experts + 1, cupy.int32), cupy.empty(max(tiles, 1), cupy.int32),
                   cupy.empty(max(tiles, 1), cupy.int32), cupy.empty(1, cupy.int32), tiles, width)


def max_tiles(num_slots: int, num_experts: int) -> int:
    """Upper bound of GEMM tiles: each active expert wastes at most one partial tile."""
    return -(-num_slots // GROUP_TILE_ROWS) + min(num_experts, num_slots)


def fast_routing() -> bool:
    """Whether grouping and combine take moe_sort_parallel and the multi-block moe_combine (default;
    $OPENINFER_MOE_FAST_ROUTING=0: the single-block kernels)."""
    return os.environ.get(FAST_ROUTING_ENV, "1") not in ("0", "false", "off")


def _switch(env: str, default: bool = False) -> bool:
    value = os.environ.get(env, "1" if default else "0").lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"{env} must be 1 or 0 (on / off), got {value!r}")
    return value in ("1", "true", "on")


def router_mma_wanted(num_tokens: int) -> bool:
    """Whether ``router_logits`` takes moe_router_logits_mma: $OPENINFER_MOE_ROUTER_MMA (default on)
    and at least ROUTER_MMA_MIN_TOKENS tokens."""
    return num_tokens >= ROUTER_MMA_MIN_TOKENS and _switch(ROUTER_MMA_ENV, default=True)


def grouping_method(num_slots: int, per_expert_blocks: bool | None = None) -> str:
    """How ``group_by_expert`` groups ``num_slots`` slots (GROUPING_METHODS): ``per_expert_blocks`` True /
    False picks "blocks" / "single"; else "blocks" from GROUP_BLOCKS_MIN_SLOTS slots with $OPENINFER_MOE_GROUP_BLOCKS
    (default), below "single"."""
    if per_expert_blocks is not None:
        return "blocks" if per_expert_blocks else "single"
    return "blocks" if group_blocks_wanted(num_slots) else "single"


def group_blocks_wanted(num_slots: int) -> bool:
    """Whether ``group_by_expert`` takes moe_expert_counts + moe_place_slots: $OPENINFER_MOE_GROUP_BLOCKS
    (default on) and at least GROUP_BLOCKS_MIN_SLOTS slots."""
    return num_slots >= GROUP_BLOCKS_MIN_SLOTS and _switch(GROUP_BLOCKS_ENV, default=True)


def route_sort_wanted(num_tokens: int, spec: RouterSpec, tid2eid: cupy.ndarray | None = None,
                      shared_experts: int = 0) -> bool:
    """Whether ``route_and_group`` runs (moe_route_sort): 1 to ROUTE_SORT_MAX_TOKENS tokens with
    $OPENINFER_MOE_ROUTE_SORT=1, to ROUTE_SORT_DEFAULT_MAX_TOKENS unset, never with =0; a router without expert
    groups, no hash routing, the slots and experts within the kernel's shared arrays."""
    unset = os.environ.get(ROUTE_SORT_ENV, "") == ""
    most = ROUTE_SORT_DEFAULT_MAX_TOKENS if unset else ROUTE_SORT_MAX_TOKENS if _switch(ROUTE_SORT_ENV) else 0
    return (0 < num_tokens <= most and tid2eid is None
            and (spec.num_groups <= 1 or spec.topk_groups >= spec.num_groups)
            and num_tokens * (spec.top_k + shared_experts) <= ROUTE_SORT_MAX_SLOTS
            and spec.num_experts + shared_experts <= ROUTE_SORT_THREADS and spec.top_k + shared_experts <= 32)


def route_decode_wanted(x: cupy.ndarray, layer: DeviceMoE, beside_shared: bool = False) -> bool:
    """Whether ``route_and_group`` runs as moe_route_decode (see ROUTE_DECODE_ENV): the switch (1 / 0; another value:
    a clear error; unset: DEFAULT_ROUTE_DECODE for steps of at most ROUTE_DECODE_DEFAULT_MAX_WORK tokens x experts,
    not ``beside_shared`` (shared experts running on the side stream meanwhile), softmax routers at one token only:
    the weights of the routing it replaces, bit for bit) and the kernel's needs:
    1..ROUTE_DECODE_MAX_TOKENS tokens, a router without expert groups, no hash routing, rows of whole 16-byte pieces
    (aligned) up to ROUTE_DECODE_MAX_HIDDEN, the experts, slots and picks within its shared arrays and one warp."""
    spec, shared = layer.router, layer.shared_experts
    tokens, hidden = int(x.shape[0]), int(x.shape[1])
    if os.environ.get(ROUTE_DECODE_ENV, "") == "":
        if (not DEFAULT_ROUTE_DECODE
                or (beside_shared and not DEFAULT_ROUTE_DECODE_BESIDE_SHARED)
                or tokens * spec.num_experts > ROUTE_DECODE_DEFAULT_MAX_WORK
                or (spec.scoring == "softmax" and tokens > 1)):
            # (a softmax router's weights from moe_route, the default above one token, sum the softmax in its
            # block's order, not a warp's)
            return False
    elif not _switch(ROUTE_DECODE_ENV):
        return False
    return (0 < tokens <= ROUTE_DECODE_MAX_TOKENS
            and layer.tid2eid is None and (spec.num_groups <= 1 or spec.topk_groups >= spec.num_groups)
            and hidden % 8 == 0 and hidden <= ROUTE_DECODE_MAX_HIDDEN and x.data.ptr % 16 == 0
            and layer.gate.data.ptr % 16 == 0 and spec.top_k <= spec.num_experts
            and spec.num_experts + shared <= MAX_EXPERTS and spec.top_k + shared <= 32
            and tokens * (spec.top_k + shared) * 4 <= ROUTE_DECODE_X_BYTES)


def route_decode_ticket() -> cupy.ndarray:
    """moe_route_decode's counter for one call: a fresh uint32 zeroed by a one-thread kernel node (moe_route_decode_ticket;
    nothing shared across streams or graphs, the kernel's last block also puts it back to zero)."""
    ticket = cupy.empty(1, cupy.uint32)
    kernel("moe_routing.cu", "moe_route_decode_ticket")((1,), (32,), (ticket,))
    return ticket


def route_decode_shape(tokens: int, hidden: int, num_experts: int, slots: int) -> tuple[int, dict[str, int]]:
    """moe_route_decode's grid and defines for a step: token groups of up to 4 tokens whose bf16 rows fit the staged
    bytes, blocks of ROUTE_DECODE_WARPS_ENV warps (4 up to 4 tokens, else 8), one warp per expert and group; the
    router rows in registers."""
    value = os.environ.get(ROUTE_DECODE_WARPS_ENV, "").strip()
    if value not in ("", "4", "8"):
        raise ValueError(f"{ROUTE_DECODE_WARPS_ENV} must be 4 or 8, got {value!r}")
    warps = int(value) if value else 4 if tokens <= 4 else 8
    group = max(g for g in (1, 2, 4) if g == 1 or g * hidden * 2 <= ROUTE_DECODE_X_BYTES)
    group = min(group, tokens)
    staged = -(-max(group * hidden * 2, slots * 4) // 16) * 16
    grid = -(-tokens // group) * -(-num_experts // warps)
    return grid, {"ROUTE_DECODE_WARPS": warps, "ROUTE_DECODE_TOKENS": group, "ROUTE_DECODE_CHUNKS": -(-hidden // 256),
                  "ROUTE_DECODE_PER_LANE": -(-num_experts // 32), "ROUTE_DECODE_X_BYTES": staged}


def route_and_group(x: cupy.ndarray, layer: DeviceMoE, ticket: cupy.ndarray | None = None,
                    one_launch: bool | None = None) -> ExpertGroupingDevice | None:
    """``group_by_expert(*route(x, ...))`` of ``layer`` in two launches: router_logits, then moe_route_sort
    (warp_route_token's ids and weights, moe_sort_parallel's offsets and tile list; each expert's
    slots in the order atomics hand out, as there). None where the logits kernel does not run (unaligned
    rows): the caller routes the usual way. The caller checks ``route_sort_wanted``; where ``one_launch`` (default:
    given a ``ticket``, else ``route_decode_wanted``), one launch instead (``route_decode``)."""
    spec, shared = layer.router, layer.shared_experts
    check_router(spec, shared)
    if (one_launch if one_launch is not None else ticket is not None or route_decode_wanted(x, layer)):
        return route_decode(x, layer, ticket)
    logits = router_logits(x, layer.gate, spec, layer.tid2eid)
    if logits is None:
        return None
    num_tokens = int(x.shape[0])
    grouping = ExpertGroupingDevice.empty(num_tokens, spec.top_k + shared, spec.num_experts + shared)
    tiles = grouping.max_tiles
    defines = {"ROUTE_SHARED_EXPERTS": shared} if shared else {}
    kernel("moe_routing.cu", "moe_route_sort", **defines)((1,), (ROUTE_SORT_THREADS,), (
        logits, NULL if layer.correction_bias is None else layer.correction_bias, np.int32(num_tokens),
        np.int32(spec.num_experts), np.int32(spec.top_k), np.int32(SCORING[spec.scoring]),
        np.int32(spec.norm_topk_prob), np.float32(spec.routed_scaling_factor), grouping.ids, grouping.weights,
        grouping.offsets, grouping.sorted_slots, grouping.slot_pos, grouping.tile_expert, grouping.tile_row,
        grouping.num_tiles, np.int32(tiles)))
    return grouping


def route_decode(x: cupy.ndarray, layer: DeviceMoE, ticket: cupy.ndarray | None = None) -> ExpertGroupingDevice:
    """``route_and_group`` in one launch, moe_route_decode (the caller checks ``route_decode_wanted``): the same ids,
    weights and layout as router_logits + moe_route_sort (each expert's slots in the order atomics hand out).
    ``ticket``: the kernel's counter, one zeroed uint32 of this call alone (default: zeroed here; ``moe_forward``
    zeroes it before the shared experts' fork point, so the zeroing is not a node between that point and the
    router, where the shared GEMV would take the SMs first)."""
    spec, shared = layer.router, layer.shared_experts
    num_tokens, hidden = int(x.shape[0]), int(x.shape[1])
    grouping = ExpertGroupingDevice.empty(num_tokens, spec.top_k + shared, spec.num_experts + shared)
    tiles = grouping.max_tiles
    grid, defines = route_decode_shape(num_tokens, hidden, spec.num_experts, int(grouping.sorted_slots.size))
    if shared:
        defines["ROUTE_SHARED_EXPERTS"] = shared
    logits = cupy.empty((num_tokens, spec.num_experts), cupy.float32)
    kernel("moe_routing.cu", "moe_route_decode", **defines)((grid,), (defines["ROUTE_DECODE_WARPS"] * 32,), (
        x, layer.gate, np.int32(num_tokens), np.int32(hidden), logits,
        route_decode_ticket() if ticket is None else ticket,
        NULL if layer.correction_bias is None else layer.correction_bias, np.int32(spec.num_experts),
        np.int32(spec.top_k), np.int32(SCORING[spec.scoring]), np.int32(spec.norm_topk_prob),
        np.float32(spec.routed_scaling_factor), grouping.ids, grouping.weights, grouping.offsets, grouping.sorted_slots,
        grouping.slot_pos, grouping.tile_expert, grouping.tile_row, grouping.num_tiles, np.int32(tiles)))
    return grouping


def route(x: cupy.ndarray, gate: cupy.ndarray, spec: RouterSpec, correction_bias: cupy.ndarray | None,
          token_ids: cupy.ndarray | None = None, tid2eid: cupy.ndarray | None = None, shared_experts: int = 0
          ) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``moe_route``: fp32 logits from bf16 ``x [T, H]`` and ``gate [E, H]``, scores, group-limited
    top-k (or ``tid2eid`` hash routing). Returns ids ``[T, k]`` int32 and weights ``[T, k]`` fp32;
    with ``shared_experts`` S, ``[T, k + S]``: each row's last S entries experts E .. E+S-1, weight 1."""
    check_router(spec, shared_experts)
    return select_experts(x, gate, spec, correction_bias, router_logits(x, gate, spec, tid2eid), token_ids, tid2eid,
                          shared_experts=shared_experts)


def check_router(spec: RouterSpec, shared_experts: int = 0) -> None:
    if (spec.top_k + shared_experts > MAX_TOPK or spec.num_groups > 64
            or spec.num_experts + shared_experts > MAX_EXPERTS or shared_experts < 0):
        raise ValueError(f"cuda routing supports top_k (+ fused shared experts) <= {MAX_TOPK}, n_group <= 64 and at "
                         f"most {MAX_EXPERTS} experts; got top_k={spec.top_k}, {shared_experts} fused shared experts, "
                         f"n_group={spec.num_groups}, {spec.num_experts} experts")


def router_logits(x: cupy.ndarray, gate: cupy.ndarray, spec: RouterSpec,
                  tid2eid: cupy.ndarray | None = None, mma: bool | None = None) -> cupy.ndarray | None:
    """``moe_router_logits``: the [E, H] router product spread over blocks (a decode step has few
    tokens), fp32 ``[T, E]``; None where ``select_experts``' one block per token computes it
    (unaligned rows, hash routing, no tokens). ``mma`` (default ``router_mma_wanted``): the
    tensor-core tiles of moe_routing.cu instead."""
    num_tokens, hidden = x.shape
    if not num_tokens or hidden % 8 or x.data.ptr % 16 or gate.data.ptr % 16 or tid2eid is not None:
        return None
    logits = cupy.empty((num_tokens, spec.num_experts), dtype=cupy.float32)
    if router_mma_wanted(num_tokens) if mma is None else mma:
        shared = ROUTER_STAGES * 2 * ROUTER_TILE * (ROUTER_TILE + 8) * 2
        fn = kernel("moe_routing.cu", "moe_router_logits_mma", ROUTER_STAGES=ROUTER_STAGES)
        if fn.max_dynamic_shared_size_bytes < shared:
            fn.max_dynamic_shared_size_bytes = shared
        fn((-(-num_tokens // ROUTER_TILE), -(-spec.num_experts // ROUTER_TILE)), (128,),
           (x, gate, np.int32(num_tokens), np.int32(hidden), np.int32(spec.num_experts), logits), shared_mem=shared)
        return logits
    kernel("moe.cu", "moe_router_logits")(
        (num_tokens, -(-spec.num_experts // ROUTER_WARPS)), (ROUTER_WARPS * 32,),
        (x, gate, np.int32(hidden), np.int32(spec.num_experts), logits))
    return logits


def select_experts(x: cupy.ndarray, gate: cupy.ndarray, spec: RouterSpec, correction_bias: cupy.ndarray | None,
                   logits: cupy.ndarray | None, token_ids: cupy.ndarray | None = None,
                   tid2eid: cupy.ndarray | None = None, narrow: bool | None = None,
                   shared_experts: int = 0) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``moe_route`` on ``router_logits``' output (None: it computes the logits itself): scores,
    group-limited top-k, weights (``route``'s second half). ``narrow`` (default: with ``logits``, where
    ``router_mma_wanted``): blocks of one thread per expert (at least 64: a thread per expert group)
    instead of 256, as the block only reads the logits. ``shared_experts``: see ``route``."""
    num_tokens, hidden = x.shape
    check_router(spec, shared_experts)
    width = spec.top_k + shared_experts
    ids = cupy.empty((num_tokens, width), dtype=cupy.int32)
    weights = cupy.empty((num_tokens, width), dtype=cupy.float32)
    if narrow is None:
        narrow = logits is not None and router_mma_wanted(num_tokens)
    defines = {"ROUTE_SHARED_EXPERTS": shared_experts} if shared_experts else {}
    threads = max(64, min(256, -(-spec.num_experts // 32) * 32)) if narrow and logits is not None else 256
    if num_tokens:
        kernel("moe.cu", "moe_route", **defines)(
            (num_tokens,), (threads,),
            (x, gate, NULL if logits is None else logits, NULL if correction_bias is None else correction_bias,
             np.int32(hidden), np.int32(spec.num_experts), np.int32(spec.top_k), np.int32(SCORING[spec.scoring]),
             np.int32(spec.num_groups), np.int32(spec.topk_groups), np.int32(spec.group_score == "max"),
             np.int32(spec.norm_topk_prob), np.float32(spec.routed_scaling_factor),
             NULL if token_ids is None else token_ids, NULL if tid2eid is None else tid2eid, ids, weights))
    return ids, weights


def group_by_expert(ids: cupy.ndarray, weights: cupy.ndarray, num_experts: int,
                    per_expert_blocks: bool | None = None, method: str | None = None) -> ExpertGroupingDevice:
    """Slots grouped by expert and the GEMM tile list (``ExpertGroupingDevice``): moe_sort_parallel
    (one block, "single") or moe_routing.cu's block per expert ("blocks": slots of an expert in slot order).
    ``method`` (GROUPING_METHODS) forces one, else ``grouping_method``."""
    num_slots = int(ids.size)
    tiles = max_tiles(num_slots, num_experts)
    grouping = ExpertGroupingDevice(
        ids, weights, cupy.empty(num_slots, cupy.int32), cupy.empty(num_slots, cupy.int32),
        cupy.empty(num_experts + 1, cupy.int32), cupy.empty(max(tiles, 1), cupy.int32),
        cupy.empty(max(tiles, 1), cupy.int32),
        # every grouping kernel below writes num_tiles: a zeroed one (a memset node in a decode graph, each layer)
        # only where none runs
        cupy.empty(1, cupy.int32) if num_slots else cupy.zeros(1, cupy.int32), tiles, int(ids.shape[1]))
    layout = (grouping.offsets, grouping.sorted_slots, grouping.slot_pos, grouping.tile_expert, grouping.tile_row,
              grouping.num_tiles, np.int32(tiles))
    method = method or grouping_method(num_slots, per_expert_blocks)
    if method not in GROUPING_METHODS:
        raise ValueError(f"unknown grouping method {method!r}; one of {', '.join(GROUPING_METHODS)}")
    if method == "blocks" and num_slots:
        if num_experts > MAX_EXPERTS:
            raise ValueError(f"moe_place_slots scans at most {MAX_EXPERTS} experts' counts, got {num_experts}")
        counts = cupy.empty(num_experts, dtype=cupy.int32)
        kernel("moe_routing.cu", "moe_expert_counts")((num_experts,), (GROUP_THREADS,), (ids, np.int32(num_slots),
                                                                                       counts))
        kernel("moe_routing.cu", "moe_place_slots")((num_experts,), (GROUP_THREADS,), (
            ids, np.int32(num_slots), np.int32(num_experts), counts, *layout))
    elif fast_routing():
        if num_experts > MAX_EXPERTS:
            raise ValueError(f"moe_sort_parallel keeps at most {MAX_EXPERTS} experts' counts, got {num_experts}")
        kernel("moe.cu", "moe_sort_parallel")((1,), (SORT_THREADS,), (ids, np.int32(num_slots),
                                                                      np.int32(num_experts), *layout))
    else:
        counts = cupy.empty(num_experts, dtype=cupy.int32)
        kernel("moe.cu", "moe_sort")((1,), (1024,), (ids, np.int32(num_slots), np.int32(num_experts), counts,
                                                     *layout))
    return grouping
