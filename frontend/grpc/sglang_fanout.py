"""``n`` > 1 choices for both worker protocols (SGLang, vLLM): :func:`fan_out_choices` makes one
engine request per choice, :func:`merge_streams` interleaves their responses into one gRPC stream.

Invariant: when the merged stream ends for any reason (all inputs done, one input failed, the
consumer went away), every input has been closed: a task pumping an input is cancelled, which
raises ``CancelledError`` inside that input, so its own ``finally``/``aclosing`` blocks run (for
an engine request: the abort that frees its KV blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from openinfer.v1 import engine_pb2 as pb

T = TypeVar("T")


class _Done:
    """Put on the queue when one input ended; carries its exception if it failed."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of every stream as they come; the first failure of any stream is raised."""
    queue: asyncio.Queue[T | _Done] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put(_Done(exc))
            return
        await queue.put(_Done())

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, _Done):
                if item.error is not None:
                    raise item.error
                remaining -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def fan_out_choices(template: pb.GenerateRequest, num_choices: int, *,
                    seed_modulus: int | None = None) -> list[pb.GenerateRequest]:
    """``num_choices`` engine requests from ``template``: the template itself for one choice, else
    copies named ``f"{request_id}-{i}"``. With ``seed_modulus``, a seeded choice ``i`` gets seed
    ``seed + i`` (mod it), so ``n`` seeded choices differ, reproducibly; without, all share the seed."""
    if num_choices <= 1:
        return [template]
    choices = []
    for index in range(num_choices):
        choice = pb.GenerateRequest()
        choice.CopyFrom(template)
        choice.request_id = f"{template.request_id}-{index}"
        if seed_modulus is not None and template.sampling.HasField("seed"):
            choice.sampling.seed = (template.sampling.seed + index) % seed_modulus
        choices.append(choice)
    return choices
