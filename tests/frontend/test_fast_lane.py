"""``OPENINFER_HTTP_FAST_LANE`` (default on): streamed completions skip FastAPI's routing, everything else
reaches the app unchanged. Each request below is answered the same with the lane on and off
(status, headers that matter, body with its ids and timestamps masked), refusals included."""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import LiveServer

from openinfer.errors import OpenInferError
from openinfer.frontend.http import create_app
from openinfer.frontend.http.fast_lane import FAST_LANE_ENV, CompletionsFastLane, fast_lane_wanted

MODEL = "tiny"
JSON = {"content-type": "application/json"}

REQUESTS = [
    ("POST", "/v1/completions", b'{"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "stream": true}', JSON),
    ("POST", "/v1/completions", b'{"prompt": "hello there", "max_tokens": 3, "temperature": 0, "stream": true,'
                                b' "stream_options": {"include_usage": true}}', JSON),
    ("POST", "/v1/completions", b'{"prompt": [[5, 6], [7, 8]], "max_tokens": 2, "temperature": 0, "stream": true}',
     JSON),
    ("POST", "/v1/completions", b'{"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}', JSON),  # not streamed
    ("POST", "/v1/completions", b'{"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "stream": 1}', JSON),
    ("POST", "/v1/completions", b'{"prompt": [5, 6, 7], "max_tokens": 3, "stream": true', JSON),  # bad JSON
    ("POST", "/v1/completions", b'[1, 2]', JSON),
    ("POST", "/v1/completions", b'{"prompt": [5, -6], "max_tokens": 3, "stream": true}', JSON),
    ("POST", "/v1/completions", b'{"prompt": [5, 6], "max_tokens": 0, "stream": true}', JSON),
    ("POST", "/v1/completions", b'{"prompt": [5, 6], "max_tokens": 2, "stream": true, "model": "other"}', JSON),
    ("POST", "/v1/completions", b'{"prompt": [5, 99999999], "max_tokens": 2, "stream": true}', JSON),
    ("POST", "/v1/completions", b'{"prompt": [5, 6], "max_tokens": 2, "temperature": 0, "stream": true}',
     {"content-type": "text/plain"}),
    ("POST", "/v1/completions", b'{"prompt": [5, 6], "max_tokens": 2, "temperature": 0, "stream": true}',
     {"content-type": "application/json; charset=utf-8"}),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,'
                                     b' "temperature": 0, "stream": true}', JSON),
    ("GET", "/v1/completions", b"", {}),
    ("GET", "/v1/models", b"", {}),
]


def normalized(response: httpx.Response) -> tuple:
    text = re.sub(r'"(id|created)":\s*("[^"]*"|\d+)', r'"\1":X', response.text)
    return response.status_code, response.headers.get("content-type"), text


def answers(monkeypatch, engine, tokenizer, lane: str, api_key: str | None = None) -> list[tuple]:
    monkeypatch.setenv(FAST_LANE_ENV, lane)
    app = create_app(engine, tokenizer, MODEL, api_key=api_key, max_body_bytes=4096)
    assert any(m.cls is CompletionsFastLane for m in app.user_middleware) == (lane == "1")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        out = [normalized(http.request(method, path, content=body, headers={**headers, **extra}))
               for method, path, body, extra in REQUESTS]
        big = b'{"prompt": [' + b"1, " * 3000 + b'1], "stream": true}'
        out.append(normalized(http.post("/v1/completions", content=big, headers={**headers, **JSON})))  # 413

        def chunks():
            yield big[:2000]
            yield big[2000:]
        out.append(normalized(http.post("/v1/completions", content=chunks(), headers={**headers, **JSON})))  # chunked
        if api_key:
            out.append(normalized(http.post("/v1/completions", content=REQUESTS[0][2], headers=JSON | {
                "authorization": "Bearer wrong"})))
    return out


@pytest.mark.parametrize("api_key", [None, "sekrit"])
def test_every_request_is_answered_as_without_the_lane(monkeypatch, engine, tokenizer, api_key):
    off = answers(monkeypatch, engine, tokenizer, "0", api_key)
    on = answers(monkeypatch, engine, tokenizer, "1", api_key)
    for (method, path, body, _), before, after in zip(REQUESTS, off, on, strict=False):
        assert after == before, (method, path, body)
    assert on[len(REQUESTS):] == off[len(REQUESTS):]
    assert on[0][0] == 200 and "data: [DONE]" in on[0][2]
    assert off[len(REQUESTS)][0] == 413 and off[len(REQUESTS) + 1][0] == 413


def test_the_lane_serves_a_streamed_completion_itself(monkeypatch, engine, tokenizer):
    """The handler runs without FastAPI's route: a route that raises shows the lane answered."""
    monkeypatch.setenv(FAST_LANE_ENV, "1")
    app = create_app(engine, tokenizer, MODEL)
    for route in app.router.routes:
        if getattr(route, "path", None) == "/v1/completions":
            async def refuse(*_):
                raise AssertionError("FastAPI's route ran")
            route.app = refuse
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        streamed = http.post("/v1/completions", content=REQUESTS[0][2], headers=JSON)
        assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
        with pytest.raises(httpx.HTTPError):  # not streamed: FastAPI's route (here, refusing)
            response = http.post("/v1/completions", content=REQUESTS[3][2], headers=JSON)
            response.raise_for_status()


@pytest.mark.parametrize(("value", "on"), [(None, True), ("0", False), ("1", True)])
def test_switch_values(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(FAST_LANE_ENV, raising=False)
    else:
        monkeypatch.setenv(FAST_LANE_ENV, value)
    assert fast_lane_wanted() is on


def test_bad_switch_values_are_refused(monkeypatch):
    monkeypatch.setenv(FAST_LANE_ENV, "yes")
    with pytest.raises(OpenInferError, match=FAST_LANE_ENV):
        fast_lane_wanted()
