"""benchmarks/sse_client.py, the lean streaming client both serving benchmarks drive bursts with
(gpu_concurrency's ``lean`` client, stub_serving's): against a scripted HTTP server (chunked and
not, frames split across chunks, error status, error frame) and against the real ``openinfer
serve`` with the stub model."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_concurrency  # noqa: E402
import stub_serving  # noqa: E402
from sse_client import CACHED_TOKENS_KEY, completion_tokens, stream_completion, usage_count  # noqa: E402


def text_frame(text: str, completion: int | None = None) -> bytes:
    chunk = {"object": "text_completion", "choices": [{"index": 0, "text": text}]}
    if completion is not None:
        chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def usage_frame(completion: int, cached: int | None = None) -> bytes:
    usage = {"prompt_tokens": 3, "total_tokens": 3 + completion, "completion_tokens": completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return b"data: " + json.dumps({"choices": [], "usage": usage}, separators=(",", ":")).encode() + b"\n\n"


async def serve_script(pieces: list[bytes], *, chunked: bool = True, status: bytes = b"200 OK",
                       delay_s: float = 0.01) -> tuple[asyncio.AbstractServer, int, list[bytes]]:
    """A server answering every POST with ``pieces`` (one HTTP chunk each, ``delay_s`` apart);
    the request bodies it received are collected."""
    received: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        received.append(await reader.readexactly(length))
        headers = b"HTTP/1.1 " + status + b"\r\ncontent-type: text/event-stream\r\n"
        writer.write(headers + (b"transfer-encoding: chunked\r\n\r\n" if chunked else b"\r\n"))
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
            await asyncio.sleep(delay_s)
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], received


def run_against(pieces: list[bytes], client, **script) -> tuple[object, list[bytes]]:
    async def main():
        server, port, received = await serve_script(pieces, **script)
        async with server:
            return await client(port, b'{"stream": true}'), received

    return asyncio.run(main())


def test_completion_tokens_is_read_without_parsing_json():
    assert completion_tokens(usage_frame(128)) == 128
    assert completion_tokens(b'data: {"usage":{"completion_tokens": 7}}') == 7
    assert completion_tokens(text_frame('say "completion_tokens": 5')) is None  # escaped quotes in text
    assert completion_tokens(text_frame("x")) is None


@pytest.mark.parametrize("chunked", [True, False])
def test_text_frames_timed_and_tokens_from_the_usage_chunk(chunked):
    # a frame split across two pieces, two frames in one piece, then the usage chunk and [DONE]
    first, second, third = text_frame("a"), text_frame("b"), text_frame("c")
    pieces = [first[:10], first[10:] + second, third, usage_frame(3) + b"data: [DONE]\n\n"]
    record, received = run_against(pieces, stream_completion, chunked=chunked)
    assert received == [b'{"stream": true}']
    assert record.ok and record.events == 3 and record.tokens == 3 and record.first_tokens == 0
    assert record.start < record.first < record.last and len(record.gaps) == 2
    assert sum(record.gaps) == pytest.approx(record.last - record.first)


def test_cached_tokens_come_from_the_usage_details_where_reported():
    assert usage_count(usage_frame(4, cached=1008), CACHED_TOKENS_KEY) == 1008
    assert usage_count(b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":null}}}', CACHED_TOKENS_KEY) is None
    record, _ = run_against([text_frame("a"), usage_frame(1, cached=32)], stream_completion)
    assert record.ok and record.cached_tokens == 32 and record.tokens == 1
    record, _ = run_against([text_frame("a"), usage_frame(1)], stream_completion)
    assert record.ok and record.cached_tokens is None  # a server that does not report them


def test_continuous_usage_counts_tokens_per_frame():
    # a lagging frontend merges tokens: the first frame carries 2, the last 5
    pieces = [text_frame("ab", 2), text_frame("c", 3), text_frame("de", 5), usage_frame(5)]
    record, _ = run_against(pieces, stream_completion)
    assert record.ok and record.events == 3 and record.first_tokens == 2 and record.tokens == 5


def test_an_error_status_and_an_error_frame_fail_the_stream():
    record, _ = run_against([b'{"error": "bad prompt"}'], stream_completion, chunked=False,
                            status=b"400 Bad Request")
    assert not record.ok and record.error.startswith("HTTP/1.1 400") and "bad prompt" in record.error
    record, _ = run_against([text_frame("a"), b'data: {"error":{"message":"engine died"}}\n\n'], stream_completion)
    assert not record.ok and "engine died" in record.error
    record, _ = run_against([usage_frame(0)], stream_completion)
    assert not record.ok and record.error == "no tokens"


def test_both_benchmarks_report_through_the_shared_client():
    pieces = [text_frame("ab", 2), text_frame("c", 3), text_frame("d", 4), usage_frame(4)]
    lean, _ = run_against(pieces, gpu_concurrency.lean_stream)
    assert lean["ok"] and lean["tokens"] == 4 and lean["events"] == 3 and len(lean["itl"]) == 2
    assert 0 < lean["ttft"] < lean["latency"]
    stub, _ = run_against(pieces, lambda port, body: stub_serving.one_stream(port, body, start_at=0.0))
    assert stub["ok"] and stub["tokens"] == 4 and stub["first_tokens"] == 2 and stub["events"] == 3
    assert stub["span"] == pytest.approx(stub["latency"] - stub["ttft"])
    failed, _ = run_against([], gpu_concurrency.lean_stream, status=b"503 Service Unavailable")
    assert failed == {"ok": False, "error": failed["error"]} and "503" in failed["error"]


def test_a_burst_against_the_real_server_with_the_stub_model():
    """stub_serving's burst (the shared client in forked client processes) through `openinfer
    serve`: every stream gets all its tokens, reported per chunk by the server's usage."""
    model_dir, vocab = stub_serving.make_model(step_ms=2.0)
    port = stub_serving.free_port()
    args = type("Args", (), {"inproc_pythonpath": "", "api_server_count": 1})()
    stats = str(Path(model_dir).parent / "stub_stats.json")
    server = stub_serving.start_server("multi", model_dir, port, args, stats)
    try:
        stub_serving.wait_healthy(port, server)
        result = stub_serving.burst(port, streams=4, prompt_len=8, output_len=6, vocab=vocab, procs=2, seed=0)
    finally:
        server.terminate()
        server.wait(30)
    assert result["num_ok"] == 4 and result["num_failed"] == 0, result["errors"]
    assert result["output_tok_s"] > 0 and result["ttft_ms"]["p50"] > 0
    # at most one event per token, plus the closing (finish) event when no token rides with it
    assert result["first_chunk_tokens_p50"] >= 1 and result["sse_events_per_token"] <= (6 + 1) / 6


def test_gpu_concurrency_records_the_policy_its_serve_args_choose():
    assert gpu_concurrency.scheduler_policy("") == "mixed"
    assert gpu_concurrency.scheduler_policy("--max-num-seqs 64 --scheduler-policy split") == "split"
    assert gpu_concurrency.scheduler_policy("--scheduler-policy=prefill_first --cuda-graph false") == "prefill_first"
