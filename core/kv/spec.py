"""Per-layer KV cache specs: what each layer caches, how layers group, how memory is split.

A model declares one spec per *cache layer* (``PagedModel.kv_cache_specs()``, in the model's
own order); the engine groups equal specs, sizes one block pool per group and one state-slot pool
from the specs' byte counts, and hands the model one allocation per spec (``backend.allocate_kv``)
in the same order. The pool and the manager only deal in ids; the model owns tensor layout::

    model.kv_cache_specs()        group_specs()                 per request (KVCacheManager)
    ──────────────────────        ─────────────                 ─────────────────────────────
    0 FullAttention(8,128)  ┐
    1 FullAttention(8,128)  ┼──▶  group 0: layers 0,1,3   ──▶  block table g0 [5, 9, 2, 7]
    3 FullAttention(8,128)  ┘
    2 SlidingWindow(W=64)   ───▶  group 1: layer 2        ──▶  block table g1 [0, 0, 4, 8]
                                                                (blocks behind the window freed
                                                                 → the null block 0)
    4 Compressed(R=4)       ───▶  group 2: layer 4        ──▶  block table g2 [6]  (1 entry/4 tok)
    5 RecurrentState(...)   ┐
    6 RecurrentState(...)   ┴──▶  group 3: layers 5,6     ──▶  state slot  3  (one per request)

    one BlockPool per paged group g: ids 1..N_g-1; id b addresses page b of every layer in g:
                        k[layer] : [N_g, block_size, ...]        (allocate_kv per spec)
    one StateSlots:   ids 1..S-1 for live requests and prefix-cache snapshots;
                        state[layer] : [num_slots, ...]             (allocate_kv per spec)

Kinds (``kind`` names them; every spec is a frozen dataclass, equal specs share a group):

- ``FullAttentionSpec`` — K and V per token (``shared_kv``: one K=V entry), every block kept.
- ``MLALatentSpec`` — one ``latent_dim``-wide entry per token (e.g. 512 + 64 rope = 576), no V.
- ``SlidingWindowSpec`` — like full attention, but a query at position p sees keys
  ``p - window + 1 .. p`` only: blocks wholly behind the window are freed as it moves.
- ``CompressedSpec`` — one ``entry_dim``-wide entry per ``ratio`` tokens; a block of
  ``block_size`` entries covers ``block_size * ratio`` tokens. The entry for tokens
  ``[e*R, (e+1)*R)`` is written by the token at ``(e+1)*R - 1`` (its slot mapping; others -1).
- ``RecurrentStateSpec`` — fixed tensors per request (conv window, SSM matrix, a compressor's
  partial window): one *state slot* per request at a fixed device address for its whole life,
  so a CUDA graph can read slot ids from a device array (``ForwardBatch.state_slots``).

Sizing (``plan_kv_cache``): one state slot costs ``bytes_per_slot`` = the sum of every state
layer's bytes; live slots for ``max_num_seqs`` requests come first (at most half the budget,
capping ``max_num_seqs``), snapshot slots next (prefix cache, up to a quarter), the rest buys
blocks. Each paged group has its own pool (own block ids, free queue and prefix cache): the
block budget is split between the groups in proportion to what one request at full context
needs of each (a sliding window needs a few blocks, a compressed group 1/R of the tokens), so
no group's pages sit idle in another group's layers. (vLLM instead shares one id space and
aliases layers of different groups onto one tensor of equal page size; we keep one tensor per
layer and one pool per group.)

For model authors (what a plugin writes; ``backend.kv_dtype`` is "float32" on numpy, "bfloat16" on cuda)::

    def kv_cache_specs(self):                        # one per cache layer, the model's order
        return [MLALatentSpec(576, self.backend.kv_dtype)] * self.num_layers

    def forward(self, batch, kv_cache):              # kv_cache[i] = allocate_kv(specs[i], ...)
        groups = group_specs(self.kv_cache_specs())  # cache it: deterministic
        for i, layer in enumerate(self.layers):
            g = groups.group_of_layer[i]
            table = batch.group_block_tables(g)      # [B, max_blocks] block ids (0 = null)
            slots = batch.group_slot_mapping(g)      # [T] where each new token's entry goes, -1: none
            latents = kv_cache[i].k                  # [num_blocks, block_size, 576]
        # recurrent layers: kv_cache[i] is a StateLayer, rows batch.state_slots[s]; a sequence
        # whose context starts with this step (context_len == query_len) starts from zeros

Prefix caching (``KVCacheManager``): block hashes are chained over token ids as before; each
group publishes its own blocks in its own pool, and a prefix of n token
blocks is a hit only when *every* group can serve it — full/MLA: blocks 0..n-1 cached;
sliding window: the blocks inside the window ending at n·block_size; compressed: n·block_size
a multiple of block_size·ratio and its blocks cached; recurrent state: a snapshot of the state
taken exactly at n·block_size tokens (see ``openinfer.kv.manager``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3": 1, "uint8": 1, "int8": 1}


def _itemsize(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of the token-indexed (paged) specs. ``dtype`` is a name from ``DTYPE_BYTES``."""

    kind: ClassVar[str] = ""
    paged: ClassVar[bool] = True  # False: per-request state in slots, not blocks

    @property
    def entry_bytes(self) -> int:
        """Bytes of one cache entry of one layer."""
        raise NotImplementedError

    @property
    def tokens_per_entry(self) -> int:
        return 1

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block of one layer."""
        return block_size * self.entry_bytes

    def num_entries(self, num_tokens: int) -> int:
        """Entries a sequence of ``num_tokens`` tokens has written."""
        return num_tokens // self.tokens_per_entry

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Block-table length that covers ``num_tokens`` tokens."""
        return cdiv(self.num_entries(num_tokens), block_size)

    def first_live_block(self, num_computed_tokens: int, block_size: int) -> int:
        """Blocks before this index are never read again once ``num_computed_tokens`` are done."""
        return 0

    def max_live_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int | None = None) -> int:
        """An upper bound on the blocks a request of ``num_tokens`` holds at once when a step
        computes at most ``chunk_tokens`` of its tokens (None: any number)."""
        return self.blocks_for(num_tokens, block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V of ``num_kv_heads × head_dim`` per token; ``shared_kv``: one entry read as both.
    ``allocate_kv`` → ``KVLayer(k, v)`` of ``[num_blocks, block_size, num_kv_heads, head_dim]``
    (``v is k`` when shared)."""

    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    shared_kv: bool = False
    kind: ClassVar[str] = "full_attention"

    @property
    def entry_bytes(self) -> int:
        return (1 if self.shared_kv else 2) * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Full attention over the last ``window`` tokens: a query at p reads keys p-window+1..p."""

    window: int = 0
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"a sliding-window spec needs window >= 1, got {self.window}")

    def first_live_block(self, num_computed_tokens: int, block_size: int) -> int:
        # the next query is at position num_computed_tokens; its oldest key is that - window + 1
        return max(0, num_computed_tokens - self.window + 1) // block_size

    def max_live_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int | None = None) -> int:
        full = self.blocks_for(num_tokens, block_size)
        if chunk_tokens is None:
            return full
        # a step over positions s..s+n-1 keeps keys s-window+1 .. s+n-1: L = window - 1 + n
        # consecutive positions, which touch at most cdiv(L - 1, block_size) + 1 blocks
        return min(full, cdiv(self.window - 2 + chunk_tokens, block_size) + 1)


@dataclass(frozen=True)
class MLALatentSpec(KVCacheSpec):
    """One ``latent_dim``-wide entry per token (MLA: compressed KV + rope key), no V.
    ``allocate_kv`` → ``KVLayer(k=[num_blocks, block_size, latent_dim], v=None)``."""

    latent_dim: int
    dtype: str = "float32"
    kind: ClassVar[str] = "mla_latent"

    @property
    def entry_bytes(self) -> int:
        return self.latent_dim * _itemsize(self.dtype)


@dataclass(frozen=True)
class CompressedSpec(KVCacheSpec):
    """One ``entry_dim``-wide entry per ``ratio`` tokens (compressed attention, indexer keys).
    ``allocate_kv`` → ``KVLayer(k=[num_blocks, block_size, entry_dim], v=None)``."""

    entry_dim: int
    ratio: int
    dtype: str = "float32"
    kind: ClassVar[str] = "compressed"

    def __post_init__(self) -> None:
        if self.ratio < 1:
            raise ValueError(f"a compressed spec needs ratio >= 1, got {self.ratio}")

    @property
    def entry_bytes(self) -> int:
        return self.entry_dim * _itemsize(self.dtype)

    @property
    def tokens_per_entry(self) -> int:
        return self.ratio


@dataclass(frozen=True)
class StateTensor:
    """One per-request state tensor: ``shape`` excludes the slot axis."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        size = 1
        for n in self.shape:
            size *= n
        return size * _itemsize(self.dtype)


@dataclass(frozen=True)
class RecurrentStateSpec(KVCacheSpec):
    """Fixed-size state per request, one row per state slot. ``allocate_kv(spec, num_slots)`` →
    ``StateLayer({name: [num_slots, *shape]})``. Slot 0 is the null slot (padding rows).

    ``snapshot_within_step``: the model's forward can also write the state after a given row of
    a sequence into another slot (``ForwardBatch.state_snapshots``), so a prefix-cache snapshot
    at a block boundary inside a prompt chunk costs no step of its own; without it the scheduler
    ends prompt chunks at block boundaries and the engine copies the state after the step."""

    tensors: tuple[StateTensor, ...]
    snapshot_within_step: bool = False
    kind: ClassVar[str] = "recurrent_state"
    paged: ClassVar[bool] = False

    @property
    def entry_bytes(self) -> int:
        return 0

    @property
    def slot_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def page_bytes(self, block_size: int) -> int:
        return 0

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return 0

    def max_live_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int | None = None) -> int:
        return 0


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with equal specs: one block table (or one state slot) per request serves them all."""

    group_id: int
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]  # indices into the model's spec list

    @property
    def paged(self) -> bool:
        return self.spec.paged


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]
    group_of_layer: tuple[int, ...]  # spec index -> group id

    @cached_property  # read several times per request per step by the KV manager
    def paged_groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(g for g in self.groups if g.paged)

    @property
    def has_state(self) -> bool:
        return any(not g.paged for g in self.groups)

    @property
    def snapshots_within_step(self) -> bool:
        """Every recurrent-state group's model writes snapshots inside a step (see
        ``RecurrentStateSpec.snapshot_within_step``); False without state."""
        state = [g.spec for g in self.groups if not g.paged]
        return bool(state) and all(getattr(spec, "snapshot_within_step", False) for spec in state)

    def bytes_per_block(self, block_size: int) -> int:
        return sum(g.spec.page_bytes(block_size) * len(g.layer_ids) for g in self.groups)

    @property
    def bytes_per_slot(self) -> int:
        return sum(g.spec.slot_bytes * len(g.layer_ids) for g in self.groups if not g.paged)

    def hit_granularity(self, block_size: int) -> int:
        """Prefix hits come in multiples of this many tokens: a block, or a whole compressed
        block (``block_size * ratio`` tokens) of every compressed group."""
        unit = block_size
        for group in self.paged_groups:
            unit = math.lcm(unit, block_size * group.spec.tokens_per_entry)
        return unit

    def blocks_needed(self, num_tokens: int, block_size: int, chunk_tokens: int | None = None) -> int:
        """Blocks a request of ``num_tokens`` holds at most, over every group, when a step
        computes at most ``chunk_tokens`` of its tokens (None: any number)."""
        return sum(g.spec.max_live_blocks(num_tokens, block_size, chunk_tokens) for g in self.paged_groups)


def group_specs(specs: Sequence[KVCacheSpec]) -> KVCacheGroups:
    """Equal specs → one group, numbered in order of first appearance (deterministic, so a
    model can compute its layers' group ids itself)."""
    if not specs:
        raise ValueError("a model must declare at least one KV cache spec")
    ids: dict[KVCacheSpec, int] = {}
    members: list[list[int]] = []
    group_of: list[int] = []
    for index, spec in enumerate(specs):
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"kv_cache_specs()[{index}] is {type(spec).__name__}, not a KVCacheSpec")
        if spec not in ids:
            ids[spec] = len(members)
            members.append([])
        members[ids[spec]].append(index)
        group_of.append(ids[spec])
    groups = tuple(KVCacheGroup(gid, spec, tuple(members[gid])) for spec, gid in ids.items())
    return KVCacheGroups(tuple(sorted(groups, key=lambda g: g.group_id)), tuple(group_of))


@dataclass(frozen=True)
class KVCachePlan:
    """How many block ids each group's pool and the state-slot pool get (each count includes
    its null id 0)."""

    group_blocks: tuple[int, ...]  # per group id: blocks of its pool (0 for state groups)
    num_state_slots: int  # 0 when no layer keeps state
    num_snapshot_slots: int  # of num_state_slots, reserved for prefix-cache snapshots
    max_num_seqs: int  # capped by the live state slots that fit

    @property
    def num_blocks(self) -> int:
        """Blocks over every group's pool."""
        return sum(self.group_blocks)


SNAPSHOT_BUDGET_FRACTION = 0.25


def plan_kv_cache(groups: KVCacheGroups, *, block_size: int, budget_bytes: int, max_num_seqs: int,
                  max_model_len: int, num_blocks: int | None = None, prefix_cache: bool = True,
                  chunk_tokens: int | None = None) -> KVCachePlan:
    """Split ``budget_bytes`` between state slots and the groups' pools (see the module
    docstring). ``num_blocks`` fixes every paged group's pool at that many blocks (tests,
    ``--num-kv-blocks``); the state slots then fit ``max_num_seqs`` live requests and, with the
    prefix cache, as many snapshots. ``chunk_tokens``: the most tokens one step computes for a
    request (sliding windows hold fewer blocks with smaller chunks)."""
    slot_bytes = groups.bytes_per_slot
    num_slots = snapshots = 0
    if groups.has_state:
        live = max_num_seqs
        if num_blocks is None:
            live = max(1, min(max_num_seqs, (budget_bytes // 2) // max(1, slot_bytes)))
        if prefix_cache:
            snapshots = max_num_seqs if num_blocks is not None else min(
                2 * live, int(budget_bytes * SNAPSHOT_BUDGET_FRACTION) // max(1, slot_bytes))
        max_num_seqs = live
        num_slots = live + snapshots + 1
    # each group's share of the block budget follows what one request at full context needs
    need = {g.group_id: max(1, g.spec.max_live_blocks(max_model_len, block_size, chunk_tokens))
            for g in groups.paged_groups}
    if num_blocks is not None:
        blocks = tuple(num_blocks if g.paged else 0 for g in groups.groups)
        return KVCachePlan(blocks, num_slots, snapshots, max_num_seqs)
    page = {g.group_id: g.spec.page_bytes(block_size) * len(g.layer_ids) for g in groups.paged_groups}
    per_request = sum(need[g] * page[g] for g in need)
    remaining = max(0, budget_bytes - num_slots * slot_bytes)
    blocks = []
    for group in groups.groups:
        if not group.paged:
            blocks.append(0)
            continue
        gid = group.group_id
        affordable = remaining * need[gid] // per_request if per_request else 0
        useful = max_num_seqs * need[gid] + 1  # every sequence at full context
        blocks.append(max(2, min(affordable, useful)))
    return KVCachePlan(tuple(blocks), num_slots, snapshots, max_num_seqs)
