"""The wire between API-server processes and the engine-core process (ZMQ IPC + msgpack).

Sockets (all ``ipc://`` in the run directory ``openinfer serve`` creates)::

    client PUSH ──connect──▶ core PULL  (bound at core-in.sock)   submissions / aborts / hello
    core PUSH ──connect──▶ client PULL (bound by each client)     one STEP message per step

Client → core: ``[client_id, commands]``, ``commands`` a list, batched per event-loop turn:
``[ADD, GenerateRequest bytes]`` or ``[ADD, GenerateRequest bytes, prompt bytes]`` (the prompt
as one buffer of little-endian int32 ids, ``PROMPT_DTYPE``, the request's ``prompt_token_ids``
then empty: a 16k-token prompt is 64 KiB copied, not 16k varints encoded and parsed),
``[ABORT, request_id]``, ``[HELLO, client_address]``.

Core → client: ``[STEP, entries, load]`` — every entry of one engine step for this client's
requests (``openinfer.engine_core.slots`` defines entries), ``[READY, ModelInfo bytes, healthy,
message, core_pid]`` (the answer to HELLO), ``[HEARTBEAT, load, healthy, message]`` while
idle. ``load`` is ``[num_running, num_waiting, kv_used, kv_total, max_queue, kv_cached]``.

Why msgpack without a schema: the entries are lists of str/int/bytes, which msgspec encodes
and decodes at a few tens of ns per field — one message per step costs ~10 µs at batch 256.
"""

from __future__ import annotations

import msgspec
import numpy as np

from openinfer.errors import InvalidRequestError
from openinfer.v1 import engine_pb2 as pb

ADD, ABORT, HELLO = range(3)
STEP, READY, HEARTBEAT = range(3)

CORE_INPUT_SOCKET = "core-in.sock"
PROMPT_DTYPE = np.dtype("<i4")  # an ADD's prompt buffer

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder()


def ipc_address(run_dir: str, name: str) -> str:
    return f"ipc://{run_dir}/{name}"


def load_fields(load: pb.Load) -> list[int]:
    return [load.num_running, load.num_waiting, load.kv_blocks_used, load.kv_blocks_total, load.max_queue,
            load.kv_blocks_cached]


def load_message(fields: list[int]) -> pb.Load:
    running, waiting, used, total, max_queue, cached = fields
    return pb.Load(num_running=running, num_waiting=waiting, kv_blocks_used=used, kv_blocks_total=total,
                   max_queue=max_queue, kv_blocks_cached=cached)


def prompt_from_buffer(buffer: bytes) -> np.ndarray:
    """An ADD's prompt buffer as its (read-only) int32 ids, without a copy."""
    if not isinstance(buffer, bytes) or len(buffer) % PROMPT_DTYPE.itemsize:
        got = f"{len(buffer)} bytes" if isinstance(buffer, bytes) else f"a {type(buffer).__name__}"
        raise InvalidRequestError(f"the prompt buffer must be little-endian int32 ids (4 bytes each), got {got}",
                                  "prompt_token_ids")
    return np.frombuffer(buffer, PROMPT_DTYPE)
