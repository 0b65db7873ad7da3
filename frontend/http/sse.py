"""Server-sent events: ``data: {json}`` frames, ``data: [DONE]`` at the end, and a response
class that notices a vanished client at once.

Invariant of ``EventStreamResponse``: when the client disconnects (or the stream ends in any
way), the body generator is closed, so its ``finally`` (which aborts the engine requests) runs
immediately, not when the next chunk happens to fail to send or the generator is garbage-collected.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE_FRAME = "data: [DONE]\n\n"


def sse_frame(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away while we were sending
                        pass
                    group.cancel_scope.cancel()

                async def watch_disconnect() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch_disconnect)
        finally:
            closer = getattr(self._generator, "aclose", None)
            if closer is not None:
                with anyio.CancelScope(shield=True):
                    await closer()
