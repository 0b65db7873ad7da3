"""The default engine serving tiny Qwen3: batching, stops, KV accounting, bad input, load."""

import asyncio
import json
import shutil

import numpy as np
import pytest

from openinfer import InvalidRequestError
from openinfer.v1 import engine_pb2 as pb
from tests.helpers.engine_utils import collect, make_request, run_all, run_one
from tests.plugins.qwen3.conftest import build_engine


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 320, size=int(rng.integers(3, 60))).tolist() for _ in range(count)]


def assert_pool_full(engine):
    load = engine.load()
    assert load.kv_blocks_used == 0, load
    assert load.num_running == 0 and load.num_waiting == 0


def test_batching_is_invisible_greedy_and_seeded(engine):
    batch = prompts(6)
    greedy = [make_request(f"g{i}", p, max_tokens=12) for i, p in enumerate(batch)]
    seeded = [make_request(f"s{i}", p, max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i)
              for i, p in enumerate(batch)]
    together = run_all(engine, greedy + seeded)
    alone = [run_one(engine, r) for r in greedy + seeded]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 12 for o in together)
    assert_pool_full(engine)


def test_requests_arriving_while_others_run_join_and_leave(engine):
    async def main():
        long = asyncio.ensure_future(collect(engine, make_request("long", prompts(1)[0], max_tokens=40)))
        await asyncio.sleep(0.05)
        short = await collect(engine, make_request("short", [5, 6, 7], max_tokens=3))
        return await long, short

    long, short = asyncio.run(main())
    assert len(long.token_ids) == 40 and len(short.token_ids) == 3
    assert short.token_ids == run_one(engine, make_request("short2", [5, 6, 7], max_tokens=3)).token_ids
    assert_pool_full(engine)


def test_stop_token_min_tokens_and_eos(engine):
    prompt = prompts(1, seed=4)[0]
    free = run_one(engine, make_request("free", prompt, max_tokens=20)).token_ids
    stop_at = free[5]
    first = free.index(stop_at)
    stopped = run_one(engine, make_request("stop", prompt, max_tokens=20, stop_token_ids=[stop_at]))
    assert stopped.token_ids == free[: first + 1]
    assert stopped.finish.reason == pb.FINISH_REASON_STOP
    assert stopped.finish.matched_stop_token_id == stop_at
    # min_tokens bans the stop id until that many tokens exist
    late = run_one(engine, make_request("late", prompt, max_tokens=20, stop_token_ids=[stop_at], min_tokens=first + 2))
    assert len(late.token_ids) >= first + 2
    assert stop_at not in late.token_ids[: first + 1]
    length = run_one(engine, make_request("len", prompt, max_tokens=4))
    assert length.finish.reason == pb.FINISH_REASON_LENGTH and length.finish.completion_tokens == 4
    assert length.finish.prompt_tokens == len(prompt)


def test_eos_stops_unless_ignored(tiny_qwen3_dir, tmp_path):
    prompt = prompts(1, seed=9)[0]
    engine = build_engine(tiny_qwen3_dir)
    try:
        free = run_one(engine, make_request("a", prompt, max_tokens=10)).token_ids
    finally:
        engine.close_sync()
    # the same checkpoint, with a token it generates declared as its EOS
    eos_dir = tmp_path / "eos"
    shutil.copytree(tiny_qwen3_dir, eos_dir)
    for name in ("config.json", "generation_config.json"):
        path = eos_dir / name
        if path.exists():
            config = json.loads(path.read_text())
            config["eos_token_id"] = free[2]
            path.write_text(json.dumps(config))
    engine = build_engine(eos_dir)
    try:
        stopped = run_one(engine, make_request("b", prompt, max_tokens=10, ignore_eos=False))
        assert stopped.token_ids == free[: free.index(free[2]) + 1]
        assert stopped.finish.reason == pb.FINISH_REASON_STOP
        ignored = run_one(engine, make_request("c", prompt, max_tokens=10, ignore_eos=True))
        assert ignored.token_ids == free
    finally:
        engine.close_sync()


def test_logprobs(engine):
    out = run_one(engine, make_request("lp", [4, 5, 6, 7], max_tokens=3, logprobs=5))
    assert len(out.logprobs) == 3
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert len(lp.top) == 5
        assert lp.top[0].token_id == token  # greedy: the sampled token is the most likely
        assert lp.logprob == pytest.approx(lp.top[0].logprob)
        assert all(a.logprob >= b.logprob for a, b in zip(lp.top, lp.top[1:], strict=False))


def test_abort_returns_blocks(engine):
    # abort at the first tokens event, with room for ~450 more: tokens that reach the consumer between two reads merge
    # into one event, so on a loaded machine a 200-token request had finished before its third event (CI, s15)
    async def main():
        agen = engine.generate(make_request("ab", prompts(1)[0], max_tokens=450))
        aborted = False
        async for event in agen:
            if event.WhichOneof("event") == "tokens" and not aborted:
                assert await engine.abort("ab")
                aborted = True
            if event.WhichOneof("event") == "finished":
                return event.finished

    finished = asyncio.run(main())
    assert finished.reason == pb.FINISH_REASON_ABORT
    assert_pool_full(engine)


def test_closing_the_stream_aborts(engine):
    async def main():
        agen = engine.generate(make_request("drop", prompts(1)[0], max_tokens=200))
        async for event in agen:
            if event.WhichOneof("event") == "tokens":
                break
        await agen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if engine.load().kv_blocks_used == 0:
                return

    asyncio.run(main())
    assert_pool_full(engine)


@pytest.mark.parametrize("request_kwargs,field", [
    ({"prompt": [1, 2, 999]}, "prompt_token_ids"),
    ({"prompt": []}, "prompt_token_ids"),
    ({"prompt": [1] * 600}, "prompt_token_ids"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 500, "prompt": [1] * 100}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(engine, request_kwargs, field):
    kwargs = {"prompt": [1, 2, 3], **request_kwargs}
    with pytest.raises(InvalidRequestError) as info:
        run_one(engine, make_request("bad", **kwargs))
    assert info.value.field == field
    assert engine.health().healthy
    assert len(run_one(engine, make_request("good", [1, 2, 3], max_tokens=2)).token_ids) == 2
