"""Request traces (``--trace-dir``) on the demo model, through the HTTP app as ``openinfer serve``
builds it: one Chrome-trace JSON per request whose spans nest on each track and whose token
counts match the response."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from openinfer.frontend.http import create_app
from openinfer.tokenizer import Tokenizer
from openinfer.tracing import check_trace
from tests.plugins.llama.conftest import build_engine


def _spans(document: dict, tid: int) -> dict[str, list[dict]]:
    by_name: dict[str, list[dict]] = {}
    for span in check_trace(document):
        if span["tid"] == tid:
            by_name.setdefault(span["name"], []).append(span)
    return by_name


def _inside(child: dict, parent: dict) -> bool:
    return parent["ts"] <= child["ts"] and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + 1e-3


@pytest.fixture(scope="module")
def traced(demo_model_dir: Path, tmp_path_factory) -> tuple[Path, list[dict]]:
    """Three requests: non-streamed completion, streamed chat (both greedy), a second
    completion sharing the first's prompt (prefix cache hit); responses kept for comparison."""
    trace_dir = tmp_path_factory.mktemp("traces")
    # a chunk budget of 8 tokens splits each prompt into several prefill chunks
    engine = build_engine(demo_model_dir, num_kv_blocks=128, trace_dir=str(trace_dir), max_num_batched_tokens=8)
    app = create_app(engine, Tokenizer.from_dir(demo_model_dir), "demo", trace_dir=str(trace_dir))
    prompt = "The capital of France is Paris. " * 6 + "The capital of Italy is"  # > 2 KV blocks: cacheable

    async def run() -> list[dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as http:
            first = (await http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 6, "temperature": 0})).json()
            async with http.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}) as response:
                chunks = [json.loads(line[6:]) async for line in response.aiter_lines()
                          if line.startswith("data: {")]
            second = (await http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 3, "temperature": 0})).json()
            return [first, {"id": chunks[0]["id"], "usage": chunks[-1]["usage"]}, second]

    try:
        responses = asyncio.run(run())
        assert engine.tracer.writer.flush() and app.state.openinfer.tracer.writer.flush()
    finally:
        engine.close_sync()
    return trace_dir, responses


def test_one_valid_trace_per_request_with_matching_tokens(traced) -> None:
    trace_dir, responses = traced
    files = sorted(trace_dir.glob("*.json"))
    assert len(files) == 3 and not list(trace_dir.glob("*.engine.json")), files  # engine halves merged
    for response in responses:
        document = json.loads((trace_dir / f"{response['id']}-0.json").read_text())
        usage = response["usage"]
        engine, frontend = _spans(document, 1), _spans(document, 2)
        [outer] = engine["engine"]
        [queue] = engine["queue"]
        rides = engine.get("prefill", []) + engine["decode"]
        assert all(_inside(s, outer) for s in [queue, *rides])
        # every token of the response came out of exactly one step this request rode in
        assert sum(s["args"]["sampled"] for s in rides) == usage["completion_tokens"]
        assert len(engine["decode"]) == usage["completion_tokens"] - 1
        prefill_tokens = sum(s["args"]["tokens"] for s in engine["prefill"])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert prefill_tokens == usage["prompt_tokens"] - cached
        assert all(s["args"]["batch_size"] >= 1 and s["args"]["step_ms"] >= 0 for s in rides)
        meta = document["otherData"]
        assert meta["engine"]["completion_tokens"] == usage["completion_tokens"]
        assert meta["frontend"]["tokens_streamed"] == usage["completion_tokens"]
        [request] = frontend["request"]
        assert sum(s["args"]["tokens"] for s in frontend["detokenize"]) == usage["completion_tokens"]
        assert all(_inside(s, request) for s in frontend["detokenize"] + frontend["stream"])
        assert frontend["stream"], "each delta handed to the client is a stream span"


def test_prompt_split_into_chunks_and_cache_hit_traced(traced) -> None:
    trace_dir, (first, _, second) = traced
    chunks = _spans(json.loads((trace_dir / f"{first['id']}-0.json").read_text()), 1)["prefill"]
    assert len(chunks) >= 2 and all(c["args"]["tokens"] <= 8 for c in chunks)
    positions = [c["args"]["position"] for c in chunks]
    assert positions == sorted(positions) and positions[0] == 0
    again = json.loads((trace_dir / f"{second['id']}-0.json").read_text())
    assert again["otherData"]["engine"]["cached_tokens"] > 0
    assert _spans(again, 1)["prefill"][0]["args"]["position"] == again["otherData"]["engine"]["cached_tokens"]


def test_check_trace_rejects_partial_overlap() -> None:
    span = {"ph": "X", "pid": 1, "tid": 1}
    good = {"traceEvents": [{**span, "name": "a", "ts": 0, "dur": 10}, {**span, "name": "b", "ts": 2, "dur": 3}]}
    assert len(check_trace(good)) == 2
    bad = {"traceEvents": [{**span, "name": "a", "ts": 0, "dur": 10}, {**span, "name": "b", "ts": 5, "dur": 10}]}
    with pytest.raises(ValueError, match="without nesting"):
        check_trace(bad)


def test_cli_generate_writes_the_engine_trace(demo_model_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """``openinfer generate --trace-dir``: no frontend traces, so the engine's file is the trace."""
    from openinfer.cli import main

    monkeypatch.setenv("OPENINFER_CACHE", str(demo_model_dir.parent))
    assert main(["generate", "--device", "cpu", "--prompt-token-ids", "1,2,3,4,5", "--max-tokens", "4", "--json",
                 "--num-kv-blocks", "64", "--trace-dir", str(tmp_path)]) == 0
    output = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    [path] = tmp_path.glob("*.engine.json")
    spans = check_trace(json.loads(path.read_text()))
    rides = [s for s in spans if s["name"] in ("prefill", "decode")]
    assert sum(s["args"]["sampled"] for s in rides) == len(output["token_ids"]) == 4
