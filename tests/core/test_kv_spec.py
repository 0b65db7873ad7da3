"""Per-layer KV cache specs: bytes, grouping, sizing, and the manager per kind — tiny pools,
exact block ids and slot ids."""

import numpy as np
import pytest

from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.kv import (
    NULL_BLOCK_ID,
    BlockPool,
    CompressedSpec,
    FullAttentionSpec,
    KVCacheManager,
    MLALatentSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    StateSlots,
    StateTensor,
    group_specs,
    plan_kv_cache,
)
from openinfer.runtime.batch_builder import build_forward_batch
from openinfer.sched.scheduler import ScheduledChunk

FULL = FullAttentionSpec(1, 1)
STATE = RecurrentStateSpec((StateTensor("conv", (2, 3)), StateTensor("ssm", (2, 2, 2))))


def manager(*specs, num_blocks=16, block_size=2, slots=0, snapshots=0):
    """A manager with one pool of ``num_blocks`` per paged group."""
    groups = group_specs(list(specs))
    pools = [BlockPool(num_blocks, block_size) if g.paged else None for g in groups.groups]
    state = StateSlots(slots) if slots else None
    return KVCacheManager(pools, groups=groups, state_slots=state, num_snapshot_slots=snapshots)


def test_spec_bytes_per_kind():
    assert FullAttentionSpec(2, 4, "float32").entry_bytes == 2 * 2 * 4 * 4
    assert FullAttentionSpec(2, 4, "bfloat16", shared_kv=True).entry_bytes == 2 * 4 * 2
    assert MLALatentSpec(576, "bfloat16").page_bytes(16) == 16 * 576 * 2
    compressed = CompressedSpec(8, ratio=4)
    assert compressed.entry_bytes == 32 and compressed.num_entries(17) == 4
    assert compressed.blocks_for(17, block_size=2) == 2  # 4 entries, 2 per block
    window = SlidingWindowSpec(1, 1, window=5)
    assert window.max_live_blocks(100, block_size=4) == 25  # any chunk size: as full attention
    # one token per step: positions p-4..p span at most 2 blocks; chunks of 8: at most 4
    assert window.max_live_blocks(100, block_size=4, chunk_tokens=1) == 2
    assert window.max_live_blocks(100, block_size=4, chunk_tokens=8) == 4
    assert STATE.slot_bytes == (6 + 8) * 4 and STATE.page_bytes(16) == 0
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        _ = FullAttentionSpec(1, 1, "float64").entry_bytes


def test_equal_specs_group_in_order_of_first_appearance():
    window = SlidingWindowSpec(1, 1, window=3)
    groups = group_specs([FULL, window, STATE, FULL, window, STATE])
    assert [g.layer_ids for g in groups.groups] == [(0, 3), (1, 4), (2, 5)]
    assert groups.group_of_layer == (0, 1, 2, 0, 1, 2)
    assert [g.group_id for g in groups.paged_groups] == [0, 1] and groups.has_state
    # bytes of one block id: every paged layer's page; of one slot: every state layer's state
    assert groups.bytes_per_block(4) == 2 * (4 * 8) + 2 * (4 * 8)
    assert groups.bytes_per_slot == 2 * STATE.slot_bytes


def test_plan_sizes_blocks_and_state_slots_from_the_budget():
    groups = group_specs([FullAttentionSpec(1, 1)] * 2 + [STATE])  # 64 B per block (bs 4), 56 B per slot
    plan = plan_kv_cache(groups, block_size=4, budget_bytes=6400, max_num_seqs=8, max_model_len=64)
    # 8 live + 16 snapshot slots (a quarter of the budget allows 28) + the null slot; blocks get the rest
    assert (plan.num_state_slots, plan.num_snapshot_slots, plan.max_num_seqs) == (25, 16, 8)
    assert plan.num_blocks == (6400 - 25 * 56) // 64
    # a small budget caps the live requests (half the budget for live state)
    small = plan_kv_cache(groups, block_size=4, budget_bytes=560, max_num_seqs=8, max_model_len=64,
                          prefix_cache=False)
    assert (small.max_num_seqs, small.num_state_slots, small.num_snapshot_slots) == (5, 6, 0)
    assert small.num_blocks == (560 - 6 * 56) // 64
    # dense: blocks only, capped at what max_num_seqs requests at full context could hold
    dense = plan_kv_cache(group_specs([FULL]), block_size=4, budget_bytes=10**9, max_num_seqs=2, max_model_len=10)
    assert (dense.num_blocks, dense.num_state_slots) == (2 * 3 + 1, 0)


def test_plan_splits_blocks_between_groups_by_what_a_request_needs():
    window, compressed = SlidingWindowSpec(1, 1, window=8), CompressedSpec(2, ratio=4)
    groups = group_specs([FULL, window, compressed])  # pages of 4 tokens: 32, 32 and 32 bytes
    plan = plan_kv_cache(groups, block_size=4, budget_bytes=96 * 100, max_num_seqs=100, max_model_len=64,
                         chunk_tokens=4)
    # per request at 64 tokens: 16 full blocks, 4 window blocks (8 - 2 + 4 positions → 3 + 1),
    # 4 compressed blocks (16 entries); 24 blocks of 32 B: the 9600 B split 16 : 4 : 4
    assert plan.group_blocks == (9600 * 16 // (24 * 32), 9600 * 4 // (24 * 32), 9600 * 4 // (24 * 32))
    assert plan.group_blocks == (200, 50, 50)
    # a fixed count (--num-kv-blocks) is every group's pool size
    fixed = plan_kv_cache(groups, block_size=4, budget_bytes=0, max_num_seqs=4, max_model_len=64, num_blocks=9)
    assert fixed.group_blocks == (9, 9, 9) and fixed.num_blocks == 27


def test_sliding_window_frees_blocks_behind_the_window():
    kv = manager(FULL, SlidingWindowSpec(1, 1, window=3), FULL)
    tokens = list(range(100, 109))
    assert kv.start_request("a", tokens) == 0
    assert kv.grow("a", 9, 0)
    assert kv.group_tables("a") == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]  # each group has its own pool
    kv.publish_full_blocks("a", tokens, 9)
    # the next query (position 9) sees keys 7..9: blocks 0-2 (positions 0-5) of the window group go
    assert kv.grow("a", 10, 9)
    assert kv.group_tables("a") == [[1, 2, 3, 4, 5], [NULL_BLOCK_ID] * 3 + [4, 5]]
    assert [p.num_free_blocks for p in kv.pools] == [15 - 5, 15 - 5 + 3]
    kv.free_request("a")
    assert all(p.num_used_blocks == 0 for p in kv.pools)
    # the same prompt hits 4 blocks: every full block, and the window's blocks behind position 8
    assert kv.start_request("b", tokens) == 8
    assert kv.group_tables("b") == [[1, 2, 3, 4], [0, 0, 0, 4]]


def test_sliding_window_hit_needs_only_the_window():
    kv = manager(SlidingWindowSpec(1, 1, window=2), block_size=2)
    tokens = list(range(10))
    kv.start_request("a", tokens)
    kv.grow("a", 10, 0)
    assert kv.group_tables("a") == [[1, 2, 3, 4, 5]]
    kv.publish_full_blocks("a", tokens, 10)
    for computed in (3, 5, 7, 9):  # the window moves: blocks 1, 2, 3, 4 are released in turn
        kv.grow("a", 10, computed)
    assert kv.group_tables("a") == [[0, 0, 0, 0, 5]]
    kv.free_request("a")
    assert list(kv.pool.free_queue)[-5:] == [1, 2, 3, 4, 5]  # eviction order: oldest released first
    kv.pool.allocate(13)  # evicts the 10 never-used blocks and blocks 1, 2, 3
    # 4 blocks of the prompt are a hit although blocks 0-2 are gone: the query at position 8
    # sees keys 7..8, all in block 3 (id 4)
    assert kv.start_request("b", tokens) == 8
    assert kv.group_tables("b") == [[0, 0, 0, 4]]


def test_compressed_entries_and_slot_mapping():
    spec = CompressedSpec(4, ratio=2)
    kv = manager(FULL, spec, block_size=2)
    tokens = list(range(50, 59))
    kv.start_request("a", tokens)
    assert kv.grow("a", 9, 0)
    # 9 tokens: 5 full-attention blocks; 4 entries = 2 compressed blocks (2 entries of 2 tokens each)
    assert kv.group_tables("a") == [[1, 2, 3, 4, 5], [1, 2]]
    batch, _ = build_forward_batch([ScheduledChunk(_request("a", tokens), 9)], kv)
    # entry e = tokens 2e, 2e+1, written by token 2e+1 at block e // 2, offset e % 2
    assert batch.kv_slot_mappings[1].tolist() == [-1, 2, -1, 3, -1, 4, -1, 5, -1]
    assert batch.kv_block_tables[1].tolist() == [[1, 2]]
    assert batch.slot_mapping.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_prefix_hit_is_intersected_across_groups():
    kv = manager(FULL, CompressedSpec(4, ratio=2), block_size=2)
    tokens = list(range(50, 59))
    kv.start_request("a", tokens)
    kv.grow("a", 9, 0)
    kv.publish_full_blocks("a", tokens, 9)
    assert [p.num_cached_blocks for p in kv.pools] == [4, 2]
    kv.free_request("a")
    # 9 tokens: 4 full blocks hit; the compressed group serves 4 blocks (8 tokens = 2 compressed blocks)
    assert kv.start_request("b", tokens) == 8
    assert kv.group_tables("b") == [[1, 2, 3, 4], [1, 2]]
    # 7 tokens: the full group could serve 3 blocks, the compressed group only whole compressed
    # blocks (an even number of token blocks): 2 token blocks = 4 tokens
    assert kv.start_request("c", tokens[:7]) == 4
    assert kv.group_tables("c") == [[1, 2], [1]]


def test_recurrent_state_slots_are_reused_lowest_first():
    kv = manager(FULL, STATE, slots=4)
    for rid in ("a", "b", "c"):
        kv.start_request(rid, [1, 2, 3])
    assert [kv.state_slot(r) for r in ("a", "b", "c")] == [1, 2, 3]
    assert not kv.can_start()
    kv.free_request("b")
    assert kv.can_start()
    kv.start_request("d", [4, 5])
    assert kv.state_slot("d") == 2
    assert kv.grow("a", 3) and kv.grow("d", 3)
    batch, _ = build_forward_batch([ScheduledChunk(_request(r, [1, 2, 3]), 3) for r in ("a", "d")], kv)
    assert batch.state_slots.tolist() == [1, 2]
    assert batch.kv_block_tables[1].shape == (2, 0)  # the state group has no table


def test_state_snapshot_hit_restore_and_eviction_with_its_block():
    kv = manager(FULL, STATE, num_blocks=6, block_size=2, slots=5, snapshots=2)
    tokens = list(range(20, 27))  # 7 tokens
    kv.start_request("a", tokens)
    kv.grow("a", 4, 0)
    assert kv.snapshot_state("a", 4) == (1, 2)  # live slot 1 → snapshot slot 2
    assert kv.snapshot_state("a", 5) is None  # not a block boundary
    assert kv.take_state_copies() == [(1, 2)]
    kv.grow("a", 7, 4)
    kv.publish_full_blocks("a", tokens, 7)  # blocks 0-2 cached; the snapshot at 4 tokens published
    assert kv.num_snapshots == 1
    kv.free_request("a")
    # full attention could serve 3 blocks, the state only the snapshot at 2 blocks
    assert kv.start_request("b", tokens) == 4
    assert kv.state_slot("b") == 1 and kv.take_state_copies() == [(2, 1)]
    kv.free_request("b")
    assert kv.start_request("b2", tokens) == 4
    kv.free_request("b2")  # started, then not admitted: its restore is dropped with its slot
    assert kv.take_state_copies() == []
    # allocating every free block evicts block 2 (token block 1, the snapshot's anchor): freed
    kv.pool.allocate(kv.pool.num_free_blocks)
    assert kv.num_snapshots == 0 and kv.state_slots.num_free_slots == 4
    assert kv.start_request("c", tokens) == 0


def test_unpublished_snapshots_are_freed_with_the_request():
    kv = manager(FULL, STATE, slots=4, snapshots=1)
    kv.start_request("a", list(range(9)))
    kv.grow("a", 4, 0)
    assert kv.snapshot_state("a", 4) == (1, 2)
    assert kv.snapshot_state("a", 2) is None  # the one snapshot slot is held (pending)
    kv.free_request("a")
    assert kv.state_slots.num_free_slots == 3


def test_numpy_allocate_kv_per_spec():
    ops = NumpyBackend()
    full = ops.allocate_kv(FullAttentionSpec(2, 4), 3, 2)
    assert full.k.shape == (3, 2, 2, 4) and full.v.shape == (3, 2, 2, 4) and full.v is not full.k
    shared = ops.allocate_kv(FullAttentionSpec(2, 4, shared_kv=True), 3, 2)
    assert shared.v is shared.k
    latent = ops.allocate_kv(MLALatentSpec(576), 3, 2)
    assert latent.k.shape == (3, 2, 576) and latent.v is None
    assert ops.allocate_kv(CompressedSpec(8, ratio=4, dtype="bfloat16"), 3, 2).k.dtype == np.uint16
    state = ops.allocate_kv(STATE, 5)
    assert state["conv"].shape == (5, 2, 3) and state["ssm"].shape == (5, 2, 2, 2)
    state["ssm"][1] = 7.0
    state.copy_slots(np.array([1]), np.array([3]))
    assert (state["ssm"][3] == 7.0).all()
    assert ops.allocate_kv(3, 2, 2, 4).k.shape == (3, 2, 2, 4)  # the legacy form


def _request(rid, tokens):
    from openinfer.sampling import SamplingState
    from openinfer.sched.request import Request
    from openinfer.v1 import engine_pb2 as pb

    return Request(request_id=rid, token_ids=list(tokens), num_prompt_tokens=len(tokens), stop=pb.StopConditions(),
                   max_tokens=4, sampling=SamplingState.create(pb.SamplingParams(), list(tokens), 0, 0))
