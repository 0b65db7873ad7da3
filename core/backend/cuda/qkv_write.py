"""q/k RMSNorm + RoPE + paged KV write with 16-byte accesses: ``qk_norm_rope.cu``'s
``qk_norm_rope_write_kv_vec`` (HEAD_DIM / 8 lanes per head, one 16-byte load and store per lane)
beside ``attention.write_qkv``'s one-warp-per-head kernel (2-byte accesses).

Opt-in (``OPENINFER_VECTOR_QKV_WRITE=1``) until measured on a GPU; ``benchmarks/gpu_elementwise.py``
times both. The results equal the warp kernel's up to the last bit of q / k (the head's sum of
squares is taken in another order); v is copied bit for bit.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import cupy
import numpy as np

from openinfer.backend.base import AttentionSpec, KVLayer
from openinfer.backend.cuda.loader import kernel

if TYPE_CHECKING:
    from openinfer.backend.cuda.attention import RopeTables
    from openinfer.backend.cuda.batch import CudaBatch

VECTOR_QKV_WRITE_ENV = "OPENINFER_VECTOR_QKV_WRITE"
MAX_THREADS = 256  # qk_norm_rope_write_kv_vec's __launch_bounds__
NULL = np.uint64(0)  # a null pointer argument


@functools.cache
def wants_vector_qkv_write() -> bool:
    """OPENINFER_VECTOR_QKV_WRITE ("1" / "0", default "0"), read once per process."""
    raw = os.environ.get(VECTOR_QKV_WRITE_ENV, "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{VECTOR_QKV_WRITE_ENV}={raw!r}: expected '0' or '1'")
    return raw == "1"


def vector_qkv_write_supported(spec: AttentionSpec) -> bool:
    """Whether the 16-byte kernel runs this head layout: HEAD_DIM / 8 lanes must divide a warp, and
    NeoX partners (lane j and j + rotary_dim / 16) must be an xor apart (rotary_dim / 16 a power of two)."""
    lanes_per_head = spec.head_dim // 8
    if spec.head_dim % 8 or lanes_per_head == 0 or 32 % lanes_per_head:
        return False
    rotary_dim = 0 if spec.rope is None else spec.rope.rotary_dim
    if rotary_dim == 0:
        return True
    partner_distance = rotary_dim // 16
    return (rotary_dim % 16 == 0 and rotary_dim <= spec.head_dim
            and partner_distance & (partner_distance - 1) == 0)


def write_qkv_vectorized(qkv: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch,
                         ropes: RopeTables) -> cupy.ndarray:
    """``attention.write_qkv`` on the 16-byte kernel: norm + rotate q and k, store k / v at the
    batch's slots (a negative slot writes nothing); returns q ``[T, nh, d]``."""
    if not vector_qkv_write_supported(spec):
        raise ValueError(f"the 16-byte q/k/v write does not take head_dim {spec.head_dim} with rotary_dim "
                         f"{0 if spec.rope is None else spec.rope.rotary_dim}; use attention.write_qkv")
    heads_per_token = spec.num_heads + 2 * spec.num_kv_heads
    if qkv.ndim != 2 or qkv.shape[1] != heads_per_token * spec.head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)}: expected [tokens, q+k+v = {heads_per_token * spec.head_dim}]")
    qkv = cupy.ascontiguousarray(qkv)
    num_tokens = qkv.shape[0]
    q = cupy.empty((num_tokens, spec.num_heads, spec.head_dim), dtype=cupy.uint16)
    if num_tokens == 0:
        return q
    if spec.rope is not None:
        cos, sin = ropes.get(spec.rope)
        rotary_dim = spec.rope.rotary_dim
    else:
        cos = sin = NULL
        rotary_dim = 0
    lanes = heads_per_token * (spec.head_dim // 8)
    threads = min(MAX_THREADS, -(-lanes // 32) * 32)
    kernel("qk_norm_rope.cu", "qk_norm_rope_write_kv_vec", HEAD_DIM=spec.head_dim)(
        (num_tokens, -(-lanes // threads)), (threads,),
        (qkv, q, kv.k, kv.v,
         spec.q_norm if spec.q_norm is not None else NULL, spec.k_norm if spec.k_norm is not None else NULL,
         np.float32(spec.norm_eps), cos, sin, np.int32(rotary_dim), batch.positions, batch.slot_mapping,
         np.int32(spec.num_heads), np.int32(spec.num_kv_heads)))
    return q
