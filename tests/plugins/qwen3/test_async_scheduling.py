"""Async scheduling (step N+1 launched before step N is read back) changes nothing a client sees."""

import numpy as np
import pytest

from tests.helpers.engine_utils import make_request, run_all
from tests.plugins.qwen3.conftest import build_engine


def mixed_requests(seed: int = 21, kinds: int = 4):
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(24):
        prompt = rng.integers(3, 320, size=int(rng.integers(2, 50))).tolist()
        kind = (3, 0, 1)[i % 3] if kinds == 3 else i % 4
        if kind == 0:
            requests.append(make_request(f"g{i}", prompt, max_tokens=int(rng.integers(1, 20))))
        elif kind == 1:
            requests.append(make_request(f"s{i}", prompt, max_tokens=15, temperature=0.8, top_p=0.9, seed=i))
        elif kind == 2:  # penalties: these rows wait for the previous step's tokens on the host
            requests.append(make_request(f"p{i}", prompt, max_tokens=12, temperature=0.7, seed=i,
                                         presence_penalty=0.5, repetition_penalty=1.2))
        else:  # stops while the next step is already launched
            requests.append(make_request(f"e{i}", prompt, max_tokens=30, stop_token_ids=list(range(3, 120)),
                                         logprobs=2))
    return requests


@pytest.mark.parametrize("with_penalties", [False, True])
def test_async_scheduling_gives_identical_outputs_and_frees_everything(tiny_qwen3_dir, with_penalties):
    requests = mixed_requests(kinds=4 if with_penalties else 3)
    sync = build_engine(tiny_qwen3_dir, async_scheduling=False)
    overlapped = build_engine(tiny_qwen3_dir, async_scheduling=True, num_kv_blocks=30, max_num_batched_tokens=64)
    try:
        expected = run_all(sync, requests)
        got = run_all(overlapped, requests)
        for want, have in zip(expected, got, strict=True):
            assert have.token_ids == want.token_ids
            assert have.finish.reason == want.finish.reason
            assert have.finish.completion_tokens == len(have.token_ids)
            # logprobs agree to float32 rounding (steps batch the rows differently)
            assert np.allclose([lp.logprob for lp in have.logprobs], [lp.logprob for lp in want.logprobs], atol=1e-5)
        if not with_penalties:  # penalty rows need the previous step's tokens, so they wait for them
            assert overlapped.num_steps_launched_ahead > 10
        assert sync.num_steps_launched_ahead == 0
        assert overlapped.load().kv_blocks_used == 0
        assert overlapped.load().num_running == 0
    finally:
        sync.close_sync()
        overlapped.close_sync()


def test_a_failing_step_reads_the_previous_one_back_once_and_fails_its_requests(tiny_qwen3_dir):
    prompt = np.random.default_rng(4).integers(3, 320, size=20).tolist()
    sync = build_engine(tiny_qwen3_dir, async_scheduling=False)
    overlapped = build_engine(tiny_qwen3_dir, async_scheduling=True)
    try:
        expected = run_all(sync, [make_request("ok", prompt, max_tokens=12)])[0].token_ids
        forward, calls = overlapped.model.forward, []

        def flaky_forward(batch, kv_cache):
            calls.append(1)
            if len(calls) == 6:  # prefill, then decode steps launched ahead; the 6th fails
                raise RuntimeError("injected device failure")
            return forward(batch, kv_cache)

        overlapped.model.forward = flaky_forward
        failed = run_all(overlapped, [make_request("boom", prompt, max_tokens=12)])[0]
        assert failed.error is not None and "injected device failure" in failed.error.message
        # every token read back before the failure is emitted exactly once, in order
        assert 0 < len(failed.token_ids) < 12 and failed.token_ids == expected[: len(failed.token_ids)]
        overlapped.model.forward = forward
        assert run_all(overlapped, [make_request("after", prompt, max_tokens=12)])[0].token_ids == expected
        assert overlapped.load().kv_blocks_used == 0
    finally:
        sync.close_sync()
        overlapped.close_sync()
