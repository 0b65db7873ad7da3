"""Where the engine core's threads spend wall time: a sampling profiler, on request.

``OPENINFER_STACK_SAMPLES=PATH`` makes the engine-core process sample the Python stack of every
other thread every ``interval`` seconds and write, at shutdown, per thread the stacks (innermost
frames last) weighted by wall time. It answers questions the step log cannot, e.g. which call
holds the engine thread while an eager step is being launched (a kernel launch that waits for
queue space, an allocation, an event wait).

Each sample is weighted by the wall time since the previous one: a thread blocked in a C call
that keeps the GIL stops the sampler too, and the time lands on the frame seen next (the same
line, for a call that returns). Off by default; about 1 % of one core at the default interval.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

STACK_SAMPLES_ENV = "OPENINFER_STACK_SAMPLES"
DEFAULT_INTERVAL_S = 0.001
STACK_DEPTH = 10  # innermost frames kept per stack
TOP_STACKS = 40  # per thread, in the written report


def _innermost_frames(frame, depth: int = STACK_DEPTH) -> list[str]:
    """``file:line function`` of the ``depth`` innermost frames, innermost first (no source lookups:
    this runs every millisecond)."""
    frames = []
    while frame is not None and len(frames) < depth:
        code = frame.f_code
        frames.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return frames


class StackSampler:
    """Samples every thread but its own; ``report`` gives the heaviest stacks per thread."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S):
        if interval_s <= 0:
            raise ValueError(f"the sampling interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.weights: dict[str, Counter[str]] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        previous = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            now = time.perf_counter()
            weight, previous = now - previous, now
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = " <- ".join(_innermost_frames(frame))
                name = names.get(ident, str(ident))
                self.weights.setdefault(name, Counter())[stack] += weight
            self.samples += 1

    def report(self, top: int = TOP_STACKS) -> dict:
        """Per thread: seconds sampled and the ``top`` heaviest stacks (innermost frame first)."""
        threads = {}
        for name, weights in self.weights.items():
            threads[name] = {"seconds": round(sum(weights.values()), 4),
                             "stacks": [{"seconds": round(s, 4), "stack": k} for k, s in weights.most_common(top)]}
        return {"interval_s": self.interval_s, "samples": self.samples, "threads": threads}

    def write(self, path: str) -> None:
        temporary = path + ".tmp"
        with open(temporary, "w") as handle:
            json.dump(self.report(), handle, indent=1)
        Path(temporary).replace(path)
