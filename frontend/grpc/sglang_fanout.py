"""Interleave several async streams into one: how ``n`` > 1 choices share one gRPC response stream.

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
