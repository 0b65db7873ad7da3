"""The engine-core step log: what a runner's observer records per launch, the device columns
matched from a step timer, and the per-burst summary a benchmark reads."""

from __future__ import annotations

import json
import math

import numpy as np

from openinfer.backend.base import ForwardBatch
from openinfer.engine_core.step_log import (
    DEVICE_COLUMNS,
    STEP_COLUMNS,
    StepLog,
    request_decode_steps,
    summarize_steps,
)
from openinfer.graph import EagerRunner


def batch(query_lens: list[int], request_ids: tuple[str, ...] = ()) -> ForwardBatch:
    count, tokens = len(query_lens), sum(query_lens)
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return ForwardBatch(token_ids=np.zeros(tokens, np.int32), positions=np.zeros(tokens, np.int32),
                        query_start=query_start, context_lens=np.asarray(query_lens, np.int32),
                        block_tables=np.zeros((count, 1), np.int32), slot_mapping=np.zeros(tokens, np.int32),
                        logits_rows=query_start[1:] - 1, max_query_len=max(query_lens),
                        max_context_len=max(query_lens), request_ids=request_ids)


class CountingBackend:
    def __init__(self) -> None:
        self.prepared = 0

    def prepare_batch(self, forward_batch: ForwardBatch) -> ForwardBatch:
        self.prepared += 1
        return forward_batch


class FakeEvent:
    def __init__(self, ms: float):
        self.ms = ms

    def synchronize(self) -> None:
        pass


class FakeTimer:
    """A StepTimer's shape: ``steps`` of (start, end, pause) events, pause None or (forward end,
    sampling start), and ``cupy.cuda.get_elapsed_time``."""

    def __init__(self, spans: list[tuple[float, float]], pauses: dict[int, tuple[float, float]] | None = None):
        pauses = pauses or {}
        self.steps = [(FakeEvent(a), FakeEvent(b), tuple(map(FakeEvent, pauses[i])) if i in pauses else None)
                      for i, (a, b) in enumerate(spans)]

        class Cuda:
            @staticmethod
            def get_elapsed_time(start: FakeEvent, end: FakeEvent) -> float:
                return end.ms - start.ms

        self.cupy = type("CupyLike", (), {"cuda": Cuda})


def test_the_observer_records_every_launch_with_its_shape():
    backend = CountingBackend()
    runner = EagerRunner(backend, lambda b: np.zeros((len(b.logits_rows), 4)))
    log = StepLog()
    runner.observer = log.observe
    runner.run(batch([1, 1, 1]))
    runner.run(batch([1, 1, 500, 300]))
    assert backend.prepared == 2
    rows = log.rows()
    assert [r[2:] for r in rows] == [[3, 3, 3, 1, 0], [802, 4, 2, 500, 0]]  # tokens, seqs, decodes, max query, graph
    assert all(r[1] >= 0 for r in rows) and rows[0][0] <= rows[1][0]


def test_device_columns_come_from_the_step_timer_newest_first_and_gaps_between_steps(tmp_path):
    log = StepLog()
    for lens in ([1, 1], [4, 1], [1, 1]):
        log.observe(batch(lens), len(lens) == 2 and max(lens) == 1, 100.0, 100.001)
    # the timer kept one more (older) step than the log: matched from the newest backwards
    timer = FakeTimer([(0.0, 5.0), (10.0, 12.0), (12.5, 20.0), (21.0, 23.0)])
    rows = log.rows(timer)
    assert [r[len(STEP_COLUMNS):] for r in rows][1:] == [[2.5, 7.5, 0.5], [11.0, 2.0, 1.0]]
    assert math.isnan(rows[0][-1]) and rows[0][len(STEP_COLUMNS)] == 0.0
    path = tmp_path / "steps.json"
    log.write(str(path), timer)
    written = json.loads(path.read_text())
    assert written["columns"] == list(STEP_COLUMNS) + list(DEVICE_COLUMNS)
    assert written["steps"][0][-1] is None  # NaN is not JSON


def test_a_step_that_waited_for_the_cpu_counts_only_its_busy_time():
    log = StepLog()
    for lens in ([1, 1], [1, 1]):
        log.observe(batch(lens), True, 100.0, 100.001)
    # the second step's forward ended at 14, its sampling began at 17: 3 ms waiting for grammar masks
    timer = FakeTimer([(0.0, 5.0), (10.0, 20.0)], pauses={1: (14.0, 17.0)})
    assert [r[len(STEP_COLUMNS):] for r in log.rows(timer)][1] == [10.0, 7.0, 5.0]


def test_summary_splits_decode_and_mixed_steps_inside_the_burst_window():
    columns = list(STEP_COLUMNS) + list(DEVICE_COLUMNS)
    #         began  host tokens seqs decodes maxq graph start busy gap
    steps = [[0.5, 1.0, 2, 2, 2, 1, 1, 0.0, 1.0, None],      # before the burst
             [10.0, 1.0, 8200, 16, 8, 1024, 0, 5.0, 100.0, 4.0],
             [10.1, 1.0, 256, 256, 256, 1, 1, 105.0, 20.0, 0.0],
             [10.2, 1.0, 255, 255, 255, 1, 1, 126.0, 18.0, 1.0],
             [20.0, 1.0, 3, 3, 3, 1, 1, 500.0, 3.0, 356.0]]   # after it
    summary = summarize_steps({"columns": columns, "steps": steps}, 9.0, 11.0)
    assert summary["num_steps"] == 3
    assert summary["mixed"]["num_steps"] == 1 and summary["mixed"]["decode_rows"] == 8
    assert summary["decode"]["num_steps"] == 2 and summary["decode"]["graph_steps"] == 2
    assert summary["decode"]["busy_ms_total"] == 38.0 and summary["busy_ms_total"] == 138.0
    assert summary["gap_ms_total"] == 1.0  # the first step's gap is before the window
    assert summary["device_span_ms"] == 139.0
    assert summary["last_step_end_estimate"] == 10.2 + 1e-3 * (1.0 + 18.0)
    assert summarize_steps({"columns": columns, "steps": steps}, 30.0, 40.0) == {"num_steps": 0}


def test_a_log_without_device_times_still_summarizes():
    log = StepLog()
    log.observe(batch([1, 1]), True, 1.0, 1.002)
    written = {"columns": list(STEP_COLUMNS), "steps": log.rows()}
    summary = summarize_steps(written, 0.0, 2.0)
    assert summary["decode"]["tokens"] == 2 and "busy_ms_total" not in summary
    assert summary["last_step_end_estimate"] == 1.0 + 1e-3 * log.rows()[0][1]


def test_each_request_gets_the_steps_it_rode_in_as_a_decode_row(tmp_path):
    log = StepLog()
    log.observe(batch([500, 300], ("a", "b")), False, 10.0, 10.001)        # both prefill
    log.observe(batch([1, 1, 700], ("a", "b", "c")), False, 10.1, 10.101)  # a, b decode beside c's prompt
    log.observe(batch([1, 1, 1], ("a", "b", "c")), True, 10.2, 10.201)
    log.observe(batch([1, 1]), True, 10.3, 10.301)                         # no ids: attributed to nobody
    log.observe(batch([1], ("c",)), True, 10.4, 10.401)
    assert log.decode_rows() == {"a": [1, 2], "b": [1, 2], "c": [2, 4]}
    #                     step 0      1            2           3           4
    timer = FakeTimer([(0.0, 50.0), (51.0, 151.0), (152.0, 162.0), (170.0, 180.0), (181.0, 190.0)])
    path = tmp_path / "steps.json"
    log.write(str(path), timer)
    written = json.loads(path.read_text())
    assert written["decode_rows"] == {"a": [1, 2], "b": [1, 2], "c": [2, 4]}
    rows = {r["request_id"]: r for r in request_decode_steps(written, 10.05, 10.5)}
    assert rows["a"]["steps"] == 2 and rows["a"]["device_ms"] == (100.0 + 10.0) / 2
    # from the end of step 0 (it sampled a's first token) to the end of step 2, over two tokens
    assert rows["a"]["engine_ms"] == (162.0 - 50.0) / 2
    # c: steps 2 and 4, 10 and 9 ms on the device; from the end of step 1 to the end of step 4
    assert rows["c"]["device_ms"] == 9.5 and rows["c"]["engine_ms"] == (190.0 - 151.0) / 2
    assert [r["request_id"] for r in request_decode_steps(written, 10.15, 10.5)] == ["c"]
    assert request_decode_steps(written, 11.0, 12.0) == []


def test_request_steps_without_device_times_have_counts_only():
    log = StepLog()
    log.observe(batch([1, 1], ("a", "b")), True, 1.0, 1.001)
    written = {"columns": list(STEP_COLUMNS), "steps": log.rows(), "decode_rows": log.decode_rows()}
    rows = request_decode_steps(written, 0.0, 2.0)
    assert [(r["request_id"], r["steps"]) for r in rows] == [("a", 1), ("b", 1)]
    assert all("device_ms" not in r for r in rows)
