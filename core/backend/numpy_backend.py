"""The NumPy backend: fp32 on the CPU. The reference every other backend is tested against,
and fast enough to serve the demo model (weights pre-transposed and contiguous, BLAS GEMMs)."""

from __future__ import annotations

from typing import Any

import numpy as np

from openinfer.backend.base import AttentionSpec, ForwardBatch, KVLayer, StateLayer, allocate_cache
from openinfer.backend.blas_threads import BlasThreads
from openinfer.rope import RotaryEmbedding


class NumpyLinear:
    """A linear layer's weight stored as ``[in_features, out_features]`` contiguous fp32, so
    ``x @ w`` is one row-major GEMM with no transpose at run time."""

    __slots__ = ("weight_t", "bias", "in_features", "out_features")

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None):
        self.out_features, self.in_features = weight.shape
        self.weight_t = np.ascontiguousarray(weight.T, dtype=np.float32)
        self.bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)


class NumpyBackend:
    name = "numpy"
    xp = np
    activation_dtype = np.float32
    kv_dtype = "float32"  # the KV cache dtype name models put in their specs
    # GEMMs with at most this many rows (decode, small prefill chunks) run on one BLAS thread;
    # see openinfer.backend.blas_threads for the measurements behind it.
    single_thread_max_rows = 64

    def __init__(self) -> None:
        self.blas_threads = BlasThreads()
        self._rope_memo: tuple[np.ndarray, RotaryEmbedding, np.ndarray, np.ndarray] | None = None

    # --- placing data ----------------------------------------------------------------------------

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array, dtype=np.float32)

    def weight(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array, dtype=np.float32)

    def linear_weight(self, weight: np.ndarray, bias: np.ndarray | None = None) -> NumpyLinear:
        return NumpyLinear(weight, bias)

    def prepare_batch(self, batch: ForwardBatch) -> ForwardBatch:
        self._rope_memo = None  # a new step: its positions get their own RoPE tables
        return batch

    def allocate_kv(self, spec: Any, num_blocks: int, block_size: int = 0, *legacy: int) -> KVLayer | StateLayer:
        """One layer's cache for a ``KVCacheSpec`` (see ``Backend.allocate_kv``)."""
        return allocate_cache(np, spec, num_blocks, block_size, *legacy, default_dtype=self.kv_dtype)

    def fill_token_sources(self, batch: ForwardBatch, previous_token_ids: np.ndarray, sources: np.ndarray) -> None:
        """Inputs sampled by the previous step: ``token_ids[dest] = previous[src]``."""
        batch.token_ids[sources[:, 0]] = np.asarray(previous_token_ids)[sources[:, 1]]

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    def synchronize(self) -> None:
        pass

    # --- ops -------------------------------------------------------------------------------------

    def embedding(self, table: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        return table[token_ids]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        # Few NumPy calls, in place where possible: a decode step runs this 2x per layer on
        # [batch, hidden], where per-call overhead costs more than the arithmetic.
        inverse_rms = np.einsum("...i,...i->...", x, x)[..., None]
        inverse_rms *= 1.0 / x.shape[-1]
        inverse_rms += eps
        np.sqrt(inverse_rms, out=inverse_rms)
        out = x / inverse_rms
        out *= weight
        return out

    def add_rms_norm(self, x: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                     eps: float) -> tuple[np.ndarray, np.ndarray]:
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def linear(self, x: np.ndarray, weight: NumpyLinear) -> np.ndarray:
        self.blas_threads.for_rows(x.shape[0], self.single_thread_max_rows)
        out = x @ weight.weight_t
        if weight.bias is not None:
            out += weight.bias
        return out

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        half = gate_up.shape[-1] // 2
        gate = gate_up[..., :half]
        out = np.negative(gate)
        np.exp(out, out=out)
        out += 1.0
        np.divide(gate, out, out=out)
        out *= gate_up[..., half:]
        return out

    def gather_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def rope_tables(self, rope: RotaryEmbedding, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``cos [T, 1, rotary_dim]`` and signed ``sin [T, 1, rotary_dim]`` of the step's positions,
        built once per step (``prepare_batch`` clears the memo) and shared by every layer::

            cos = [ cos | cos ]      sin = [ -sin | sin ]      (each half rotary_dim / 2)
        """
        memo = self._rope_memo
        if memo is not None and memo[0] is positions and memo[1] is rope:
            return memo[2], memo[3]
        cos, sin = rope.cos[positions], rope.sin[positions]
        cos_full = np.concatenate([cos, cos], axis=-1)[:, None, :]
        sin_signed = np.concatenate([-sin, sin], axis=-1)[:, None, :]
        self._rope_memo = (positions, rope, cos_full, sin_signed)
        return cos_full, sin_signed

    def apply_rope(self, x: np.ndarray, positions: np.ndarray, spec: AttentionSpec) -> np.ndarray:
        """NeoX (rotate-half) RoPE on the first ``rotary_dim`` dims of each head of ``x [T, H, D]``:
        ``[x1, x2] → [x1·cos − x2·sin, x2·cos + x1·sin]``."""
        rope = spec.rope
        rotary_dim, half = rope.rotary_dim, rope.rotary_dim // 2
        cos, sin = self.rope_tables(rope, positions)
        rotating = x[..., :rotary_dim]
        swapped = np.concatenate([rotating[..., half:], rotating[..., :half]], axis=-1)
        swapped *= sin
        out = rotating * cos
        out += swapped
        if rotary_dim == x.shape[-1]:
            return out
        return np.concatenate([out, x[..., rotary_dim:]], axis=-1)

    def write_kv(self, k: np.ndarray, v: np.ndarray, kv: KVLayer, slot_mapping: np.ndarray) -> None:
        num_kv_heads, head_dim = kv.k.shape[2:]
        kv.k.reshape(-1, num_kv_heads, head_dim)[slot_mapping] = k
        kv.v.reshape(-1, num_kv_heads, head_dim)[slot_mapping] = v

    def attention(self, qkv: np.ndarray, spec: AttentionSpec, kv: KVLayer, batch: ForwardBatch) -> np.ndarray:
        """Per-head q/k norm → RoPE → paged KV write → causal GQA attention over each
        sequence's whole context (cached + new); returns ``[T, num_heads * head_dim]``."""
        num_tokens = qkv.shape[0]
        d, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
        q = qkv[:, : spec.q_size].reshape(num_tokens, nh, d)
        k = qkv[:, spec.q_size : spec.q_size + spec.kv_size].reshape(num_tokens, nkv, d)
        v = qkv[:, spec.q_size + spec.kv_size : spec.q_size + 2 * spec.kv_size].reshape(num_tokens, nkv, d)
        if spec.q_norm is not None:
            q = self.rms_norm(q, spec.q_norm, spec.norm_eps)
            k = self.rms_norm(k, spec.k_norm, spec.norm_eps)
        if spec.rope is not None and spec.q_norm is None:  # q and k side by side: rotate both at once
            qk = self.apply_rope(qkv[:, : spec.q_size + spec.kv_size].reshape(num_tokens, nh + nkv, d),
                                 batch.positions, spec)
            q, k = qk[:, :nh], qk[:, nh:]
        elif spec.rope is not None:
            q = self.apply_rope(q, batch.positions, spec)
            k = self.apply_rope(k, batch.positions, spec)
        self.write_kv(k, v, kv, batch.slot_mapping)
        return paged_attention(q, kv, batch, spec.scale).reshape(num_tokens, nh * d)


def paged_attention(q: np.ndarray, kv: KVLayer, batch: ForwardBatch, scale: float) -> np.ndarray:
    """Causal attention of ``q [T, nh, d]`` over the paged KV of each sequence in the batch.

    The i-th of a sequence's ``n`` new queries sits at position ``L - n + i`` of its context of
    length ``L`` and sees keys ``0 ..= L - n + i``. GQA: query head ``h`` reads KV head
    ``h // (nh // nkv)``.
    """
    num_tokens, nh, d = q.shape
    block_size, nkv = kv.k.shape[1], kv.k.shape[2]
    group = nh // nkv
    out = np.empty_like(q)
    for i in range(batch.num_seqs):
        start, end = int(batch.query_start[i]), int(batch.query_start[i + 1])
        n, length = end - start, int(batch.context_lens[i])
        if n == 0:
            continue
        blocks = batch.block_tables[i, : -(-length // block_size)]
        keys = kv.k[blocks].reshape(-1, nkv, d)[:length]  # [L, nkv, d]
        values = kv.v[blocks].reshape(-1, nkv, d)[:length]
        # [nkv, group * n, d] @ [nkv, d, L] -> [nkv, group * n, L]
        queries = q[start:end].reshape(n, nkv, group, d).transpose(1, 2, 0, 3).reshape(nkv, group * n, d)
        scores = (queries @ keys.transpose(1, 2, 0)) * scale
        if n > 1:
            query_pos = (length - n + np.arange(n))[None, :, None]  # [1, n, 1]
            key_pos = np.arange(length)[None, None, :]
            mask = np.broadcast_to(key_pos > query_pos, (group, n, length)).reshape(group * n, length)
            scores = np.where(mask[None], -np.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        context = probs @ values.transpose(1, 0, 2)  # [nkv, group * n, d]
        out[start:end] = context.reshape(nkv, group, n, d).transpose(2, 0, 1, 3).reshape(n, nh, d)
    return out
