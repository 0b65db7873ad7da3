"""Qwen3.5 through the default PagedEngine: greedy tokens equal HF, batching and chunking
invisible, preemption recomputes the state, every request's state slot comes back, and the
prefix cache (KV blocks + state snapshots) serves repeated prefixes with unchanged outputs."""

import asyncio
import json

import numpy as np
import pytest

from openinfer import create_engine
from openinfer.v1 import engine_pb2 as pb
from tests.helpers.engine_utils import (
    assert_everything_returned,
    build_plugin_engine,
    collect,
    make_request,
    run_all,
    run_greedy_batch,
    run_one,
)
from tests.plugins.qwen35.qwen35_helpers import hf_greedy


def build_engine(path, **options):
    from openinfer_qwen35 import plugin

    return build_plugin_engine(plugin, path, **options)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 96, size=int(rng.integers(70, 100))).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def hf_reference(tiny):
    """HF greedy continuations of the shared prompts (computed once)."""
    _, hf = tiny
    return {tuple(p): hf_greedy(hf, p, 32) for p in prompts(3)}


def test_engine_greedy_matches_hf_with_chunked_prefill_and_batching(tiny, hf_reference):
    path, _ = tiny
    # a 40-token budget splits every prompt into chunks and mixes prefill chunks with decodes
    engine = build_engine(path, max_num_batched_tokens=40)
    try:
        assert engine.options.enable_prefix_cache and engine.state_slots is not None
        batch = prompts(3)
        together = run_greedy_batch(engine, batch, hf_reference, 32, "r")
        assert all(o.finish.reason == pb.FINISH_REASON_LENGTH for o in together)
        assert_everything_returned(engine)
        alone = run_one(engine, make_request("alone", batch[1], max_tokens=32))
        assert alone.token_ids == together[1].token_ids
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_preemption_recomputes_state_from_scratch(tiny, hf_reference):
    path, _ = tiny
    # 16 usable blocks of 16 tokens: three ~120-token requests cannot all stay resident
    engine = build_engine(path, num_kv_blocks=17, max_num_batched_tokens=64)
    try:
        batch = prompts(3)
        run_greedy_batch(engine, batch, hf_reference, 32, "p")
        assert engine.scheduler.num_preemptions > 0
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_more_requests_than_state_slots_queue_and_finish(tiny):
    path, _ = tiny
    from openinfer_qwen35.config import Qwen35Config
    from openinfer_qwen35.state import bytes_per_slot

    config = Qwen35Config.from_dict(json.loads((path / "config.json").read_text()))
    # a state budget of 5 slots: live state gets half of it (2 slots), snapshots a quarter (1)
    engine = build_engine(path, cpu_kv_cache_gib=5.9 * bytes_per_slot(config) / 2**30)
    try:
        assert engine.kv_plan.max_num_seqs == 2 and engine.kv_plan.num_snapshot_slots == 1
        assert engine.state_slots.num_usable_slots == 3 and engine.scheduler.max_num_seqs == 2
    finally:
        engine.close_sync()
    engine = build_engine(path, max_num_seqs=2, num_kv_blocks=32)
    try:
        assert engine.state_slots.num_usable_slots == 2 + 2  # live + snapshots
        batch = [p[:20] for p in prompts(5, seed=4)]
        together = run_all(engine, [make_request(f"q{i}", p, max_tokens=6) for i, p in enumerate(batch)])
        alone = [run_one(engine, make_request(f"a{i}", p, max_tokens=6)) for i, p in enumerate(batch)]
        assert [o.token_ids for o in together] == [o.token_ids for o in alone]
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_abort_and_dropped_streams_free_the_state_slot(tiny):
    path, _ = tiny
    engine = build_engine(path)
    try:
        async def abort_after_three_tokens():
            seen = 0
            async for event in engine.generate(make_request("ab", prompts(1)[0], max_tokens=200)):
                if event.WhichOneof("event") == "tokens":
                    seen += 1
                    if seen == 3:
                        assert engine.state_slots.has("ab")
                        assert await engine.abort("ab")
                if event.WhichOneof("event") == "finished":
                    return event.finished

        assert asyncio.run(abort_after_three_tokens()).reason == pb.FINISH_REASON_ABORT
        assert_everything_returned(engine)

        async def drop_the_stream():
            stream = engine.generate(make_request("drop", prompts(1)[0], max_tokens=200))
            async for event in stream:
                if event.WhichOneof("event") == "tokens":
                    break
            await stream.aclose()

        asyncio.run(drop_the_stream())
        assert_everything_returned(engine)
        # the freed slot is reused and starts from a zero state: same answer as a fresh engine
        again = run_one(engine, make_request("again", prompts(1)[0], max_tokens=8))
        assert again.token_ids == run_one(engine, make_request("again2", prompts(1)[0], max_tokens=8)).token_ids
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_plugin_is_discovered_for_text_and_multimodal_checkpoints(tiny, tiny_multimodal, hf_reference):
    path, _ = tiny
    prompt = prompts(1)[0]
    for model_dir in (path, tiny_multimodal):
        engine = create_engine(model_dir, device="cpu")
        try:
            assert engine.info().plugin == "openinfer-qwen35"
            assert run_one(engine, make_request("d", prompt, max_tokens=32)).token_ids == hf_reference[tuple(prompt)]
            assert_everything_returned(engine)
        finally:
            engine.close_sync()


def test_prefix_cache_hits_restore_state_snapshots_with_identical_outputs(tiny):
    path, _ = tiny
    prompt = prompts(1, seed=7)[0]  # 70-99 tokens
    cold = build_engine(path, enable_prefix_cache=False)
    try:
        want_first = run_one(cold, make_request("c1", prompt, max_tokens=12)).token_ids
        second_turn = prompt + want_first[:10] + [7, 8, 9, 10, 11]  # a's history + a new turn
        want_second = run_one(cold, make_request("c2", second_turn, max_tokens=12)).token_ids
        assert cold.kv.num_snapshots == 0
    finally:
        cold.close_sync()
    engine = build_engine(path)
    try:
        first = asyncio.run(collect(engine, make_request("w1", prompt, max_tokens=12)))
        assert first.token_ids == want_first and first.cached_tokens == 0
        # the prompt's first chunk stopped at its last full block; the state there was snapshotted
        boundary = (len(prompt) - 1) // 16 * 16
        repeat = asyncio.run(collect(engine, make_request("w2", prompt, max_tokens=12)))
        assert repeat.token_ids == want_first and repeat.cached_tokens == boundary
        assert repeat.finish.cached_tokens == boundary
        # the second turn continues from the snapshot a's decode took at its last block boundary
        second = asyncio.run(collect(engine, make_request("w3", second_turn, max_tokens=12)))
        assert second.token_ids == want_second
        assert second.cached_tokens == (len(prompt) + 11) // 16 * 16
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_state_snapshots_are_freed_when_their_blocks_are_evicted(tiny):
    path, _ = tiny
    # 7 usable blocks of 16 tokens: a second ~90-token request evicts most of the first's blocks
    engine = build_engine(path, num_kv_blocks=8, max_num_batched_tokens=64)
    try:
        first, second = prompts(2, seed=9)
        run_one(engine, make_request("e1", first, max_tokens=4))
        snapshots = set(engine.kv.snapshots)
        assert snapshots and engine.state_slots.num_used_slots == len(snapshots)
        run_one(engine, make_request("e2", second, max_tokens=4))
        survivors = snapshots & set(engine.kv.snapshots)
        assert len(survivors) < len(snapshots)  # evicted with the blocks they belong to
        assert all(engine.kv.snapshot_block_cached(h) for h in engine.kv.snapshots)
        assert engine.state_slots.num_used_slots == engine.kv.num_snapshots  # their slots are free
        again = run_one(engine, make_request("e3", first, max_tokens=4))
        assert again.cached_tokens == 0  # the state at every boundary of its prompt is gone
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_engine_logprobs_equal_hf_log_softmax(tiny):
    from openinfer.sampling import log_softmax
    from tests.plugins.qwen35.qwen35_helpers import hf_logits

    path, hf = tiny
    prompt = prompts(1, seed=6)[0]
    engine = build_engine(path, max_num_batched_tokens=48)
    try:
        outcome = run_one(engine, make_request("lp", prompt, max_tokens=8, logprobs=2))
    finally:
        engine.close_sync()
    reference = log_softmax(hf_logits(hf, prompt + outcome.token_ids)[len(prompt) - 1 : -1])
    ours = np.array([lp.logprob for lp in outcome.logprobs])
    assert np.abs(ours - reference[np.arange(8), outcome.token_ids]).max() <= 1e-4
