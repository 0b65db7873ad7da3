"""The step-time model: an op's time per step interpolated over the ledger's grid (piecewise
linear in context, then in log2 batch; prefill through the nearest three lengths), a step the
sum of its ops; and the checks' predictions from it."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np


def interpolate(xs: list[float], ys: list[float], x: float, degree: int = 1) -> float:
    """Piecewise linear (degree 1) or through the nearest three points (degree 2: prefill,
    whose attention grows with the square of the length); extrapolates from the nearest."""
    if len(xs) == 1:
        return ys[0]
    if degree == 2 and len(xs) >= 3:
        i = int(np.clip(np.searchsorted(xs, x) - 2, 0, len(xs) - 3))
        px, py = xs[i:i + 3], ys[i:i + 3]
        return float(sum(py[j] * math.prod((x - px[k]) / (px[j] - px[k]) for k in range(3) if k != j)
                         for j in range(3)))
    i = int(np.clip(np.searchsorted(xs, x) - 1, 0, len(xs) - 2))
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class StepModel:
    """Predicts a step from the ledger's grid: per op, context first, then log2 batch.

    A graph replay launches the same kernels with shorter gaps than the stream-queued replay
    the ops were timed in: that saving is one constant per model (``graph_saving_s``, the
    median over the grid of ops-sum minus measured replay), reported and taken off."""

    def __init__(self, entries: list[dict[str, Any]], eager: bool, context_degree: int = 1):
        self.eager = eager
        self.degree = context_degree
        self.graph_saving_s = 0.0 if eager else float(np.median(
            [e["sum_device_s"] - e["measured_s"] for e in entries]))
        self.table: dict[str, dict[int, dict[int, tuple[float, float]]]] = defaultdict(lambda: defaultdict(dict))
        for entry in entries:
            for row in entry["ops"]:
                self.table[row["op"]][entry["batch"]][entry["context"]] = (row["time_s"], row["host_s"])

    def predict(self, batch: int, context: int) -> float:
        device = host = 0.0
        for per_batch in self.table.values():
            batches = sorted(per_batch)
            dev_at, host_at = [], []
            for b in batches:
                contexts = sorted(per_batch[b])
                dev_at.append(max(0.0, interpolate(contexts, [per_batch[b][c][0] for c in contexts], context,
                                                    self.degree)))
                host_at.append(max(0.0, interpolate(contexts, [per_batch[b][c][1] for c in contexts], context,
                                                     self.degree)))
            logs = [math.log2(b) for b in batches]
            device += max(0.0, interpolate(logs, dev_at, math.log2(batch)))
            host += max(0.0, interpolate(logs, host_at, math.log2(batch)))
        return max(device, host) if self.eager else device - self.graph_saving_s




def predict_checks(report: dict[str, Any]) -> None:
    """(Re)compute the step-time model from the ledger's grid entries and its checks' predictions."""
    decode = [e for e in report["entries"] if e["phase"] == "decode"]
    prefill = [{**e, "batch": 1, "context": e["tokens"]} for e in report["entries"] if e["phase"] == "prefill"]
    models = {"decode": StepModel(decode, not report["cuda_graphs"]),
              # prefill: one sequence, so "batch" is 1 and the grid runs over its length
              "prefill": StepModel(prefill, True, 2)}
    report["model"] = {"decode_graph_saving_s": models["decode"].graph_saving_s,
                       "decode": "sum over ops of the grid interpolated (linear in context, then in log2 batch)"
                                 + (" less the graph saving" if report["cuda_graphs"] else "; eager: max(device, host)"),
                       "prefill": "sum over ops, through the nearest three lengths; eager: max(device, host)"}
    for check in report["checks"]:
        check["predicted_s"] = models[check["phase"]].predict(check["batch"], check["context"])
        check["error"] = check["predicted_s"] / check["measured_s"] - 1


