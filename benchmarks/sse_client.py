"""A lean streaming completions client: one raw HTTP/1.1 POST per stream, SSE frames read off
the socket (chunked or not), JSON parsed for no frame. Cheap enough that a few client
processes can drive hundreds of streams and measure the server, not the client.

``stream_completion(port, body)`` returns a ``StreamRecord`` of when each text frame arrived,
the ``completion_tokens`` the server reported (from the usage chunk, or from every chunk with
``stream_options.continuous_usage_stats``) and the prompt's ``cached_tokens``
(``usage.prompt_tokens_details``, where the server reports it); each benchmark derives its own
figures from it (``benchmarks/gpu_concurrency.py``, ``benchmarks/stub_serving.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

COMPLETION_TOKENS_KEY = b'"completion_tokens":'
CACHED_TOKENS_KEY = b'"cached_tokens":'
ERROR_PREFIXES = (b'data: {"error"', b'data: {"object":"error"')


@dataclass
class StreamRecord:
    """One stream as the client saw it (``time.perf_counter`` seconds)."""

    start: float  # just before connecting
    first: float | None = None  # the first text frame
    last: float | None = None  # the last text frame
    events: int = 0  # text frames (the usage-only chunk is not one)
    tokens: int = 0  # the last completion_tokens the server reported
    first_tokens: int = 0  # completion_tokens reported with the first text frame (0: not reported)
    cached_tokens: int | None = None  # the prompt's tokens served from the prefix cache (None: not reported)
    gaps: list[float] = field(default_factory=list)  # between consecutive text frames
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.first is not None and not self.error


def completion_body(model: str, prompt: list[int] | str, max_tokens: int) -> bytes:
    """A streaming /v1/completions request: greedy, ``max_tokens`` out whatever the model samples
    (ignore_eos), usage in the last chunk."""
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()


def completion_tokens(frame: bytes) -> int | None:
    """The ``completion_tokens`` of an SSE frame's usage, without parsing its JSON."""
    return usage_count(frame, COMPLETION_TOKENS_KEY)


def usage_count(frame: bytes, key: bytes) -> int | None:
    """The integer after ``key`` (a JSON key with its colon) in an SSE frame, without parsing its
    JSON; None where the key is absent or its value is not a number (``null``)."""
    at = frame.find(key)
    if at < 0:
        return None
    begin = end = at + len(key)
    while end < len(frame) and frame[end:end + 1] == b" ":
        begin = end = end + 1
    while end < len(frame) and frame[end:end + 1].isdigit():
        end += 1
    return int(frame[begin:end]) if end > begin else None


class _Frames:
    """SSE frames (``data: ...``) from body bytes arriving in arbitrary pieces."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self.buffer += data
        frames = []
        while b"\n\n" in self.buffer:
            frame, self.buffer = self.buffer.split(b"\n\n", 1)
            if frame.startswith(b"data: ") and frame != b"data: [DONE]":
                frames.append(frame)
        return frames


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool):
    while True:
        if chunked:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                return
            yield (await reader.readexactly(size + 2))[:-2]
        else:
            data = await reader.read(1 << 16)
            if not data:
                return
            yield data


async def stream_completion(port: int, body: bytes, *, host: str = "127.0.0.1",
                            path: str = "/v1/completions") -> StreamRecord:
    """POST ``body`` (a streaming request's JSON) and read its SSE stream to the end."""
    record = StreamRecord(start=time.perf_counter())
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(), len(body), body))
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            rest = await reader.read(2000)
            record.error = (status + rest)[:300].decode(errors="replace")
            return record
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            lowered = line.lower()
            chunked |= lowered.startswith(b"transfer-encoding:") and b"chunked" in lowered
        frames = _Frames()
        async for piece in _body_pieces(reader, chunked):
            for frame in frames.feed(piece):
                now = time.perf_counter()
                if frame.startswith(ERROR_PREFIXES):
                    record.error = frame[:300].decode(errors="replace")
                    continue
                count = completion_tokens(frame)
                if b'"choices":[]' not in frame:  # a text frame (the usage chunk has no choices)
                    record.events += 1
                    if record.first is None:
                        record.first, record.first_tokens = now, count or 0
                    else:
                        record.gaps.append(now - record.last)
                    record.last = now
                if count is not None:
                    record.tokens = count
                cached = usage_count(frame, CACHED_TOKENS_KEY)
                if cached is not None:
                    record.cached_tokens = cached
    finally:
        writer.close()
    if record.first is None and not record.error:
        record.error = "no tokens"
    return record
