"""Paged KV memory: the block pool (ids, ref counts, prefix cache) and the per-request manager.

The pool only hands out block ids; each model decides the tensor layout behind them
(GQA K/V, MLA latents, ...). The same allocator serves the NumPy and CUDA backends.
"""

from openinfer.kv.block_pool import Block, BlockPool, hash_block_tokens
from openinfer.kv.manager import KVCacheManager

__all__ = ["Block", "BlockPool", "KVCacheManager", "hash_block_tokens"]
