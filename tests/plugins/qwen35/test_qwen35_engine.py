"""Qwen3.5 through the default PagedEngine: greedy tokens equal HF, batching and chunking
invisible, preemption recomputes the state, and every request's state slot comes back."""

import asyncio
import json
import time

import numpy as np
import pytest

from openinfer import EngineOptions, create_engine
from openinfer.v1 import engine_pb2 as pb
from tests.helpers.engine_utils import collect, make_request, run_all, run_one
from tests.plugins.qwen35.qwen35_helpers import hf_greedy


def build_engine(path, **options):
    from openinfer_qwen35 import plugin

    config = json.loads((path / "config.json").read_text())
    return plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cpu", **options))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 96, size=int(rng.integers(70, 100))).tolist() for _ in range(count)]


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def assert_everything_returned(engine):
    """No request holds a KV block or a state slot once every request has finished."""
    assert wait_until(lambda: engine.model.state.slots.num_used_slots == 0), engine.model.state.slots.owners()
    load = engine.load()
    assert load.kv_blocks_used == 0 and load.num_running == 0 and load.num_waiting == 0, load


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
        assert not engine.options.enable_prefix_cache
        batch = prompts(3)
        together = run_all(engine, [make_request(f"r{i}", p, max_tokens=32) for i, p in enumerate(batch)])
        assert [o.token_ids for o in together] == [hf_reference[tuple(p)] for p in batch]
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
        outcomes = run_all(engine, [make_request(f"p{i}", p, max_tokens=32) for i, p in enumerate(batch)])
        assert engine.scheduler.num_preemptions > 0
        assert [o.token_ids for o in outcomes] == [hf_reference[tuple(p)] for p in batch]
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_more_requests_than_state_slots_queue_and_finish(tiny):
    path, _ = tiny
    from openinfer_qwen35.config import Qwen35Config
    from openinfer_qwen35.state import DeltaNetStateCache

    config = Qwen35Config.from_dict(json.loads((path / "config.json").read_text()))
    slot_bytes = DeltaNetStateCache.bytes_per_slot(config)
    engine = build_engine(path, cpu_kv_cache_gib=2.5 * slot_bytes / 2**30)  # room for 2 slots
    try:
        assert engine.model.state.slots.num_usable_slots == 2
        assert engine.scheduler.max_num_seqs == 2
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
                        assert engine.model.state.slots.has("ab")
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


def test_repeated_prompt_is_recomputed_not_served_from_a_prefix_cache(tiny):
    path, _ = tiny
    engine = build_engine(path)
    try:
        prompt = prompts(1)[0]
        first = asyncio.run(collect(engine, make_request("c1", prompt, max_tokens=2)))
        second = asyncio.run(collect(engine, make_request("c2", prompt, max_tokens=2)))
        # the prefix cache is off for a recurrent model: a repeated prompt is recomputed
        assert first.cached_tokens == 0 and second.cached_tokens == 0
        assert first.token_ids == second.token_ids
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
