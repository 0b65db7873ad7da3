"""q/k RMSNorm + RoPE + paged KV write with 16-byte accesses: ``qk_norm_rope.cu``'s
``qk_norm_rope_write_kv_vec`` (HEAD_DIM / 8 lanes per head, one 16-byte load and store per lane and
token) beside ``attention.write_qkv``'s one-warp-per-head kernel (2-byte accesses).

The default where the head layout allows it (``OPENINFER_VECTOR_QKV_WRITE=0`` reverts): E2 (H200,
``benchmarks/gpu_elementwise.py``, Qwen3-4B's 32 + 8 + 8 heads) measured it 1.6x the warp kernel
at 1k-16k tokens (16k: 231 -> 141 us, 42 -> 69 % of copy bandwidth), 1.4x at 256, equal at 1-64.
The results equal the warp kernel's up to the last bit of q / k (the head's sum of squares is taken
in another order); v is copied bit for bit. For measuring: ``OPENINFER_QKV_TOKENS_PER_THREAD``
(1, 2 or 4) gives each thread that many tokens' loads in flight, ``OPENINFER_QKV_PREFETCH_ROPE=1``
loads cos / sin with the row, ``OPENINFER_QKV_SCALAR_ROPE=1`` reads them element by element inside
the rotation (32 registers at one token per thread instead of 40-48 with the 16-byte cos / sin
loads of 057af7b: more resident warps, so more row loads in flight; the same arithmetic in other
code shapes).
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
TOKENS_PER_THREAD_ENV = "OPENINFER_QKV_TOKENS_PER_THREAD"
TOKENS_PER_THREAD_CHOICES = (1, 2, 4)
PREFETCH_ROPE_ENV = "OPENINFER_QKV_PREFETCH_ROPE"
SCALAR_ROPE_ENV = "OPENINFER_QKV_SCALAR_ROPE"
MAX_THREADS = 256  # qk_norm_rope_write_kv_vec's __launch_bounds__
NULL = np.uint64(0)  # a null pointer argument


_override: list[bool | None] = [None]  # set_vector_qkv_write's choice, above the environment


@functools.cache
def _vector_qkv_write_env() -> bool:
    raw = os.environ.get(VECTOR_QKV_WRITE_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{VECTOR_QKV_WRITE_ENV}={raw!r}: expected '0' or '1'")
    return raw == "1"


def wants_vector_qkv_write() -> bool:
    """Whether ``attention.write_qkv`` takes the 16-byte kernel: ``set_vector_qkv_write``'s choice,
    else OPENINFER_VECTOR_QKV_WRITE ("1", the default, or "0"), read once per process."""
    return _vector_qkv_write_env() if _override[0] is None else _override[0]


def set_vector_qkv_write(on: bool | None) -> None:
    """Force the 16-byte kernel on or off for this process (benchmarks and tests timing or checking
    both kernels); None goes back to the environment's choice."""
    _override[0] = on


@functools.cache
def default_tokens_per_thread() -> int:
    """OPENINFER_QKV_TOKENS_PER_THREAD (1, the default, 2 or 4), read once per process."""
    raw = os.environ.get(TOKENS_PER_THREAD_ENV, "1")
    if raw not in tuple(map(str, TOKENS_PER_THREAD_CHOICES)):
        raise ValueError(f"{TOKENS_PER_THREAD_ENV}={raw!r}: expected one of {TOKENS_PER_THREAD_CHOICES}")
    return int(raw)


@functools.cache
def default_prefetch_rope() -> bool:
    """OPENINFER_QKV_PREFETCH_ROPE ("0", the default, or "1"), read once per process."""
    raw = os.environ.get(PREFETCH_ROPE_ENV, "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{PREFETCH_ROPE_ENV}={raw!r}: expected '0' or '1'")
    return raw == "1"


@functools.cache
def default_scalar_rope() -> bool:
    """OPENINFER_QKV_SCALAR_ROPE ("1", the default, or "0"), read once per process. E2 (H200,
    gpu_elementwise.py write_qkv, Qwen3-4B heads): 77.9 -> 72.4 us at 8k rows, 152.2 -> 141.2 us
    at 16k (61 -> 67 % of copy), 3.8 vs 3.9 us at 256; "0" takes the 16-byte cos / sin loads."""
    raw = os.environ.get(SCALAR_ROPE_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{SCALAR_ROPE_ENV}={raw!r}: expected '0' or '1'")
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
                         ropes: RopeTables, tokens_per_thread: int | None = None,
                         prefetch_rope: bool | None = None, scalar_rope: bool | None = None) -> cupy.ndarray:
    """``attention.write_qkv`` on the 16-byte kernel: norm + rotate q and k, store k / v at the
    batch's slots (a negative slot writes nothing); returns q ``[T, nh, d]``. ``tokens_per_thread``:
    1, 2 or 4 (None: ``OPENINFER_QKV_TOKENS_PER_THREAD``, default 1); ``prefetch_rope``: cos / sin
    loaded with the row (None: ``OPENINFER_QKV_PREFETCH_ROPE``, default off); ``scalar_rope``: cos /
    sin read per element in the rotation, unless prefetched (None: ``OPENINFER_QKV_SCALAR_ROPE``,
    default on)."""
    if tokens_per_thread is None:
        tokens_per_thread = default_tokens_per_thread()
    if prefetch_rope is None:
        prefetch_rope = default_prefetch_rope()
    if scalar_rope is None:
        scalar_rope = default_scalar_rope()
    if tokens_per_thread not in TOKENS_PER_THREAD_CHOICES:
        raise ValueError(f"tokens_per_thread must be one of {TOKENS_PER_THREAD_CHOICES}, got {tokens_per_thread}")
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
    kernel("qk_norm_rope.cu", "qk_norm_rope_write_kv_vec", HEAD_DIM=spec.head_dim,
           QKV_TOKENS_PER_THREAD=tokens_per_thread, QKV_PREFETCH_ROPE=int(prefetch_rope),
           QKV_SCALAR_ROPE=int(scalar_rope))(
        (-(-num_tokens // tokens_per_thread), -(-lanes // threads)), (threads,),
        (qkv, q, kv.k, kv.v,
         spec.q_norm if spec.q_norm is not None else NULL, spec.k_norm if spec.k_norm is not None else NULL,
         np.float32(spec.norm_eps), cos, sin, np.int32(rotary_dim), batch.positions, batch.slot_mapping,
         np.int32(num_tokens), np.int32(spec.num_heads), np.int32(spec.num_kv_heads)))
    return q
