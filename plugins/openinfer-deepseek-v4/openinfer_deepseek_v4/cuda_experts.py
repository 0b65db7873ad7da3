"""DeepSeek-V4's MoE layer on the GPU: core's device routing and grouping (``moe.cu``), the
routed experts' grouped GEMMs in their stored format, the clamped SwiGLU, core's combine.

Expert formats, per layer and projection (``stack_experts`` picks the first that fits):

    fp4   [E, N, K/2] e2m1 pairs + e8m0 scales [E, N, K/32]  core kernels/moe_fp4.cu (V4-Flash)
    fp8   [E, N, K] e4m3 + 128×128 block scales              core moe.cu (scales widened to fp32)
    bf16  [E, N, K]                                          core moe.cu (anything else, dequantised)

``gate_up`` stacks w1 over w3 (gate rows first); ``down`` is w2. Imported only on a CUDA machine.

FP4 experts take one of moe_fp4.cu's two GEMMs per step:

    stream  steps of at most STREAM_MAX_TOKENS tokens (decode): weights streamed from registers as
            the MMA's A operand, read once per tile; the tile's rows in passes of 8 or 16
    tiles   larger steps (prefill): 64×64 output tiles, the weight tile decoded into shared memory

``OPENINFER_DSV4_FP4_GEMM=stream|tiles`` forces one of them (benchmarks compare the two).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import cupy
import numpy as np

from openinfer import WeightLoadError, float32_to_bf16
from openinfer.backend.cuda import moe as core_moe
from openinfer.backend.cuda import moe_routing
from openinfer.backend.cuda.loader import kernel
from openinfer.moe import MoEWeights
from openinfer.parallel.expert_cuda import local_grouping, zero_other_slots
from openinfer.quant import e8m0_to_float32
from openinfer_deepseek_v4.cuda_linears import linear, stream_defines

FP4_GROUP = 32
TILE = 64  # moe_fp4.cu's output tile
THREADS = 128
STREAM_N = 64  # moe_fp4.cu: weight rows per stream block (4 warps × 16)
STREAM_THREADS = 128
STREAM_MAX_TOKENS = 256  # steps up to this many tokens take the stream kernel
FP4_GEMM_METHODS = ("auto", "stream", "tiles")
NULL = np.uint64(0)


def _fp4_gemm_setting() -> str:
    method = os.environ.get("OPENINFER_DSV4_FP4_GEMM", "auto")
    if method not in FP4_GEMM_METHODS:
        raise ValueError(f"OPENINFER_DSV4_FP4_GEMM={method!r}: expected one of {', '.join(FP4_GEMM_METHODS)}")
    return method


FP4_GEMM = _fp4_gemm_setting()


@dataclass
class Fp4Experts:
    """One projection of all experts of a layer, FP4 as stored."""

    codes: cupy.ndarray  # [E, N, K/2] uint8
    scales: cupy.ndarray  # [E, N, K/32] uint8 (e8m0)
    out_features: int
    in_features: int


@dataclass
class DeviceMoELayer:
    """One MoE layer's device tensors: router (bf16 weight, fp32 bias or int64 hash table) and
    the stacked experts."""

    gate: cupy.ndarray  # [E, H] bf16
    correction_bias: cupy.ndarray | None  # [E] fp32
    tid2eid: cupy.ndarray | None  # [vocab, k] int64
    gate_up: Any  # Fp4Experts | core ExpertLinear
    down: Any
    distinct_experts: bool = True  # a token's k slots never share an expert (bounds rows per expert)


def _stack_projection(ckpt: Any, modules: list[list[str]], shape: tuple[int, int]) -> Any:
    """Each expert's rows (``modules[e]`` stacked in order) → one device projection."""
    out_features, in_features = shape
    stored = [[ckpt.stored_quantized(m) for m in mods] for mods in modules]
    formats = {s[0] if s is not None else None for row in stored for s in row}
    if formats == {"fp4"} and in_features % FP4_GROUP == 0:
        codes = np.stack([np.concatenate([s[1] for s in row]) for row in stored])
        scales = np.stack([np.concatenate([s[2] for s in row]) for row in stored])
        if codes.shape[1:] != (out_features, in_features // 2) or scales.shape[1:] != (out_features,
                                                                                       in_features // FP4_GROUP):
            raise WeightLoadError(f"FP4 experts {modules[0]}: codes {codes.shape[1:]} / scales {scales.shape[1:]} "
                                  f"do not fit a [{out_features}, {in_features}] projection")
        return Fp4Experts(cupy.asarray(codes), cupy.asarray(scales), out_features, in_features)
    block = 128
    parts_aligned = all(len(mods) == 1 or out_features // len(mods) % block == 0 for mods in modules)
    if formats == {"fp8"} and parts_aligned:  # every fused part starts on a scale block
        codes = np.stack([np.concatenate([s[1] for s in row]) for row in stored])
        scales = np.stack([np.concatenate([e8m0_to_float32(s[2]) for s in row]) for row in stored])
        if codes.shape[1:] != (out_features, in_features):
            raise WeightLoadError(f"FP8 experts {modules[0]}: codes {codes.shape[1:]}, expected "
                                  f"({out_features}, {in_features})")
        return core_moe.upload_expert_linear("fp8", codes, scales.astype(np.float32), shape, block=block)
    rows = np.stack([float32_to_bf16(np.concatenate([ckpt.get(f"{m}.weight") for m in mods])) for mods in modules])
    if rows.shape[1:] != (out_features, in_features):
        raise WeightLoadError(f"experts {modules[0]}: weights {rows.shape[1:]}, expected ({out_features}, {in_features})")
    return core_moe.upload_expert_linear("bf16", rows, None, shape)


def stack_experts(ckpt: Any, prefixes: list[str], hidden: int, inter: int) -> tuple[Any, Any]:
    """``weights.ExpertStacker`` for cuda: (gate_up, down) of every expert of a layer."""
    gate_up = _stack_projection(ckpt, [[p + "w1", p + "w3"] for p in prefixes], (2 * inter, hidden))
    down = _stack_projection(ckpt, [[p + "w2"] for p in prefixes], (hidden, inter))
    return gate_up, down


def device_layer(layer: MoEWeights, ops: Any) -> DeviceMoELayer:
    gate_up, down = layer.stacked
    distinct = True  # score routing picks k different experts; a hash table may repeat one in a row
    if layer.tid2eid is not None and layer.tid2eid.shape[1] > 1:
        table = np.sort(np.asarray(layer.tid2eid), axis=1)
        distinct = bool(np.all(table[:, 1:] != table[:, :-1]))
    return DeviceMoELayer(
        ops.weight(np.asarray(layer.gate, np.float32)),
        None if layer.correction_bias is None else cupy.asarray(layer.correction_bias, np.float32),
        None if layer.tid2eid is None else cupy.asarray(layer.tid2eid, np.int64), gate_up, down, distinct)


def fp4_gemm_method(a: cupy.ndarray, weight: Fp4Experts, num_tokens: int, method: str | None = None) -> str:
    """``stream`` or ``tiles`` for a step of ``num_tokens`` tokens (``method``: None follows
    ``OPENINFER_DSV4_FP4_GEMM``, ``auto`` picks by the step's size). The stream kernel's
    16-byte row copies need 16-byte aligned rows of ``a`` and of the codes."""
    method = FP4_GEMM if method is None else method
    if method not in FP4_GEMM_METHODS:
        raise ValueError(f"FP4 GEMM method {method!r}: expected one of {', '.join(FP4_GEMM_METHODS)}")
    aligned = a.data.ptr % 16 == 0 and weight.codes.data.ptr % 16 == 0
    if method == "tiles" or not aligned:
        return "tiles"
    if method == "stream":
        return "stream"
    return "stream" if num_tokens <= STREAM_MAX_TOKENS else "tiles"


def fp4_grouped_gemm(a: cupy.ndarray, weight: Fp4Experts, grouping: moe_routing.ExpertGroupingDevice,
                     gather: bool, distinct_experts: bool = True, method: str | None = None,
                     stages: str | None = None) -> cupy.ndarray:
    """``core_moe.grouped_gemm`` for FP4 weights: rows in expert order, ``[T·k, N]`` bf16.
    ``distinct_experts``: no token routes two slots to one expert, so an expert's rows are at
    most the step's tokens (the stream kernel sizes its passes by that bound). ``stages``: the
    stream kernel's staging ring (None: ``OPENINFER_DSV4_STREAM_STAGES``)."""
    num_slots = int(grouping.sorted_slots.size)
    out = cupy.empty((num_slots, weight.out_features), dtype=cupy.uint16)
    if num_slots == 0:
        return out
    a = cupy.ascontiguousarray(a)
    if a.shape[1] != weight.in_features:
        raise ValueError(f"fp4 experts take {weight.in_features} inputs, got rows of {a.shape[1]}")
    num_tokens = num_slots // grouping.top_k
    args = (a, grouping.sorted_slots if gather else NULL, np.int32(grouping.top_k), weight.codes, weight.scales,
            grouping.tile_expert, grouping.tile_row, grouping.num_tiles, grouping.offsets, out,
            np.int32(weight.out_features), np.int32(weight.in_features))
    if fp4_gemm_method(a, weight, num_tokens, method) == "stream":
        rows_per_expert = num_tokens if distinct_experts else num_slots
        chunks = 1 if rows_per_expert <= 8 else 2  # more rows than 16: further passes over the weights
        kernel("moe_fp4.cu", "moe_fp4_stream_gemm", **stream_defines(chunks, stages))(
            (-(-weight.out_features // STREAM_N), grouping.max_tiles), (STREAM_THREADS,), args)
    else:
        kernel("moe_fp4.cu", "moe_fp4_grouped_gemm")(
            (grouping.max_tiles, -(-weight.out_features // TILE)), (THREADS,), args)
    return out


def grouped_gemm(a: cupy.ndarray, weight: Any, grouping: moe_routing.ExpertGroupingDevice, gather: bool,
                 distinct_experts: bool = True) -> cupy.ndarray:
    if isinstance(weight, Fp4Experts):
        return fp4_grouped_gemm(a, weight, grouping, gather, distinct_experts)
    return core_moe.grouped_gemm(a, weight, grouping, gather)


def swiglu_clamp(gate_up: cupy.ndarray, limit: float | None) -> cupy.ndarray:
    """``openinfer.moe.swiglu`` on bf16 ``[rows, 2I]`` rows (gate first): ``[rows, I]`` bf16."""
    gate_up = cupy.ascontiguousarray(gate_up)
    rows, width = gate_up.shape
    out = cupy.empty((rows, width // 2), dtype=cupy.uint16)
    if out.size:
        blocks = max(1, min(4096, -(-out.size // 256)))
        kernel("moe_fp4.cu", "swiglu_clamp")((blocks,), (256,), (gate_up, out, np.int64(rows), np.int32(width // 2),
                                                                 np.float32(limit or 0.0)))
    return out


def moe_layer(ops: Any, x: cupy.ndarray, layer: MoEWeights, device: DeviceMoELayer,
              token_ids: cupy.ndarray, rank: Any = None) -> cupy.ndarray:
    """Route on the device, both expert GEMMs over the grouped rows, clamped SwiGLU between,
    weighted combine plus the shared expert. ``rank`` (a ``RankContext``, expert parallel): the
    stack holds this rank's experts only; its slots are grouped apart from the others'
    (``openinfer.parallel.expert_cuda``), the shared expert runs on rank 0 and one all-reduce
    sums the ranks' shares."""
    x = cupy.ascontiguousarray(x)
    shared = None
    if layer.shared is not None and (rank is None or rank.comm.rank == 0):
        shared = linear(ops, swiglu_clamp(linear(ops, x, layer.shared.gate_up), layer.swiglu_limit), layer.shared.down)
    ids, weights = moe_routing.route(x, device.gate, layer.router, device.correction_bias,
                                  token_ids if device.tid2eid is not None else None, device.tid2eid)
    if rank is None:
        grouping = moe_routing.group_by_expert(ids, weights, layer.router.num_experts)
    else:
        held = rank.expert.experts(layer.router.num_experts)
        grouping = local_grouping(ids, weights, held)
    hidden = grouped_gemm(x, device.gate_up, grouping, gather=True, distinct_experts=device.distinct_experts)
    y = grouped_gemm(swiglu_clamp(hidden, layer.swiglu_limit), device.down, grouping, gather=False,
                     distinct_experts=device.distinct_experts)
    if rank is None:
        return core_moe.combine(y, grouping, shared, int(x.shape[1]))
    y = zero_other_slots(y, grouping, held.stop - held.start)
    return rank.comm.all_reduce(core_moe.combine(y, grouping, shared, int(x.shape[1])))
