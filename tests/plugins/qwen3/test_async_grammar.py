"""Async scheduling with structured outputs: the forward of step N+1 is launched before step N
is read back even when a row has a grammar; only that step's sampling waits for the matchers to
consume N's tokens. Nothing a client sees changes (NumPy backend, a tiny random Qwen3 behind a
real tokenizer)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from openinfer import EngineOptions, structured
from openinfer.structured import GrammarMatcher
from openinfer.v1 import engine_pb2 as pb
from tests.helpers.engine_utils import collect, make_request, run_all

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "frontend"))
from agent_checkpoints import write_family_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "k": {"enum": ["a", "b"]}},
          "required": ["n", "k"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_family_model(tmp_path_factory.mktemp("qwen3-grammar"), "qwen3", seed=5)


def build(path: Path, **options):
    from openinfer_qwen3 import plugin

    config = json.loads((path / "config.json").read_text())
    return plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cpu", **options))


def constrained(request: pb.GenerateRequest, kind: str) -> pb.GenerateRequest:
    if kind == "json":
        request.structured_output.json_schema = json.dumps(SCHEMA)
    elif kind == "regex":
        request.structured_output.regex = "[a-z]{3,9}( [a-z]{2,5}){1,3}"
    elif kind == "choice":
        request.structured_output.choice.choices.extend(["alpha", "beta gamma", "delta"])
    return request


def mixed_batch() -> list[pb.GenerateRequest]:
    """Grammar rows (greedy, seeded, with penalties, cut by max_tokens) next to plain rows (one
    stopping while the next step is already launched), in the same steps."""
    requests = []
    for i in range(18):
        prompt = [5 + i, 9, 11, 40 + 3 * i, 7]
        kind = ("json", "regex", "choice", "plain", "json", "plain")[i % 6]
        if kind == "plain":
            request = make_request(f"plain{i}", prompt, max_tokens=14, stop_token_ids=list(range(60, 90)) if i % 4 else ())
        elif i % 5 == 1:  # sampled: the request's own generator gives the same draws on both paths
            request = make_request(f"{kind}{i}", prompt, max_tokens=40, temperature=1.0, seed=i, ignore_eos=False)
        elif i % 5 == 2:  # penalties read the generated tokens on the host as well
            request = make_request(f"{kind}{i}", prompt, max_tokens=40, ignore_eos=False, repetition_penalty=1.3)
        elif i % 5 == 3:  # ends mid-structure
            request = make_request(f"{kind}{i}", prompt, max_tokens=4, ignore_eos=False)
        else:
            request = make_request(f"{kind}{i}", prompt, max_tokens=40, ignore_eos=False)
        requests.append(constrained(request, kind))
    return requests


def test_grammar_rows_launch_ahead_with_identical_outputs(model_dir):
    requests = mixed_batch()
    sync = build(model_dir, async_scheduling=False)
    overlapped = build(model_dir, async_scheduling=True, max_num_seqs=8)
    try:
        expected = run_all(sync, requests)
        got = run_all(overlapped, requests)
        for request, want, have in zip(requests, expected, got, strict=True):
            assert have.error is None and want.error is None
            assert have.token_ids == want.token_ids, request.request_id
            assert have.finish.reason == want.finish.reason, request.request_id
            assert have.finish.completion_tokens == len(have.token_ids)
        reasons = {o.finish.reason for r, o in zip(requests, got, strict=True) if r.HasField("structured_output")}
        assert reasons == {pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH}  # completed and cut grammars
        # every step after the first has a grammar row, and (nearly) every one ran ahead
        assert overlapped.num_steps_launched_ahead >= overlapped.num_steps - 4
        assert sync.num_steps_launched_ahead == 0
        assert overlapped.load().kv_blocks_used == 0 and overlapped.load().num_running == 0
    finally:
        sync.close_sync()
        overlapped.close_sync()


def test_the_next_forward_runs_before_the_matcher_consumes_the_previous_token(model_dir, monkeypatch):
    """A grammar row and a plain row in one batch: after the prefill, each step's forward is
    queued before the matchers see the previous step's token."""
    events: list[str] = []
    accept = GrammarMatcher.accept

    def recording_accept(self, token_id):
        events.append("accept")
        return accept(self, token_id)

    monkeypatch.setattr(GrammarMatcher, "accept", recording_accept)
    consume_tokens = structured.consume_tokens

    def recording_consume(executor, consume):  # the mask worker's: the step's tokens, then its masks
        events.extend(["accept"] * len(consume))
        return consume_tokens(executor, consume)

    monkeypatch.setattr(structured, "consume_tokens", recording_consume)
    engine = build(model_dir, async_scheduling=True)
    forward = engine.model.forward

    def recording_forward(batch, kv_cache):
        events.append("forward")
        return forward(batch, kv_cache)

    engine.model.forward = recording_forward
    try:
        requests = [constrained(make_request("g", [5, 9, 11], max_tokens=8), "regex"),
                    make_request("p", [6, 9, 11], max_tokens=8)]
        outcomes = run_all(engine, requests)
    finally:
        engine.close_sync()
    assert [len(o.token_ids) for o in outcomes] == [8, 8]
    # prefill, then the first decode's forward, then the prefill's token reaches the matcher; and so on
    assert events[:5] == ["forward", "forward", "accept", "forward", "accept"]
    assert events.count("accept") == 8


def test_abort_mid_grammar_leaves_the_others_and_the_engine_intact(model_dir):
    long_regex = make_request("long", [5, 9, 11], max_tokens=60, ignore_eos=False)
    long_regex.structured_output.regex = "[a-z]{60}"
    plain = make_request("plain", [8, 9, 11], max_tokens=30)
    follow_up = constrained(make_request("after", [7, 9, 11], max_tokens=40, ignore_eos=False), "json")
    sync = build(model_dir, async_scheduling=False)
    overlapped = build(model_dir, async_scheduling=True)
    try:
        long_want, plain_want, after_want = run_all(sync, [long_regex, plain, follow_up])

        async def abort_after_some_tokens():
            async def aborted() -> list[int]:
                tokens: list[int] = []
                async for event in overlapped.generate(long_regex):
                    if event.WhichOneof("event") == "tokens":
                        tokens.extend(event.tokens.ids)
                        if len(tokens) >= 5:
                            break  # leaving the stream aborts the request mid-structure
                return tokens

            return await asyncio.gather(aborted(), collect(overlapped, plain))

        long_got, plain_got = asyncio.run(abort_after_some_tokens())
        assert long_got == long_want.token_ids[:len(long_got)]
        assert plain_got.token_ids == plain_want.token_ids
        after_got = run_all(overlapped, [follow_up])[0]
        assert after_got.token_ids == after_want.token_ids
        assert after_got.finish.reason == after_want.finish.reason
        assert overlapped.health().healthy
        assert overlapped.load().kv_blocks_used == 0 and overlapped.load().num_running == 0
    finally:
        sync.close_sync()
        overlapped.close_sync()
