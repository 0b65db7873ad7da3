"""DeepSeek-V4 through the default PagedEngine: greedy tokens equal HF with chunked prefill and
batching, preemption recomputes the attention state, prefix-cache hits (whole compressed blocks,
open windows restored from snapshots) leave outputs unchanged, seeded sampling is reproducible,
and every request's blocks and state slot come back when it ends."""

import numpy as np
import pytest

from openinfer import create_engine
from openinfer.v1 import engine_pb2 as pb
from tests.helpers.engine_utils import (
    assert_everything_returned,
    build_plugin_engine,
    make_request,
    run_all,
    run_greedy_batch,
    run_one,
)
from tests.plugins.deepseek_v4.conftest import prompt
from tests.plugins.deepseek_v4.dsv4_helpers import hf_greedy


def build_engine(path, **options):
    from openinfer_deepseek_v4 import plugin

    return build_plugin_engine(plugin, path, **options)


def prompts(count: int) -> list[list[int]]:
    return [prompt(length, seed=10 + i) for i, length in enumerate((70, 93, 121)[:count])]


@pytest.fixture(scope="module")
def hf_reference(tiny):
    _, hf = tiny
    return {tuple(p): hf_greedy(hf, p, 16) for p in prompts(3)}


def test_engine_greedy_matches_hf_with_chunked_prefill_and_batching(tiny, hf_reference):
    path, _ = tiny
    engine = build_engine(path, max_num_batched_tokens=40)  # chunks every prompt, mixes prefill and decode
    try:
        assert engine.options.enable_prefix_cache
        batch = prompts(3)
        together = run_greedy_batch(engine, batch, hf_reference, 16, "r")
        assert all(o.finish.reason == pb.FINISH_REASON_LENGTH for o in together)
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_preemption_recomputes_the_state(tiny, hf_reference):
    path, _ = tiny
    # 6 blocks per KV cache group's pool: a 32-token chunk's sliding window fits (4 blocks), the
    # three requests' compressed (rate 4) entries (2 + 2 + 3 blocks) do not
    engine = build_engine(path, num_kv_blocks=6, max_num_batched_tokens=32)
    try:
        batch = prompts(3)
        run_greedy_batch(engine, batch, hf_reference, 16, "p")
        assert engine.scheduler.num_preemptions > 0
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_seeded_sampling_is_reproducible_and_batching_invisible(tiny):
    path, _ = tiny
    engine = build_engine(path, max_num_batched_tokens=48)
    try:
        p = prompts(1)[0]

        def sampled(rid, seed, **kwargs):
            return make_request(rid, p, max_tokens=12, temperature=0.9, seed=seed, top_p=0.9, top_k=40,
                                min_p=0.02, frequency_penalty=0.3, logprobs=2, **kwargs)

        alone = run_one(engine, sampled("s0", 7))
        together = run_all(engine, [sampled("s1", 7), sampled("s2", 8), make_request("g", prompts(2)[1], 8)])
        assert together[0].token_ids == alone.token_ids and len(alone.token_ids) == 12
        assert together[1].token_ids != alone.token_ids  # another seed, another draw
        assert len(alone.logprobs) == 12
        np.testing.assert_allclose([lp.logprob for lp in together[0].logprobs],
                                   [lp.logprob for lp in alone.logprobs], atol=1e-5)
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_plugin_is_discovered_and_serves(tiny, hf_reference):
    path, _ = tiny
    engine = create_engine(path, device="cpu")
    try:
        assert engine.info().plugin == "openinfer-deepseek-v4"
        p = prompts(1)[0]
        assert run_one(engine, make_request("d", p, max_tokens=16)).token_ids == hf_reference[tuple(p)]
        assert_everything_returned(engine)
    finally:
        engine.close_sync()


def test_prefix_cache_hits_restore_the_compressor_state(tiny_5x):
    """HCA rate 16 and 2-token blocks: hits come in 32-token units (a whole HCA block); the
    compressors' open windows and the CSA overlap come back from the state snapshot."""
    path, hf = tiny_5x
    first = prompt(90, seed=21)
    expected = hf_greedy(hf, first, 8)
    engine = build_engine(path, block_size=2, max_num_batched_tokens=40)
    try:
        assert engine.kv.hit_granularity == 32
        cold = run_one(engine, make_request("cold", first, max_tokens=8))
        assert cold.token_ids == expected and cold.cached_tokens == 0
        warm = run_one(engine, make_request("warm", first, max_tokens=8))
        assert warm.token_ids == expected and warm.cached_tokens == 64
        follow = first + expected + prompt(13, seed=22)  # a second turn: 111 tokens
        second = run_one(engine, make_request("turn2", follow, max_tokens=8))
        assert second.cached_tokens == 96
        assert_everything_returned(engine)
    finally:
        engine.close_sync()
    cold_engine = build_engine(path, block_size=2, enable_prefix_cache=False)
    try:
        assert second.token_ids == run_one(cold_engine, make_request("cold2", follow, max_tokens=8)).token_ids
    finally:
        cold_engine.close_sync()
