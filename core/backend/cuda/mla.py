"""Multi-head latent attention on the GPU, absorbed form, over the paged latent cache
(kernels in ``openinfer/kernels/mla.cu``; the NumPy reference is ``openinfer.mla``).

One step, T new tokens, H heads::

    mla_write_latent   rms(c_kv)·w | rope(k_pe) → cache[slot];  rope(q_pe) in place
    W_UK (batched)     q_latent[t, h] = q_nope[t, h] · W_UK[h]             [T, H, lora]
    mla_attention      o_latent[t, h] = softmax(q̃·c_kv + q_pe·k_pe) · c_kv  over positions ≤ t
    W_UV (batched)     o[t, h]        = W_UV[h] · o_latent[t, h]          [T, H·v]

Prefill tokens take the same path (each token attends over its own causal context), so a
mixed batch needs no second kernel.
"""

from __future__ import annotations

import cupy
import numpy as np

from openinfer.backend.cuda.cublas import Cublas
from openinfer.backend.cuda.loader import kernel
from openinfer.mla import MLASpec

HEADS_PER_BLOCK = 16  # mla.cu
MLA_THREADS = 256
MAX_SPLITS = 16
NULL = np.uint64(0)


def num_splits(num_tokens: int, head_chunks: int, num_sms: int) -> int:
    """Context splits per token: about two waves of blocks over the SMs, at most 16, 1 for
    prefill-sized steps. Depends on the token count only, so a captured decode graph stays valid
    for every context length."""
    return max(1, min(MAX_SPLITS, -(-2 * num_sms // (num_tokens * head_chunks))))


def _defines(spec: MLASpec) -> dict[str, int]:
    return {"KV_LORA": spec.kv_lora_rank, "ROPE_DIM": spec.qk_rope_dim}


def check_spec(spec: MLASpec) -> None:
    if spec.kv_lora_rank % 16 or spec.qk_rope_dim % 2:
        raise ValueError(f"cuda MLA needs kv_lora_rank % 16 == 0 and an even rope dim, got {spec.kv_lora_rank}, "
                         f"{spec.qk_rope_dim}")


def mla_forward(blas: Cublas, q: cupy.ndarray, latent: cupy.ndarray, cache: cupy.ndarray, w_uk: cupy.ndarray,
                w_uv: cupy.ndarray, kv_a_norm: cupy.ndarray, spec: MLASpec, batch, cos: cupy.ndarray,
                sin: cupy.ndarray, eps: float, num_sms: int = 132) -> cupy.ndarray:
    """``q [T, H·(nope+rope)]`` (rope dims not yet rotated; rotated on a copy here) and ``latent``
    ``[T, lora + rope]`` (a row view of kv_a's output, un-normed) → attention output ``[T, H·v]``.
    ``cache`` is the layer's ``[num_blocks, block_size, …, lora + rope]`` bf16 latent cache;
    ``w_uk [H, nope, lora]`` and ``w_uv [H, v, lora]`` are kv_b split per head (bf16)."""
    check_spec(spec)
    num_tokens = int(q.shape[0])
    heads, nope, lora, v = spec.num_heads, spec.qk_nope_dim, spec.kv_lora_rank, spec.v_head_dim
    head_dim = spec.qk_head_dim
    out = cupy.empty((num_tokens, heads * v), dtype=cupy.uint16)
    if num_tokens == 0:
        return out
    q = cupy.ascontiguousarray(q)  # its rope dims are rotated in place: callers pass a buffer they own
    block_size = int(cache.shape[1])
    kernel("mla.cu", "mla_write_latent", **_defines(spec))((num_tokens,), (128,), (
        latent, np.int32(latent.strides[0] // 2), kv_a_norm, np.float32(eps), q, np.int32(heads),
        np.int32(head_dim), np.int32(nope), batch.positions, batch.slot_mapping, cos, sin, cache))
    q_latent = cupy.empty((num_tokens, heads, lora), dtype=cupy.uint16)
    # q_latent_h^T [lora x T] = W_UK[h]^T [lora x nope] . q_nope_h^T [nope x T]   (column-major)
    blas.matmul_strided_batched(False, False, lora, num_tokens, nope, w_uk, lora, nope * lora,
                                q, heads * head_dim, head_dim, q_latent, heads * lora, lora, heads)
    o_latent = cupy.empty((num_tokens, heads, lora), dtype=cupy.uint16)
    head_chunks = -(-heads // HEADS_PER_BLOCK)
    splits = num_splits(num_tokens, head_chunks, num_sms)
    partial_o = partial_ml = NULL
    if splits > 1:
        partial_o = cupy.empty((num_tokens, heads, splits, lora), dtype=cupy.float32)
        partial_ml = cupy.empty((num_tokens, heads, splits, 2), dtype=cupy.float32)
    kernel("mla.cu", "mla_attention", **_defines(spec))((num_tokens, head_chunks, splits), (MLA_THREADS,), (
        q_latent, q, np.int32(head_dim), np.int32(nope), cache, batch.block_tables,
        np.int32(batch.block_tables.shape[1]), np.int32(block_size), batch.query_start, np.int32(batch.num_seqs),
        batch.positions, np.int32(heads), np.float32(spec.scale), o_latent, np.int32(splits), partial_o, partial_ml))
    if splits > 1:
        kernel("mla.cu", "mla_combine_splits", **_defines(spec))((num_tokens * heads,), (128,), (
            partial_o, partial_ml, np.int32(splits), o_latent))
    # o_h^T [v x T] = W_UV[h] [v x lora] . o_latent_h^T [lora x T]
    blas.matmul_strided_batched(True, False, v, num_tokens, lora, w_uv, lora, v * lora,
                                o_latent, heads * lora, lora, out, heads * v, v, heads)
    return out
