"""Stop a non-streamed request's work when its client goes away.

A streamed response notices a vanished client itself (``EventStreamResponse``); a non-streamed
one is still being computed while nothing is sent, so without this the engine would run it to
its end for nobody. Invariant: when ``until_disconnected`` returns or raises, the work is done or
cancelled and every given choice stream is closed (its engine request finished or aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from starlette.requests import Request

from openinfer.frontend.http.errors import OpenAIError
from openinfer.frontend.http.generation import ChoiceStream, close_all

T = TypeVar("T")
# nginx's "client closed request": logged, never seen by the client (it is gone)
CLIENT_CLOSED_REQUEST = 499


async def wait_for_disconnect(client: Request) -> None:
    """Return once the client has disconnected. The body has been read already (FastAPI parsed
    it), so the only message left to receive is ``http.disconnect``."""
    while True:
        message = await client.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(client: Request | None, work: Awaitable[T], streams: Sequence[ChoiceStream]) -> T:
    """Await ``work``; if the client disconnects first, cancel it, abort ``streams`` and raise."""
    if client is None:
        return await work
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(client))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await close_all(streams)
    if task.cancelled():
        raise OpenAIError(CLIENT_CLOSED_REQUEST, "the client closed the connection before the reply was ready",
                          None, "client_disconnected")
    return task.result()
