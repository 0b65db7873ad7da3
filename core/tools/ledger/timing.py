"""Timing a recorded step: on cuda every op replayed behind a spin kernel with an event between
ops (``Timer``); on the NumPy backend an op's host time (``HostTimer``); and the ceilings (copy
bandwidth, GEMM rate) each is measured against."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from openinfer.tools.ledger.recording import OpCall

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def gpu_seconds(fn: Any, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` between CUDA events on the current stream, after ``warmup``
    untimed calls (also the benchmarks' GPU timer)."""
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(statistics.median(times))


class Timer:
    """Device timing on cuda: ops replayed behind a spin kernel with an event between each."""

    peak_names = ("copy", "cuBLAS bf16")

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.spin = cupy.RawKernel(_SPIN, "spin")
        self.clock_khz = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)

    def hold(self, seconds: float) -> None:
        self.spin((1,), (1,), (np.int64(seconds * self.clock_khz * 1e3),))

    def ops(self, calls: list[OpCall], repeats: int, forward: Any) -> dict[str, Any]:
        """Median device and host seconds per op, in step order; the device time an event
        record itself adds (measured: the same replay with events only at its ends) is taken
        off each op; and the host time of the whole forward (its Python between ops included)
        while the device is held."""
        cupy = self.cupy
        host_times: list[list[float]] = [[] for _ in calls]
        device_times: list[list[float]] = [[] for _ in calls]
        plain: list[float] = []
        forward_host: list[float] = []
        hold_s = 0.05
        for rep in range(repeats + 1):
            if rep:  # the same replay, events at its ends only; then the model's own forward
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                cupy.cuda.get_current_stream().synchronize()
                self.hold(hold_s)
                start.record()
                for call in calls:
                    call.fn(*call.args, **call.kwargs)
                end.record()
                end.synchronize()
                plain.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
                self.hold(hold_s)
                t0 = time.perf_counter()
                forward()
                forward_host.append(time.perf_counter() - t0)
                cupy.cuda.get_current_stream().synchronize()
            events = [cupy.cuda.Event() for _ in range(len(calls) + 1)]
            cupy.cuda.get_current_stream().synchronize()
            self.hold(hold_s)
            began = time.perf_counter()
            events[0].record()
            for i, call in enumerate(calls):
                t0 = time.perf_counter()
                call.fn(*call.args, **call.kwargs)
                host_times[i].append(time.perf_counter() - t0)
                events[i + 1].record()
            enqueue_s = time.perf_counter() - began
            events[-1].synchronize()
            if rep == 0:  # warm-up: learn how long the host takes to enqueue the step
                hold_s = 1.5 * enqueue_s + 0.005
                for lst in host_times:
                    lst.clear()
                continue
            for i in range(len(calls)):
                device_times[i].append(cupy.cuda.get_elapsed_time(events[i], events[i + 1]) / 1e3)
        device = [statistics.median(t) for t in device_times]
        event_cost = max(0.0, (sum(device) - statistics.median(plain)) / max(1, len(calls)))
        return {"device_s": [max(0.0, t - event_cost) for t in device], "host_s": [statistics.median(t) for t in host_times],
                "event_cost_s": event_cost, "forward_host_s": statistics.median(forward_host)}

    def gpu(self, fn: Any, repeats: int) -> float:
        return gpu_seconds(fn, repeats)

    def wall(self, fn: Any, repeats: int) -> float:
        fn()
        self.cupy.cuda.get_current_stream().synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            self.cupy.cuda.get_current_stream().synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


class HostTimer:
    """Timing on the NumPy backend: an op's time is its host time (the CPU computes it)."""

    peak_names = ("NumPy copy", "NumPy fp32 matmul")

    def ops(self, calls: list[OpCall], repeats: int, forward: Any) -> dict[str, Any]:
        times: list[list[float]] = [[] for _ in calls]
        forward_times = []
        for rep in range(repeats + 1):
            for i, call in enumerate(calls):
                t0 = time.perf_counter()
                call.fn(*call.args, **call.kwargs)
                if rep:  # the first round warms caches
                    times[i].append(time.perf_counter() - t0)
            if rep:
                t0 = time.perf_counter()
                forward()
                forward_times.append(time.perf_counter() - t0)
        seconds = [statistics.median(t) for t in times]
        return {"device_s": seconds, "host_s": seconds, "event_cost_s": 0.0,
                "forward_host_s": statistics.median(forward_times)}

    def gpu(self, fn: Any, repeats: int) -> float:
        return self.wall(fn, repeats)

    def wall(self, fn: Any, repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def ceilings(timer: Timer | HostTimer) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and cuBLAS bf16 rate (on the CPU: NumPy's copy and
    fp32 matmul rate), measured now; the GEMM rate is kept as ``bf16_flops_per_s`` either way."""
    if isinstance(timer, HostTimer):
        src = np.random.default_rng(0).random(2**24, dtype=np.float32)
        dst = np.empty_like(src)
        copy_s = timer.wall(lambda: np.copyto(dst, src), 5)
        n = 1024
        a = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
        gemm_s = timer.wall(lambda: a @ a, 5)
        return {"copy_bytes_per_s": 2 * src.nbytes / copy_s, "bf16_flops_per_s": 2 * n**3 / gemm_s}
    import cupy

    from openinfer.backend.cuda.cublas import Cublas

    src = cupy.random.random(2**28, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    copy_s = timer.gpu(lambda: dst.__setitem__(Ellipsis, src), 10)
    n = 8192
    a = (cupy.random.standard_normal((n, n), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
    out = cupy.empty((n, n), dtype=cupy.uint16)
    blas = Cublas()
    gemm_s = timer.gpu(lambda: blas.matmul_nt(a, a, out), 10)
    return {"copy_bytes_per_s": 2 * src.nbytes / copy_s, "bf16_flops_per_s": 2 * n**3 / gemm_s}


