"""Paged KV memory: per-layer cache specs and groups, the block pool (ids, ref counts, prefix
cache), the state-slot pool and the per-request manager.

The pool only hands out block ids; each model decides the tensor layout behind them
(GQA K/V, MLA latents, ...) through its specs (``openinfer.kv.spec``). The same allocator
serves the NumPy and CUDA backends.
"""

from openinfer.kv.block_pool import NULL_BLOCK_ID, Block, BlockPool, hash_block_tokens
from openinfer.kv.manager import KVCacheManager
from openinfer.kv.spec import (
    CompressedSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheGroups,
    KVCachePlan,
    KVCacheSpec,
    MLALatentSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    StateTensor,
    group_specs,
    plan_kv_cache,
)
from openinfer.kv.state_slots import NULL_SLOT_ID, StateSlots

__all__ = [
    "Block", "BlockPool", "CompressedSpec", "FullAttentionSpec", "KVCacheGroup", "KVCacheGroups",
    "KVCacheManager", "KVCachePlan", "KVCacheSpec", "MLALatentSpec", "NULL_BLOCK_ID", "NULL_SLOT_ID",
    "RecurrentStateSpec", "SlidingWindowSpec", "StateSlots", "StateTensor", "group_specs",
    "hash_block_tokens", "plan_kv_cache",
]
