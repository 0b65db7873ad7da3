"""Step runners: how the engine turns a ForwardBatch into logits.

``EagerRunner`` calls the model (the NumPy path and ``--cuda-graph=false``).
``CudaGraphRunner`` captures one decode step per batch-size bucket and replays it::

    buckets   1 2 4 8 16 24 32 48 64 96 128 192 256   (up to max_num_seqs)
    a decode step of B sequences -> smallest bucket >= B, padded:
      padded sequences: context length 0, slot -1 (writes no KV), null-block tables, null
      state slot 0 (models with recurrent state read their slots from the static batch's
      ``state_slots``, so a replay reads and writes each request's fixed slot)

Each bucket owns a ``StaticBatch`` (device inputs at fixed addresses) and the logits array the
capture produced. Graphs are captured largest first, on a side stream, all allocating from
one private memory pool that nothing else uses; graphs never run concurrently, so they may
share intermediates. Invariant: the logits returned by ``run`` stay valid until the next call.
Prefill, chunked and mixed steps, and decode batches larger than the largest bucket, run eagerly.

A runner's ``observer`` (None unless a diagnostic sets it, e.g. ``openinfer.engine_core.step_log``)
is called after each launch with the batch, whether a graph replayed it, and the wall-clock
times the launch began and returned.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from openinfer.backend.base import ForwardBatch

logger = logging.getLogger("openinfer.graph")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

Forward = Callable[[Any], Any]  # device batch -> logits
# (batch, replayed by a graph, launch began, launch returned): wall-clock seconds
LaunchObserver = Callable[[ForwardBatch, bool, float, float], None]


class EagerRunner:
    """Prepare the batch and call the model; no graphs."""

    def __init__(self, backend: Any, forward: Forward):
        self.backend = backend
        self.forward = forward
        self.observer: LaunchObserver | None = None

    def run(self, batch: ForwardBatch, previous_token_ids: Any = None) -> Any:
        began = time.time() if self.observer is not None else 0.0
        logits = self._run(batch, previous_token_ids)
        if self.observer is not None:
            self.observer(batch, False, began, time.time())
        return logits

    def _run(self, batch: ForwardBatch, previous_token_ids: Any = None) -> Any:
        device_batch = self.backend.prepare_batch(batch)
        if batch.token_sources.shape[0]:
            self.backend.fill_token_sources(device_batch, previous_token_ids, batch.token_sources)
        return self.forward(device_batch)


@dataclass
class _Captured:
    static: Any  # StaticBatch
    graph: Any  # cupy.cuda.Graph
    logits: Any  # [bucket, vocab]


class CudaGraphRunner:
    def __init__(self, backend: Any, forward: Forward, max_num_seqs: int, max_blocks_per_seq: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, num_groups: int = 1, with_state: bool = False,
                 discover_kernels: bool = False):
        self.backend = backend
        self.forward = forward
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_groups = num_groups
        self.with_state = with_state
        self.buckets = sorted({b for b in buckets if b <= max_num_seqs} | {min(max_num_seqs, max(buckets))})
        self.graphs: dict[int, _Captured] = {}
        self.eager = EagerRunner(backend, forward)
        self.capture_seconds = 0.0
        self.num_precompiled_modules = 0
        self.discover_kernels = discover_kernels  # the forward may run dry (see ``capture``)
        self.observer: LaunchObserver | None = None

    def capture(self) -> None:
        """Capture every bucket, largest first (its pool blocks then serve the smaller ones).
        With ``discover_kernels`` (a forward that computes no indices on the device), first a
        dry forward of the largest and smallest buckets finds the kernels the step uses, and
        the backend compiles them in parallel (``precompile_kernels``). Those two
        buckets get a warm-up forward before their capture, the others are captured at once
        (a failed capture is retried after a warm-up)."""
        import cupy

        start = time.perf_counter()
        self.pool = cupy.cuda.MemoryPool()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            statics = {bucket: (self.backend.static_batch(bucket, self.max_blocks_per_seq, self.num_groups,
                                                          self.with_state)
                                if self.num_groups > 1 or self.with_state
                                else self.backend.static_batch(bucket, self.max_blocks_per_seq))
                       for bucket in self.buckets}
            precompile = getattr(self.backend, "precompile_kernels", None) if self.discover_kernels else None
            if precompile is not None:  # the largest and the smallest bucket take different kernels
                ends = {max(self.buckets), min(self.buckets)}
                self.num_precompiled_modules = precompile(lambda: [self.forward(statics[b].batch) for b in ends])
            warm = {max(self.buckets), min(self.buckets)}  # the others reuse their pool blocks and kernels
            for bucket in sorted(self.buckets, reverse=True):
                static = statics[bucket]
                if bucket in warm:
                    self.forward(static.batch)  # warm-up: compiles what discovery missed, fills the pool
                try:
                    self.graphs[bucket] = self._capture_one(cupy, static)
                except Exception:  # e.g. an allocation capture refuses: warm this bucket up and retry
                    if bucket in warm:
                        raise
                    logger.debug("capturing bucket %d without a warm-up failed; retrying after one", bucket,
                                 exc_info=True)
                    self.forward(static.batch)
                    self.graphs[bucket] = self._capture_one(cupy, static)
            self.stream.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs in %.1f s", len(self.graphs), self.capture_seconds)

    def _capture_one(self, cupy: Any, static: Any) -> _Captured:
        self.stream.synchronize()
        mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
        if mode is None:
            self.stream.begin_capture()
        else:
            self.stream.begin_capture(mode)
        try:
            logits = self.forward(static.batch)
        finally:
            graph = self.stream.end_capture()
        return _Captured(static, graph, logits)

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The bucket a batch replays in, or None when it must run eagerly."""
        if not batch.is_decode or batch.num_tokens != batch.num_seqs or batch.logits_rows.shape[0] != batch.num_seqs:
            return None
        if batch.block_tables.shape[1] > self.max_blocks_per_seq or any(
                t.shape[1] > self.max_blocks_per_seq for t in batch.kv_block_tables):
            return None
        i = bisect.bisect_left(self.buckets, batch.num_seqs)
        return self.buckets[i] if i < len(self.buckets) and self.buckets[i] in self.graphs else None

    def run(self, batch: ForwardBatch, previous_token_ids: Any = None) -> Any:
        """Logits rows of ``batch``. Inputs listed in ``batch.token_sources`` are taken from
        ``previous_token_ids`` (the previous step's samples, still on the device)."""
        began = time.time() if self.observer is not None else 0.0
        bucket = self.bucket_for(batch)
        if bucket is None:
            logits = self.eager.run(batch, previous_token_ids)
        else:
            captured = self.graphs[bucket]
            captured.static.fill(batch)  # one H2D copy on the current stream, ordered before the replay
            if batch.token_sources.shape[0]:
                self.backend.fill_token_sources(captured.static.batch, previous_token_ids, batch.token_sources)
            captured.graph.launch()
            logits = captured.logits[: batch.num_seqs]
        if self.observer is not None:
            self.observer(batch, bucket is not None, began, time.time())
        return logits

    def run_padded_eager(self, batch: ForwardBatch) -> Any:
        """The same padded inputs as ``run`` but launched op by op (graph vs eager tests)."""
        bucket = self.bucket_for(batch)
        if bucket is None:
            return self.eager.run(batch)
        captured = self.graphs[bucket]
        captured.static.fill(batch)
        return self.forward(captured.static.batch)[: batch.num_seqs]


def create_runner(backend: Any, forward: Forward, *, cuda_graph: bool, max_num_seqs: int,
                  max_model_len: int, block_size: int, num_groups: int = 1,
                  with_state: bool = False, discover_kernels: bool = False) -> EagerRunner | CudaGraphRunner:
    """Graphs on cuda when enabled (captured here), else the eager runner. ``num_groups`` /
    ``with_state``: the model's KV cache groups and whether it keeps recurrent state;
    ``discover_kernels``: the forward may run dry to find its kernels (compiled in parallel)."""
    if not cuda_graph or getattr(backend, "name", "") != "cuda":
        return EagerRunner(backend, forward)
    runner = CudaGraphRunner(backend, forward, max_num_seqs, -(-max_model_len // block_size),
                             num_groups=num_groups, with_state=with_state, discover_kernels=discover_kernels)
    runner.capture()
    return runner
