"""Ranks as SPMD workers: every rank owns its model shard, its KV cache and its step runner
(CUDA graphs included), and runs the same steps in the same order.

::

    engine (rank 0's process)                       rank r (thread on numpy, process on cuda)
      PagedEngine ── ParallelRunner.run(batch) ──►  RankWorker.step(batch)
        │                ├─ send ("step", batch) to every other rank ──────┘
        │                ├─ broadcast the previous step's sampled ids (async scheduling)
        │                └─ rank 0's own RankWorker.step(batch) → logits (sampled on rank 0)
        ├─ copy_state_slots(copies) ─► every rank (state snapshots / restores, in step order)
        └─ release_request(id) ─► every rank (models with private per-request state)

Commands travel in order through one channel per rank (a queue for threads, a pipe for
processes); activations travel only through the ``Communicator`` (NCCL on GPUs). Only rank
0's logits are sampled; the others drop theirs. A rank's model is built by a picklable
``RankModelFactory(backend, RankContext)``, so a process rank imports its plugin itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openinfer.backend.base import Backend, ForwardBatch, KVLayer
from openinfer.errors import OpenInferError
from openinfer.parallel.communicator import Communicator
from openinfer.parallel.layout import ParallelLayout
from openinfer.parallel.rank import RankContext

logger = logging.getLogger("openinfer.parallel")

RankModelFactory = Callable[[Backend, RankContext], Any]  # -> PagedModel
WORKER_START_TIMEOUT_S = 1800.0  # loading a large shard from disk


@dataclass(frozen=True)
class RunnerSetup:
    """What every rank needs to allocate its KV and build its step runner (same on all ranks)."""

    num_blocks: int
    block_size: int
    cuda_graph: bool
    max_num_seqs: int
    max_model_len: int
    num_state_slots: int = 0
    num_groups: int = 1
    with_state: bool = False
    group_blocks: tuple[int, ...] = ()  # per KV cache group id (each paged group has its own pool)


class RankWorker:
    """One rank's model, KV cache and runner."""

    def __init__(self, model: Any, comm: Communicator):
        self.model = model
        self.comm = comm
        self.kv_cache: list[KVLayer] = []
        self.state_layers: list[Any] = []
        self.runner: Any = None

    def setup(self, setup: RunnerSetup) -> None:
        """This rank's KV (its own specs: its heads) and runner, in the engine's layout."""
        from openinfer.backend.base import StateLayer
        from openinfer.graph import create_runner
        from openinfer.kv.spec import group_specs
        from openinfer.runtime.model import kv_cache_specs_of

        backend = self.model.backend
        specs = kv_cache_specs_of(self.model)
        blocks = [setup.group_blocks[g] if setup.group_blocks else setup.num_blocks
                  for g in group_specs(specs).group_of_layer]
        data_parallel = getattr(self.model, "data_parallel_attention", None)
        if data_parallel is not None:  # this rank caches only its own sequences: a smaller pool
            if len(set(blocks)) > 1:
                raise OpenInferError("data-parallel attention handles models with one KV cache group")
            local = data_parallel.local_blocks(blocks[0], setup.block_size)
            blocks = [local] * len(blocks)
        self.kv_cache = [backend.allocate_kv(s, n if s.paged else setup.num_state_slots, setup.block_size)
                         for s, n in zip(specs, blocks, strict=True)]
        self.state_layers = [c for c in self.kv_cache if isinstance(c, StateLayer)]
        self.runner = create_runner(backend, lambda batch: self.model.forward(batch, self.kv_cache),
                                    cuda_graph=setup.cuda_graph, max_num_seqs=setup.max_num_seqs,
                                    max_model_len=setup.max_model_len, block_size=setup.block_size,
                                    num_groups=setup.num_groups, with_state=setup.with_state)

    def copy_state_slots(self, copies: list[tuple[int, int]]) -> None:
        from openinfer.runtime.engine import copy_state_slots

        if self.state_layers:
            copy_state_slots(self.model.backend, self.state_layers, copies)

    def step(self, batch: ForwardBatch, previous_token_ids: Any, num_previous: int) -> Any:
        if num_previous:  # inputs sampled on rank 0 by the step still in flight
            xp = self.model.backend.xp
            source = previous_token_ids if self.comm.rank == 0 else xp.zeros(num_previous, dtype=xp.int32)
            previous_token_ids = self.comm.broadcast(xp.ascontiguousarray(source, dtype=xp.int32), root=0)
        return self.runner.run(batch, previous_token_ids)

    def release_request(self, request_id: str) -> None:
        release = getattr(self.model, "release_request", None)
        if release is not None:
            release(request_id)

    def handle(self, command: tuple) -> Any:
        """Run one command from rank 0: ("setup", RunnerSetup) | ("step", batch, n) | ("release", id)
        | ("copy_state", [(src, dst), ...])."""
        kind = command[0]
        if kind == "setup":
            return self.setup(command[1])
        if kind == "step":
            return self.step(command[1], None, command[2])
        if kind == "release":
            return self.release_request(command[1])
        if kind == "copy_state":
            return self.copy_state_slots(command[1])
        raise ValueError(f"unknown rank command {kind!r}")


# --- other ranks as threads (numpy + the fake communicator) ----------------------------------------


class ThreadRank:
    """Rank r > 0 on a thread: commands through a queue, errors reported back on ``replies``."""

    def __init__(self, worker: RankWorker):
        self.worker = worker
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"openinfer-rank{worker.comm.rank}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            command = self.commands.get()
            if command[0] == "stop":
                return
            try:
                self.worker.handle(command)
                if command[0] == "setup":
                    self.replies.put(("ready", None))
            except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which raises it
                logger.exception("rank %d failed", self.worker.comm.rank)
                self.replies.put(("error", f"rank {self.worker.comm.rank}: {exc!r}"))
                abort = getattr(getattr(self.worker.comm, "group", None), "abort", None)
                if abort is not None:
                    abort()
                return

    def send(self, command: tuple) -> None:
        self.commands.put(command)

    def wait_ready(self) -> None:
        kind, message = self.replies.get(timeout=WORKER_START_TIMEOUT_S)
        if kind == "error":
            raise OpenInferError(message)

    def check(self) -> None:
        try:
            kind, message = self.replies.get_nowait()
        except queue.Empty:
            return
        if kind == "error":
            raise OpenInferError(message)

    def close(self) -> None:
        self.commands.put(("stop",))


# --- other ranks as processes (cuda + NCCL) --------------------------------------------------------


def _process_rank_main(rank: int, layout: ParallelLayout, load_format: str, unique_id: Any,
                       factory: RankModelFactory, connection: Any) -> None:
    """Entry point of rank r's process: own GPU r, join the NCCL group, load, then serve commands."""
    from openinfer.parallel.nccl import NcclCommunicator, disable_multicast

    disable_multicast()
    try:
        from openinfer.backend.cuda import CudaBackend

        backend = CudaBackend(device=rank)
        comm = NcclCommunicator.create(unique_id, rank, layout.world_size)
        model = factory(backend, RankContext(layout=layout, rank=rank, comm=comm, load_format=load_format))
        worker = RankWorker(model, comm)
        connection.send(("loaded", None))
        while True:
            command = connection.recv()
            if command[0] == "stop":
                return
            worker.handle(command)
            if command[0] == "setup":
                connection.send(("ready", None))
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0
        try:
            connection.send(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001 - rank 0 is gone
            pass


class ProcessRank:
    """Rank r > 0 as its own process (spawned: CUDA cannot fork), commands through a pipe."""

    def __init__(self, rank: int, layout: ParallelLayout, load_format: str, unique_id: Any,
                 factory: RankModelFactory):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=_process_rank_main, args=(rank, layout, load_format, unique_id, factory, child),
            name=f"openinfer-rank{rank}", daemon=True)
        self.process.start()
        child.close()
        self.rank = rank
        self.closing = False  # set by close(): the process is expected to exit

    def send(self, command: tuple) -> None:
        self.connection.send(command)

    def _expect(self, wanted: str) -> None:
        if not self.connection.poll(WORKER_START_TIMEOUT_S):
            raise OpenInferError(f"rank {self.rank} did not answer within {WORKER_START_TIMEOUT_S:.0f} s")
        try:
            kind, message = self.connection.recv()
        except EOFError as exc:
            raise OpenInferError(f"rank {self.rank}'s process exited (code {self.process.exitcode})") from exc
        if kind == "error":
            raise OpenInferError(message)
        if kind != wanted:
            raise OpenInferError(f"rank {self.rank} answered {kind!r}, expected {wanted!r}")

    def wait_loaded(self) -> None:
        self._expect("loaded")

    def wait_ready(self) -> None:
        self._expect("ready")

    def check(self) -> None:
        """Raise the rank's error report, or that its process is gone (nothing can step without it)."""
        if self.connection.poll():
            self._expect("ok")  # anything unsolicited is an error report
        if self.process.exitcode is not None:
            raise OpenInferError(f"rank {self.rank}'s process exited (code {self.process.exitcode}); the group "
                                 "cannot step without it: restart the server")

    def close(self) -> None:
        self.closing = True
        try:
            self.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()


def watch_ranks(remotes: list[Any], on_death: Callable[[Any], None], interval_s: float = 1.0,
                stop: threading.Event | None = None) -> None:
    """Until every rank is closing (or ``stop`` is set): call ``on_death(rank)`` once for the first
    rank process that exits unexpectedly. On GPUs ``on_death`` aborts rank 0's NCCL communicator,
    so a step waiting for the dead rank fails with an error instead of hanging forever."""
    stop = stop or threading.Event()
    while not stop.is_set() and not all(r.closing for r in remotes):
        for remote in remotes:
            if not remote.closing and remote.process.exitcode is not None:
                on_death(remote)
                return
        stop.wait(interval_s)


def _abort_on_death(comm: Any) -> Callable[[Any], None]:
    def on_death(remote: Any) -> None:
        logger.error("rank %d's process exited (code %s): aborting the NCCL group so no step waits for it",
                     remote.rank, remote.process.exitcode)
        comm.abort()

    return on_death


# --- rank 0: the model the engine sees ------------------------------------------------------------


class ParallelRunner:
    """The engine's step runner for a group: tells every rank to step, steps rank 0, returns
    rank 0's logits (the full vocabulary: the LM head's parts are all-gathered)."""

    def __init__(self, local: RankWorker, remotes: list[Any]):
        self.local = local
        self.remotes = remotes

    def run(self, batch: ForwardBatch, previous_token_ids: Any = None) -> Any:
        num_previous = 0
        if batch.token_sources.shape[0]:
            num_previous = int(previous_token_ids.shape[0])
        for remote in self.remotes:
            remote.check()
            remote.send(("step", batch, num_previous))
        try:
            return self.local.step(batch, previous_token_ids, num_previous)
        except Exception:
            for remote in self.remotes:  # a rank that failed first broke the collective: raise its error
                remote.check()
            raise

    def copy_state_slots(self, copies: list[tuple[int, int]]) -> None:
        """State snapshots / restores the KV manager queued, on every rank's state layers."""
        for remote in self.remotes:
            remote.send(("copy_state", copies))
        self.local.copy_state_slots(copies)


class ParallelModel:
    """Rank 0's model as a ``PagedModel`` for the engine, driving the other ranks.

    The engine asks it for its KV and runner through ``create_step_runner`` (each rank
    allocates its own KV and captures its own graphs); ``forward`` runs rank 0 alone and is
    only for code that calls the model directly with a single rank's view (none in a group)."""

    def __init__(self, local_model: Any, comm: Communicator, remotes: list[Any]):
        self.local = RankWorker(local_model, comm)
        self.local_model = local_model
        self.remotes = remotes
        self.spec = local_model.spec
        self.backend = local_model.backend
        self.world_size = comm.world_size
        self._finalizer = weakref.finalize(self, _close_all, list(remotes))

    def kv_cache_specs(self) -> list[Any]:
        """Rank 0's per-layer specs (every rank's have the same structure and bytes)."""
        from openinfer.runtime.model import kv_cache_specs_of

        return kv_cache_specs_of(self.local_model)

    def engine_kv_blocks(self, rank_blocks: int) -> int:
        """The engine's pool (in blocks) when each rank's KV memory holds ``rank_blocks``: the same
        when every rank holds a part or a copy of every sequence's KV; under data-parallel attention,
        where each rank caches only its own sequences, about ``ranks / headroom`` times it."""
        data_parallel = getattr(self.local_model, "data_parallel_attention", None)
        return data_parallel.engine_blocks(rank_blocks) if data_parallel is not None else rank_blocks

    def forward(self, batch: Any, kv_cache: list[KVLayer]) -> Any:
        raise OpenInferError("a tensor/expert-parallel model steps all ranks together: use the runner from "
                             "create_step_runner, not forward")

    def create_step_runner(self, setup: RunnerSetup) -> tuple[list[KVLayer], ParallelRunner]:
        for remote in self.remotes:
            remote.send(("setup", setup))
        self.local.setup(setup)  # graph capture runs collectives: every rank captures at once
        for remote in self.remotes:
            remote.wait_ready()
        return self.local.kv_cache, ParallelRunner(self.local, self.remotes)

    def close(self) -> None:
        self._finalizer()


class ParallelStateModel(ParallelModel):
    """A group whose model keeps per-request state: releases reach every rank."""

    def release_request(self, request_id: str) -> None:
        for remote in self.remotes:
            remote.send(("release", request_id))
        self.local.release_request(request_id)


def _close_all(remotes: list[Any]) -> None:
    for remote in remotes:
        remote.close()


def _group_model(local_model: Any, comm: Communicator, remotes: list[Any]) -> ParallelModel:
    cls = ParallelStateModel if hasattr(local_model, "release_request") else ParallelModel
    return cls(local_model, comm, remotes)


def start_thread_group(factory: RankModelFactory, layout: ParallelLayout, load_format: str,
                       make_backend: Callable[[], Backend]) -> ParallelModel:
    """Ranks as threads with the in-process fake communicator (numpy backend, CPU tests)."""
    from openinfer.parallel.fake import ThreadGroup

    comms = ThreadGroup(layout.world_size).communicators()
    models = [factory(make_backend(), RankContext(layout=layout, rank=c.rank, comm=c, load_format=load_format))
              for c in comms]
    remotes = [ThreadRank(RankWorker(model, comm)) for model, comm in zip(models[1:], comms[1:], strict=True)]
    return _group_model(models[0], comms[0], remotes)


def start_process_group(factory: RankModelFactory, layout: ParallelLayout, load_format: str) -> ParallelModel:
    """Ranks 1..N-1 as spawned processes, one GPU each; rank 0 in this process on GPU 0."""
    from openinfer.backend.cuda import CudaBackend
    from openinfer.parallel.nccl import NcclCommunicator, disable_multicast, new_unique_id

    disable_multicast()
    unique_id = new_unique_id()
    remotes = [ProcessRank(rank, layout, load_format, unique_id, factory) for rank in range(1, layout.world_size)]
    try:
        backend = CudaBackend(device=0)
        comm = NcclCommunicator.create(unique_id, 0, layout.world_size)
        model = factory(backend, RankContext(layout=layout, rank=0, comm=comm, load_format=load_format))
        for remote in remotes:
            remote.wait_loaded()
    except BaseException:
        _close_all(remotes)
        raise
    logger.info("started %d ranks (pid %d + %s)", layout.world_size, os.getpid(),
                [r.process.pid for r in remotes])
    threading.Thread(target=watch_ranks, args=(remotes, _abort_on_death(comm)), name="openinfer-rank-watchdog",
                     daemon=True).start()
    return _group_model(model, comm, remotes)

