"""The block pool: fixed-size KV blocks with ref counts and a prefix cache.

::

    block ids      0      1      2      3      4   ...  N-1
                 [null] [ A  ] [ A  ] [ B  ] [free] ... [free]
    ref count      -      1      1      2      0          0
    hash           -     h0     h1     h0'     -          -

Block 0 is reserved as the *null block*: padded entries of block tables point at it, so a
kernel reading past a sequence's end reads harmless memory and never another request's KV.

Invariants:
- A block is either in use (ref_count > 0) or in the free queue, never both.
- The free queue is in eviction order: least recently freed first. A freed block keeps its
  hash (and stays findable in ``cached``) until it is taken from the front and reused, so a
  request arriving after its prefix's owner finished still hits the cache (LRU eviction).
- Only full blocks are hashed. A block's hash chains its parent's hash with its own token ids
  and ``extra_key`` (anything else that changes KV: LoRA, model revision, cache salt), so equal
  hashes mean equal prefixes; token ids are stored and compared too, so a hash collision can
  never serve wrong KV.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

NULL_BLOCK_ID = 0
_ROOT_HASH = b"openinfer-prefix-cache-v1"
# runs of cached blocks a pool remembers for lookups (``BlockPool._runs``): a 16k-token prompt's
# run is ~0.1 MB (its hashes, block ids and token bytes)
KNOWN_RUNS = 16


# token ids hash and compare as little-endian int32 (ids are below the vocabulary size, < 2**31;
# a block's 16 ids then fit one 64-byte compression block of the hash with its parent and key)
TOKEN_DTYPE = np.dtype("<i4")
TOKEN_WIDTH = TOKEN_DTYPE.itemsize
TokenChunk = Sequence[int] | bytes  # a block's token ids, or their bytes (``token_bytes``)


def token_bytes(token_ids: TokenChunk) -> bytes:
    """The canonical byte form of token ids (little-endian int32), used for hashing and comparing."""
    if isinstance(token_ids, bytes):
        return token_ids
    return np.asarray(token_ids, dtype=TOKEN_DTYPE).tobytes()


def hash_block_tokens(parent_hash: bytes | None, token_ids: TokenChunk, extra_key: str = "") -> bytes:
    """Chained hash of one full block: H(parent | extra_key | tokens)."""
    parent = parent_hash if parent_hash is not None else _ROOT_HASH
    return hashlib.blake2b(b"".join((parent, extra_key.encode(), b"|", token_bytes(token_ids))),
                           digest_size=16).digest()


class _HashMemo:
    """Block hashes by their hash input (parent hash, key, tokens), the most recent
    ``capacity``: a warm prefix's blocks were hashed when its first request came, and a dict
    probe costs a quarter of a blake2b (16k tokens: 0.3 ms instead of 1.2 ms on the CPU that
    ran benchmarks/warm_prefix_host.py). Hashes are a pure function of the input, so what the
    memo forgets is only recomputed."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.table: dict[bytes, bytes] = {}

    def trim(self) -> None:
        """Forget the oldest quarter once over capacity (dicts keep insertion order)."""
        if len(self.table) > self.capacity:
            try:
                oldest = list(itertools.islice(self.table, len(self.table) - 3 * self.capacity // 4))
            except RuntimeError:  # another engine thread inserted meanwhile: trim on a later call
                return
            for key in oldest:
                self.table.pop(key, None)


# 64k blocks (1M tokens of distinct prefixes at 16 per block): about 15 MB of host memory
_MEMO = _HashMemo(1 << 16)


def chain_block_hashes(parent_hash: bytes | None, data: bytes, block_size: int, extra_key: str = "") -> list[bytes]:
    """``hash_block_tokens`` of each consecutive full block in ``data`` (``token_bytes`` of whole
    blocks), each chained to the previous one: the same hashes, one tight loop, blocks hashed
    before taken from the memo."""
    parent = parent_hash if parent_hash is not None else _ROOT_HASH
    separator = extra_key.encode() + b"|"
    blake2b, stride = hashlib.blake2b, TOKEN_WIDTH * block_size
    memo = _MEMO.table
    known = memo.get
    hashes: list[bytes] = []
    append = hashes.append
    for start in range(0, len(data) - stride + 1, stride):
        key = parent + separator + data[start : start + stride]
        parent = known(key)
        if parent is None:
            parent = memo[key] = blake2b(key, digest_size=16).digest()
        append(parent)
    _MEMO.trim()
    return hashes


class _ChainMemo:
    """The latest ``PrefixHashes`` that started with each first block (its hash input), at most
    ``capacity``: a request whose tokens begin like an earlier one's takes that one's hashes for
    the blocks they share after one comparison of their token bytes, instead of a memo probe per
    block (a warm 16k prompt: 1023 probes, ~0.3-0.7 ms). The chains are append-only and their
    hashes a pure function of the tokens, so a shared chain is only read."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.chains: OrderedDict[bytes, PrefixHashes] = OrderedDict()

    def remember(self, first_key: bytes, chain: PrefixHashes) -> None:
        self.chains[first_key] = chain
        self.chains.move_to_end(first_key)
        while len(self.chains) > self.capacity:
            self.chains.popitem(last=False)

    def shared_hashes(self, first_key: bytes, data: bytes, stride: int) -> list[bytes]:
        """The remembered chain's hashes of the leading blocks of ``data`` whose bytes it holds."""
        chain = self.chains.get(first_key)
        if chain is None:
            return []
        num_blocks = min(len(chain.hashes), len(chain._data) // stride, len(data) // stride)
        known = chain._data
        if known[: num_blocks * stride] != data[: num_blocks * stride]:  # diverged: the longest common run
            low, high = 1, num_blocks  # block 0 is shared (it is the key); find the last shared count
            while low < high:
                middle = (low + high + 1) // 2
                if known[: middle * stride] == data[: middle * stride]:
                    low = middle
                else:
                    high = middle - 1
            num_blocks = low
        return chain.hashes[:num_blocks]


# 256 distinct first blocks, each chain alive as long as it is remembered (a 16k prompt's: ~0.1 MB)
_CHAINS = _ChainMemo(256)


def _token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as ``TOKEN_DTYPE``, kept without a copy when they already are and cannot change
    (a prompt read in place from the engine core's message); copied otherwise."""
    ids = np.asarray(token_ids)
    if ids.dtype == TOKEN_DTYPE and not ids.flags.writeable:
        return ids
    return np.array(ids, TOKEN_DTYPE)


class PrefixHashes:
    """One token sequence's chained block hashes (and the token bytes they cover), computed once
    and extended as the sequence grows: a request keeps one, so every prefix lookup while it
    waits, its start and each publish of its blocks hash each of its blocks once."""

    def __init__(self, block_size: int, extra_key: str = "", known_tokens: np.ndarray | None = None):
        """``known_tokens``: the first token ids of every sequence this will hash (a request's
        prompt, as the array it arrived in), read instead of converting ``token_ids``' list
        (a 16k-token prompt: ~0.3-0.5 ms of a warm request's start)."""
        self.block_size = block_size
        self.extra_key = extra_key
        self.hashes: list[bytes] = []
        self._data = bytearray()  # token_bytes of the hashed blocks
        self._known = None if known_tokens is None else _token_array(known_tokens)

    def extend(self, token_ids: Sequence[int], num_blocks: int, max_new_hashes: int | None = None) -> list[bytes]:
        """The hashes of ``token_ids``' first ``num_blocks`` full blocks (or more, when computed
        before), hashing only those not hashed yet. A block holding a placeholder (a negative
        id: a token not read back yet) and those after it are left unhashed. ``max_new_hashes``:
        compute at most that many hashes this call (blocks shared with a remembered chain cost
        none), so fewer than ``num_blocks`` may come back."""
        have, bs = len(self.hashes), self.block_size
        if num_blocks > have:
            if self._known is not None and num_blocks * bs <= len(self._known):
                tokens = self._known[have * bs : num_blocks * bs]
            else:
                # a list, or an int array (a request's ``TokenIds`` slice)
                tokens = np.asarray(token_ids[have * bs : num_blocks * bs], np.int64)
            placeholders = np.flatnonzero(tokens < 0)
            if placeholders.size:
                tokens = tokens[: placeholders[0] // bs * bs]
            data = np.asarray(tokens, TOKEN_DTYPE).tobytes()
            stride, shared = TOKEN_WIDTH * bs, []
            if not have and len(data) >= stride:
                first_key = self.extra_key.encode() + b"|" + data[:stride]
                shared = _CHAINS.shared_hashes(first_key, data, stride)
                _CHAINS.remember(first_key, self)
            rest = data[len(shared) * stride :]
            if max_new_hashes is not None:
                rest = rest[: max(0, max_new_hashes) * stride]
            parent = shared[-1] if shared else (self.hashes[-1] if have else None)
            self.hashes.extend(shared)
            if rest:
                self.hashes.extend(chain_block_hashes(parent, rest, bs, self.extra_key))
            self._data += data[: (len(self.hashes) - have) * stride]  # the hashed blocks' bytes only
        return self.hashes

    def extend_known(self) -> list[bytes]:
        """``extend`` over every full block of the ``known_tokens``."""
        return self.extend(self._known if self._known is not None else (), self.num_known_blocks)

    @property
    def num_known_blocks(self) -> int:
        """Full blocks of the ``known_tokens`` given at construction (0 without them)."""
        return 0 if self._known is None else len(self._known) // self.block_size

    def token_bytes(self, first_block: int, end_block: int) -> bytes:
        """The token bytes of hashed blocks ``[first_block, end_block)``."""
        stride = TOKEN_WIDTH * self.block_size
        return bytes(self._data[first_block * stride : end_block * stride])


@dataclass(slots=True)  # (slots: faster attribute access in touch / free loops over a prefix's blocks)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_bytes: bytes = b""  # the cached block's tokens, compared on every hit


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots; block 0 is the null block."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_count = 1  # never freed, never handed out
        # Free blocks in eviction order (front = evicted first). OrderedDict gives O(1) removal
        # when a cached free block is revived by a prefix hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id (in use or free)
        # called with a block's hash when its cached content is evicted (the manager frees the
        # recurrent-state snapshot that belongs to it)
        self.on_evict: Callable[[bytes], None] | None = None
        # known runs of cached blocks, by their first hash, least recently used first: (hashes,
        # their blocks, their token bytes, the ``_num_forgotten`` then), from the last lookups and
        # from requests whose prompt blocks were published (``remember_run``). While no cached
        # block is forgotten, every (hash -> block, tokens) pair of a run still holds (publishing
        # never changes an existing entry), so a lookup sharing a run's leading hashes and tokens
        # (a request on a warm prefix, e.g. right after the request that computed it) takes them
        # after two comparisons instead of a dict probe and a join per block
        self._runs: OrderedDict[bytes, tuple[list[bytes], tuple[int, ...], bytes, int]] = OrderedDict()
        self._num_forgotten = 0

    # --- queries ------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def lookup_prefix(self, hashes: Sequence[bytes], data: bytes) -> list[int]:
        """The cached blocks of the longest run of leading blocks found under ``hashes`` whose
        tokens equal ``data``'s (``token_bytes`` of at least those blocks): a dict probe per
        block and one comparison of all their tokens (block by block only on a mismatch), but
        for the leading blocks of a known run (``_runs``)."""
        if not self.enable_prefix_cache or not hashes:
            return []
        stride = TOKEN_WIDTH * self.block_size
        known: list[int] = []
        run = self._runs.get(hashes[0])
        if run is not None and run[3] == self._num_forgotten:
            run_hashes, run_blocks, run_data, _ = run
            num = min(len(run_blocks), len(hashes))
            if hashes[:num] == run_hashes[:num] and data[: num * stride] == run_data[: num * stride]:
                known = list(run_blocks[:num])
        found = known + self._lookup_run(hashes[len(known):], data[len(known) * stride :])
        if found and (run is None or len(found) > len(run[1]) or run[3] != self._num_forgotten):
            self._remember(list(hashes[: len(found)]), tuple(found), data[: len(found) * stride])
        return found

    def remember_run(self, hashes: Sequence[bytes], data: bytes) -> None:
        """Note the cached blocks of the leading ``hashes`` (whose tokens are ``data``: whole
        blocks) as a known run, so that a lookup of the same prefix skips its per-block probes
        (the engine notes each request's prompt once its blocks are published). Blocks not
        cached under these hashes end the run. The leading blocks a known run under the same
        first hash already holds are taken from it: only the rest are probed."""
        if not self.enable_prefix_cache or not hashes:
            return
        stride = TOKEN_WIDTH * self.block_size
        shared: tuple[int, ...] = ()
        run = self._runs.get(hashes[0])
        if run is not None and run[3] == self._num_forgotten:
            run_hashes, run_blocks, run_data, _ = run
            # chained hashes: equal at block k means equal before it, so the shared length is the
            # last k whose hashes are equal (a binary search); the tokens confirm it
            low, high = 0, min(len(run_blocks), len(hashes))
            while low < high:
                middle = (low + high + 1) // 2
                if hashes[middle - 1] == run_hashes[middle - 1]:
                    low = middle
                else:
                    high = middle - 1
            if low and data[: low * stride] == run_data[: low * stride]:
                if low == len(hashes) and len(run_blocks) >= low:
                    return  # nothing the run does not hold already
                shared = run_blocks[:low]
        rest = list(map(self.cached.get, hashes[len(shared):]))
        if None in rest:
            del rest[rest.index(None):]
        found = shared + tuple(rest)
        if found:
            self._remember(list(hashes[: len(found)]), found, data[: len(found) * stride])

    def _remember(self, hashes: list[bytes], blocks: tuple[int, ...], data: bytes) -> None:
        runs = self._runs
        runs[hashes[0]] = (hashes, blocks, data, self._num_forgotten)
        runs.move_to_end(hashes[0])
        while len(runs) > KNOWN_RUNS:
            runs.popitem(last=False)

    def _lookup_run(self, hashes: Sequence[bytes], data: bytes) -> list[int]:
        """``lookup_prefix`` without the last lookup's help."""
        found = list(map(self.cached.get, hashes))
        if None in found:
            del found[found.index(None):]
        blocks, stride = self.blocks, TOKEN_WIDTH * self.block_size
        if b"".join([blocks[b].token_bytes for b in found]) == data[: len(found) * stride]:
            return found
        for i, block_id in enumerate(found):  # a hash collision: keep the blocks before it
            if blocks[block_id].token_bytes != data[i * stride : (i + 1) * stride]:
                return found[:i]
        return found

    def lookup(self, block_hash: bytes, token_ids: TokenChunk) -> int | None:
        """The cached block holding exactly these tokens after this parent chain, if any."""
        if not self.enable_prefix_cache:
            return None
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_bytes != token_bytes(token_ids):
            return None
        return block_id

    # --- verbs ---------------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` fresh blocks from the front of the free queue (evicting their
        cached content). Raises when there are not enough; check ``can_allocate`` first."""
        if num_blocks > self.num_free_blocks:
            raise MemoryError(f"asked for {num_blocks} KV blocks, {self.num_free_blocks} free")
        popitem, blocks = self.free_queue.popitem, self.blocks  # (locals: a cold 16k prompt takes 1,024)
        taken = [popitem(last=False)[0] for _ in range(num_blocks)]
        # ascending: blocks freed together re-enter the queue tail-first, so this puts a run of
        # consecutive ids in table order, which the sm90 prefill attention can load as one TMA box
        # (OPENINFER_SM90_KV_RUNS); the same blocks are taken and evicted either way
        taken.sort()
        for block_id in taken:
            block = blocks[block_id]
            if block.block_hash is not None:
                self._forget(block)
            block.ref_count = 1
        return taken

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); revives free ones."""
        blocks, queue = self.blocks, self.free_queue  # (locals: this runs per block of a 16k prefix)
        for block_id in block_ids:
            block = blocks[block_id]
            if not block.ref_count:
                del queue[block_id]
            block.ref_count += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Pass blocks in the order they should be
        evicted (callers pass a request's blocks tail-first so shared prefixes live longest)."""
        blocks, queue = self.blocks, self.free_queue
        for block_id in block_ids:
            block = blocks[block_id]
            if block_id == NULL_BLOCK_ID or block.ref_count <= 0:
                raise AssertionError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if not block.ref_count:
                queue[block_id] = None
                if block.block_hash is None:
                    queue.move_to_end(block_id, last=False)  # uncached: reuse first

    def cache_full_block(self, block_id: int, block_hash: bytes, token_ids: TokenChunk) -> None:
        """Publish a now-full block under its chained hash (first writer wins)."""
        if not self.enable_prefix_cache:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_bytes = token_bytes(token_ids)
        self.cached[block_hash] = block_id

    def cache_full_blocks(self, block_ids: Sequence[int], hashes: Sequence[bytes], data: bytes,
                          blocks_per_entry: int = 1) -> None:
        """``cache_full_block`` of each entry of ``block_ids`` (null entries skipped): entry i holds
        token blocks ``[i * n, (i + 1) * n)`` (n = ``blocks_per_entry``: a compressed group's ratio)
        of ``hashes`` and of ``data`` (their token bytes), published under the last one's hash."""
        if not self.enable_prefix_cache:
            return
        stride = TOKEN_WIDTH * self.block_size * blocks_per_entry
        blocks, cached = self.blocks, self.cached  # (locals: a cold 16k prompt publishes 1,024)
        for index, block_id in enumerate(block_ids):
            if block_id == NULL_BLOCK_ID:
                continue
            block, block_hash = blocks[block_id], hashes[(index + 1) * blocks_per_entry - 1]
            if block.block_hash is not None or block_hash in cached:
                continue  # first writer wins
            block.block_hash = block_hash
            block.token_bytes = data[index * stride : (index + 1) * stride]
            cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        for block in self.blocks[1:]:
            self._forget(block)

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            self._num_forgotten += 1
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
            block.block_hash = None
            block.token_bytes = b""
