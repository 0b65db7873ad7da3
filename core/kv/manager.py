"""Per-request view of the block pool: which blocks a request holds, prefix hits, growth.

The scheduler talks only to this class; it never sees ``BlockPool`` internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from openinfer.kv.block_pool import BlockPool, hash_block_tokens, token_bytes


@dataclass
class RequestBlocks:
    extra_key: str = ""  # engine-wide key + the request's cache salt, chained into every hash
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks, in order
    num_cached_blocks: int = 0  # how many leading blocks are published in the prefix cache


class KVCacheManager:
    def __init__(self, pool: BlockPool, extra_key: str = ""):
        self.pool = pool
        self.block_size = pool.block_size
        self.extra_key = extra_key
        self.requests: dict[str, RequestBlocks] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self.requests[request_id].block_ids

    def request_key(self, cache_salt: str = "") -> str:
        """What besides token ids goes into a request's block hashes."""
        return f"{self.extra_key}|{cache_salt}" if cache_salt else self.extra_key

    def find_cached_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full blocks that prefixes ``token_ids``. The last token is
        never served from the cache (its logits must be computed), so at most
        ``(len-1) // block_size`` blocks."""
        key = self.extra_key if extra_key is None else extra_key
        max_blocks = (len(token_ids) - 1) // self.block_size
        data = token_bytes(token_ids[: max_blocks * self.block_size])
        stride = 8 * self.block_size
        hits: list[int] = []
        hashes: list[bytes] = []
        parent: bytes | None = None
        for i in range(max_blocks):
            chunk = data[i * stride : (i + 1) * stride]
            block_hash = hash_block_tokens(parent, chunk, key)
            block_id = self.pool.lookup(block_hash, chunk)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        return hits, hashes

    def start_request(self, request_id: str, token_ids: Sequence[int], use_cache: bool = True,
                      cache_salt: str = "") -> int:
        """Register a request, taking references on its cached prefix; returns cached tokens."""
        key = self.request_key(cache_salt)
        hits, hashes = self.find_cached_prefix(token_ids, key) if use_cache else ([], [])
        self.pool.touch(hits)
        self.requests[request_id] = RequestBlocks(key, list(hits), list(hashes), len(hits))
        return len(hits) * self.block_size

    def can_grow(self, request_id: str, num_total_tokens: int, reserve: int = 0) -> bool:
        held = len(self.requests[request_id].block_ids)
        return self.pool.can_allocate(max(0, self.blocks_needed(num_total_tokens) - held) + reserve)

    def grow(self, request_id: str, num_total_tokens: int) -> bool:
        """Make the request hold enough blocks for ``num_total_tokens``; False if the pool is short."""
        blocks = self.requests[request_id]
        missing = self.blocks_needed(num_total_tokens) - len(blocks.block_ids)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        blocks.block_ids.extend(self.pool.allocate(missing))
        return True

    def publish_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish every block whose KV is now fully computed into the prefix cache."""
        blocks = self.requests[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(blocks.block_ids))
        if blocks.num_cached_blocks >= num_full:
            return
        first, stride = blocks.num_cached_blocks, 8 * self.block_size
        data = token_bytes(token_ids[first * self.block_size : num_full * self.block_size])
        for i in range(first, num_full):
            parent = blocks.block_hashes[i - 1] if i > 0 else None
            chunk = data[(i - first) * stride : (i - first + 1) * stride]
            block_hash = hash_block_tokens(parent, chunk, blocks.extra_key)
            self.pool.cache_full_block(blocks.block_ids[i], block_hash, chunk)
            blocks.block_hashes.append(block_hash)
            blocks.num_cached_blocks += 1

    def free_request(self, request_id: str) -> None:
        """Return every block; tail first so the shared head of a prefix is evicted last."""
        blocks = self.requests.pop(request_id, None)
        if blocks is not None:
            self.pool.free(list(reversed(blocks.block_ids)))
