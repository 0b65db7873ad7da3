"""Serving under pressure on the CPU: a tiny KV pool (preemption), prefix cache, chunked prefill."""

import numpy as np

from tests.helpers.engine_utils import make_request, run_all, run_one
from tests.plugins.qwen3.conftest import build_engine


def test_64_concurrent_requests_in_a_tiny_pool_match_running_alone(tiny_qwen3_dir):
    rng = np.random.default_rng(11)
    requests = []
    for i in range(64):
        prompt = rng.integers(3, 320, size=int(rng.integers(2, 40))).tolist()
        if i % 2:
            requests.append(make_request(f"r{i}", prompt, max_tokens=int(rng.integers(1, 24))))
        else:
            requests.append(make_request(f"r{i}", prompt, max_tokens=int(rng.integers(1, 24)), temperature=1.0,
                                         top_k=50, seed=i))
    # 24 usable blocks of 16 tokens: far less than 64 requests need at once, so the scheduler
    # must queue, chunk (budget 64 tokens) and preempt
    pressured = build_engine(tiny_qwen3_dir, num_kv_blocks=25, max_num_batched_tokens=64, enable_prefix_cache=False)
    relaxed = build_engine(tiny_qwen3_dir, num_kv_blocks=64)
    try:
        together = run_all(pressured, requests)
        alone = [run_one(relaxed, r) for r in requests]
        assert pressured.scheduler.num_preemptions > 0
        assert [o.token_ids for o in together] == [o.token_ids for o in alone]
        assert all(o.finish is not None for o in together)
        assert pressured.load().kv_blocks_used == 0
        assert pressured.pool.num_free_blocks == pressured.pool.num_usable_blocks
    finally:
        pressured.close_sync()
        relaxed.close_sync()


def test_shared_prefix_reports_cached_tokens_and_gives_identical_output(tiny_qwen3_dir):
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 320, size=50).tolist()
    first = make_request("first", prefix + [7, 8], max_tokens=1)  # finishes in its prefill step
    second = make_request("second", prefix + [9, 10, 11], max_tokens=10)
    cached = build_engine(tiny_qwen3_dir)
    uncached = build_engine(tiny_qwen3_dir, enable_prefix_cache=False)
    try:
        run_one(cached, first)
        hit = run_one(cached, second)
        miss = run_one(uncached, second)
        assert hit.cached_tokens == 48 and hit.finish.cached_tokens == 48  # 3 full blocks of 16
        assert miss.cached_tokens == 0
        assert hit.token_ids == miss.token_ids
        assert cached.load().kv_blocks_used == 0
        assert cached.load().kv_blocks_cached > 0
    finally:
        cached.close_sync()
        uncached.close_sync()


def test_prompt_logprobs_cover_every_prompt_token_after_the_first(tiny_qwen3_dir):
    engine = build_engine(tiny_qwen3_dir, max_num_batched_tokens=8)  # chunked prompt
    try:
        prompt = list(range(3, 23))
        out = []

        async def main():
            async for event in engine.generate(make_request("p", prompt, max_tokens=2, logprobs=1,
                                                            prompt_logprobs=True)):
                if event.WhichOneof("event") == "tokens":
                    out.extend(event.tokens.prompt_logprobs)

        import asyncio

        asyncio.run(main())
        assert len(out) == len(prompt) - 1
        assert all(lp.logprob <= 0 for lp in out)
    finally:
        engine.close_sync()


def test_cache_salt_isolates_prefix_cache(tiny_qwen3_dir):
    rng = np.random.default_rng(8)
    prefix = rng.integers(3, 320, size=40).tolist()
    engine = build_engine(tiny_qwen3_dir)
    try:
        def salted(name, suffix, salt):
            request = make_request(name, prefix + suffix, max_tokens=3)
            request.cache_salt = salt
            return request

        run_one(engine, salted("a", [5], "tenant-a"))
        same_tenant = run_one(engine, salted("b", [6], "tenant-a"))
        other_tenant = run_one(engine, salted("c", [7], "tenant-b"))
        unsalted = run_one(engine, make_request("d", prefix + [8], max_tokens=3))
        assert same_tenant.cached_tokens == 32
        assert other_tenant.cached_tokens == 0
        assert unsalted.cached_tokens == 0
    finally:
        engine.close_sync()
