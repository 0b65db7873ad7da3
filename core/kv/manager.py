"""Per-request view of the block pool and the state slots: block tables per KV cache group,
state slots, prefix hits intersected across groups, snapshots of recurrent state.

The scheduler talks only to this class; it never sees ``BlockPool`` internals. Without
``groups`` the manager serves one full-attention group (every dense model).

::

    request "a" (block_size 4, groups: 0 full, 1 sliding W=6, 2 compressed R=2, 3 state)
    tokens       t0 .. t3 | t4 .. t7 | t8 .. t11 | t12 t13
    token blocks     0         1          2          3 (partial)
    hashes          H0        H1         H2                      chained over token ids
    g0 table      [ 5,        6,         7,         8 ]          pool 0, published as H_i
    g1 table      [ 0,        0,         3,         4 ]          pool 1; 0: freed behind the window
    g2 table      [ 2 ]   one block = 4 entries = 8 tokens        pool 2, published as H_1
    state slot    3 (live)   snapshot of slot 3 at 8 tokens → slot 7, cached under H_1

Prefix hits: the longest n (< the prompt's blocks) such that every group serves n token
blocks (see ``openinfer.kv.spec``); a recurrent-state hit queues a copy snapshot → live slot
(``take_state_copies``) that the engine runs before the request's first step. Snapshots live
in their own slots (an LRU set of at most ``num_snapshot_slots``) and are freed when the block
they belong to (token block n-1 of the first per-token group) is evicted from its pool.

Each paged group has its own ``BlockPool`` (own ids, free queue and prefix cache), sized by
the engine from the groups' page bytes and per-request needs (``openinfer.kv.spec``), so a
group's pages are never idle in another group's layers.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from openinfer.kv.block_pool import NULL_BLOCK_ID, TOKEN_WIDTH, BlockPool, PrefixHashes
from openinfer.kv.spec import CompressedSpec, FullAttentionSpec, KVCacheGroups, SlidingWindowSpec, group_specs
from openinfer.kv.state_slots import NULL_SLOT_ID, StateSlots
from openinfer.kv.table_rows import BlockTableRows

# Where a model that snapshots inside a step (``KVCacheGroups.snapshots_within_step``) takes a
# prompt's snapshot, by what a later request can reuse (``snapshot_within``):
#
#   "follow_up" (default): the state at the prompt's last block boundary <= its length. A chat's
#       next turn extends the prompt (and the answer), so that is the state it restores. A prompt
#       ending exactly on a boundary needs no snapshot inside the step: its final state is copied
#       after the step (``snapshot_state``), and each GDN layer runs once. Only a prompt ending
#       inside a block snapshots inside the step (at the boundary before its partial block).
#   "retry": that, and for a prompt ending on a boundary also the boundary one block before its
#       end: a hit never covers a prompt's last token, so an identical prompt (a retry, or the
#       same prompt with its last token changed) can reuse all but its last block only from there.
#       Costs a second snapshot slot per prompt and, unless the model's kernels write the state
#       at that row themselves, a second run of each GDN layer's core in the step (the 64-stream
#       burst of 1,024-token prompts: 1.06x -> 0.99x vLLM, GPU.md "Qwen3.5 side by side after D3").
SNAPSHOT_POLICY_ENV = "OPENINFER_STATE_SNAPSHOTS"
SNAPSHOT_POLICIES = ("follow_up", "retry")
DEFAULT_SNAPSHOT_POLICY = "follow_up"


def snapshot_policy() -> str:
    """``OPENINFER_STATE_SNAPSHOTS`` (a key of ``SNAPSHOT_POLICIES``), else the default."""
    value = os.environ.get(SNAPSHOT_POLICY_ENV, "").strip().lower() or DEFAULT_SNAPSHOT_POLICY
    if value not in SNAPSHOT_POLICIES:
        raise ValueError(f"{SNAPSHOT_POLICY_ENV}={value!r}: expected one of {SNAPSHOT_POLICIES}")
    return value


@dataclass
class RequestBlocks:
    # the hashes of the request's full token blocks, in order (its key: the engine-wide key + the
    # request's cache salt, chained into every hash); the request's own, kept across preemptions
    prefix: PrefixHashes
    tables: list[list[int]] = field(default_factory=list)  # per group id ([] for state groups)
    num_published: list[int] = field(default_factory=list)  # per group: leading table entries published
    num_released: list[int] = field(default_factory=list)  # per group: leading entries freed (window)
    state_slot: int = NULL_SLOT_ID
    pending_snapshots: list[tuple[int, int]] = field(default_factory=list)  # (num_tokens, slot)
    generated_snapshot: bytes | None = None  # the request's latest snapshot past its prompt
    row: int = -1  # the request's row in the manager's ``BlockTableRows``
    prompt_run_remembered: bool = False  # its prompt's published blocks noted as a known run
    uses_cache: bool = False  # its blocks are looked up and published (hashing ahead pays off)

    @property
    def block_ids(self) -> list[int]:
        return self.tables[0] if self.tables else []

    @property
    def block_hashes(self) -> list[bytes]:
        return self.prefix.hashes

    @property
    def num_cached_blocks(self) -> int:
        return self.num_published[0] if self.num_published else 0


class KVCacheManager:
    """``pools``: one ``BlockPool`` per paged group, indexed by group id (None for state
    groups), or one pool when the model has a single paged group."""

    def __init__(self, pools: BlockPool | Sequence[BlockPool | None], extra_key: str = "",
                 groups: KVCacheGroups | None = None, state_slots: StateSlots | None = None,
                 num_snapshot_slots: int = 0, block_size: int = 16, snapshots: str | None = None):
        """``snapshots``: a key of ``SNAPSHOT_POLICIES`` (default ``snapshot_policy()``)."""
        self.groups = groups or group_specs([FullAttentionSpec(1, 1)])
        if isinstance(pools, BlockPool):
            paged = [g.group_id for g in self.groups.paged_groups]
            if len(paged) > 1:
                raise ValueError(f"{len(paged)} paged KV cache groups need one BlockPool each")
            pools = [pools if g.paged else None for g in self.groups.groups]
        if len(pools) != len(self.groups.groups) or any(
                (p is None) == g.paged for p, g in zip(pools, self.groups.groups, strict=True)):
            raise ValueError("pools must hold one BlockPool per paged group and None per state group")
        self.pools: list[BlockPool | None] = list(pools)
        first_paged = next((p for p in self.pools if p is not None), None)
        if first_paged is None:  # state only: an idle pool keeps the block accounting uniform
            first_paged = BlockPool(2, block_size)
        self.pool = first_paged  # the (first) paged group's pool: what a dense model has
        self.block_size = first_paged.block_size
        if any(p is not None and p.block_size != self.block_size for p in self.pools):
            raise ValueError("every group's pool must use the same block size")
        self.extra_key = extra_key
        self.requests: dict[str, RequestBlocks] = {}
        # ``defer_frees``: free_request only queues a request's blocks; they go back to the pools
        # at ``settle_frees()`` (the engine core calls it once a step's tokens are sent, so
        # returning a 16k-token request's thousand blocks is not between its token and its
        # client) or first thing in any call that allocates or takes blocks
        self.defer_frees = False
        self._pending_frees: list[list[list[int]]] = []
        self._pending_runs: list[tuple[PrefixHashes, int]] = []  # prompts to note as known runs
        self.table_rows = BlockTableRows(len(self.groups.groups))  # the tables as arrays, for batches
        # every group paged, one entry per token, no window (dense and MLA models): a request
        # needs ceil(tokens / block_size) blocks in each and never frees any early (``grow``'s fast path)
        self._plain_groups = all(g.paged and g.spec.tokens_per_entry == 1 and not isinstance(g.spec, SlidingWindowSpec)
                                 for g in self.groups.groups)
        # prefix hits (and so useful state snapshots) fall on multiples of this many tokens
        self.hit_granularity = self.groups.hit_granularity(self.block_size)
        if self.groups.has_state and state_slots is None:
            raise ValueError("a model with recurrent-state layers needs a StateSlots pool")
        self.state_slots = state_slots
        self.num_snapshot_slots = num_snapshot_slots if first_paged.enable_prefix_cache else 0
        self.snapshot_policy = snapshot_policy() if snapshots is None else snapshots
        if self.snapshot_policy not in SNAPSHOT_POLICIES:
            raise ValueError(f"snapshots={self.snapshot_policy!r}: expected one of {SNAPSHOT_POLICIES}")
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # token-block hash -> slot, LRU first
        self._snapshot_ids = 0
        self._state_copies: list[tuple[int, int]] = []
        # the group whose token block n-1 a snapshot at n blocks belongs to (evicted with it)
        per_token = [g.group_id for g in self.groups.paged_groups if g.spec.tokens_per_entry == 1]
        self._anchor_group = per_token[0] if per_token else None
        if self._anchor_group is not None and self.state_slots is not None:  # (no state: no snapshots)
            self.pools[self._anchor_group].on_evict = self._on_block_evicted

    # --- queries ---------------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at most, over every group, when a
        step computes at most ``chunk_tokens`` of them (sliding windows hold fewer)."""
        return self.groups.blocks_needed(num_tokens, self.block_size, chunk_tokens)

    def shortfall(self, num_tokens: int, chunk_tokens: int | None = None) -> tuple[int, int] | None:
        """(blocks needed, blocks the pool holds) of the first group whose whole pool cannot hold
        a request of ``num_tokens`` alone; None when every group's can."""
        self._settle()
        for group in self.groups.paged_groups:
            needed = group.spec.max_live_blocks(num_tokens, self.block_size, chunk_tokens)
            usable = self.pools[group.group_id].num_usable_blocks
            if needed > usable:
                return needed, usable
        return None

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table of group 0 (the only one of a dense model)."""
        return self.requests[request_id].block_ids

    def group_tables(self, request_id: str) -> list[list[int]]:
        """One block table per group id (empty for recurrent-state groups)."""
        return self.requests[request_id].tables

    def table_rows_of(self, request_ids: Sequence[str]) -> np.ndarray:
        """The ``BlockTableRows`` row of each request (for ``gather_tables``)."""
        requests = self.requests
        return np.fromiter((requests[r].row for r in request_ids), np.int64, count=len(request_ids))

    def gather_tables(self, group_id: int, rows: np.ndarray) -> np.ndarray:
        """Group ``group_id``'s block tables of the requests in ``rows``, null-padded to the longest."""
        return self.table_rows.gather(group_id, rows)

    def state_slot(self, request_id: str) -> int:
        """The request's live state slot (the null slot 0 when the model keeps no state)."""
        return self.requests[request_id].state_slot

    def request_key(self, cache_salt: str = "") -> str:
        """What besides token ids goes into a request's block hashes."""
        return f"{self.extra_key}|{cache_salt}" if cache_salt else self.extra_key

    def prefix_hashes(self, cache_salt: str = "", known_tokens: np.ndarray | None = None) -> PrefixHashes:
        """An empty hash cache for a request's token blocks (pass it to ``start_request``);
        ``known_tokens``: its prompt's ids as an array (``PrefixHashes``)."""
        return PrefixHashes(self.block_size, self.request_key(cache_salt), known_tokens)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """State-slot copies ``(src, dst)`` queued since the last call (snapshot restores and
        snapshots); the engine runs them on every state layer before the next forward."""
        copies, self._state_copies = self._state_copies, []
        return copies

    # --- prefix lookup ---------------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: Sequence[int], extra_key: str | None = None,
                           prefix: PrefixHashes | None = None) -> tuple[list[int], list[bytes]]:
        """Longest prefix of full token blocks that every group can serve (the last token is
        never served from the cache: its logits must be computed), as (the first paged group's
        hit blocks, the token-block hashes). ``prefix``: the sequence's hash cache, if it has one."""
        n, hashes, hits = self._find(token_ids, self._prefix_for(extra_key, prefix))
        first = next((g.group_id for g in self.groups.paged_groups), None)
        return (hits[first][:n] if first is not None else []), hashes[:n]

    def _prefix_for(self, extra_key: str | None, prefix: PrefixHashes | None) -> PrefixHashes:
        key = self.extra_key if extra_key is None else extra_key
        if prefix is None or prefix.extra_key != key or prefix.block_size != self.block_size:
            return PrefixHashes(self.block_size, key)
        return prefix

    def _find(self, token_ids: Sequence[int], prefix: PrefixHashes
              ) -> tuple[int, list[bytes], list[list[int | None]]]:
        bs, groups = self.block_size, self.groups.groups
        max_blocks = (len(token_ids) - 1) // bs
        # full attention / MLA need every block of the prefix: the scan stops at their first miss
        prefix_groups = [g.group_id for g in groups
                         if g.paged and not isinstance(g.spec, CompressedSpec | SlidingWindowSpec)]
        hashes = self._hash_prefix(prefix, token_ids, max_blocks,
                                   self.pools[prefix_groups[0]] if prefix_groups else None)
        data = prefix.token_bytes(0, len(hashes))
        other = [g for g in groups if g.group_id not in prefix_groups]
        hits: list[list[int | None]] = [[] for _ in groups]
        n = len(hashes)
        for g in prefix_groups:
            hits[g] = self.pools[g].lookup_prefix(hashes[:n], data)
            n = min(n, len(hits[g]))
        for group in other:
            hits[group.group_id] = [self._lookup_other(group.group_id, i, hashes[i], data) for i in range(n)]
        hashes = hashes[:n]
        while n > 0 and not all(self._serves(group, n, hits[group.group_id], hashes) for group in other):
            n -= 1
        return n, hashes, hits

    @staticmethod
    def _hash_prefix(prefix: PrefixHashes, token_ids: Sequence[int], max_blocks: int,
                     pool: BlockPool | None) -> list[bytes]:
        """The hashes of the leading blocks a prefix hit could cover: all ``max_blocks``, or with
        a full-attention ``pool`` (a hit ends at its first miss) hashed in doubling steps until a
        block's hash is not in its cache. A cold 16k-token prompt then hashes a few dozen blocks
        before its first step instead of 1,023 (~1 ms of blake2b); publishing its blocks hashes
        the rest, while the device runs the step. Blocks shared with a remembered chain
        (``_ChainMemo``, a warm prefix) are taken whole at once, whatever the step."""
        if pool is None or not pool.enable_prefix_cache:
            return prefix.extend(token_ids, max_blocks)[:max_blocks]
        budget = 16
        hashes = prefix.extend(token_ids, max_blocks, budget)
        while len(hashes) < max_blocks and hashes and hashes[-1] in pool.cached:
            before, budget = len(hashes), 2 * budget
            hashes = prefix.extend(token_ids, max_blocks, budget)
            if len(hashes) == before:  # a placeholder ends the hashable blocks
                break
        return hashes[:max_blocks]

    def _lookup_other(self, group_id: int, index: int, block_hash: bytes, data: bytes) -> int | None:
        spec = self.groups.groups[group_id].spec
        if not spec.paged:
            return None
        if isinstance(spec, CompressedSpec):
            if (index + 1) % spec.ratio:
                return None
            stride = TOKEN_WIDTH * self.block_size
            chunk = data[(index + 1 - spec.ratio) * stride : (index + 1) * stride]
            return self.pools[group_id].lookup(block_hash, chunk)
        stride = TOKEN_WIDTH * self.block_size
        return self.pools[group_id].lookup(block_hash, data[index * stride : (index + 1) * stride])

    def _serves(self, group, n: int, hits: list[int | None], hashes: list[bytes]) -> bool:
        spec, bs = group.spec, self.block_size
        if not spec.paged:
            return hashes[n - 1] in self.snapshots
        if isinstance(spec, CompressedSpec):
            return n % spec.ratio == 0 and all(hits[j] is not None for j in range(spec.ratio - 1, n, spec.ratio))
        return all(hits[j] is not None for j in range(spec.first_live_block(n * bs, bs), n))

    # --- lifecycle -------------------------------------------------------------------------------

    def start_request(self, request_id: str, token_ids: Sequence[int], use_cache: bool = True,
                      cache_salt: str = "", prefix: PrefixHashes | None = None) -> int:
        """Register a request, taking references on its cached prefix (and a state slot, with a
        restore from a snapshot on a hit); returns cached tokens. ``prefix``: the request's hash
        cache (``prefix_hashes``), so its blocks are hashed once over its life. Raises
        MemoryError when the model keeps state and no state slot is free (check ``can_start``
        first)."""
        self._settle()
        prefix = self._prefix_for(self.request_key(cache_salt), prefix)
        n, hashes, hits = self._find(token_ids, prefix) if use_cache else (0, [], [])
        bs = self.block_size
        tables: list[list[int]] = []
        for group in self.groups.groups:
            spec = group.spec
            if not spec.paged or n == 0:
                tables.append([])
                continue
            count = spec.blocks_for(n * bs, bs)
            if isinstance(spec, CompressedSpec):
                table = [hits[group.group_id][(j + 1) * spec.ratio - 1] for j in range(count)]
                live = table
            else:
                first = spec.first_live_block(n * bs, bs)
                live = hits[group.group_id][first:count]  # cached blocks: never the null block
                table = [NULL_BLOCK_ID] * first + live if first else live
            self.pools[group.group_id].touch(live)
            tables.append(table)
        blocks = RequestBlocks(prefix, tables, [len(t) for t in tables],
                               [spec_first(g.spec, n * bs, bs) for g in self.groups.groups],
                               uses_cache=use_cache and self.pool.enable_prefix_cache)
        if self.state_slots is not None:
            blocks.state_slot = self.state_slots.allocate(request_id)
            if n:
                snapshot = self.snapshots[hashes[n - 1]]
                self.snapshots.move_to_end(hashes[n - 1])
                self._state_copies.append((snapshot, blocks.state_slot))
        blocks.row = self.table_rows.assign()
        for group_id, table in enumerate(tables):
            if table:
                self.table_rows.write(group_id, blocks.row, 0, table)
        self.requests[request_id] = blocks
        return n * bs

    def can_start(self) -> bool:
        """Whether a new request can take a state slot (always True without state)."""
        return self.state_slots is None or self._free_live_slots() > 0

    def _free_live_slots(self) -> int:
        held = len(self.snapshots) + sum(len(r.pending_snapshots) for r in self.requests.values())
        return self.state_slots.num_free_slots - max(0, self.num_snapshot_slots - held)

    def can_grow(self, request_id: str, num_total_tokens: int, reserve: int = 0) -> bool:
        self._settle()
        missing = self._missing(self.requests[request_id], num_total_tokens)
        return all(self.pools[g].can_allocate(n + reserve) for g, n in missing.items())

    def _missing(self, blocks: RequestBlocks, num_total_tokens: int) -> dict[int, int]:
        """Blocks each paged group still needs for ``num_total_tokens``."""
        return {g.group_id: max(0, g.spec.blocks_for(num_total_tokens, self.block_size) - len(blocks.tables[g.group_id]))
                for g in self.groups.paged_groups}

    def grow(self, request_id: str, num_total_tokens: int, num_computed_tokens: int | None = None) -> bool:
        """Make the request hold enough blocks for ``num_total_tokens``; False if the pool is
        short. With ``num_computed_tokens``, sliding-window blocks that no query from there on
        can see are freed first (their table entries become the null block)."""
        self._settle()
        blocks = self.requests[request_id]
        prefix = blocks.prefix
        if num_computed_tokens and blocks.uses_cache and len(prefix.hashes) < prefix.num_known_blocks:
            # a prompt's later chunk, planned while the device computes the earlier one (async
            # scheduling): hash the rest of the prompt's blocks now, not between its last chunk's
            # read-back and its first token (publishing a cold 16k prompt hashed ~1,000 blocks there)
            prefix.extend_known()
        if self._plain_groups:
            needed = -(-num_total_tokens // self.block_size)
            if all(len(table) >= needed for table in blocks.tables):  # most steps: the last block has room
                return True
        elif num_computed_tokens is not None:
            self.release_behind_window(request_id, num_computed_tokens)
        missing = self._missing(blocks, num_total_tokens)
        if not all(self.pools[g].can_allocate(n) for g, n in missing.items()):
            return False
        for g, n in missing.items():
            if n > 0:
                new = self.pools[g].allocate(n)
                self.table_rows.write(g, blocks.row, len(blocks.tables[g]), new)
                blocks.tables[g].extend(new)
        return True

    def release_behind_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Free every block wholly behind each sliding window; returns how many were freed."""
        self._settle()
        blocks, freed = self.requests[request_id], 0
        for group in self.groups.paged_groups:
            gid, table = group.group_id, blocks.tables[group.group_id]
            first = min(len(table), group.spec.first_live_block(num_computed_tokens, self.block_size))
            release = [b for b in table[blocks.num_released[gid]:first] if b != NULL_BLOCK_ID]
            if release:
                self.pools[gid].free(list(reversed(release)))
                freed += len(release)
            if first > blocks.num_released[gid]:
                for j in range(blocks.num_released[gid], first):
                    table[j] = NULL_BLOCK_ID
                self.table_rows.write(gid, blocks.row, blocks.num_released[gid],
                                      [NULL_BLOCK_ID] * (first - blocks.num_released[gid]))
            blocks.num_released[gid] = max(blocks.num_released[gid], first)
        return freed

    def publish_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish every block whose KV is now fully computed into the prefix cache, and the
        state snapshots taken at those block boundaries."""
        blocks = self.requests[request_id]
        num_computed_blocks = num_computed_tokens // self.block_size
        # the whole prompt's blocks are hashed at the first publish (a chunked prompt's first chunk
        # is read back while the device computes the next), not its last chunk's at the last one:
        # that one is between the device's last step and the request's first token
        num_hashed = len(blocks.prefix.extend(token_ids, max(num_computed_blocks, blocks.prefix.num_known_blocks)))
        num_full = min(num_computed_blocks, num_hashed)
        for group in self.groups.paged_groups:
            gid, spec, table = group.group_id, group.spec, blocks.tables[group.group_id]
            ratio = spec.tokens_per_entry if isinstance(spec, CompressedSpec) else 1
            done = min(num_full // ratio, len(table))
            first = blocks.num_published[gid]
            if done > first:
                # one copy of the entries' tokens, sliced per entry (a cold 16k prompt publishes 1,024)
                self.pools[gid].cache_full_blocks(table[first:done], blocks.block_hashes[first * ratio:done * ratio],
                                                  blocks.prefix.token_bytes(first * ratio, done * ratio), ratio)
            blocks.num_published[gid] = max(blocks.num_published[gid], done)
        self._publish_snapshots(blocks, num_full)
        self._remember_prompt_run(blocks, num_full)

    def _remember_prompt_run(self, blocks: RequestBlocks, num_full: int) -> None:
        """Once a request's prompt blocks (those a prompt array names: ``prefix_hashes``'
        ``known_tokens``) are all published, note them in each full-attention pool as a known
        run: the next request on this prefix (a warm prefix) then finds them without a probe per
        block. Once per request, so decode steps publishing a block now and then cost nothing."""
        known = blocks.prefix.num_known_blocks
        if blocks.prompt_run_remembered or not known or num_full < known:
            return
        blocks.prompt_run_remembered = True
        # noted at the next ``settle_frees`` (after the step's tokens are sent): not between a
        # warm request's token and its client (its prefix's chain is append-only: still valid then)
        self._pending_runs.append((blocks.prefix, known))

    def _remember_runs(self) -> None:
        pending, self._pending_runs = self._pending_runs, []
        pools = [self.pools[g.group_id] for g in self.groups.paged_groups
                 if not isinstance(g.spec, CompressedSpec | SlidingWindowSpec)]
        for prefix, known in pending:
            hashes, data = prefix.hashes[:known], prefix.token_bytes(0, known)
            for pool in pools:
                pool.remember_run(hashes, data)

    def free_request(self, request_id: str) -> None:
        """Return every block (tail first so the shared head of a prefix is evicted last), the
        state slot and any snapshot not yet published."""
        blocks = self.requests.pop(request_id, None)
        if blocks is None:
            return
        self.table_rows.release(blocks.row)
        if self.defer_frees:
            self._pending_frees.append(blocks.tables)
        else:
            self._return_blocks(blocks.tables)
        if self.state_slots is not None:
            self.state_slots.free(request_id)
            for _, slot in blocks.pending_snapshots:
                self._free_slot(slot)
            # a restore into the freed slot (a request that started but was not admitted) is moot
            self._state_copies = [c for c in self._state_copies if blocks.state_slot not in c]

    def _return_blocks(self, tables: list[list[int]]) -> None:
        for pool, table in zip(self.pools, tables, strict=True):
            if pool is not None:  # (plain groups' tables never hold the null block)
                pool.free(table[::-1] if self._plain_groups else [b for b in reversed(table) if b != NULL_BLOCK_ID])

    def _settle(self) -> None:
        if self._pending_frees or self._pending_runs:
            self.settle_frees()

    def settle_frees(self) -> None:
        """Return the blocks of every request freed since the last call (``defer_frees``), in
        the order they were freed: the pools end as if each had been freed at once. Then note
        the prompts published since as known runs (``_remember_prompt_run``)."""
        pending, self._pending_frees = self._pending_frees, []
        for tables in pending:
            self._return_blocks(tables)
        if self._pending_runs:
            self._remember_runs()

    # --- state snapshots -------------------------------------------------------------------------

    def snapshot_state(self, request_id: str, num_tokens: int, in_prompt: bool = True) -> tuple[int, int] | None:
        """After a step that left the request's state at exactly ``num_tokens`` (a block
        boundary), copy it into a snapshot slot; it is published under the block's hash once
        that block is (``publish_full_blocks``). Returns the copy ``(live, snapshot)`` it queued,
        or None when snapshots are off, ``num_tokens`` is not a multiple of ``hit_granularity``
        or no slot can be had."""
        blocks = self.requests.get(request_id)
        if blocks is None or num_tokens % max(1, self.hit_granularity):
            return None
        slot = self._snapshot_slot(blocks, num_tokens, in_prompt)
        if slot is None:
            return None
        copy = (blocks.state_slot, slot)
        self._state_copies.append(copy)
        return copy

    def snapshot_within(self, request_id: str, start: int, end: int, num_prompt_tokens: int,
                        ends_request: bool = False) -> tuple[int, int] | None:
        """For a step computing tokens ``start:end`` of the request on a model that snapshots
        inside a step (``KVCacheGroups.snapshots_within_step``): the last hit boundary strictly
        inside the chunk gets a snapshot slot, which the forward fills with the state after that
        token (``ForwardBatch.state_snapshots``); published like ``snapshot_state``'s. A chunk
        ending on a boundary needs none (``snapshot_state`` copies the state there after the
        step), except under the ``retry`` policy (``SNAPSHOT_POLICIES``) when it ends the
        request's tokens (``ends_request``): then the boundary one block before. Returns ``(rows
        before the boundary, snapshot slot)``, or None: no boundary inside, or no slot."""
        granularity = self.hit_granularity
        if end - start < 2 or (end % granularity == 0 and not (ends_request and self.snapshot_policy == "retry")):
            return None
        boundary = (end - 1) // granularity * granularity
        blocks = self.requests.get(request_id)
        if boundary <= start or blocks is None:
            return None
        slot = self._snapshot_slot(blocks, boundary, boundary <= num_prompt_tokens)
        return None if slot is None else (boundary - start, slot)

    def _snapshot_slot(self, blocks: RequestBlocks, num_tokens: int, in_prompt: bool) -> int | None:
        """A free slot for the request's snapshot at ``num_tokens`` (evicting the least recently
        used snapshot when all are held), noted as pending; None when snapshots are off or one
        at ``num_tokens`` is pending already."""
        if self.state_slots is None or not self.num_snapshot_slots or num_tokens <= 0:
            return None
        if any(abs(t) == num_tokens for t, _ in blocks.pending_snapshots):
            return None
        held = len(self.snapshots) + sum(len(r.pending_snapshots) for r in self.requests.values())
        if held >= self.num_snapshot_slots:
            if not self.snapshots:
                return None
            _, evicted = self.snapshots.popitem(last=False)  # the least recently used snapshot
            self._free_slot(evicted)
        self._snapshot_ids += 1
        slot = self.state_slots.allocate(f"\x00snapshot-{self._snapshot_ids}")
        blocks.pending_snapshots.append((num_tokens if in_prompt else -num_tokens, slot))
        return slot

    def _publish_snapshots(self, blocks: RequestBlocks, num_full: int) -> None:
        keep = []
        for signed_tokens, slot in blocks.pending_snapshots:
            n = abs(signed_tokens) // self.block_size
            if n > num_full:
                keep.append((signed_tokens, slot))
                continue
            block_hash = blocks.block_hashes[n - 1]
            if block_hash in self.snapshots or not self.snapshot_block_cached(block_hash):
                self._free_slot(slot)
                continue
            self.snapshots[block_hash] = slot
            if signed_tokens < 0:  # past the prompt: only the newest one is worth its memory
                if blocks.generated_snapshot is not None and blocks.generated_snapshot in self.snapshots:
                    self._free_slot(self.snapshots.pop(blocks.generated_snapshot))
                blocks.generated_snapshot = block_hash
        blocks.pending_snapshots = keep

    def snapshot_block_cached(self, block_hash: bytes) -> bool:
        """Whether the block a snapshot under ``block_hash`` belongs to is in the prefix cache."""
        if self._anchor_group is None:
            return True
        return block_hash in self.pools[self._anchor_group].cached

    def _on_block_evicted(self, block_hash: bytes) -> None:
        slot = self.snapshots.pop(block_hash, None)
        if slot is not None:
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        self.state_slots.free_slot(slot)

    @property
    def num_snapshots(self) -> int:
        return len(self.snapshots)


def spec_first(spec, num_tokens: int, block_size: int) -> int:
    """Leading table entries of a request that are already released (null) at ``num_tokens``."""
    return spec.first_live_block(num_tokens, block_size) if spec.paged else 0
