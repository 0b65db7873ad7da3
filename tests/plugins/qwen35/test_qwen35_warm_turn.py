"""A warm chat turn on Qwen3.5 (NumPy): the prompt runs in one step — the state at its last
block boundary is snapshotted inside that step (``state.split_at_snapshots``), not by a step of
its own for the last ``len % 16`` tokens — and cached runs equal uncached ones, alone or with
other prompts in the step."""

import dataclasses

import numpy as np
import pytest
from openinfer_qwen35.state import SNAPSHOT_IN_STEP_ENV, StepSequences, split_at_snapshots

from tests.helpers.engine_utils import assert_everything_returned, make_request, run_all, run_one
from tests.plugins.qwen35.test_qwen35_engine import build_engine, prompts


@pytest.fixture
def in_step(monkeypatch):
    monkeypatch.setenv(SNAPSHOT_IN_STEP_ENV, "1")


def spy_forwards(engine) -> list[list[int]]:
    """Each later ``model.forward``'s rows per sequence and its snapshot rows."""
    steps: list[list[int]] = []
    forward = engine.model.forward

    def spy(batch, kv_cache):
        steps.append(np.diff(batch.query_start).tolist() + [tuple(r) for r in batch.state_snapshots.tolist()])
        return forward(batch, kv_cache)

    engine.model.forward = spy
    return steps


def count_core_runs(engine) -> list[int]:
    """How many times each later forward ran a GDN layer core (``KernelPlan.delta_net``), summed
    over its layers: a forward without a split runs each GDN layer's core once."""
    runs: list[int] = []
    plan, forward = engine.model.plan, engine.model.forward

    def delta_net(*args, **kwargs):
        runs[-1] += 1
        return plan.delta_net(*args, **kwargs)

    def spy(batch, kv_cache):
        runs.append(0)
        return forward(batch, kv_cache)

    engine.model.plan = dataclasses.replace(plan, delta_net=delta_net)
    engine.model.forward = spy
    return runs


def test_a_prompt_ending_on_a_boundary_runs_each_gdn_layer_once(tiny, in_step):
    """The default snapshot policy (``follow_up``): a prompt of whole blocks is snapshotted by a
    copy after its step, so its GDN layers run once; a prompt ending inside a block runs each in
    two parts around its last boundary; the next turn of either starts from its snapshot."""
    path, _ = tiny
    base = prompts(1, seed=7)[0]
    aligned, ragged = base[:64], base[1:68]  # 64 tokens: whole blocks; 67: a boundary at 64 inside
    cold = build_engine(path, enable_prefix_cache=False)
    try:
        want = {len(p): run_one(cold, make_request(f"c{len(p)}", p + [5, 6], max_tokens=4)).token_ids
                for p in (aligned, ragged)}
    finally:
        cold.close_sync()
    engine = build_engine(path)
    try:
        layers = len(engine.model.config.linear_layer_ids)
        runs = count_core_runs(engine)
        run_one(engine, make_request("a", aligned, max_tokens=1))
        assert runs == [layers]
        run_one(engine, make_request("b", ragged, max_tokens=1))
        assert runs[1] == 2 * layers  # the 64 rows before the boundary, then the 3 after
        for prompt in (aligned, ragged):
            turn = run_one(engine, make_request(f"t{len(prompt)}", prompt + [5, 6], max_tokens=4))
            assert turn.token_ids == want[len(prompt)] and turn.cached_tokens == 64
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_split_at_snapshots_orders_head_rows_then_tail_rows():
    seqs = StepSequences(np.array([0, 5, 6, 10]), np.array([3, 4, 7]), np.array([True, False, True]),
                         snapshots=np.array([[0, 2, 9], [2, 3, 11]]))
    split = split_at_snapshots(seqs)
    assert split.head.query_start.tolist() == [0, 2, 3, 6] and split.head.slots.tolist() == [3, 4, 7]
    assert split.head.fresh.tolist() == [True, False, True]
    assert split.tail.query_start.tolist() == [0, 3, 4] and split.tail.slots.tolist() == [3, 7]
    assert not split.tail.fresh.any() and split.num_head_rows == 6
    assert split.order.tolist() == [0, 1, 5, 6, 7, 8, 2, 3, 4, 9]
    assert (split.order[split.inverse] == np.arange(10)).all()
    assert split.live.tolist() == [3, 7] and split.snapshot.tolist() == [9, 11]
    assert split.pairs == ((3, 9), (7, 11))
    last_only = split_at_snapshots(StepSequences(np.array([0, 4, 9]), np.array([1, 2]), np.array([True, True]),
                                                 snapshots=np.array([[1, 3, 5]])))
    assert last_only.order is None and last_only.num_head_rows == 7
    assert split_at_snapshots(StepSequences(np.array([0, 4]), np.array([1]), np.array([True]))) is None


def test_a_prompt_runs_in_one_step_and_a_repeat_starts_from_its_boundary(tiny, in_step):
    path, _ = tiny
    prompt = prompts(1, seed=7)[0]  # 70-99 tokens
    cold = build_engine(path, enable_prefix_cache=False)
    try:
        want = run_one(cold, make_request("c", prompt, max_tokens=6)).token_ids
    finally:
        cold.close_sync()
    engine = build_engine(path)
    try:
        steps = spy_forwards(engine)
        first = run_one(engine, make_request("a", prompt, max_tokens=1))
        boundary = (len(prompt) - 1) // 16 * 16
        assert first.token_ids == want[:1]
        if len(prompt) % 16:  # the boundary inside the prompt: one step, with its snapshot row
            assert steps == [[len(prompt), (0, boundary, steps[0][1][2])]]
        assert engine.kv.num_snapshots >= 1
        repeat = run_one(engine, make_request("b", prompt, max_tokens=6))
        assert repeat.token_ids == want and repeat.cached_tokens == boundary
        assert steps[1][0] == len(prompt) - boundary
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_warm_turns_of_a_batch_equal_cold_ones(tiny, in_step):
    path, _ = tiny
    firsts = prompts(3, seed=11)
    cold = build_engine(path, enable_prefix_cache=False)
    try:
        want = [o.token_ids for o in run_all(cold, [make_request(f"c{i}", p, max_tokens=8)
                                                  for i, p in enumerate(firsts)])]
        turns = [p + w[:6] + [5, 6, 7, 8, 9] for p, w in zip(firsts, want, strict=True)]
        want_turns = [o.token_ids for o in run_all(cold, [make_request(f"d{i}", t, max_tokens=8)
                                                        for i, t in enumerate(turns)])]
    finally:
        cold.close_sync()
    engine = build_engine(path)
    try:
        steps = spy_forwards(engine)
        got = run_all(engine, [make_request(f"a{i}", p, max_tokens=8) for i, p in enumerate(firsts)])
        assert [o.token_ids for o in got] == want
        assert sorted(steps[0][:3]) == sorted(len(p) for p in firsts)  # the three prompts in one step
        again = run_all(engine, [make_request(f"b{i}", t, max_tokens=8) for i, t in enumerate(turns)])
        assert [o.token_ids for o in again] == want_turns
        assert all(o.cached_tokens >= len(p) // 16 * 16 for o, p in zip(again, firsts, strict=True))
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_switched_off_the_prompt_stops_at_its_last_full_block(tiny, monkeypatch):
    monkeypatch.setenv(SNAPSHOT_IN_STEP_ENV, "0")
    path, _ = tiny
    prompt = prompts(1, seed=7)[0]
    assert len(prompt) % 16
    engine = build_engine(path)
    try:
        steps = spy_forwards(engine)
        run_one(engine, make_request("a", prompt, max_tokens=1))
        boundary = (len(prompt) - 1) // 16 * 16
        assert steps == [[boundary], [len(prompt) - boundary]]  # the tail step of the earlier design
    finally:
        engine.close_sync()
