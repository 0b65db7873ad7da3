"""``OPENINFER_SUBMIT_AT_ONCE``: the API server's engine-core client sends a submission at once
(when none waits in the event-loop turn) instead of at the end of the turn; later ones in the same
turn still go out together; off, every submission of a turn is one message at its end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from openinfer.engine_core.client import SUBMIT_AT_ONCE_ENV, EngineCoreClient, submit_at_once
from openinfer.engine_core.protocol import ABORT, ADD, decoder
from openinfer.errors import OpenInferError
from openinfer.v1 import engine_pb2 as pb


class RecordingSocket:
    def __init__(self):
        self.messages: list[list] = []

    def send(self, data, flags=0):
        self.messages.append(decoder.decode(data)[1])  # [client_id, commands] -> commands


def client_with(monkeypatch, value: str | None) -> EngineCoreClient:
    if value is None:
        monkeypatch.delenv(SUBMIT_AT_ONCE_ENV, raising=False)
    else:
        monkeypatch.setenv(SUBMIT_AT_ONCE_ENV, value)
    client = EngineCoreClient("/nonexistent-run-dir")
    client.push = RecordingSocket()
    client._ready.set()
    return client


async def submit_two(client: EngineCoreClient) -> list[list[list]]:
    """Two submissions in one turn; the sent messages (lists of commands) after each point."""
    streams = [client.generate_prompt_array(pb.GenerateRequest(request_id=f"r{i}"), np.arange(1, 5, dtype=np.int32))
               for i in range(2)]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    await asyncio.sleep(0)  # both generators ran up to their first await: submitted in this turn
    in_turn = [list(m) for m in client.push.messages]
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the end-of-turn flush ran
    after_turn = [list(m) for m in client.push.messages]
    for first in firsts:
        first.cancel()
    await asyncio.gather(*firsts, return_exceptions=True)
    for stream in streams:
        await stream.aclose()
    return [in_turn, after_turn]


def test_off_by_default_one_message_per_turn(monkeypatch):
    client = client_with(monkeypatch, None)
    in_turn, after_turn = asyncio.run(submit_two(client))
    assert in_turn == []
    assert [[command[0] for command in message] for message in after_turn] == [[ADD, ADD]]


def test_at_once_sends_the_first_now_and_batches_the_rest_of_the_turn(monkeypatch):
    client = client_with(monkeypatch, "1")
    in_turn, after_turn = asyncio.run(submit_two(client))
    assert [[command[0] for command in message] for message in in_turn] == [[ADD]]
    assert [[command[0] for command in message] for message in after_turn] == [[ADD], [ADD]]
    sent = [pb.GenerateRequest.FromString(message[0][1]).request_id for message in after_turn]
    assert sent == ["r0", "r1"]
    assert all(np.frombuffer(message[0][2], "<i4").tolist() == [1, 2, 3, 4] for message in after_turn)


def test_aborts_are_never_sent_alone_at_once(monkeypatch):
    client = client_with(monkeypatch, "1")

    async def run() -> list[list]:
        client._queue([ABORT, "r9"])
        before = list(client.push.messages)
        await asyncio.sleep(0)
        return [before, list(client.push.messages)]

    before, after = asyncio.run(run())
    assert before == [] and [[c[0] for c in m] for m in after] == [[ABORT]]


@pytest.mark.parametrize(("value", "on"), [(None, False), ("0", False), ("1", True), (" 1 ", True)])
def test_switch_values(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(SUBMIT_AT_ONCE_ENV, raising=False)
    else:
        monkeypatch.setenv(SUBMIT_AT_ONCE_ENV, value)
    assert submit_at_once() is on


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_bad_values_are_refused_with_the_variable_named(monkeypatch, value):
    monkeypatch.setenv(SUBMIT_AT_ONCE_ENV, value)
    with pytest.raises(OpenInferError, match=SUBMIT_AT_ONCE_ENV):
        submit_at_once()
