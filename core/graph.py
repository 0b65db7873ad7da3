"""Step runners: how the engine turns a ForwardBatch into logits.

``EagerRunner`` calls the model (the NumPy path and ``--cuda-graph=false``).
``CudaGraphRunner`` captures one decode step per batch-size bucket and replays it::

    buckets   1 2 4 8 16 24 32 48 64 96 128 192 256   (up to max_num_seqs)
    a decode step of B sequences -> smallest bucket >= B, padded:
      padded sequences: context length 0, slot -1 (writes no KV), null-block tables, null
      state slot 0 (models with recurrent state read their slots from the static batch's
      ``state_slots``, so a replay reads and writes each request's fixed slot)

Short prefill steps (on by default, ``OPENINFER_PREFILL_GRAPHS=0`` turns them off; plain
full-attention models, one KV cache group, no recurrent state; see ``prefill_graphs_wanted``):
every sequence runs at most ``SHORT_PREFILL_MAX_QUERY`` new tokens, e.g. a warm prefix whose
prompt is cached but for its last block, alone or next to decode rows::

    prefill buckets   1 2 4 8 16 32 64 sequences (up to max_num_seqs), each holding
                      sequences + SHORT_PREFILL_MAX_QUERY - 1 tokens, 16 new tokens per sequence at most
    a step of B sequences, T tokens -> the smallest bucket with >= B sequences and >= T tokens
      (``StaticPrefillBatch``: query_start and logits rows at fixed addresses; padded token
      rows belong to no sequence and write no KV)

Attention then runs the short-query kernel (or the prefill kernel over one fixed tile per
sequence), whose grid depends only on the bucket, so one capture serves every context length.

Each bucket owns a ``StaticBatch`` (device inputs at fixed addresses) and the logits array the
capture produced. Graphs are captured largest first, on a side stream, all allocating from
one private memory pool that nothing else uses; graphs never run concurrently, so they may
share intermediates. Invariant: the logits returned by ``run`` stay valid until the next call.
Other prefill, chunked and mixed steps, and batches larger than the largest bucket, run eagerly.

A runner's ``observer`` (None unless a diagnostic sets it, e.g. ``openinfer.engine_core.step_log``)
is called after each launch with the batch, whether a graph replayed it, and the wall-clock
times the launch began and returned.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from openinfer.backend.base import ForwardBatch
from openinfer.engine_core.startup import wait_for_deferred_weights

logger = logging.getLogger("openinfer.graph")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_PREFILL_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # sequences of a short-prefill graph
SHORT_PREFILL_MAX_QUERY = 16  # new tokens per sequence in a short-prefill graph (the short-query kernel's limit)
PREFILL_GRAPHS_ENV = "OPENINFER_PREFILL_GRAPHS"  # "1" / "0": short-prefill graphs on / off
# unset: on (plain full-attention models). Measured on an H200 in window D2 (benchmarks/gpu_serving.py
# --warm-prefix-engine --max-num-seqs 64, Qwen3-4B shape, dummy weights, short-query attention auto):
# warm prefix TTFT eager -> graph 16k 12.9 -> 8.6 ms, 4k 18.2 -> 6.0, 1k 15.1 -> 5.0 (medians of 4),
# greedy tokens equal 5 of 5 rounds at each context; the 7 short-prefill graphs cost 0.14 s of a 9.2 s
# start (model_load 8.4 s, kernel compile with both kinds' dry runs 0.37 s, 9 decode graphs 0.22 s).
# The earlier H100 run's 33.7 s start (phases not recorded then) was most likely that day's dummy load: a
# float32 -> bf16 conversion per tensor on one core (4 G values), now a view of one bf16 pool.
PREFILL_GRAPHS_DEFAULT = True

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


def short_prefill_tokens(num_seqs: int) -> int:
    """Token rows of a short-prefill bucket of ``num_seqs`` sequences: one sequence may run the
    most new tokens while the others decode one each."""
    return num_seqs + SHORT_PREFILL_MAX_QUERY - 1


def decode_bucket(batch: ForwardBatch, buckets: Sequence[int], max_blocks_per_seq: int) -> int | None:
    """The smallest of ``buckets`` (sorted) a plain decode step fits, or None."""
    if not batch.is_decode or batch.num_tokens != batch.num_seqs or batch.logits_rows.shape[0] != batch.num_seqs:
        return None
    if batch.block_tables.shape[1] > max_blocks_per_seq or any(
            t.shape[1] > max_blocks_per_seq for t in batch.kv_block_tables):
        return None
    i = bisect.bisect_left(buckets, batch.num_seqs)
    return buckets[i] if i < len(buckets) else None


def short_prefill_bucket(batch: ForwardBatch, buckets: Sequence[int], max_blocks_per_seq: int) -> int | None:
    """The smallest of ``buckets`` (sorted sequence counts) whose short-prefill graph holds this
    step: not plain decode, at most SHORT_PREFILL_MAX_QUERY new tokens per sequence, one KV
    cache group, no state slots; or None."""
    if batch.num_seqs == 0 or batch.max_query_len > SHORT_PREFILL_MAX_QUERY:
        return None
    if batch.is_decode and batch.num_tokens == batch.num_seqs:
        return None  # a decode graph's step
    if batch.kv_block_tables or batch.state_slots.shape[0] or batch.block_tables.shape[1] > max_blocks_per_seq:
        return None
    need = max(batch.num_seqs, batch.logits_rows.shape[0])
    for bucket in buckets[bisect.bisect_left(buckets, need):]:
        if short_prefill_tokens(bucket) >= batch.num_tokens:
            return bucket
    return None


def _ends(buckets: Sequence[int]) -> set[int]:
    """The largest and the smallest of ``buckets`` (none of none)."""
    return {max(buckets), min(buckets)} if buckets else set()


def prefill_graphs_wanted(kv_specs: Sequence[Any] | None = None) -> bool:
    """Whether to capture short-prefill graphs: ``OPENINFER_PREFILL_GRAPHS`` ("0" | "1"; unset:
    ``PREFILL_GRAPHS_DEFAULT``; anything else is an error), and only for models whose every KV
    cache spec is plain full attention when ``kv_specs`` is given: their attention reads every
    step input from device memory. MLA's and compressed attention's prefill plans are made on
    the host from the step's query lengths, so a graph would freeze one plan (unset without
    ``kv_specs``: off)."""
    from openinfer.kv.spec import FullAttentionSpec

    value = os.environ.get(PREFILL_GRAPHS_ENV)
    if value is not None and value not in ("0", "1"):
        raise ValueError(f"{PREFILL_GRAPHS_ENV} must be 0 or 1, got {value!r}")
    plain = kv_specs is not None and all(type(spec) is FullAttentionSpec for spec in kv_specs)
    if value is None:
        return PREFILL_GRAPHS_DEFAULT and plain
    if value == "1" and kv_specs is not None and not plain:
        logger.info("%s=1 ignored: short-prefill graphs serve plain full-attention models only", PREFILL_GRAPHS_ENV)
        return False
    return value == "1"


@dataclass
class _Captured:
    static: Any  # StaticBatch
    graph: Any  # cupy.cuda.Graph
    logits: Any  # [bucket, vocab]


class CudaGraphRunner:
    def __init__(self, backend: Any, forward: Forward, max_num_seqs: int, max_blocks_per_seq: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, num_groups: int = 1, with_state: bool = False,
                 discover_kernels: bool = False, prefill_buckets: Sequence[int] = (),
                 extra_dry_run: Callable[[], Any] | None = None):
        """``prefill_buckets``: sequence counts of short-prefill graphs (none by default; only
        with one KV cache group and no recurrent state, which their static batch holds).
        ``extra_dry_run``: more dry forwards (e.g. the engine's prefill warm-up steps, on the
        default memory pool) whose kernels join the capture's one parallel compile."""
        self.backend = backend
        self.forward = forward
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_groups = num_groups
        self.with_state = with_state
        self.buckets = sorted({b for b in buckets if b <= max_num_seqs} | {min(max_num_seqs, max(buckets))})
        self.graphs: dict[int, _Captured] = {}
        self.prefill_buckets = sorted({b for b in prefill_buckets if 1 <= b <= max_num_seqs}) \
            if num_groups == 1 and not with_state else []
        self.prefill_graphs: dict[int, _Captured] = {}
        self.use_prefill_graphs = True  # False: short-prefill steps run eagerly (side-by-side measurements)
        self.eager = EagerRunner(backend, forward)
        self.capture_seconds = 0.0
        # seconds of the start-up phases: "kernel_compile" (the dry forwards and the parallel
        # compile), "graph_capture" (decode buckets), "prefill_graph_capture" (short-prefill ones)
        self.capture_phases: dict[str, float] = {}
        self.num_precompiled_modules = 0
        self.discover_kernels = discover_kernels  # the forward may run dry (see ``capture``)
        self.extra_dry_run = extra_dry_run
        self.observer: LaunchObserver | None = None

    def capture(self) -> None:
        """Capture every bucket, decode ones largest first (its pool blocks then serve the
        smaller ones), then the short-prefill ones. With ``discover_kernels`` (a forward that
        computes no indices on the device), first a dry forward of the largest and smallest
        decode and short-prefill buckets finds the kernels the steps use, and the backend
        compiles them in parallel (``precompile_kernels``): no kernel is compiled one at a time
        inside a warm-up. Those buckets get a warm-up forward before their capture, the others
        are captured at once (a failed capture is retried after a warm-up). ``capture_phases``
        then holds the seconds of each part (the engine reports them as start-up phases)."""
        import cupy

        start = time.perf_counter()
        # where the extra dry run allocates and runs: the caller's, as if it ran after the capture
        outer = (cupy.cuda.get_current_stream(), cupy.cuda.get_allocator())
        self.pool = cupy.cuda.MemoryPool()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            statics = {bucket: (self.backend.static_batch(bucket, self.max_blocks_per_seq, self.num_groups,
                                                          self.with_state)
                                if self.num_groups > 1 or self.with_state
                                else self.backend.static_batch(bucket, self.max_blocks_per_seq))
                       for bucket in self.buckets}
            prefill_statics = {bucket: self.backend.static_prefill_batch(
                bucket, short_prefill_tokens(bucket), self.max_blocks_per_seq, SHORT_PREFILL_MAX_QUERY)
                for bucket in self.prefill_buckets}
            # the largest and the smallest bucket of each kind take different kernels
            ends = [statics[b] for b in _ends(self.buckets)] + [prefill_statics[b] for b in _ends(self.prefill_buckets)]
            precompile = getattr(self.backend, "precompile_kernels", None) if self.discover_kernels else None
            if precompile is not None:
                gemm_rows = [*self.buckets, *(short_prefill_tokens(b) for b in self.prefill_buckets)]
                self.num_precompiled_modules = precompile(lambda: self._dry_run(cupy, ends, outer), gemm_rows=gemm_rows)
            compiled = time.perf_counter()
            # a deferred load's weight copies ran beside the compile; the warm-ups below read them
            weights_waited = wait_for_deferred_weights()
            compiled += weights_waited
            warm = _ends(self.buckets)  # the others reuse their pool blocks and kernels
            for bucket in sorted(self.buckets, reverse=True):
                self.graphs[bucket] = self._capture_warmed(cupy, statics[bucket], warmed=bucket in warm,
                                                           what=f"bucket {bucket}")
            self.stream.synchronize()
            decode_done = time.perf_counter()
            self._capture_prefill(cupy, prefill_statics)
            self.stream.synchronize()
        end = time.perf_counter()
        # eager GEMMs of fewer rows than a bucket run padded to it: cuBLAS kernels loaded by the
        # capture, never loaded mid-serving (a load waits for the whole device, see linear.linear)
        set_buckets = getattr(self.backend, "set_gemm_row_buckets", None)
        if set_buckets is not None:
            set_buckets([*self.buckets, *(short_prefill_tokens(b) for b in self.prefill_buckets)])
        self.capture_seconds = end - start
        self.capture_phases = {"kernel_compile": compiled - weights_waited - start, "graph_capture": decode_done - compiled}
        if weights_waited:
            self.capture_phases["deferred_weights_wait"] = weights_waited
        if self.prefill_buckets:
            self.capture_phases["prefill_graph_capture"] = end - decode_done
        logger.info("captured %d CUDA graphs (%d of them short-prefill) in %.1f s (%s)",
                    len(self.graphs) + len(self.prefill_graphs), len(self.prefill_graphs), self.capture_seconds,
                    ", ".join(f"{k} {v:.2f} s" for k, v in self.capture_phases.items()))

    def _dry_run(self, cupy: Any, statics: list[Any], outer: tuple[Any, Any]) -> None:
        """The discovery forwards: the end buckets' static batches (on the graphs' pool and
        stream), then ``extra_dry_run`` on the caller's stream and allocator (``outer``): its
        activations are not the graphs' pool's to keep, nor a side stream's to cache."""
        for static in statics:
            self.forward(static.batch)
        if self.extra_dry_run is not None:
            stream, allocator = outer
            with stream, cupy.cuda.using_allocator(allocator):
                self.extra_dry_run()

    def _capture_prefill(self, cupy: Any, statics: dict[int, Any]) -> None:
        """The short-prefill buckets, largest first; the largest and the smallest warmed up
        first (their first GEMMs of more than one row, their pool blocks), the others retried
        after one."""
        warm = _ends(self.prefill_buckets)
        for bucket in sorted(self.prefill_buckets, reverse=True):
            self.prefill_graphs[bucket] = self._capture_warmed(cupy, statics[bucket], warmed=bucket in warm,
                                                               what=f"prefill bucket {bucket}")

    def _capture_warmed(self, cupy: Any, static: Any, *, warmed: bool, what: str) -> _Captured:
        """Capture one bucket; ``warmed`` ones run once first (compiling what kernel discovery
        missed, filling the memory pool). An unwarmed bucket whose capture fails (e.g. an
        allocation the capture refuses) is warmed up and captured again."""
        if warmed:
            self.forward(static.batch)
        try:
            return self._capture_one(cupy, static)
        except Exception:
            if warmed:
                raise
            logger.debug("capturing %s without a warm-up failed; retrying after one", what, exc_info=True)
            self.forward(static.batch)
            return self._capture_one(cupy, static)

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
        """The decode bucket a batch replays in, or None (see ``prefill_bucket_for``)."""
        bucket = decode_bucket(batch, self.buckets, self.max_blocks_per_seq)
        return bucket if bucket in self.graphs else None

    def prefill_bucket_for(self, batch: ForwardBatch) -> int | None:
        """The short-prefill bucket a batch replays in, or None."""
        bucket = short_prefill_bucket(batch, self.prefill_buckets, self.max_blocks_per_seq)
        return bucket if bucket in self.prefill_graphs else None

    def _captured_for(self, batch: ForwardBatch) -> _Captured | None:
        bucket = self.bucket_for(batch)
        if bucket is not None:
            return self.graphs[bucket]
        bucket = self.prefill_bucket_for(batch) if self.prefill_graphs and self.use_prefill_graphs else None
        return None if bucket is None else self.prefill_graphs[bucket]

    def run(self, batch: ForwardBatch, previous_token_ids: Any = None) -> Any:
        """Logits rows of ``batch``. Inputs listed in ``batch.token_sources`` are taken from
        ``previous_token_ids`` (the previous step's samples, still on the device)."""
        began = time.time() if self.observer is not None else 0.0
        captured = self._captured_for(batch)
        if captured is None:
            logits = self.eager.run(batch, previous_token_ids)
        else:
            captured.static.fill(batch)  # one H2D copy on the current stream, ordered before the replay
            if batch.token_sources.shape[0]:
                self.backend.fill_token_sources(captured.static.batch, previous_token_ids, batch.token_sources)
            captured.graph.launch()
            logits = captured.logits[: batch.logits_rows.shape[0]]
        if self.observer is not None:
            self.observer(batch, captured is not None, began, time.time())
        return logits

    def run_padded_eager(self, batch: ForwardBatch) -> Any:
        """The same padded inputs as ``run`` but launched op by op (graph vs eager tests)."""
        captured = self._captured_for(batch)
        if captured is None:
            return self.eager.run(batch)
        captured.static.fill(batch)
        return self.forward(captured.static.batch)[: batch.logits_rows.shape[0]]


def create_runner(backend: Any, forward: Forward, *, cuda_graph: bool, max_num_seqs: int,
                  max_model_len: int, block_size: int, num_groups: int = 1,
                  with_state: bool = False, discover_kernels: bool = False,
                  kv_specs: Sequence[Any] | None = None,
                  extra_dry_run: Callable[[], Any] | None = None) -> EagerRunner | CudaGraphRunner:
    """Graphs on cuda when enabled (captured here), else the eager runner. ``num_groups`` /
    ``with_state``: the model's KV cache groups and whether it keeps recurrent state;
    ``discover_kernels``: the forward may run dry to find its kernels (compiled in parallel);
    ``extra_dry_run``: more dry forwards whose kernels join that compile (see ``CudaGraphRunner``).
    ``kv_specs``: the model's KV cache specs; with ``prefill_graphs_wanted(kv_specs)`` the runner
    also captures the short-prefill buckets (``DEFAULT_PREFILL_BUCKETS``)."""
    if not cuda_graph or getattr(backend, "name", "") != "cuda":
        return EagerRunner(backend, forward)
    runner = CudaGraphRunner(backend, forward, max_num_seqs, -(-max_model_len // block_size),
                             num_groups=num_groups, with_state=with_state, discover_kernels=discover_kernels,
                             prefill_buckets=DEFAULT_PREFILL_BUCKETS if prefill_graphs_wanted(kv_specs) else (),
                             extra_dry_run=extra_dry_run if discover_kernels else None)
    runner.capture()
    return runner
