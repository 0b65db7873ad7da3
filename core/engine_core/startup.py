"""Start-up phases and host memory of the ``openinfer serve`` processes.

Each process records where its start went (``StartupPhases``: process spawn → imports → engine
build → ready, and inside the engine build what ``PagedEngine`` measures itself: KV allocation,
CUDA graph capture) and, once the engine is built, gives back the host memory that loading
needed but serving does not (``release_host_memory``): pinned staging memory (the weight
uploader's ring, and CuPy's pinned pool, which keeps a block per size for every ``cupy.asarray``
of a large array: measured on an H100 with Qwen3-4B, 2.28 GB of the engine core's 2.94 GB RSS
after loading, shown as RssShmem), freed heap pages glibc still holds, the checkpoint's
page-cache pages. ``memory_breakdown`` says what the resident set is made of (anonymous /
file-backed / shared), so an RSS figure can be explained.

The supervisor stamps ``OPENINFER_SPAWN_TIME`` (wall clock) into each child's environment, so
the first phase includes the interpreter start and the ``openinfer`` import. Besides the phases
(consecutive), any thread notes when a start-up event happened (``note_event``: CuPy imported, the
weight copies done, a kernel module built, ...); ``startup_events`` gives them in order, as seconds
after the process's start, for the ``--startup-report``'s per-process timeline.

How the engine core's start overlaps itself (each a switch, defaults from s12 D2): the CUDA context
is made in a thread beside the imports (``OPENINFER_EARLY_CUDA``); the weights' copies run while the
kernels compile and the graphs are captured (``OPENINFER_DEFERRED_WEIGHTS``, ``OPENINFER_WEIGHTS_JOIN``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from openinfer.errors import OpenInferError

SPAWN_TIME_ENV = "OPENINFER_SPAWN_TIME"
API_STARTUP_FILE = "startup-{role}.json"  # in the run directory: an API server's phases once it listens


def process_start_time() -> float | None:
    """Wall-clock time this process started (Linux ``/proc``, ~10 ms resolution), else None."""
    try:
        with open("/proc/self/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class StartupPhases:
    """Ordered ``(phase, seconds)`` of one process's start; ``mark(name)`` closes the phase that
    began at the previous mark. The first phase begins when the supervisor spawned the process
    (``OPENINFER_SPAWN_TIME``), else when the process started, else at construction."""

    def __init__(self) -> None:
        now = time.time()
        try:  # popped: this process's own children were not spawned then
            started = float(os.environ.pop(SPAWN_TIME_ENV, ""))
        except ValueError:
            started = process_start_time() or now
        self.started = min(now, started)
        self.last = self.started
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> float:
        now = time.time()
        seconds = now - self.last
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        self.last = now
        return seconds

    def split(self, name: str, parts: dict[str, float], rest: str) -> None:
        """Replace phase ``name`` by ``parts`` (sub-phases measured inside it) and ``rest``, the
        part of it no sub-phase covers."""
        total = self.phases.pop(name, 0.0)
        known = {k: v for k, v in parts.items() if v}
        self.phases[rest] = max(0.0, total - sum(known.values()))
        self.phases.update(known)

    @property
    def total(self) -> float:
        return self.last - self.started

    def as_dict(self) -> dict[str, float]:
        return {**{k: round(v, 4) for k, v in self.phases.items()}, "total": round(self.total, 4)}


# wall-clock times of start-up events (``note_event``), for a timeline across threads and processes
_events: dict[str, float] = {}


def note_event(name: str, last: bool = False) -> None:
    """Record when start-up event ``name`` happened (wall clock): its first occurrence, or with
    ``last`` its latest. Any thread; costs a dict write."""
    if last:
        _events[name] = time.time()
    else:
        _events.setdefault(name, time.time())


def startup_events(since: float) -> dict[str, float]:
    """Every noted event as seconds after ``since`` (a process's ``StartupPhases.started``), in
    the order they happened."""
    return {name: round(at - since, 4) for name, at in sorted(_events.items(), key=lambda item: item[1])}


def memory_breakdown() -> dict[str, int]:
    """This process's resident memory in bytes: ``rss`` and its ``anon`` / ``file`` / ``shmem``
    parts (Linux ``/proc/self/status``), plus CuPy's pinned-pool bytes when CuPy is loaded."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            pool = cupy.get_default_pinned_memory_pool()
            out["cupy_pinned_pool_free"] = int(pool.n_free_blocks())
            out["cupy_device_pool_held"] = int(cupy.get_default_memory_pool().total_bytes())
        except Exception:  # no device: nothing to report
            pass
    return out


def _malloc_trim() -> bool:
    """Return freed heap pages to the OS (glibc keeps them; loading frees gigabytes at once)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


# "driver" (default since s12 D2): the context alone, made in a thread through the driver API by ctypes, which
# lets go of the GIL (H200, served Qwen3-4B: CuPy imported + context made 1.11-1.16 -> 0.73-0.79 s after the
# core's spawn; with OPENINFER_WEIGHTS_JOIN=serve and OPENINFER_GEMM_PRELOAD=1 a cold start 2.87 / 3.02 ->
# 2.58 / 2.72 s, a restart 2.65 / 2.97 -> 2.05 / 2.43 s, results/served_start_s12d2_h200.json); "1": CuPy's
# import and the context in a thread (CuPy's import holds the GIL: the main thread's imports wait meanwhile);
# "0": the backend makes the context
EARLY_CUDA_ENV = "OPENINFER_EARLY_CUDA"
EARLY_CUDA_MODES = ("0", "1", "driver")
DEFAULT_EARLY_CUDA = "driver"


def early_cuda_mode() -> str:
    """``OPENINFER_EARLY_CUDA`` (``DEFAULT_EARLY_CUDA`` when unset); anything but ``EARLY_CUDA_MODES``
    is an error (the engine core reports it and exits 2, as for a bad option)."""
    mode = os.environ.get(EARLY_CUDA_ENV, DEFAULT_EARLY_CUDA).strip().lower() or DEFAULT_EARLY_CUDA
    if mode not in EARLY_CUDA_MODES:
        raise OpenInferError(f"{EARLY_CUDA_ENV}={mode!r}: expected one of {', '.join(EARLY_CUDA_MODES)}")
    return mode


def early_cuda_wanted(options: dict, switch: str | None = EARLY_CUDA_ENV) -> bool:
    """Whether ``start_cuda_early`` should run for an engine built with these ``EngineOptions``
    fields: only where the engine's one GPU is device 0 (``device`` "cuda" or "auto", one rank),
    so no context is made on a GPU the engine will not use; and ``switch`` (an environment
    variable) is not "0" (None: no switch asked)."""
    if switch is not None:
        value = early_cuda_mode() if switch == EARLY_CUDA_ENV else os.environ.get(switch, "0").strip()
        if value == "0":
            return False
    if str(options.get("device") or "auto") not in ("auto", "cuda"):
        return False
    ranks = [options.get(name) for name in ("tensor_parallel_size", "expert_parallel_size", "pipeline_parallel_size")]
    return all(int(rank or 1) <= 1 for rank in ranks)


_early_cuda: threading.Thread | None = None


def early_cuda_from_argv(argv: list[str]) -> threading.Thread | None:
    """``start_cuda_early`` when the engine-core command line's ``--options-json`` asks for what
    ``early_cuda_wanted`` accepts: called before the process imports ZMQ, protobuf and the rest,
    so CuPy's import and the context overlap those too. A malformed command line starts nothing
    (the argument parser reports it)."""
    options: dict = {}
    for index, arg in enumerate(argv):
        if arg == "--options-json" and index + 1 == len(argv):
            return None
        text = arg.partition("=")[2] if arg.startswith("--options-json=") else (
            argv[index + 1] if arg == "--options-json" else None)
        if text is not None:
            try:
                import json

                options = json.loads(text)
            except ValueError:
                return None
    try:
        if not isinstance(options, dict) or not early_cuda_wanted(options):
            return None
    except OpenInferError:  # a bad switch: the engine core's start reports it
        return None
    return start_cuda_early()


def retain_primary_context(ordinal: int = 0) -> bool:
    """Create (or take) device ``ordinal``'s primary CUDA context through the driver API by
    ctypes: the CUDA runtime (CuPy) then finds it made. ctypes releases the GIL for each call, so
    the ~0.3-0.5 s the driver takes overlap Python work in other threads. False when there is no
    driver or device (the backend's own start reports that)."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    device, context = ctypes.c_int(), ctypes.c_void_p()
    return (driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(device), ordinal) == 0
            and driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0)


def start_cuda_early() -> threading.Thread:
    """Create device 0's CUDA context (the primary context, which the backend then finds made) in
    a daemon thread, beside the main thread's plugin discovery and imports: with
    ``OPENINFER_EARLY_CUDA=driver`` through the driver API (``retain_primary_context``), else by
    importing CuPy and calling ``cudaFree(0)``. Failures are left to the backend's own start,
    which reports them. Once per process (a second call returns the first thread)."""
    global _early_cuda
    if _early_cuda is not None:
        return _early_cuda
    by_driver = early_cuda_mode() == "driver"

    def init() -> None:
        try:
            if by_driver:
                retain_primary_context(0)
            else:
                import cupy

                cupy.cuda.runtime.free(0)  # cudaFree(0): the idiom that creates the context
            note_event("early_cuda_context")
        except Exception:  # noqa: BLE001 — no GPU or no CuPy: the engine's start says so itself
            pass

    _early_cuda = threading.Thread(target=init, name="openinfer-cuda-init", daemon=True)
    _early_cuda.start()
    return _early_cuda


# "1" (the default since s9 D2: a fresh H200's start -> HTTP ready 5.31 -> 4.95 s, a restart 3.90 -> 3.58 s,
# greedy outputs unchanged; results/start12_served_start_s9d2_h200.json): weights copied while kernels compile;
# "0": copied during the load, as before
DEFERRED_WEIGHTS_ENV = "OPENINFER_DEFERRED_WEIGHTS"


@contextlib.contextmanager
def deferred_weights(options: Any) -> Iterator[Any]:
    """Unless ``OPENINFER_DEFERRED_WEIGHTS=0``, with one CUDA rank (``EngineOptions``), the block's
    model load allocates its bf16 weights and queues their copies (``weight_upload.
    deferred_uploads``), yielding the queue; the caller starts it and the engine joins it after its
    kernel discovery and compile (``wait_for_deferred_weights``). Else yields None."""
    wanted = os.environ.get(DEFERRED_WEIGHTS_ENV, "1").strip() != "0" and early_cuda_wanted(
        {"device": getattr(options, "device", "auto"), "tensor_parallel_size": getattr(options, "tensor_parallel_size", 1),
         "expert_parallel_size": getattr(options, "expert_parallel_size", 1)}, switch=None)
    if not wanted:
        yield None
        return
    try:
        from openinfer.backend.cuda.weight_upload import deferred_uploads
    except ImportError:  # no CuPy: nothing to defer
        yield None
        return
    with deferred_uploads() as copies:
        yield copies


# when the engine joins a deferred load's weight copies: "serve" (default since s12 D2, with the driver's early
# context and the GEMM preload: see EARLY_CUDA_ENV) just before it serves: the graph capture and the prefill
# warm-up (whose outputs are thrown away; they read the weights only as garbage) run beside the copies, in a
# relaxed-mode capture that other threads' copies do not disturb; "compile" (as since s9 D2) after the
# kernel compile, before the graphs' warm-up forwards (a restart waited 0.3-0.4 s for the copies there)
WEIGHTS_JOIN_ENV = "OPENINFER_WEIGHTS_JOIN"
WEIGHTS_JOIN_POINTS = ("compile", "serve")
_joining_later = threading.local()  # .held: inside weights_joined_later (the thread building an engine)


def weights_join_point() -> str:
    """``OPENINFER_WEIGHTS_JOIN`` ("serve" when unset); anything else is a clear start-up error."""
    point = os.environ.get(WEIGHTS_JOIN_ENV, "serve").strip().lower() or "serve"
    if point not in WEIGHTS_JOIN_POINTS:
        raise OpenInferError(f"{WEIGHTS_JOIN_ENV}={point!r}: expected one of {', '.join(WEIGHTS_JOIN_POINTS)}")
    return point


@contextlib.contextmanager
def weights_joined_later(later: bool = True) -> Iterator[None]:
    """Within the block (with ``later``; this thread only), ``wait_for_deferred_weights`` returns
    at once: the caller joins the copies after it, before the first forward whose results are kept."""
    if not later:
        yield
        return
    previous = getattr(_joining_later, "held", False)
    _joining_later.held = True
    try:
        yield
    finally:
        _joining_later.held = previous


def wait_for_deferred_weights() -> float:
    """Join the weight copies a deferred load started (none, or inside ``weights_joined_later``:
    returns at once); seconds waited."""
    if getattr(_joining_later, "held", False):
        return 0.0
    upload = sys.modules.get("openinfer.backend.cuda.weight_upload")
    wait = getattr(upload, "wait_for_deferred_uploads", None)
    if wait is None:
        return 0.0
    began = time.perf_counter()
    wait()
    return time.perf_counter() - began


# milliseconds of the GIL's switch interval while the engine core starts (unset: Python's 5 ms throughout).
# While the main thread runs Python (dry forwards, graph capture), a weight-copy or kernel-build thread
# back from a C call waits up to one interval for the GIL, several times a chunk or module. s12 D2, 1 ms,
# one run: served cold start 2.96 vs 2.58 / 2.72 s without, restart 2.73 vs 2.05 / 2.43; opt-in
START_SWITCH_INTERVAL_ENV = "OPENINFER_START_SWITCH_INTERVAL_MS"


@contextlib.contextmanager
def start_switch_interval() -> Iterator[float | None]:
    """Within the block, the GIL switch interval ``OPENINFER_START_SWITCH_INTERVAL_MS`` (yielded in
    seconds; None and unchanged when unset); restored after it."""
    value = os.environ.get(START_SWITCH_INTERVAL_ENV, "").strip()
    if not value:
        yield None
        return
    try:
        seconds = float(value) / 1e3
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 0.1:
        raise OpenInferError(f"{START_SWITCH_INTERVAL_ENV}={value!r}: expected milliseconds in (0, 100]")
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield seconds
    finally:
        sys.setswitchinterval(previous)


GC_FREEZE_ENV = "OPENINFER_GC_FREEZE"


def freeze_startup_heap() -> int:
    """Move every object alive after start-up (modules, the model, graphs, plans: millions of them)
    into the collector's permanent generation, so a full collection during serving walks only what
    serving allocated: without it a gen-2 pass in the middle of a burst stalled one step's launch by
    100-200 ms (the step log shows it). Returns how many objects were frozen (0 when
    ``OPENINFER_GC_FREEZE=0``)."""
    if os.environ.get(GC_FREEZE_ENV, "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_host_memory() -> dict[str, int]:
    """Give back what loading the model left resident and serving never reads again; returns
    ``memory_breakdown()`` before and after (``before_*`` / ``after_*``)."""
    before = memory_breakdown()
    gc.collect()  # checkpoint views and their memory maps: unmapped once unreferenced
    upload = sys.modules.get("openinfer.backend.cuda.weight_upload")
    if upload is not None:
        upload.release_staging()  # the weight uploader's pinned ring
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.cuda.get_current_stream().synchronize()  # staging blocks still being copied stay busy
            # a block goes back to the pool only when an allocation sweeps CuPy's watch list
            sweep = cupy.cuda.alloc_pinned_memory(1)
            del sweep
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        except Exception:  # no usable device: there is no pinned pool to empty
            pass
    _malloc_trim()
    after = memory_breakdown()
    return {**{f"before_{k}": v for k, v in before.items()}, **{f"after_{k}": v for k, v in after.items()}}
