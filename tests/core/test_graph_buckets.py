"""Which CUDA graph a step replays (no GPU): decode buckets and short-prefill buckets."""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np
import pytest

from openinfer.backend.base import ForwardBatch
from openinfer.graph import (
    PREFILL_GRAPHS_ENV,
    SHORT_PREFILL_MAX_QUERY,
    CudaGraphRunner,
    decode_bucket,
    prefill_graphs_wanted,
    short_prefill_bucket,
    short_prefill_tokens,
)

BLOCK_SIZE = 16
MAX_BLOCKS = 64
DECODE_BUCKETS = [1, 2, 4, 8, 16]
PREFILL_BUCKETS = [1, 2, 4, 8]


def step(cached: list[int], new: list[int]) -> ForwardBatch:
    """Sequence i: ``cached[i]`` tokens cached, ``new[i]`` run now, over its own blocks."""
    width = max(-(-(c + n) // BLOCK_SIZE) for c, n in zip(cached, new, strict=True))
    tables = np.zeros((len(new), width), np.int32)
    for i, (c, n) in enumerate(zip(cached, new, strict=True)):
        used = -(-(c + n) // BLOCK_SIZE)
        tables[i, :used] = 1 + i * MAX_BLOCKS + np.arange(used)
    return ForwardBatch.over_blocks(tables, cached, new, BLOCK_SIZE)


def test_decode_steps_take_the_smallest_decode_bucket_and_never_a_prefill_one():
    for num_seqs, expected in ((1, 1), (3, 4), (8, 8), (9, 16)):
        batch = step([100] * num_seqs, [1] * num_seqs)
        assert decode_bucket(batch, DECODE_BUCKETS, MAX_BLOCKS) == expected
        assert short_prefill_bucket(batch, PREFILL_BUCKETS, MAX_BLOCKS) is None
    assert decode_bucket(step([5] * 17, [1] * 17), DECODE_BUCKETS, MAX_BLOCKS) is None  # past the largest


def test_a_warm_prefix_alone_or_beside_decodes_takes_a_short_prefill_bucket():
    # a warm prefix whose prompt is cached but for its last 8 tokens
    warm = step([16376], [8])
    assert warm.max_query_len == 8 and warm.max_context_len == 16384
    assert decode_bucket(warm, DECODE_BUCKETS, 16384 // BLOCK_SIZE) is None
    assert short_prefill_bucket(warm, PREFILL_BUCKETS, 16384 // BLOCK_SIZE) == 1
    # the same beside 2 decoding sequences: 3 sequences, 10 tokens -> the 4-sequence bucket
    mixed = step([300, 16376, 40], [1, 8, 1])
    assert short_prefill_bucket(mixed, PREFILL_BUCKETS, 16384 // BLOCK_SIZE) == 4
    # one sequence of the most new tokens fills the one-sequence bucket exactly
    full = step([50], [SHORT_PREFILL_MAX_QUERY])
    assert full.num_tokens == short_prefill_tokens(1)
    assert short_prefill_bucket(full, PREFILL_BUCKETS, MAX_BLOCKS) == 1


def test_more_tokens_than_a_bucket_holds_move_to_a_larger_bucket():
    # 2 sequences of 16 new tokens: 32 tokens; buckets hold 2 -> 17, 4 -> 19, 8 -> 23 tokens
    two = step([40, 90], [16, 16])
    assert short_prefill_bucket(two, PREFILL_BUCKETS, MAX_BLOCKS) is None
    assert short_prefill_tokens(32) >= two.num_tokens > short_prefill_tokens(16)  # 47 >= 32 > 31
    assert short_prefill_bucket(two, [1, 2, 4, 8, 16, 32], MAX_BLOCKS) == 32


def test_steps_a_short_prefill_graph_cannot_hold_run_eagerly():
    assert short_prefill_bucket(step([0], [SHORT_PREFILL_MAX_QUERY + 1]), PREFILL_BUCKETS, MAX_BLOCKS) is None
    assert short_prefill_bucket(step([0] * 9, [2] * 9), PREFILL_BUCKETS, MAX_BLOCKS) is None  # 9 > 8 sequences
    wide = step([MAX_BLOCKS * BLOCK_SIZE], [4])  # its table is one block wider than the graph's
    assert short_prefill_bucket(wide, PREFILL_BUCKETS, MAX_BLOCKS) is None
    grouped = step([30], [4])
    grouped.kv_block_tables, grouped.kv_slot_mappings = (grouped.block_tables,), (grouped.slot_mapping,)
    assert short_prefill_bucket(grouped, PREFILL_BUCKETS, MAX_BLOCKS) is None
    stateful = step([30], [4])
    stateful.state_slots = np.array([3], np.int32)
    assert short_prefill_bucket(stateful, PREFILL_BUCKETS, MAX_BLOCKS) is None
    assert short_prefill_bucket(step([30], [4]), [], MAX_BLOCKS) is None


def test_the_switch_reads_zero_or_one_and_serves_plain_full_attention_only(monkeypatch):
    from openinfer.graph import PREFILL_GRAPHS_DEFAULT
    from openinfer.kv.spec import FullAttentionSpec, MLALatentSpec, SlidingWindowSpec

    full = [FullAttentionSpec(8, 128, "bfloat16")] * 2
    window = [*full, SlidingWindowSpec(8, 128, "bfloat16", window=512)]
    mla = [MLALatentSpec(576, "bfloat16")]
    monkeypatch.delenv(PREFILL_GRAPHS_ENV, raising=False)
    assert prefill_graphs_wanted() is False  # unset, specs unknown
    assert prefill_graphs_wanted(full) is PREFILL_GRAPHS_DEFAULT
    assert prefill_graphs_wanted(mla) is False
    monkeypatch.setenv(PREFILL_GRAPHS_ENV, "1")
    assert prefill_graphs_wanted() is True
    assert prefill_graphs_wanted(full) is True
    assert prefill_graphs_wanted(window) is False and prefill_graphs_wanted(mla) is False
    monkeypatch.setenv(PREFILL_GRAPHS_ENV, "0")
    assert prefill_graphs_wanted(full) is False
    monkeypatch.setenv(PREFILL_GRAPHS_ENV, "yes")
    with pytest.raises(ValueError, match=PREFILL_GRAPHS_ENV):
        prefill_graphs_wanted()


class _Static:
    def __init__(self) -> None:
        self.filled: list[ForwardBatch] = []
        self.batch = "static device batch"

    def fill(self, batch: ForwardBatch) -> None:
        self.filled.append(batch)


class _Graph:
    def __init__(self) -> None:
        self.launches = 0

    def launch(self) -> None:
        self.launches += 1


class _Backend:
    name = "cuda"

    def __init__(self) -> None:
        self.prepared: list[ForwardBatch] = []

    def prepare_batch(self, batch: ForwardBatch) -> ForwardBatch:
        self.prepared.append(batch)
        return batch


def test_the_runner_replays_the_short_prefill_graph_and_returns_one_logits_row_per_sampled_row():
    from openinfer.graph import _Captured

    backend = _Backend()
    eager_logits = np.full((1, 5), 7.0)
    runner = CudaGraphRunner(backend, lambda batch: eager_logits, max_num_seqs=8, max_blocks_per_seq=2048,
                             buckets=(1, 2, 4, 8), prefill_buckets=(1, 4, 64))
    assert runner.prefill_buckets == [1, 4]  # none past max_num_seqs
    for bucket in (1, 4):
        runner.prefill_graphs[bucket] = _Captured(_Static(), _Graph(), np.arange(bucket * 5.0).reshape(bucket, 5))
    seen = []
    runner.observer = lambda batch, graphed, began, returned: seen.append(graphed)
    mixed = step([300, 16376, 40], [1, 8, 1])
    logits = runner.run(mixed)
    four = runner.prefill_graphs[4]
    assert four.static.filled == [mixed] and four.graph.launches == 1 and not runner.prefill_graphs[1].graph.launches
    np.testing.assert_array_equal(logits, np.arange(15.0).reshape(3, 5))
    # a middle chunk of a chunked prefill samples nothing: no logits rows come back
    chunk = step([64], [16])
    chunk.logits_rows = np.zeros(0, np.int32)
    assert runner.run(chunk).shape == (0, 5)
    assert runner.prefill_graphs[1].graph.launches == 1
    # too long for any short-prefill graph: eager
    long = step([0], [17])
    assert runner.run(long) is eager_logits and backend.prepared == [long]
    assert seen == [True, True, False]


def test_models_with_state_or_several_kv_groups_get_no_short_prefill_buckets():
    for kwargs in ({"num_groups": 2}, {"with_state": True}):
        runner = CudaGraphRunner(_Backend(), lambda batch: None, max_num_seqs=8, max_blocks_per_seq=MAX_BLOCKS,
                                 prefill_buckets=(1, 2), **kwargs)
        assert runner.prefill_buckets == []


class _CaptureProbe:
    """Stands in for a CudaGraphRunner while one bucket is captured: counts warm-ups and fails
    the first ``failures`` captures."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.forwards = 0
        self.captures = 0

    def forward(self, batch: object) -> None:
        self.forwards += 1

    def _capture_one(self, cupy: object, static: object) -> str:
        self.captures += 1
        if self.captures <= self.failures:
            raise RuntimeError("operation not permitted when stream is capturing")
        return "graph"


@pytest.mark.parametrize("warmed", [True, False])
def test_capture_warms_up_first_or_retries_after_a_warm_up(warmed: bool) -> None:
    static = type("Static", (), {"batch": object()})()
    ok = _CaptureProbe(failures=0)
    assert CudaGraphRunner._capture_warmed(ok, None, static, warmed=warmed, what="bucket 4") == "graph"
    assert (ok.forwards, ok.captures) == ((1, 1) if warmed else (0, 1))

    retried = _CaptureProbe(failures=1)
    if warmed:  # a warmed bucket that still fails is a real error
        with pytest.raises(RuntimeError, match="capturing"):
            CudaGraphRunner._capture_warmed(retried, None, static, warmed=True, what="bucket 4")
    else:
        assert CudaGraphRunner._capture_warmed(retried, None, static, warmed=False, what="bucket 4") == "graph"
        assert (retried.forwards, retried.captures) == (1, 2)


class _StandInStream:
    """The part of ``cupy.cuda.Stream`` a capture uses; ``end_capture`` hands back a graph."""

    def __init__(self, non_blocking: bool = False) -> None:
        self.capturing = False

    def __enter__(self) -> _StandInStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def begin_capture(self) -> None:
        self.capturing = True

    def end_capture(self) -> _Graph:
        self.capturing = False
        return _Graph()


_CALLER_STREAM = _StandInStream()  # the stream and allocator current when capture() is called
_CALLER_ALLOCATOR = "the caller's allocator"


def _stand_in_cupy(allocators: list | None = None) -> types.SimpleNamespace:
    """``allocators``: where each ``using_allocator`` block's allocator is recorded."""

    @contextlib.contextmanager
    def using_allocator(malloc):
        if allocators is not None:
            allocators.append(malloc)
        yield

    cuda = types.SimpleNamespace(MemoryPool=lambda: types.SimpleNamespace(malloc="the graphs' pool"),
                                 Stream=_StandInStream, using_allocator=using_allocator,
                                 get_current_stream=lambda: _CALLER_STREAM, get_allocator=lambda: _CALLER_ALLOCATOR,
                                 runtime=types.SimpleNamespace())
    return types.SimpleNamespace(cuda=cuda)


class _CapturingBackend(_Backend):
    """Static batches named by kind and bucket; records every forward, whether it ran dry
    (inside ``precompile_kernels``), during a capture, or as a warm-up."""

    def __init__(self) -> None:
        super().__init__()
        self.dry = False
        self.prefill_shapes: list[tuple[int, int, int, int]] = []
        self.gemm_row_buckets: list[int] = []

    def set_gemm_row_buckets(self, buckets) -> None:
        self.gemm_row_buckets = sorted(set(buckets))

    def static_batch(self, num_seqs: int, max_blocks_per_seq: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(batch=("decode", num_seqs))

    def static_prefill_batch(self, num_seqs: int, num_tokens: int, max_blocks_per_seq: int,
                             max_query_len: int) -> types.SimpleNamespace:
        self.prefill_shapes.append((num_seqs, num_tokens, max_blocks_per_seq, max_query_len))
        return types.SimpleNamespace(batch=("prefill", num_seqs))

    def precompile_kernels(self, dry_run, gemm_rows=()) -> int:
        self.gemm_rows = list(gemm_rows)
        self.dry = True
        try:
            dry_run()
        finally:
            self.dry = False
        return 3


@pytest.mark.parametrize("prefill_buckets", [(1, 2, 4, 8), ()])
def test_capture_compiles_both_kinds_at_once_and_reports_each_phase(monkeypatch, prefill_buckets):
    monkeypatch.setitem(sys.modules, "cupy", _stand_in_cupy())
    backend = _CapturingBackend()
    forwards: list[tuple[str, tuple[str, int]]] = []

    def forward(batch: tuple[str, int]) -> str:
        stream = runner.stream if hasattr(runner, "stream") else None
        how = "dry" if backend.dry else "captured" if stream is not None and stream.capturing else "warm-up"
        forwards.append((how, batch))
        return f"logits of {batch}"

    runner = CudaGraphRunner(backend, forward, max_num_seqs=16, max_blocks_per_seq=MAX_BLOCKS,
                             buckets=DECODE_BUCKETS, discover_kernels=True, prefill_buckets=prefill_buckets)
    runner.capture()
    decode_ends = {("decode", 1), ("decode", 16)}
    prefill_ends = {("prefill", 1), ("prefill", 8)} if prefill_buckets else set()
    # one dry run finds the kernels of both kinds, before any warm-up or capture
    dry = [batch for how, batch in forwards if how == "dry"]
    assert set(dry) == decode_ends | prefill_ends and forwards[:len(dry)] == [("dry", b) for b in dry]
    assert runner.num_precompiled_modules == 3
    # the ends of each kind are warmed up once; every bucket is captured once, largest first per kind
    assert sorted(b for how, b in forwards if how == "warm-up") == sorted(decode_ends | prefill_ends)
    captured = [b for how, b in forwards if how == "captured"]
    assert captured == [("decode", b) for b in sorted(DECODE_BUCKETS, reverse=True)] + \
        [("prefill", b) for b in sorted(prefill_buckets, reverse=True)]
    assert sorted(runner.graphs) == DECODE_BUCKETS and sorted(runner.prefill_graphs) == list(prefill_buckets)
    for kind, graphs in (("decode", runner.graphs), ("prefill", runner.prefill_graphs)):
        for bucket, graph in graphs.items():  # each replay returns its own capture's logits
            assert graph.logits == f"logits of {(kind, bucket)}"
    assert backend.prefill_shapes == [(b, short_prefill_tokens(b), MAX_BLOCKS, SHORT_PREFILL_MAX_QUERY)
                                      for b in prefill_buckets]
    # the start-up report's phases: the short-prefill capture is its own phase, when there is one
    expected = {"kernel_compile", "graph_capture"} | ({"prefill_graph_capture"} if prefill_buckets else set())
    assert set(runner.capture_phases) == expected
    assert all(seconds >= 0 for seconds in runner.capture_phases.values())
    assert sum(runner.capture_phases.values()) == pytest.approx(runner.capture_seconds, abs=1e-3)
    # eager GEMMs are padded to row counts the capture ran: every decode bucket, every short-prefill shape
    assert backend.gemm_row_buckets == sorted({*DECODE_BUCKETS, *(short_prefill_tokens(b) for b in prefill_buckets)})
    # the same row counts were named to the compile (OPENINFER_GEMM_PRELOAD loads their cuBLAS kernels then)
    assert sorted(set(backend.gemm_rows)) == backend.gemm_row_buckets


def test_extra_dry_run_joins_the_one_compile_on_the_callers_stream_and_allocator(monkeypatch):
    """The engine's prefill warm-up steps (``extra_dry_run``) run dry inside the same discovery as
    the end buckets, after them, with the allocator current when capture() was called (not the
    graphs' pool); no other forward runs dry. A runner without discovery never calls it."""
    allocators: list = []
    monkeypatch.setitem(sys.modules, "cupy", _stand_in_cupy(allocators))
    backend = _CapturingBackend()
    events: list[str] = []

    def forward(batch: tuple[str, int]) -> str:
        events.append(("dry " if backend.dry else "") + f"{batch[0]} {batch[1]}")
        return "logits"

    def extra_dry_run() -> None:
        events.append(f"extra dry={backend.dry} allocator={allocators[-1]}")

    for discover in (True, False):
        events.clear()
        CudaGraphRunner(backend, forward, max_num_seqs=16, max_blocks_per_seq=MAX_BLOCKS, buckets=DECODE_BUCKETS,
                        discover_kernels=discover, prefill_buckets=(1, 8), extra_dry_run=extra_dry_run).capture()
        extra = [i for i, e in enumerate(events) if e.startswith("extra")]
        if not discover:
            assert not extra and not any(e.startswith("dry") for e in events)
            continue
        assert [events[i] for i in extra] == [f"extra dry=True allocator={_CALLER_ALLOCATOR}"]
        assert sorted(events[:extra[0]]) == ["dry decode 1", "dry decode 16", "dry prefill 1", "dry prefill 8"]
        assert not any(e.startswith("dry") for e in events[extra[0] + 1:])
        assert allocators[:2] == ["the graphs' pool", _CALLER_ALLOCATOR]
