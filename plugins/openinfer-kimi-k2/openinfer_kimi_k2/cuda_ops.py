"""The CUDA plan's Kimi-K2 ops and weight builder (bf16; imported only on the cuda backend).

Weights stay in their checkpoint format where a kernel reads it: FP8 block-scaled and INT4
pack-quantized linears become ``ExpertLinear`` (E = 1 for dense projections, stacked over the
experts of a MoE layer) and are dequantized inside the grouped GEMM; everything else is bf16.
Row blocks are fused (``qkv_a``, ``gate_up``) on the raw quantized rows when every block
boundary of the fused matrix falls on a scale boundary; otherwise the rows are dequantized to
bf16 (correct, just not packed).
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import cupy
import numpy as np

from openinfer import DummyCheckpoint
from openinfer.backend.cuda import mla as cuda_mla
from openinfer.backend.cuda import moe as cuda_moe
from openinfer.backend.cuda.moe import DeviceMoE, ExpertLinear
from openinfer.moe import ExpertWeights, MoEWeights
from openinfer_kimi_k2.kernel_plan import KernelPlan
from openinfer_kimi_k2.weights import LinearBuilder

_STORED_TO_KERNEL = {"fp8_block": "fp8", "int4_group": "int4"}


class CudaLinearBuilder(LinearBuilder):
    """Keeps FP8 / INT4 linears packed on the device (see module docstring)."""

    def _packed_rows(self, modules: list[str], orders: list[np.ndarray | None]) -> tuple | None:
        """(format, data [N, K…], scale, (N, K), group, block) of the fused raw rows, or None when
        they cannot stay packed."""
        stored = [self.linears[m] for m in modules]
        formats = {s.format for s in stored}
        if len(formats) != 1 or next(iter(formats)) not in _STORED_TO_KERNEL:
            return None
        kind = _STORED_TO_KERNEL[stored[0].format]
        in_features = stored[0].shape[1]
        if any(s.shape[1] != in_features for s in stored):
            return None
        datas, scales = [], []
        block = stored[0].block[0]
        group = 0
        for s, order in zip(stored, orders, strict=True):
            data = np.asarray(self.ckpt.raw(s.tensor("weight")))
            if kind == "fp8":
                if s.block[0] != s.block[1] or s.block[0] != block:
                    return None
                scale = self.ckpt.get(s.tensor("scale"))
                if s is not stored[-1] and s.shape[0] % block:
                    return None  # the next block's rows would share this one's last scale row
                if order is not None:
                    if np.any(order // block != np.arange(len(order)) // block):
                        return None  # a row would leave its scale block
                    data = data[order]
            else:
                scale = np.asarray(self.ckpt.raw(s.tensor("scale")))  # bf16 bits, one row per output row
                group = in_features // scale.shape[1]
                if order is not None:
                    data, scale = data[order], scale[order]
            datas.append(data)
            scales.append(scale)
        out_features = sum(s.shape[0] for s in stored)
        return kind, np.concatenate(datas), np.concatenate(scales), (out_features, in_features), group or 32, block

    def fused(self, modules: list[str], row_orders: list[np.ndarray | None] | None = None) -> Any:
        orders = row_orders or [None] * len(modules)
        packed = self._packed_rows(modules, orders)
        if packed is None:
            return super().fused(modules, row_orders)
        kind, data, scale, shape, group, block = packed
        return cuda_moe.upload_expert_linear(kind, data[None], scale[None], shape, group, block)

    def experts(self, modules: list[str | None]) -> tuple[list[ExpertWeights | None], Any]:
        """Stack the layer's experts per projection on the device; ``experts[e]`` are views. Under
        expert parallelism only this rank's experts (``modules[e]`` not None) are stacked."""
        held = [m for m in modules if m is not None]
        gate_up = self._stack([[f"{m}.gate_proj", f"{m}.up_proj"] for m in held])
        down = self._stack([[f"{m}.down_proj"] for m in held])
        experts: list[ExpertWeights | None] = []
        for module in modules:
            index = len([e for e in experts if e is not None])  # its place in the local stack
            experts.append(None if module is None else ExpertWeights(gate_up.expert(index), down.expert(index)))
        return experts, (gate_up, down)

    def _stack(self, per_expert: list[list[str]]) -> ExpertLinear:
        packed = [self._packed_rows(mods, [None] * len(mods)) for mods in per_expert]
        if all(p is not None for p in packed) and len({(p[0], p[3], p[4], p[5]) for p in packed}) == 1:
            kind, _, _, shape, group, block = packed[0]
            data = np.stack([p[1] for p in packed])
            scale = np.stack([p[2] for p in packed])
            return cuda_moe.upload_expert_linear(kind, data, scale, shape, group, block)
        # bf16: each expert's rows straight to the device (narrowed there), then stacked
        rows = cupy.stack([self._device_rows(mods) for mods in per_expert])
        return ExpertLinear("bf16", rows, None, int(rows.shape[1]), int(rows.shape[2]))

    def _device_rows(self, modules: list[str]) -> cupy.ndarray:
        """The row blocks of ``modules`` as one bf16 device matrix: BF16 checkpoint bytes as they
        are, anything else (dequantized, widened, or a dummy checkpoint's noise) as fp32 narrowed
        on the GPU — never a host-side bf16 rounding pass over the experts."""
        stored = [self.linears[m] for m in modules]
        if not isinstance(self.ckpt, DummyCheckpoint) and all(
                s.format == "dense" and self.ckpt.dtype(s.tensor("weight")) == "BF16" for s in stored):
            parts = [np.asarray(self.ckpt.raw(s.tensor("weight"))) for s in stored]
        else:
            parts = [self.dense(m) for m in modules]
        return self.backend.weight(parts[0] if len(parts) == 1 else np.concatenate(parts))


# Opt-in, measured slower: $OPENINFER_KIMI_DENSE_GEMV=<a tensor-core decode GEMV of moe.GEMV_KERNELS: mma, mma_split2,
# mma_split4, ...> runs the bf16 dense projections of steps of 2..DENSE_GEMV_MAX_ROWS rows (q / kv_a, o_proj, the dense
# layers; not the LM head: at most DENSE_GEMV_MAX_OUT output rows) as that decode GEMV (moe_gemv_mma over the weight
# as one expert: one pass over the weights for 16 token rows; split K: more blocks) instead of cuBLAS, which reads
# these weights at 25-42 % of the copy bandwidth at 16 rows (Moonlight ledger, s11 D3: q+kv_a 8.7 us for 15 MB,
# o_proj 8.1 us for 8.4 MB, event-timed eager). Products summed in another order: other bits than cuBLAS's. s12 D1
# (H200, Moonlight decode graphs, one process): in graphs cuBLAS takes 6.9 / 5.9 us; mma_split4_depth4 / _depth8 took
# the b16 step 8.053 -> 8.454 / 8.311 ms (0.953 / 0.969x), b64 (past 32 rows: cuBLAS) unchanged.
DENSE_GEMV_ENV = "OPENINFER_KIMI_DENSE_GEMV"
DENSE_GEMV_MAX_ROWS = 32  # moe.GEMV_ROW_LIMITS of the tensor-core GEMVs
DENSE_GEMV_MAX_OUT = 32768


def dense_gemv_kernel(x: cupy.ndarray, weight: Any) -> str | None:
    """The decode GEMV $OPENINFER_KIMI_DENSE_GEMV asks for ``x @ weight^T`` (a bf16 ``CudaLinear``), or None (unset,
    or the step / weight outside DENSE_GEMV_ENV's bounds, or unaligned rows); a name that is not a tensor-core GEMV
    is a clear error."""
    name = os.environ.get(DENSE_GEMV_ENV, "")
    if not name or name == "0":
        return None
    if name not in cuda_moe.TENSOR_CORE_GEMVS:
        raise ValueError(f"{DENSE_GEMV_ENV} is one of {', '.join(cuda_moe.TENSOR_CORE_GEMVS)} (or 0 / unset: cuBLAS); "
                         f"got {name!r}")
    w = getattr(weight, "weight", None)
    if (w is None or getattr(weight, "bias", None) is not None or w.ndim != 2 or w.dtype != cupy.uint16
            or x.ndim != 2 or not 2 <= x.shape[0] <= DENSE_GEMV_MAX_ROWS or w.shape[0] > DENSE_GEMV_MAX_OUT
            or w.shape[1] % 8 or not w.flags.c_contiguous or w.data.ptr % 16):
        return None
    return name


def cuda_linear(ops: Any, x: cupy.ndarray, weight: Any) -> cupy.ndarray:
    if isinstance(weight, ExpertLinear):
        return cuda_moe.quantized_linear(x, weight, ops.blas)
    name = dense_gemv_kernel(x, weight)
    if name is not None:
        x = cupy.ascontiguousarray(x)
        if x.data.ptr % 16 == 0:
            as_expert = ExpertLinear("bf16", weight.weight[None], None, int(weight.weight.shape[0]),
                                     int(weight.weight.shape[1]))
            return cuda_moe.quantized_linear(x, as_expert, None, "gemv", gemv_kernel=name)
    return ops.linear(x, weight)


def cuda_norm_linear(ops: Any, x: cupy.ndarray, norm: cupy.ndarray, eps: float, weight: Any) -> cupy.ndarray:
    """``linear(rms_norm(x))``: for a bf16 weight core's ``add_rms_norm_linear``, one launch for a
    decode row where the backend fuses decode ops (OPENINFER_FUSED_DECODE), the same numbers."""
    if isinstance(weight, ExpertLinear):
        return cuda_linear(ops, ops.rms_norm(x, norm, eps), weight)
    return ops.add_rms_norm_linear(x, None, norm, eps, weight)[0]


def swiglu_down(ops: Any, hidden: cupy.ndarray, down: Any) -> cupy.ndarray:
    """``down(silu_mul(hidden))``, ``hidden`` the gate_up projection's output: for a bf16 down projection core's
    ``silu_mul_linear`` (one launch for a decode row where the backend fuses decode ops, the same numbers)."""
    if isinstance(down, ExpertLinear):
        return cuda_linear(ops, ops.silu_mul(hidden), down)
    return ops.silu_mul_linear(hidden, down)


def shared_expert_phases(ops: Any, shared: Any) -> cuda_moe.SharedExpertPhases:
    """A layer's shared experts for ``moe_forward`` (small steps: on a side stream beside the routed experts), in
    its two phases so that the down projection may run beside the routed one (``cuda_moe.shared_down_late``)."""
    return cuda_moe.SharedExpertPhases(up=partial(cuda_linear, ops, weight=shared.gate_up),
                                       down=partial(swiglu_down, ops, down=shared.down))


def cuda_attention(ops: Any, qkv_a: cupy.ndarray, w: Any, kv: Any, batch: Any, spec: Any, rope: Any,
                   q_lora_rank: int | None, eps: float) -> cupy.ndarray:
    if q_lora_rank:
        q = cuda_norm_linear(ops, cupy.ascontiguousarray(qkv_a[:, :q_lora_rank]), w.q_a_norm, eps, w.q_b)
        latent = qkv_a[:, q_lora_rank:]
    else:
        q, latent = qkv_a[:, : -spec.latent_dim], qkv_a[:, -spec.latent_dim:]
    cos, sin = ops.ropes.get(rope)
    return cuda_mla.mla_forward(ops.blas, q, latent, kv.k, w.mla.w_uk, w.mla.w_uv, w.kv_a_norm, spec, batch,
                                cos, sin, eps, ops.num_sms)


def prepare_weights(weights: Any, ops: Any) -> None:
    """Router tables on the device, next to the stacked experts (once, after loading); with
    $OPENINFER_MOE_SHARED_FUSED the shared experts stacked after the routed ones (``fuse_shared``)."""
    fuse, fused = cuda_moe.shared_fusion_wanted(), False
    for layer in weights.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoEWeights) and not isinstance(mlp.stacked, DeviceMoE):
            gate_up, down = mlp.stacked
            mlp.stacked = DeviceMoE(
                mlp.router, ops.weight(mlp.gate),
                None if mlp.correction_bias is None else cupy.asarray(mlp.correction_bias, dtype=cupy.float32),
                gate_up, down, None if mlp.tid2eid is None else cupy.asarray(mlp.tid2eid, dtype=cupy.int64))
            if fuse:
                fused = fuse_shared(mlp) or fused
    if fused:  # the replaced stacks and shared weights back to the device before the KV cache is sized
        cupy.get_default_memory_pool().free_all_blocks()


def fuse_shared(mlp: MoEWeights) -> bool:
    """Stack ``mlp``'s bf16 shared experts after its routed ones (``cuda_moe.fuse_shared_experts``) where
    this rank holds every routed expert (expert parallel adds the shared experts on one rank only) and the
    shapes fit; the experts' views then point into the new stacks and ``mlp.shared`` is None, so the old
    stacks and the shared weights are freed. Whether it fused."""
    shared = mlp.shared
    if (shared is None or any(e is None for e in mlp.experts) or isinstance(shared.gate_up, ExpertLinear)
            or isinstance(shared.down, ExpertLinear) or not hasattr(shared.gate_up, "weight")
            or not hasattr(shared.down, "weight") or shared.gate_up.bias is not None or shared.down.bias is not None
            or not cuda_moe.shared_fusion_fits(mlp.stacked, shared.gate_up.weight, shared.down.weight)):
        return False
    mlp.stacked = cuda_moe.fuse_shared_experts(mlp.stacked, shared.gate_up.weight, shared.down.weight)
    gate_up, down = mlp.stacked.gate_up, mlp.stacked.down
    mlp.experts = [ExpertWeights(gate_up.expert(e), down.expert(e)) for e in range(len(mlp.experts))]
    mlp.shared = None
    return True


def cuda_moe_layer(ops: Any, h: cupy.ndarray, layer: MoEWeights, batch: Any) -> cupy.ndarray:
    # None where fuse_shared stacked the shared experts with the routed ones
    shared_experts = shared_expert_phases(ops, layer.shared) if layer.shared is not None else None
    return cuda_moe.moe_forward(ops, h, layer.stacked, None, batch.token_ids, shared_experts=shared_experts)


def cuda_moe_add_norm(ops: Any, h: cupy.ndarray, layer: MoEWeights, batch: Any, residual: cupy.ndarray,
                      norm: cupy.ndarray, eps: float) -> tuple[cupy.ndarray, cupy.ndarray] | None:
    """``add_rms_norm(moe(h), residual, norm, eps)`` with the combine fused into the norm where
    $OPENINFER_MOE_COMBINE_NORM asks (``cuda_moe.combine_norm_wanted``); else None (the caller runs both)."""
    if not cuda_moe.combine_norm_wanted(int(h.shape[0])) or not isinstance(layer.stacked, DeviceMoE):
        return None
    shared_experts = shared_expert_phases(ops, layer.shared) if layer.shared is not None else None
    return cuda_moe.moe_forward(ops, h, layer.stacked, None, batch.token_ids, shared_experts=shared_experts,
                                add_norm=(residual, norm, eps))


def cuda_start_prefetch(ops: Any, mlp: Any) -> cupy.cuda.Event | None:
    """Before a MoE layer's attention: its fused shared experts into L2 on a side stream where
    $OPENINFER_MOE_L2_PREFETCH asks (``cuda_moe.start_l2_prefetch``); the event to join, else None."""
    if isinstance(mlp, MoEWeights) and isinstance(mlp.stacked, DeviceMoE):
        return cuda_moe.start_l2_prefetch(mlp.stacked)
    return None


CUDA_PLAN = KernelPlan(backend="cuda", attention=cuda_attention, moe=cuda_moe_layer, linear=cuda_linear,
                       builder=CudaLinearBuilder, prepare=prepare_weights, start_prefetch=cuda_start_prefetch,
                       join_prefetch=cuda_moe.join_l2_prefetch, moe_add_norm=cuda_moe_add_norm)
