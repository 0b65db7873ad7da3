"""The CUDA plan's Qwen3.5 ops: launchers for ``kernels/gated_deltanet.cu`` (bf16, CuPy).

One cached loader compiles the source per key-head dim (``-DDK=...``: the delta-rule kernel
keeps a state column in registers). Every launcher checks its inputs and raises ``ValueError``
naming what was wrong. Imported only when the model runs on the cuda backend.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import cupy
import numpy as np

from openinfer_qwen35.config import Qwen35Config
from openinfer_qwen35.kernel_plan import KernelPlan
from openinfer_qwen35.state import StepSequences
from openinfer_qwen35.weights import DeltaNetWeights

SOURCE = "gated_deltanet.cu"
MAX_CONV_WIDTH = 9  # gdn_conv_state keeps K-1 <= 8 old inputs in registers
MAX_KEY_HEAD_DIM = 256
SPLIT = 4  # threads per value channel in gdn_delta_rule (each holds DK / SPLIT state rows)
TILE_DV = 32  # value channels per gdn_delta_rule block (a head spreads over dv / 32 blocks)


@functools.cache
def _module(key_head_dim: int) -> cupy.RawModule:
    code = (resources.files("openinfer_qwen35") / "kernels" / SOURCE).read_text()
    return cupy.RawModule(code=code, options=("-std=c++17", f"-DDK={key_head_dim}", f"-DSPLIT={SPLIT}"))


def kernel(name: str, key_head_dim: int = 128) -> cupy.RawKernel:
    return _module(key_head_dim).get_function(name)


def _blocks(n: int, threads: int = 256, cap: int = 8192) -> int:
    return max(1, min(cap, (n + threads - 1) // threads))


def _bf16(x: Any, what: str) -> cupy.ndarray:
    if not isinstance(x, cupy.ndarray) or x.dtype != cupy.uint16:
        raise ValueError(f"{what} must be a bf16 (uint16) CuPy array, got {type(x).__name__} "
                         f"{getattr(x, 'dtype', '')}")
    return x


def prepare_sequences(seqs: StepSequences) -> StepSequences:
    """Device int32 copies of the step's sequence arrays (one small upload per step)."""
    query_start = seqs.query_start.astype(np.int32)
    token_seq = np.repeat(np.arange(len(seqs.slots), dtype=np.int32), np.diff(query_start))
    packed = cupy.asarray(np.concatenate([query_start, seqs.slots.astype(np.int32),
                                          seqs.fresh.astype(np.int32), token_seq]))
    num_seqs = len(seqs.slots)
    views = {"query_start": packed[: num_seqs + 1], "slots": packed[num_seqs + 1 : 2 * num_seqs + 1],
             "fresh": packed[2 * num_seqs + 1 : 3 * num_seqs + 1], "token_seq": packed[3 * num_seqs + 1 :]}
    return StepSequences(seqs.query_start, seqs.slots, seqs.fresh, device=views)


def device_sequences(batch: Any) -> StepSequences:
    """The step's sequences straight from a ``CudaBatch``'s device arrays: slots from
    ``batch.state_slots``, ``fresh`` where the context starts with this step (or is empty: a
    CUDA-graph padding row, which then reads zeros and writes the null slot). Decode steps
    touch no host memory, so they can be captured in a CUDA graph; prefill steps upload the
    row → sequence map."""
    if batch.state_slots is None:
        raise ValueError("Qwen3.5 keeps recurrent state: the device batch carries no state_slots "
                         "(the engine fills them from the model's RecurrentStateSpec)")
    num_seqs = batch.num_seqs
    query_start = batch.query_start
    fresh = ((batch.context_lens - (query_start[1:] - query_start[:-1])) <= 0).astype(cupy.int32)
    if batch.num_tokens == num_seqs:  # one token per sequence (decode, graph replay)
        token_seq = cupy.arange(num_seqs, dtype=cupy.int32)
    else:
        host = np.asarray(batch.host.query_start, np.int32)
        token_seq = cupy.asarray(np.repeat(np.arange(num_seqs, dtype=np.int32), np.diff(host)))
    views = {"query_start": query_start, "slots": batch.state_slots, "fresh": fresh, "token_seq": token_seq}
    return StepSequences(None, batch.state_slots, fresh, device=views)


def delta_net(proj: cupy.ndarray, w: DeltaNetWeights, conv_state: cupy.ndarray, ssm_state: cupy.ndarray,
              seqs: StepSequences, config: Qwen35Config) -> cupy.ndarray:
    """``[T, q|k|v|z|b|a]`` bf16 → gated-normed ``[T, nv·dv]`` bf16; updates the slots in place."""
    proj = cupy.ascontiguousarray(_bf16(proj, "delta_net projection"))
    conv_dim, value_dim = config.conv_dim, config.linear_value_dim
    nk, nv, dk, dv = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                      config.linear_value_head_dim)
    width = config.linear_conv_kernel_dim
    if proj.shape[1] != conv_dim + value_dim + 2 * nv:
        raise ValueError(f"delta_net projection has {proj.shape[1]} features, expected "
                         f"{conv_dim + value_dim + 2 * nv} (q|k|v|z|b|a)")
    if not 2 <= width <= MAX_CONV_WIDTH or dk > MAX_KEY_HEAD_DIM or dk % SPLIT:
        raise ValueError(f"cuda Gated DeltaNet supports conv width 2..{MAX_CONV_WIDTH} and key head dims <= "
                         f"{MAX_KEY_HEAD_DIM} divisible by {SPLIT}; got {width} and {dk}")
    if ssm_state.dtype != cupy.float32 or conv_state.dtype != cupy.uint16:
        raise ValueError("state slots must be fp32 (ssm) and bf16 (conv) CuPy arrays")
    device = seqs.device
    num_tokens, num_seqs = proj.shape[0], len(seqs.slots)
    stride = np.int32(proj.shape[1])
    conv_out = cupy.empty((num_tokens, conv_dim), dtype=cupy.uint16)
    core = cupy.empty((num_tokens, value_dim), dtype=cupy.uint16)  # delta-rule output, before the norm
    out = cupy.empty((num_tokens, value_dim), dtype=cupy.uint16)
    if num_tokens == 0:
        return out
    kernel("gdn_conv1d", dk)(
        (_blocks(num_tokens * conv_dim),), (256,),
        (proj, stride, w.conv_weight, conv_state, device["query_start"], device["slots"], device["fresh"],
         device["token_seq"], conv_out, np.int32(num_tokens), np.int32(conv_dim), np.int32(width)))
    kernel("gdn_conv_state", dk)(
        (_blocks(num_seqs * conv_dim),), (256,),
        (proj, stride, conv_state, device["query_start"], device["slots"], device["fresh"], np.int32(num_seqs),
         np.int32(conv_dim), np.int32(width)))
    tile_dv = min(dv, TILE_DV)
    kernel("gdn_delta_rule", dk)(
        (num_seqs, nv, -(-dv // tile_dv)), (-(-tile_dv * SPLIT // 32) * 32,),
        (proj, stride, conv_out, ssm_state, w.neg_decay_rate, w.dt_bias, device["query_start"], device["slots"],
         device["fresh"], core, np.int32(nk), np.int32(nv), np.int32(dv), np.int32(tile_dv)))
    kernel("gdn_gated_norm", dk)(
        (num_tokens, nv), (min(256, -(-dv // 32) * 32),),
        (core, proj, stride, w.norm, out, np.int32(conv_dim), np.int32(value_dim), np.int32(dv),
         np.float32(config.rms_norm_eps)))
    return out


def sigmoid_mul(x: cupy.ndarray, gate: cupy.ndarray) -> cupy.ndarray:
    """``x · sigmoid(gate)``; ``gate`` may be a column slice of a wider array (row stride kept)."""
    x = cupy.ascontiguousarray(_bf16(x, "sigmoid_mul input"))
    gate = _bf16(gate, "sigmoid_mul gate")
    if gate.shape != x.shape or gate.strides[1] != 2:
        raise ValueError(f"sigmoid_mul: gate {tuple(gate.shape)} (strides {gate.strides}) must match x "
                         f"{tuple(x.shape)} with contiguous rows")
    out = cupy.empty_like(x)
    if x.size:
        kernel("sigmoid_mul")((_blocks(x.size),), (256,),
                              (x, gate, np.int32(gate.strides[0] // 2), out, np.int64(x.shape[0]),
                               np.int32(x.shape[1])))
    return out


def rms_norm(x: cupy.ndarray, weight: cupy.ndarray, eps: float) -> cupy.ndarray:
    """Zero-centred RMSNorm with the fp32 weight ``1 + w``."""
    x = cupy.ascontiguousarray(_bf16(x, "rms_norm input"))
    out = cupy.empty_like(x)
    features = x.shape[-1]
    if x.size:
        kernel("zero_centred_rms_norm")((x.size // features,), (min(1024, -(-features // 32) * 32),),
                                        (x, weight, out, np.int32(features), np.float32(eps)))
    return out


def add_rms_norm(x: cupy.ndarray, residual: cupy.ndarray, weight: cupy.ndarray,
                 eps: float) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``residual + x`` (bf16) and its zero-centred RMSNorm with the fp32 weight ``1 + w``."""
    x = cupy.ascontiguousarray(_bf16(x, "add_rms_norm input"))
    residual = cupy.ascontiguousarray(_bf16(residual, "add_rms_norm residual"))
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    out, summed = cupy.empty_like(x), cupy.empty_like(x)
    features = x.shape[-1]
    if x.size:
        kernel("zero_centred_add_rms_norm")((x.size // features,), (min(1024, -(-features // 32) * 32),),
                                            (x, residual, weight, out, summed, np.int32(features), np.float32(eps)))
    return out, summed


def _fp32_device(array: np.ndarray) -> cupy.ndarray:
    return cupy.asarray(np.ascontiguousarray(array, dtype=np.float32))


CUDA_PLAN = KernelPlan(
    backend="cuda",
    sigmoid_mul=sigmoid_mul,
    delta_net=delta_net,
    fp32_vector=_fp32_device,
    conv_state_dtype="bfloat16",
    step_sequences=device_sequences,
    rms_norm=rms_norm,
    add_rms_norm=add_rms_norm,
    norm_weight=_fp32_device,
)
