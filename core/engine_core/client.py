"""``EngineCoreClient``: the ``EngineHandle`` of an API-server process, talking to the engine core.

One receive task per process decodes each STEP message (all of a step's entries for this
process's requests) and pushes the entries into per-request ``RequestSlot``s — one wake-up per
request per step, however many tokens piled up meanwhile. Submissions and aborts made during
one event-loop turn go out as one message.

Faults: the input socket is monitored; when the core process dies (the IPC connection drops)
every in-flight request ends at once with an UNAVAILABLE error event and ``health()`` turns
unhealthy. ZMQ reconnects by itself when the supervisor restarts the core; the client then says
HELLO again and is healthy once the new core answers READY.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import uuid
from collections.abc import AsyncIterator

import numpy as np
import zmq
import zmq.asyncio

from openinfer.engine_core.protocol import (
    ABORT,
    ADD,
    CORE_INPUT_SOCKET,
    HEARTBEAT,
    HELLO,
    PROMPT_DTYPE,
    READY,
    STEP,
    decoder,
    encoder,
    ipc_address,
    load_message,
)
from openinfer.engine_core.slots import RequestSlot, dispatch
from openinfer.errors import EngineDeadError, InvalidRequestError, OpenInferError, QueueFullError
from openinfer.v1 import engine_pb2 as pb

logger = logging.getLogger("openinfer.engine_core.client")

CORE_RECONNECT_MS = 20  # how often an API server retries the engine core's input socket
CORE_DIED = "the engine core process died while this request was in flight; it was lost — retry it"
# OPENINFER_SUBMIT_AT_ONCE=1: a submission made while none waits to be sent goes to the core at once
# instead of at the end of the event-loop turn (the core starts admitting it sooner; submissions
# made after it in the same turn are still batched into one message). Opt-in until measured.
SUBMIT_AT_ONCE_ENV = "OPENINFER_SUBMIT_AT_ONCE"


def submit_at_once() -> bool:
    """``OPENINFER_SUBMIT_AT_ONCE``: 1 on, 0 or unset off; anything else is an error."""
    value = os.environ.get(SUBMIT_AT_ONCE_ENV, "0").strip()
    if value not in ("0", "1"):
        raise OpenInferError(f"{SUBMIT_AT_ONCE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


class EngineCoreClient:
    """Create inside the event loop that will use it, then ``await client.connect(timeout)``."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.client_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self.address = ipc_address(run_dir, f"client-{self.client_id.decode()}.sock")
        self.context = zmq.asyncio.Context()
        self._slots: dict[str, RequestSlot] = {}
        self._pending: list = []
        self._flush_scheduled = False
        self._submit_at_once = submit_at_once()
        self._info: pb.ModelInfo | None = None
        self._ready = asyncio.Event()
        self._connected = False
        self._engine_healthy = False
        self._engine_message = "not connected to the engine core yet"
        self._load = pb.Load()
        self.core_pid = 0
        self.num_step_messages = 0
        self.num_token_entries = 0
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    # --- connection ------------------------------------------------------------------------

    async def connect(self, timeout_s: float = 600.0) -> pb.ModelInfo:
        self.pull = self.context.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(self.address)
        self.push = self.context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.IMMEDIATE, 1)  # nothing is queued for a core that is not there
        # retry the core's socket every 20 ms, never backing off: the core binds it only when its start-up
        # is over, and a backoff grown to 500 ms (measured: API servers became ready on a 0.5 s grid)
        # added up to half a second to every start and restart; an ipc connect attempt costs nothing
        self.push.setsockopt(zmq.RECONNECT_IVL, CORE_RECONNECT_MS)
        self.push.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
        self.monitor = self.push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.push.connect(ipc_address(self.run_dir, CORE_INPUT_SOCKET))
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._monitor_loop())]
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        assert self._info is not None
        return self._info

    async def _monitor_loop(self) -> None:
        while True:
            frames = await self.monitor.recv_multipart()
            event = struct.unpack("=hi", frames[0][:6])[0]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
                self._send([[HELLO, self.address]])
            elif event == zmq.EVENT_DISCONNECTED:
                self._on_core_lost()

    def _on_core_lost(self) -> None:
        if self._connected:
            logger.error("lost the engine core; failing %d in-flight requests", len(self._slots))
        self._connected = False
        self._ready.clear()
        self._engine_healthy = False
        self._engine_message = "the engine core process is not running (restarting)"
        slots, self._slots = self._slots, {}
        for slot in slots.values():
            slot.fail(pb.ERROR_CODE_UNAVAILABLE, CORE_DIED)

    async def _receive_loop(self) -> None:
        while True:
            frame = await self.pull.recv(copy=False)
            message = decoder.decode(frame.buffer)
            kind = message[0]
            if kind == STEP:
                self.num_step_messages += 1
                entries = message[1]
                self.num_token_entries += len(entries)
                dispatch(self._slots, entries)
                self._load = load_message(message[2])
            elif kind == HEARTBEAT:
                self._load = load_message(message[1])
                self._engine_healthy, self._engine_message = message[2], message[3]
            elif kind == READY:
                self._info = pb.ModelInfo.FromString(message[1])
                self._engine_healthy, self._engine_message = message[2], message[3]
                self.core_pid = message[4]
                if self._connected:
                    self._ready.set()
                    logger.info("connected to the engine core (pid %d)", self.core_pid)

    def _send(self, commands: list) -> bool:
        try:
            self.push.send(encoder.encode([self.client_id, commands]), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # no core connected (IMMEDIATE) or the socket is closing
            return False

    def _queue(self, command: list) -> None:
        if self._submit_at_once and not self._flush_scheduled and command[0] == ADD:
            # nothing waits in this turn: this one goes now; later ones in the turn are batched
            self._pending.append(command)
            self._flush()
            self._flush_scheduled = True  # (cleared by the flush at the end of the turn)
            asyncio.get_running_loop().call_soon(self._flush)
            return
        self._pending.append(command)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send every submission/abort of this loop turn in one message."""
        self._flush_scheduled = False
        commands, self._pending = self._pending, []
        if commands and not self._send(commands):
            for command, argument, *_ in commands:
                if command == ADD:
                    slot = self._slots.pop(pb.GenerateRequest.FromString(argument).request_id, None)
                    if slot is not None:
                        slot.fail(pb.ERROR_CODE_UNAVAILABLE, "the engine core is not running (restarting)")

    # --- EngineHandle ----------------------------------------------------------------------

    def info(self) -> pb.ModelInfo:
        if self._info is None:
            raise EngineDeadError("not connected to the engine core yet")
        return self._info

    def health(self) -> pb.HealthResponse:
        if not self._ready.is_set():
            return pb.HealthResponse(healthy=False, message=self._engine_message)
        return pb.HealthResponse(healthy=self._engine_healthy, message=self._engine_message)

    def load(self) -> pb.Load:
        return self._load

    def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.TokenEvent]:
        return self._generate(request, None)

    def generate_prompt_array(self, request: pb.GenerateRequest, prompt_ids: np.ndarray
                              ) -> AsyncIterator[pb.TokenEvent]:
        """``generate`` with the prompt beside the request (its ``prompt_token_ids`` empty): sent to
        the core as the array's bytes, little-endian int32 (``protocol`` ADD)."""
        return self._generate(request, np.ascontiguousarray(prompt_ids, dtype=PROMPT_DTYPE).tobytes())

    async def _generate(self, request: pb.GenerateRequest, prompt: bytes | None) -> AsyncIterator[pb.TokenEvent]:
        if not self._ready.is_set():
            raise EngineDeadError(f"the engine is unavailable: {self._engine_message}")
        request_id = request.request_id
        if not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if request_id in self._slots:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight", "request_id")
        slot = RequestSlot(request_id, asyncio.get_running_loop())
        self._slots[request_id] = slot
        self._queue([ADD, request.SerializeToString()] if prompt is None else [ADD, request.SerializeToString(), prompt])
        events = slot.events()
        finished = False
        try:
            first = await anext(events)
            if slot.rejection is not None:
                finished = True
                raise _rejection(*slot.rejection)
            finished = first.WhichOneof("event") in ("finished", "error")
            yield first
            if finished:
                return
            async for event in events:
                finished = event.WhichOneof("event") in ("finished", "error")
                yield event
        finally:
            if not finished and not slot.done:
                self._slots.pop(request_id, None)
                self._queue([ABORT, request_id])

    async def abort(self, request_id: str) -> bool:
        """The core answers with the request's FINISHED(ABORT) entry."""
        if request_id not in self._slots:
            return False
        self._queue([ABORT, request_id])
        return True

    async def close(self) -> None:
        """Closes this process's sockets; the engine core keeps running for the others."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots.values():
            slot.fail(pb.ERROR_CODE_UNAVAILABLE, "the API server is shutting down")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            self.push.disable_monitor()
        for sock in (getattr(self, "monitor", None), getattr(self, "push", None), getattr(self, "pull", None)):
            if sock is not None:
                sock.close(0)
        self.context.term()
        path = self.address.removeprefix("ipc://")
        with contextlib.suppress(OSError):
            os.unlink(path)


def _rejection(code: int, message: str, detail: str | int) -> Exception:
    if code == pb.ERROR_CODE_INVALID_ARGUMENT:
        return InvalidRequestError(message, detail or None)
    if code == pb.ERROR_CODE_RESOURCE_EXHAUSTED:
        return QueueFullError(int(detail or 0))
    return EngineDeadError(message)
