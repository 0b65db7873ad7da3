"""Every scheduler policy through the engine (sync and launch-ahead): a burst of requests with
prompts longer than the token budget gets the same greedy tokens whichever way steps are formed
(decodes riding along with prompt chunks, alternating, or prompts first)."""

import pytest

from openinfer import EngineOptions, PagedEngine
from openinfer.sched.scheduler import POLICIES
from tests.core.test_kv_spec_engine import ToyHybrid
from tests.helpers.engine_utils import make_request, run_all

PROMPTS = [[(7 * i + j) % 31 + 1 for j in range(5 + 3 * i)] for i in range(5)]


def burst(policy: str, async_scheduling: bool) -> list[list[int]]:
    engine = PagedEngine(ToyHybrid(), EngineOptions(device="cpu", block_size=2, num_kv_blocks=96, max_num_seqs=4,
                                                    max_num_batched_tokens=7, enable_prefix_cache=False,
                                                    async_scheduling=async_scheduling, scheduler_policy=policy))
    try:
        assert engine.scheduler.policy == policy
        outcomes = run_all(engine, [make_request(f"r{i}", p, 6) for i, p in enumerate(PROMPTS)])
        assert engine.load().kv_blocks_used == 0
        return [o.token_ids for o in outcomes]
    finally:
        engine.close_sync()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_policy_gives_the_same_tokens(async_scheduling):
    want = burst("mixed", async_scheduling)
    assert all(len(tokens) == 6 for tokens in want)
    for policy in POLICIES[1:]:
        assert burst(policy, async_scheduling) == want, policy


def test_the_engine_option_alone_chooses_the_policy(monkeypatch):
    monkeypatch.setenv("OPENINFER_SCHEDULER_POLICY", "split")  # no longer read
    for options, policy in ((dict(scheduler_policy="prefill_first"), "prefill_first"), ({}, "mixed")):
        engine = PagedEngine(ToyHybrid(), EngineOptions(device="cpu", block_size=2, num_kv_blocks=16, **options))
        try:
            assert engine.scheduler.policy == policy
        finally:
            engine.close_sync()
