"""A plugin's own ``EngineHandle`` (not a ``PagedEngine``) behind the engine-core transport:
tokens, logprobs and refusals reach an ``EngineCoreClient`` as from the engine itself."""

from __future__ import annotations

import asyncio

import pytest
from fakes import FakeEngine

from openinfer.engine_core.adapter import HandleAdapter
from openinfer.engine_core.client import EngineCoreClient
from openinfer.engine_core.process import CoreTransport
from openinfer.errors import InvalidRequestError, QueueFullError
from openinfer.v1 import engine_pb2 as pb


def request(rid: str, prompt: list[int], max_tokens: int = 5, logprobs: int = 0) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, logprobs=logprobs,
                              stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True))


async def collect(client: EngineCoreClient, req: pb.GenerateRequest) -> list[pb.TokenEvent]:
    return [event async for event in client.generate(req)]


async def test_a_plain_engine_handle_serves_through_the_core_transport(tmp_path):
    fake = FakeEngine(vocab_size=100, max_running=2, token_delay_s=0.01)
    adapter = HandleAdapter(fake)
    transport = CoreTransport(adapter, str(tmp_path))
    adapter.attach_transport(transport, transport.deliver)  # from here on the adapter's thread owns it
    client = EngineCoreClient(str(tmp_path))
    try:
        await client.connect(10)
        events = await collect(client, request("a", [5, 6, 7], logprobs=1))
        tokens = [t for e in events if e.HasField("tokens") for t in e.tokens.ids]
        assert tokens == [5, 6, 7, 5, 6]  # the fake repeats the prompt (greedy)
        assert sum(len(e.tokens.logprobs) for e in events) == 5
        assert events[-1].finished.completion_tokens == 5
        with pytest.raises(InvalidRequestError):
            await collect(client, request("bad", []))
        slow = [asyncio.create_task(collect(client, request(f"s{i}", [1, 2], max_tokens=50))) for i in range(2)]
        await asyncio.sleep(0.2)
        with pytest.raises(QueueFullError):
            await collect(client, request("third", [1, 2]))
        assert all(len(r) > 1 for r in await asyncio.gather(*slow))
    finally:
        await client.close()
        adapter.close_sync()
        transport.close()
