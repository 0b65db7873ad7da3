"""Device idle time between engine steps, measured with CUDA events.

For each launched step, an event is recorded on the stream before its first kernel and one
after its last (sampling). The device is idle between step N's end and step N+1's start::

    stream:  [ step N kernels ]<-- idle gap -->[ step N+1 kernels ]
                         end_N ^               ^ start_N+1

``elapsed(end_N, start_N+1)`` is that gap: ~0 when the CPU queued N+1 before N finished.
A step sampled only after the previous one is read back (a grammar row: its mask follows the
previous token) may also leave the device idle between its forward and its sampling; that
pause, ``elapsed(forward_end, sampling_start)``, counts as idle too.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


class StepTimer:
    """Keeps the last ``capacity`` steps' events; the NumPy backend has none (``create`` → None)."""

    def __init__(self, cupy_module: Any, capacity: int = 4096):
        self.cupy = cupy_module
        # (start, end, (forward_end, sampling_start) or None) per step
        self.steps: deque[tuple[Any, Any, tuple[Any, Any] | None]] = deque(maxlen=capacity)

    @classmethod
    def create(cls, backend: Any) -> StepTimer | None:
        if getattr(backend, "name", "") != "cuda":
            return None
        import cupy

        return cls(cupy)

    def start(self) -> Any:
        event = self.cupy.cuda.Event()
        event.record()
        return event

    def stop(self, start: Any, pause: tuple[Any, Any] | None = None) -> None:
        """End the step begun at ``start``; ``pause``: two events (``start()``) around a stretch
        of it in which the device may wait for the CPU (between the forward and the sampling)."""
        end = self.cupy.cuda.Event()
        end.record()
        self.steps.append((start, end, pause))

    def reset(self) -> None:
        self.steps.clear()

    def report(self) -> dict[str, float]:
        """Idle gaps between consecutive steps and busy time per step, in milliseconds."""
        steps = list(self.steps)
        if len(steps) < 2:
            return {"num_steps": len(steps)}
        steps[-1][1].synchronize()
        elapsed = self.cupy.cuda.get_elapsed_time
        gaps = np.array([elapsed(prev[1], step[0]) for prev, step in zip(steps[:-1], steps[1:], strict=True)])
        spans = np.array([elapsed(start, end) for start, end, _ in steps])
        pauses = np.array([elapsed(*pause) if pause is not None else 0.0 for _, _, pause in steps])
        busy = spans - pauses
        idle = gaps.sum() + pauses[1:].sum()
        return {"num_steps": len(steps), "idle_gap_ms_mean": float(gaps.mean()),
                "idle_gap_ms_p50": float(np.percentile(gaps, 50)), "idle_gap_ms_p99": float(np.percentile(gaps, 99)),
                "pause_ms_mean": float(pauses.mean()), "busy_ms_mean": float(busy.mean()),
                "idle_fraction": float(idle / (idle + busy[1:].sum()))}
