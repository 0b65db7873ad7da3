"""Prefix-cache snapshots of recurrent state written inside a step (``RecurrentStateSpec.
snapshot_within_step``): the scheduler no longer cuts a prompt at its last full block, so a
prompt runs in one step; the forward writes the state at the boundary inside it into the snapshot
slot the batch names (``ForwardBatch.state_snapshots``). Cached and uncached runs give the same
tokens, cached tokens are reported, and the snapshots' slots come back when their blocks go.
Where the snapshot goes is ``KVCacheManager.snapshot_within``'s policy (``SNAPSHOT_POLICIES``)."""

import numpy as np
import pytest

from openinfer import EngineOptions, PagedEngine
from openinfer.kv import RecurrentStateSpec, StateTensor
from openinfer.kv.manager import SNAPSHOT_POLICY_ENV
from tests.core.test_kv_spec_engine import DIM, ToyHybrid
from tests.helpers.engine_utils import assert_everything_returned, make_request, run_all, run_one


class ToySnapshotting(ToyHybrid):
    """ToyHybrid whose forward also writes the state after a boundary row into a snapshot slot,
    and which records each forward's rows per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[int]] = []
        self.snapshots_written: list[tuple[int, int, int]] = []

    def kv_cache_specs(self):
        specs = super().kv_cache_specs()
        return specs[:3] + [RecurrentStateSpec((StateTensor("s", (DIM,)),), snapshot_within_step=True)]

    def forward(self, batch, kv_cache):
        state = kv_cache[3]
        self.steps.append(np.diff(batch.query_start).tolist())
        written = []
        for seq, cut, slot in np.asarray(batch.state_snapshots).reshape(-1, 3).tolist():
            start = batch.query_start[seq]
            first = batch.context_lens[seq] - (batch.query_start[seq + 1] - start)
            s = np.zeros(DIM, np.float32) if first == 0 else state["s"][batch.state_slots[seq]].copy()
            for row in range(start, start + cut):  # the same fold as ToyHybrid's, up to the boundary
                s = 0.5 * s + self.embed[batch.token_ids[row]]
            written.append((slot, s))
            self.snapshots_written.append((seq, cut, slot))
        logits = super().forward(batch, kv_cache)
        for slot, s in written:
            state["s"][slot] = s
        return logits


def _engine(model=None, **options):
    options = {"device": "cpu", "block_size": 2, "num_kv_blocks": 64, "max_num_seqs": 4, **options}
    return PagedEngine(model or ToySnapshotting(), EngineOptions(**options))


def test_a_prompt_runs_in_one_step_and_its_boundary_state_is_snapshotted_inside_it():
    prompt = [3, 9, 4, 17, 8, 1, 30, 12, 5, 7, 22]  # 11 tokens; hits come in 4s: the boundary at 8
    model = ToySnapshotting()
    engine = _engine(model)
    try:
        assert engine.kv.hit_granularity == 4 and engine.scheduler.last_chunk_whole
        first = run_one(engine, make_request("a", prompt, 1))
        assert model.steps == [[11]]  # one step, not 8 + 3
        assert model.snapshots_written == [(0, 8, model.snapshots_written[0][2])]
        assert engine.kv.num_snapshots == 1
        repeat = run_one(engine, make_request("b", prompt, 1))
        assert repeat.token_ids == first.token_ids and repeat.cached_tokens == 8
        assert model.steps[-1] == [3]
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_a_prompt_ending_on_a_boundary_snapshots_after_its_step_only():
    """The default policy (``follow_up``): the state a next turn restores is the prompt's final
    one; no snapshot inside the step, so a hybrid model's state layers run once."""
    prompt = [3, 9, 4, 17, 8, 1, 30, 12, 5, 7, 22, 2]  # 12 tokens: on a boundary (hits come in 4s)
    model = ToySnapshotting()
    engine = _engine(model)
    try:
        assert engine.kv.snapshot_policy == "follow_up"
        first = run_one(engine, make_request("a", prompt, 1))
        assert model.steps == [[12]] and model.snapshots_written == []
        longer = run_one(engine, make_request("c", prompt + [4, 4, 4], 1))  # from the snapshot after the step
        assert longer.cached_tokens == 12 and model.steps[-1] == [3]
        # an identical prompt cannot use the state after its own last token: computed again, same tokens
        repeat = run_one(engine, make_request("b", prompt, 1))
        assert repeat.token_ids == first.token_ids and repeat.cached_tokens == 0
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_the_retry_policy_keeps_the_boundary_before_for_a_repeat(monkeypatch):
    monkeypatch.setenv(SNAPSHOT_POLICY_ENV, "retry")
    prompt = [3, 9, 4, 17, 8, 1, 30, 12, 5, 7, 22, 2]
    model = ToySnapshotting()
    engine = _engine(model)
    try:
        assert engine.kv.snapshot_policy == "retry"
        first = run_one(engine, make_request("a", prompt, 1))
        assert model.steps == [[12]] and [w[:2] for w in model.snapshots_written] == [(0, 8)]
        repeat = run_one(engine, make_request("b", prompt, 1))
        assert repeat.token_ids == first.token_ids and repeat.cached_tokens == 8
        longer = run_one(engine, make_request("c", prompt + [4, 4, 4], 1))
        assert longer.cached_tokens == 12
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_an_unknown_policy_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(SNAPSHOT_POLICY_ENV, "everywhere")
    with pytest.raises(ValueError, match="OPENINFER_STATE_SNAPSHOTS"):
        _engine()


def test_a_chunk_cut_by_the_budget_ends_on_a_boundary():
    """A prompt longer than the step's budget: its first chunk stops at the last boundary inside
    the budget (the state there is snapshotted by a copy after the step, nothing inside it); its
    last chunk runs whole with the snapshot inside."""
    prompt = list(range(1, 16))  # 15 tokens, budget 10: 8 (a boundary) then 7 (the boundary at 12 inside)
    model = ToySnapshotting()
    engine = _engine(model, max_num_batched_tokens=10, max_model_len=32)
    try:
        first = run_one(engine, make_request("a", prompt, 1))
        assert model.steps[:2] == [[8], [7]]
        assert [w[:2] for w in model.snapshots_written] == [(0, 4)]
        turn = run_one(engine, make_request("b", prompt + [6, 6], 1))
        assert turn.cached_tokens == 12
        assert first.token_ids
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_cached_and_uncached_outputs_equal_over_turns_and_a_batch():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 32, size=n).tolist() for n in (13, 10, 17)]
    cold = _engine(enable_prefix_cache=False)
    try:
        want = [run_one(cold, make_request(f"c{i}", p, 6)).token_ids for i, p in enumerate(prompts)]
        turns = [p + w[:4] + [6, 2, 9] for p, w in zip(prompts, want, strict=True)]
        want_turns = [run_one(cold, make_request(f"t{i}", t, 6)).token_ids for i, t in enumerate(turns)]
        assert cold.kv.num_snapshots == 0 and not cold.scheduler.align_chunks
    finally:
        cold.close_sync()
    model = ToySnapshotting()
    warm = _engine(model)
    try:
        # all three in one step: the snapshotted sequences are not only the last one
        got = run_all(warm, [make_request(f"w{i}", p, 6) for i, p in enumerate(prompts)])
        assert [o.token_ids for o in got] == want
        assert model.steps[0] == [13, 10, 17] and len(model.snapshots_written) == 3
        again = run_all(warm, [make_request(f"x{i}", t, 6) for i, t in enumerate(turns)])
        assert [o.token_ids for o in again] == want_turns
        assert all(o.cached_tokens > 0 for o in again)
        assert_everything_returned(warm)
    finally:
        warm.close_sync()


def test_snapshot_slots_are_freed_with_their_blocks():
    engine = _engine(num_kv_blocks=12)  # 11 usable blocks of 2 tokens: a second prompt evicts the first's
    try:
        run_one(engine, make_request("a", list(range(1, 18)), 2))
        held = set(engine.kv.snapshots)
        assert held and engine.state_slots.num_used_slots == len(held)
        run_one(engine, make_request("b", list(range(31, 14, -1)), 2))
        assert not held <= set(engine.kv.snapshots)
        assert engine.state_slots.num_used_slots == engine.kv.num_snapshots
        assert_everything_returned(engine)
    finally:
        engine.close_sync()
