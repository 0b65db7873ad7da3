"""A per-launch log of the engine's steps, for serving benchmarks (off unless asked for).

With ``OPENINFER_STEP_LOG=PATH`` in its environment, the engine-core process records every
launch — wall-clock time it began, host time the launch took, tokens, sequences, single-token
sequences (decodes), longest query, graph replay or eager — and, on shutdown, writes them to
``PATH`` as JSON together with each step's device time from the engine's ``step_timer`` (CUDA
events around the forward and sampling; absent on the NumPy backend). A benchmark cuts the log
into its bursts by wall-clock time and sees how the scheduler formed the steps, what each kind
of step cost on the device and how long the device sat idle between steps.

Columns of ``steps`` (``STEP_COLUMNS``): ``began`` (s, wall clock), ``host_ms`` (building the
device batch and queueing the kernels), ``tokens``, ``seqs``, ``decodes``, ``max_query``,
``graph`` (0/1); with device times also ``device_start_ms`` (from the first step kept),
``busy_ms`` and ``gap_ms`` (idle before this step; NaN for the first).

``decode_rows`` (where the batches carry request ids): per request, the positions in ``steps``
of the launches it rode in as a one-token row (a decode), oldest first — the steps whose device
time a streamed request's TPOT should be set against (``request_decode_steps``). A launch keeps a
reference to its batch's ``request_ids`` tuple (no per-row work on the engine thread) and the
inversion happens in ``write``.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from typing import Any

import numpy as np

STEP_LOG_ENV = "OPENINFER_STEP_LOG"
STEP_COLUMNS = ("began", "host_ms", "tokens", "seqs", "decodes", "max_query", "graph")
DEVICE_COLUMNS = ("device_start_ms", "busy_ms", "gap_ms")


class StepLog:
    """Keeps the last ``capacity`` launches of one runner (``observe`` is its observer)."""

    def __init__(self, capacity: int = 4096):
        self.records: deque[tuple] = deque(maxlen=capacity)
        # per kept launch: the request ids of its one-token rows (the batch's own tuple when
        # every row is one), or () where the batch names no requests
        self.decode_ids: deque[tuple[str, ...]] = deque(maxlen=capacity)

    def observe(self, batch: Any, graphed: bool, began: float, returned: float) -> None:
        lengths = np.diff(batch.query_start)
        one_token = lengths == 1
        decodes = int(np.count_nonzero(one_token))
        self.records.append((began, 1e3 * (returned - began), batch.num_tokens, batch.num_seqs,
                             decodes, int(batch.max_query_len), int(graphed)))
        ids = getattr(batch, "request_ids", ()) or ()
        if len(ids) != len(lengths):  # padded or anonymous rows: nothing to attribute
            ids = ()
        elif decodes != len(ids):
            ids = tuple(ids[i] for i in np.flatnonzero(one_token))
        self.decode_ids.append(ids)

    def decode_rows(self) -> dict[str, list[int]]:
        """Per request id, the positions (in ``rows()``) of the kept launches it rode in as a
        one-token row, oldest first."""
        out: dict[str, list[int]] = {}
        for position, ids in enumerate(self.decode_ids):
            for request_id in ids:
                out.setdefault(request_id, []).append(position)
        return out

    @classmethod
    def attach(cls, engine: Any) -> StepLog | None:
        """Observe ``engine.runner`` when it takes an observer (the single-device runners)."""
        runner = getattr(engine, "runner", None)
        if runner is None or not hasattr(runner, "observer"):
            return None
        log = cls()
        runner.observer = log.observe
        return log

    def rows(self, step_timer: Any = None) -> list[list[float]]:
        """One row per kept launch; with a ``StepTimer`` (same launches, same order), the device
        columns too, matched from the newest step backwards."""
        rows = [list(r) for r in self.records]
        steps = list(step_timer.steps) if step_timer is not None else []
        if not steps or not rows:
            return rows
        steps[-1][1].synchronize()
        elapsed = step_timer.cupy.cuda.get_elapsed_time
        count = min(len(rows), len(steps))
        steps, first = steps[-count:], steps[-count][0]
        previous_end = None
        for row, (start, end, pause) in zip(rows[-count:], steps, strict=True):
            start_ms = elapsed(first, start)
            gap = start_ms - previous_end if previous_end is not None else math.nan
            # a step sampled after the previous read-back may wait for the CPU inside its span
            waited = elapsed(*pause) if pause is not None else 0.0
            row += [start_ms, elapsed(start, end) - waited, gap]
            previous_end = elapsed(first, end)
        return rows

    def write(self, path: str, step_timer: Any = None) -> None:
        rows = self.rows(step_timer)
        columns = list(STEP_COLUMNS) + (list(DEVICE_COLUMNS) if rows and len(rows[-1]) > len(STEP_COLUMNS) else [])
        temporary = path + ".tmp"
        with open(temporary, "w") as handle:
            # NaN is not JSON: the first gap becomes null
            json.dump({"columns": columns, "steps": [[None if isinstance(v, float) and math.isnan(v) else v
                                                      for v in row] for row in rows],
                       "decode_rows": self.decode_rows()}, handle)
        os.replace(temporary, path)


def summarize_steps(log: dict, since: float, until: float) -> dict:
    """What the steps that began in ``[since, until]`` (wall clock) did: counts, tokens and device
    time by kind (``decode``: every sequence one token; ``mixed``: prompt chunks, with or
    without decodes riding along), idle gaps, and when the last one ended."""
    columns = log["columns"]
    index = {name: i for i, name in enumerate(columns)}
    rows = [r for r in log["steps"] if since <= r[index["began"]] <= until]
    if not rows:
        return {"num_steps": 0}

    def column(name: str, subset: list) -> np.ndarray:
        return np.asarray([np.nan if r[index[name]] is None else r[index[name]] for r in subset], float)

    decode = [r for r in rows if r[index["tokens"]] == r[index["seqs"]]]
    mixed = [r for r in rows if r[index["tokens"]] != r[index["seqs"]]]
    out: dict[str, Any] = {"num_steps": len(rows), "first_began": rows[0][index["began"]],
                           "last_began": rows[-1][index["began"]]}
    for name, subset in (("decode", decode), ("mixed", mixed)):
        if not subset:
            continue
        part: dict[str, Any] = {
            "num_steps": len(subset), "tokens": int(column("tokens", subset).sum()),
            "decode_rows": int(column("decodes", subset).sum()),
            "seqs_mean": float(column("seqs", subset).mean()),
            "graph_steps": int(column("graph", subset).sum()),
            "host_ms_mean": float(column("host_ms", subset).mean()),
        }
        if "busy_ms" in index:
            busy = column("busy_ms", subset)
            part.update(busy_ms_total=float(busy.sum()), busy_ms_mean=float(busy.mean()),
                        busy_ms_p50=float(np.percentile(busy, 50)), busy_ms_max=float(busy.max()))
        out[name] = part
    if "busy_ms" in index:
        busy, gaps = column("busy_ms", rows), column("gap_ms", rows)[1:]
        gaps = gaps[~np.isnan(gaps)]
        out["busy_ms_total"] = float(busy.sum())
        out["gap_ms_total"] = float(gaps.sum()) if len(gaps) else 0.0
        out["gap_ms_p50"] = float(np.percentile(gaps, 50)) if len(gaps) else 0.0
        out["gap_ms_max"] = float(gaps.max()) if len(gaps) else 0.0
        start, last = column("device_start_ms", rows[:1])[0], rows[-1]
        out["device_span_ms"] = float(last[index["device_start_ms"]] + last[index["busy_ms"]] - start)
    # the last step ends at least its launch and device time after its launch began: an estimate
    # on the wall clock, to set against when the clients saw their last token
    last = rows[-1]
    device_ms = last[index["busy_ms"]] if "busy_ms" in index and last[index["busy_ms"]] is not None else 0.0
    out["last_step_end_estimate"] = float(last[index["began"]] + 1e-3 * (last[index["host_ms"]] + device_ms))
    return out


def request_decode_steps(log: dict, since: float, until: float) -> list[dict]:
    """Per request whose first decode step began in ``[since, until]`` (wall clock), the steps it
    rode in as a one-token row (``decode_rows`` of the log), oldest request first:

    - ``steps``: how many; ``first`` / ``last``: their positions in ``log["steps"]``;
    - ``device_ms``: the mean device time of those steps (``busy_ms``), what a decode token of
      this request cost the GPU — mixed steps it rode in count at their full length;
    - ``engine_ms``: its tokens' cadence on the device timeline, from the end of the step before
      its first decode step (the one that sampled its first token) to the end of its last,
      over ``steps`` — ``device_ms`` plus the device's idle gaps while the host prepared steps;
    - ``launch_ms``: the same cadence on the host's wall clock, from the launch of the step
      before its first decode step to the launch of its last (no device columns needed: the
      NumPy backend and the stub engine have only this one)."""
    index = {name: i for i, name in enumerate(log["columns"])}
    steps = log["steps"]

    def value(position: int, name: str) -> float | None:
        # rows older than the step timer's window have no device columns
        row = steps[position]
        return row[index[name]] if name in index and index[name] < len(row) else None

    out = []
    for request_id, positions in (log.get("decode_rows") or {}).items():
        if not positions or not since <= value(positions[0], "began") <= until:
            continue
        row: dict[str, Any] = {"request_id": request_id, "steps": len(positions), "first": positions[0],
                               "last": positions[-1], "first_began": value(positions[0], "began"),
                               "last_began": value(positions[-1], "began")}
        if positions[0] > 0:
            row["launch_ms"] = 1e3 * (row["last_began"] - value(positions[0] - 1, "began")) / len(positions)
        busy = [value(p, "busy_ms") for p in positions]
        if all(b is not None for b in busy):
            row["device_ms"] = float(np.mean(busy))
            end = value(positions[-1], "device_start_ms") + busy[-1]
            if positions[0] > 0 and value(positions[0] - 1, "busy_ms") is not None:
                start = value(positions[0] - 1, "device_start_ms") + value(positions[0] - 1, "busy_ms")
                row["engine_ms"] = float((end - start) / len(positions))
        out.append(row)
    out.sort(key=lambda r: (r["first"], r["last"]))
    return out
