"""The backend interface: data structures that cross into ops, and the ops' signatures.

Activations are 2-D ``[num_tokens, features]`` arrays of the backend's activation dtype
(fp32 on numpy, bf16-as-uint16 on cuda). A step's tokens are flattened over sequences
(varlen layout)::

    token_ids     [ a0 a1 a2 a3 | b0 | c0 c1 ]      T = 7 tokens this step
    query_start   [ 0,           4,   5,    7 ]     B + 1 offsets
    context_lens  [ 4,           9,   2     ]       KV length of each sequence after this step
    block_tables  [[3, 0, 0], [5, 6, 0], [8, 0, 0]] padded with the null block 0
    slot_mapping  [ 48 49 50 51 | 104 | 128 129 ]   block * block_size + offset of each new token
    logits_rows   [ 3, 4, 6 ]                       rows whose logits are sampled
    request_ids   ( "a",         "b", "c" )         one per sequence (models with per-request state)
    state_slots   [ 3,           1,   4 ]           each sequence's state slot (recurrent layers)

With several KV cache groups (``openinfer.kv.spec``) ``kv_block_tables[g]`` / ``kv_slot_mappings[g]``
hold group g's table and write slots (empty for recurrent-state groups); ``block_tables`` /
``slot_mapping`` are the first paged group's (the only ones a dense model reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from openinfer.kv.spec import FullAttentionSpec, KVCacheSpec, RecurrentStateSpec
from openinfer.rope import RotaryEmbedding

# how each KV cache dtype name is stored (bf16 and fp8 as raw bits, as the kernels read them)
STORAGE_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16,
                  "float8_e4m3": np.uint8, "uint8": np.uint8, "int8": np.int8}


class BatchViews:
    """What a step's batch answers the same way on the host (``ForwardBatch``, NumPy arrays) and on
    the device (the CUDA backend's batch, CuPy arrays): the dataclass supplies the fields."""

    token_ids: Any
    context_lens: Any
    block_tables: Any
    slot_mapping: Any
    kv_block_tables: tuple
    kv_slot_mappings: tuple
    max_query_len: int

    def group_block_tables(self, group_id: int) -> Any:
        """KV cache group ``group_id``'s block tables (the one table when there is one group)."""
        return self.kv_block_tables[group_id] if self.kv_block_tables else self.block_tables

    def group_slot_mapping(self, group_id: int) -> Any:
        return self.kv_slot_mappings[group_id] if self.kv_slot_mappings else self.slot_mapping

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class ForwardBatch(BatchViews):
    """One step's input, built by the runner on the host (NumPy int32 arrays)."""

    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    query_start: np.ndarray  # [B+1]
    context_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, max_blocks_per_seq]
    slot_mapping: np.ndarray  # [T]
    logits_rows: np.ndarray  # [R] rows of T to compute logits for
    max_query_len: int
    max_context_len: int
    # [K, 2] (row of token_ids, row of the previous step's sampled ids): inputs sampled by a
    # step still in flight, filled on the device (async scheduling); empty when none
    token_sources: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    # [B] the request behind each sequence, for models that keep per-request state outside the
    # KV pool (recurrent layers in state slots); empty when the caller has no request ids.
    request_ids: tuple[str, ...] = ()
    # per KV cache group id: [B, max_blocks_g] tables and [T] write slots (-1: no write; for a
    # compressed group only the token completing an entry writes). Empty: one group, above.
    kv_block_tables: tuple[np.ndarray, ...] = ()
    kv_slot_mappings: tuple[np.ndarray, ...] = ()
    # [B] each sequence's state slot (0, the null slot, for padding); empty without state layers
    state_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # [S, 3] (sequence, rows of it before the boundary, snapshot slot): after that many of the
    # sequence's rows, copy its state into the snapshot slot, then go on (models whose
    # ``RecurrentStateSpec.snapshot_within_step``; the prefix cache's snapshots inside a chunk)
    state_snapshots: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))

    @classmethod
    def over_blocks(cls, block_tables: np.ndarray, cached: list[int], new: list[int], block_size: int,
                    token_ids: np.ndarray | None = None) -> ForwardBatch:
        """Sequence i has ``cached[i]`` tokens in the cache already and runs ``new[i]`` more, over
        row i of ``block_tables`` (its blocks, as a KV manager would hand them out); logits for
        each sequence's last token. For kernel tests and benchmarks that build steps by hand."""
        lengths = [c + n for c, n in zip(cached, new, strict=True)]
        tables = np.asarray(block_tables, np.int32)
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new, strict=True)]).astype(np.int32)
        seq_of_token = np.repeat(np.arange(len(new)), new)
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
        num_tokens = int(sum(new))
        ids = np.zeros(num_tokens, np.int32) if token_ids is None else np.asarray(token_ids, np.int32)
        return cls(token_ids=ids, positions=positions, query_start=query_start,
                   context_lens=np.asarray(lengths, np.int32), block_tables=tables,
                   slot_mapping=slots.astype(np.int32), logits_rows=(query_start[1:] - 1).astype(np.int32),
                   max_query_len=max(new), max_context_len=max(lengths))



DeviceBatch = Any  # a ForwardBatch whose arrays live on the backend's device


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention layer, for ``ops.attention``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RotaryEmbedding | None
    scale: float
    q_norm: Any = None  # per-head RMSNorm weight [head_dim] applied before RoPE (Qwen3), or None
    k_norm: Any = None
    norm_eps: float = 1e-6

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class KVLayer:
    """One layer's paged cache. Full attention / sliding window: ``k``/``v`` are
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``v is k`` for a shared K=V entry);
    MLA latent and compressed: ``k`` is ``[num_blocks, block_size, width]``, ``v`` None."""

    k: Any
    v: Any = None


@dataclass
class StateLayer:
    """One recurrent layer's state: ``tensors[name]`` is ``[num_slots, *shape]`` (see
    ``RecurrentStateSpec``); row = state slot."""

    tensors: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]

    def copy_slots(self, src: Any, dst: Any) -> None:
        """``state[dst] = state[src]`` in every tensor (snapshots and their restores)."""
        for tensor in self.tensors.values():
            tensor[dst] = tensor[src]


class Backend(Protocol):
    name: str
    xp: Any  # numpy or cupy

    # --- placing data ---
    def upload(self, array: np.ndarray) -> Any: ...                  # activations/small tensors
    def weight(self, array: np.ndarray) -> Any: ...                  # norms, embeddings
    def linear_weight(self, weight: np.ndarray, bias: np.ndarray | None = None) -> Any: ...
    def prepare_batch(self, batch: ForwardBatch) -> DeviceBatch: ...
    # one layer's cache for ``spec`` (a ``KVCacheSpec``): ``num_blocks`` blocks, or slots for a
    # ``RecurrentStateSpec`` (→ ``StateLayer``). The legacy form (num_blocks, block_size,
    # num_kv_heads, head_dim) allocates full-attention K and V.
    def allocate_kv(self, spec: Any, num_blocks: int, block_size: int = 0) -> KVLayer | StateLayer: ...
    def to_host(self, x: Any) -> np.ndarray: ...                     # float32 on the host

    # --- ops ---
    def embedding(self, table: Any, token_ids: Any) -> Any: ...
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any: ...
    def add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]: ...
    def linear(self, x: Any, weight: Any) -> Any: ...
    def silu_mul(self, gate_up: Any) -> Any: ...
    def attention(self, qkv: Any, spec: AttentionSpec, kv: KVLayer, batch: DeviceBatch) -> Any: ...
    def gather_rows(self, x: Any, rows: Any) -> Any: ...
    def add(self, a: Any, b: Any) -> Any: ...


def allocate_cache(xp: Any, spec: Any, num_blocks: int, block_size: int = 0, *legacy: int,
                   default_dtype: str = "float32") -> KVLayer | StateLayer:
    """Zeroed cache tensors for one layer (``xp`` is numpy or cupy); see ``Backend.allocate_kv``.
    ``allocate_cache(xp, num_blocks, block_size, num_kv_heads, head_dim)`` is the legacy form."""
    if not isinstance(spec, KVCacheSpec):  # legacy positional form: full attention K and V
        num_blocks, block_size, (num_kv_heads, head_dim) = spec, num_blocks, (block_size, *legacy)
        spec = FullAttentionSpec(num_kv_heads, head_dim, default_dtype)
    if isinstance(spec, RecurrentStateSpec):
        return StateLayer({t.name: xp.zeros((num_blocks, *t.shape), STORAGE_DTYPES[t.dtype]) for t in spec.tensors})
    if block_size <= 0:
        raise ValueError(f"allocate_kv({type(spec).__name__}) needs a block_size, got {block_size}")
    dtype = STORAGE_DTYPES[spec.dtype]
    if isinstance(spec, FullAttentionSpec):  # also sliding window
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        k = xp.zeros(shape, dtype)
        return KVLayer(k, k if spec.shared_kv else xp.zeros(shape, dtype))
    width = spec.entry_bytes // np.dtype(dtype).itemsize  # MLA latent / compressed: one entry
    return KVLayer(xp.zeros((num_blocks, block_size, width), dtype), None)
