"""Workers: the model on one device, driven by the engine core one step at a time.

The interface tensor/expert parallelism builds on (``openinfer.parallel`` creates the ranks'
communicators; a worker only needs its ``WorkerConfig``)::

    engine core ──(step batch: ForwardBatch arrays + sampling params, broadcast to every rank)──▶ worker ×N
                ◀──────────────(sampled token ids, from rank 0 only)─────────────────────────────

* ``init(config)``: bind rank ``config.rank`` of ``config.world_size`` to ``config.device``
  (CUDA device index, or "cpu"); set up the communicator between ranks.
* ``load_model(model_path, options)`` → the model's ``ModelSpec`` (every rank loads its shard).
* ``execute_step(step)`` → sampled ids ``[rows]`` int32 on rank 0 (other ranks return None).
* ``shutdown()``.

Placement (measured by ``benchmarks/worker_placement.py`` with the stub step on the CPU): with one
GPU the worker lives in the engine-core process (``InProcessWorker``: a call, no copy); a worker
in its own process (``RemoteWorker`` ↔ ``serve_worker``) costs one IPC round trip and the batch
encoding per step, on the critical path between two device steps. The remote form exists for
N > 1 ranks, where each rank must own its device in its own process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import zmq

from openinfer.backend.base import ForwardBatch
from openinfer.engine_core.protocol import decoder, encoder

_ARRAY_FIELDS = ("token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping",
                 "logits_rows", "token_sources")


@dataclass(frozen=True)
class WorkerConfig:
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"  # "cpu", or a CUDA device index as text ("0", "1", ...)


@dataclass
class StepInput:
    """What every rank needs for one step: the batch and, for rank 0, each row's sampling
    parameters ``[temperature, top_p, top_k, min_p, seed or -1]``."""

    batch: ForwardBatch
    sampling: np.ndarray  # [rows, 5] float64


class Worker(Protocol):
    def init(self, config: WorkerConfig) -> None: ...

    def load_model(self, model_path: str, options: dict[str, Any]) -> Any: ...

    def execute_step(self, step: StepInput) -> np.ndarray | None: ...

    def shutdown(self) -> None: ...


def encode_step(step: StepInput) -> bytes:
    """One msgpack message: every array as (dtype, shape, bytes), plus the scalars."""
    batch = step.batch
    arrays = [(a.dtype.str, a.shape, a.tobytes()) for a in (getattr(batch, f) for f in _ARRAY_FIELDS)]
    sampling = (step.sampling.dtype.str, step.sampling.shape, step.sampling.tobytes())
    return encoder.encode([arrays, sampling, batch.max_query_len, batch.max_context_len, list(batch.request_ids)])


def decode_step(data: bytes | memoryview) -> StepInput:
    arrays, sampling, max_query_len, max_context_len, request_ids = decoder.decode(data)

    def array(item: list) -> np.ndarray:
        dtype, shape, raw = item
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)

    fields = {name: array(item) for name, item in zip(_ARRAY_FIELDS, arrays, strict=True)}
    batch = ForwardBatch(**fields, max_query_len=max_query_len, max_context_len=max_context_len,
                         request_ids=tuple(request_ids))
    return StepInput(batch, array(sampling))


class InProcessWorker:
    """A worker in the calling process (one GPU: the engine core's own). ``model_factory`` builds
    the model; ``step_fn(model, step)`` runs forward + sampling and returns the ids."""

    def __init__(self, model_factory: Any, step_fn: Any):
        self.model_factory = model_factory
        self.step_fn = step_fn
        self.config = WorkerConfig()
        self.model = None

    def init(self, config: WorkerConfig) -> None:
        self.config = config

    def load_model(self, model_path: str, options: dict[str, Any]) -> Any:
        self.model = self.model_factory(model_path, self.config, options)
        return getattr(self.model, "spec", None)

    def execute_step(self, step: StepInput) -> np.ndarray | None:
        ids = self.step_fn(self.model, step)
        return ids if self.config.rank == 0 else None

    def shutdown(self) -> None:
        self.model = None


class RemoteWorker:
    """The engine core's handle on a worker in another process (``serve_worker``), over a ZMQ
    PAIR socket: one request/reply per step."""

    def __init__(self, address: str, context: zmq.Context | None = None):
        self.socket = (context or zmq.Context.instance()).socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def _call(self, kind: str, payload: Any) -> Any:
        self.socket.send_multipart([kind.encode(), payload if isinstance(payload, bytes) else encoder.encode(payload)],
                                   copy=False)
        reply = self.socket.recv(copy=False)
        status, value = decoder.decode(reply.buffer)
        if status != "ok":
            raise RuntimeError(f"worker failed: {value}")
        return value

    def init(self, config: WorkerConfig) -> None:
        self._call("init", dataclasses.asdict(config))

    def load_model(self, model_path: str, options: dict[str, Any]) -> Any:
        return self._call("load", [model_path, options])

    def execute_step(self, step: StepInput) -> np.ndarray | None:
        ids = self._call("step", encode_step(step))
        return None if ids is None else np.frombuffer(ids, np.int32)

    def shutdown(self) -> None:
        try:
            self._call("shutdown", None)
        finally:
            self.socket.close(0)


def serve_worker(address: str, worker: Worker) -> None:
    """The loop of a worker process: bind ``address``, answer the core's calls until shutdown."""
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    try:
        while True:
            kind, payload = sock.recv_multipart(copy=False)
            name = bytes(kind.buffer).decode()
            try:
                if name == "step":
                    ids = worker.execute_step(decode_step(payload.buffer))
                    result: Any = None if ids is None else np.ascontiguousarray(ids, np.int32).tobytes()
                elif name == "init":
                    worker.init(WorkerConfig(**decoder.decode(payload.buffer)))
                    result = None
                elif name == "load":
                    model_path, options = decoder.decode(payload.buffer)
                    spec = worker.load_model(model_path, options)
                    result = None if spec is None else repr(spec)
                elif name == "shutdown":
                    worker.shutdown()
                    sock.send(encoder.encode(["ok", None]))
                    return
                else:
                    raise ValueError(f"unknown worker call {name!r}")
                sock.send(encoder.encode(["ok", result]), copy=False)
            except Exception as exc:  # reported to the core, which fails the step's requests
                sock.send(encoder.encode(["error", repr(exc)]))
    finally:
        sock.close(0)
