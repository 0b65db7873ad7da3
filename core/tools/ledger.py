"""Kernel ledger and step-time model (GPU): every op of a model's decode and prefill, timed on
the device over a grid of (batch, context), with its kernels, shape, bytes, FLOPs and % of
its roofline; from those, a predicted step time for any (batch, context) next to a measured one.

    python -m openinfer.tools.ledger --model-path DIR [--out ledger.json] [--markdown ledger.md]
    python -m openinfer.tools.ledger --random qwen3-4b --out ...     # that shape, random weights
    python -m openinfer.tools.ledger --model-path DIR --device cpu ... # the NumPy backend (host clock)

``--random`` writes only the preset's config.json and loads it with ``load_format="dummy"``
(random weights at the real shapes: speed does not depend on values). Batches follow the
engine's KV cache groups, so hybrid models (Qwen3.5: full attention in paged blocks, Gated
DeltaNet state in slots) get their group tables and one state slot per sequence.

How an op is timed (cuda): one forward runs with the model's op objects (its backend and, where it has
one, its kernel plan) wrapped, recording each top-level op call with its arguments. The
recorded calls are then replayed in order behind a spin kernel that holds the stream, with an
event between consecutive ops: the host enqueues the whole step before the device starts, so
each event gap is the op's device time in a real step's order (its weights cold in L2, its
inputs warm) and no host launch gaps. Median over ``--repeats`` replays. On the CPU (numpy) an
op's time is its host time, and the ceilings are NumPy's copy rate and fp32 matmul rate.

Model: an op's time per step is interpolated over the grid (piecewise linear in context, then
in log2 batch); a step is the sum of its ops (on the eager path: the larger of the summed
device and host times). The measured step is the graph replay (CUDA-graph models) or the eager
forward, timed with events / host clock.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BLOCK_SIZE = 16
LARGE_ARRAY_BYTES = 1 << 30  # a pool (KV cache, state slots) is never read whole by one op
# backend methods that place data or sample rather than compute a layer
NOT_OPS = frozenset({"upload", "weight", "linear_weight", "prepare_batch", "static_batch", "allocate_kv",
                     "to_host", "synchronize", "kv_memory_budget", "sample_rows", "sample_rows_async",
                     "upload_token_ids", "fill_token_sources", "fp32_vector", "norm_weight", "forward",
                     "release_request", "load", "kv_cache_specs"})

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-4B's shape (benchmarks/gpu_bench.py)
    "qwen3-4b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2560,
                     intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=True),
    # transformers' default Qwen3_5TextConfig (a 9B-class hybrid: 3 Gated DeltaNet layers per full
    # attention); the rest of its config.json is filled from transformers when it is written
    "qwen3.5-default": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text"),
}


def write_preset_config(preset: str, path: Path) -> Path:
    """``path/config.json`` of ``preset`` (served with ``load_format="dummy"``). A preset that
    names only its architecture takes the rest from transformers' default config of that class
    (a test/bench dependency, needed only here)."""
    config = dict(PRESETS[preset])
    if config["model_type"] == "qwen3_5_text" and len(config) == 2:
        import transformers

        config = {**transformers.Qwen3_5TextConfig().to_dict(), **config}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# --- recording -----------------------------------------------------------------------------------


@dataclass
class OpCall:
    owner: str  # "backend" or "plan"
    name: str
    fn: Any  # the unwrapped bound method
    args: tuple
    kwargs: dict
    result: Any
    kernels: list[str] = field(default_factory=list)


class OpRecorder:
    """Wraps the public methods of the model's op objects; records top-level calls while on."""

    def __init__(self, owners: dict[str, Any], model: Any = None, kernel_names: bool = True):
        self.calls: list[OpCall] = []
        self.recording = False
        self._depth = 0
        self._current: OpCall | None = None
        self._patched: list[tuple[Any, str]] = []
        if model is not None:
            self._wrap_model(model)
        for owner_name, owner in owners.items():
            for name in dir(owner):
                if name.startswith("_") or name in NOT_OPS:
                    continue
                if isinstance(getattr(type(owner), name, None), property):
                    continue
                method = getattr(owner, name)
                if callable(method) and hasattr(method, "__self__"):
                    setattr(owner, name, self._wrap(owner_name, name, method))
                    self._patched.append((owner, name))
        if kernel_names:  # cuda: the kernels each op launches
            self._patch_kernel_loaders()

    def _wrap_model(self, model: Any) -> None:
        """A model's own op table: a frozen dataclass of functions (``model.plan``, replaced by a
        copy whose callables are wrapped) and functions it keeps as attributes (``model.rms_norm``)."""
        import dataclasses

        plan = getattr(model, "plan", None)
        if plan is not None and dataclasses.is_dataclass(plan):
            wrapped = {f.name: self._wrap("plan", f.name, getattr(plan, f.name)) for f in dataclasses.fields(plan)
                       if callable(getattr(plan, f.name)) and f.name not in NOT_OPS}
            model.plan = dataclasses.replace(plan, **wrapped)
        for name, value in list(vars(model).items()):
            if name.startswith("_") or name in NOT_OPS or name == "plan" or not callable(value):
                continue
            if hasattr(value, "__self__") or type(value).__name__ == "function":
                setattr(model, name, self._wrap("model", name, value))

    def _wrap(self, owner: str, name: str, method: Any) -> Any:
        @functools.wraps(method)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if not self.recording or self._depth:
                self._depth += 1
                try:
                    return method(*args, **kwargs)
                finally:
                    self._depth -= 1
            call = OpCall(owner, name, method, args, kwargs, None)
            self._current = call
            self._depth += 1
            try:
                call.result = method(*args, **kwargs)
            finally:
                self._depth -= 1
                self._current = None
            self.calls.append(call)
            return call.result
        return recorded

    def _note_kernel(self, name: str) -> None:
        if self._current is not None and (not self._current.kernels or self._current.kernels[-1] != name):
            self._current.kernels.append(name)

    def _patch_kernel_loaders(self) -> None:
        """Kernel names per op: every launch goes through a loader called per launch."""
        from openinfer.backend.cuda import loader
        from openinfer.backend.cuda.cublas import Cublas

        original = loader._kernel

        def named(source: str, name: str, defines: tuple) -> Any:
            self._note_kernel(name)
            return original(source, name, defines)

        loader._kernel = named
        original_arch = loader._arch_kernel  # architecture-specific builds (the sm90 prefill attention)

        def named_arch(source: str, name: str, arch: str, defines: tuple, shared_bytes: int) -> Any:
            self._note_kernel(f"{name} ({arch})")
            return original_arch(source, name, arch, defines, shared_bytes)

        loader._arch_kernel = named_arch
        matmul = Cublas.matmul_nt

        def cublas(blas: Any, *args: Any, **kwargs: Any) -> Any:
            self._note_kernel("cublas_gemmEx_bf16")
            return matmul(blas, *args, **kwargs)

        Cublas.matmul_nt = cublas
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("openinfer_") and module_name.endswith("cuda_ops") and hasattr(module, "kernel"):
                plugin_kernel = module.kernel

                def plugin_named(name: str, *args: Any, _original: Any = plugin_kernel, **kwargs: Any) -> Any:
                    self._note_kernel(name)
                    return _original(name, *args, **kwargs)

                module.kernel = plugin_named

    def record(self, forward: Any) -> list[OpCall]:
        self.calls = []
        self.recording = True
        try:
            forward()
        finally:
            self.recording = False
        return self.calls


# --- costs ---------------------------------------------------------------------------------------


@functools.cache
def _array_types() -> tuple[type, ...]:
    """The array classes an op's arguments may hold: NumPy's, and CuPy's where it is installed."""
    try:
        import cupy
    except ImportError:
        return (np.ndarray,)
    return (np.ndarray, cupy.ndarray)


def _arrays(value: Any) -> list[Any]:
    if isinstance(value, _array_types()):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _arrays(v)]
    if hasattr(value, "__dataclass_fields__"):
        return [a for name in value.__dataclass_fields__ for a in _arrays(getattr(value, name))]
    return []


def _linear_weight(layer: Any) -> tuple[int, int, int]:
    """(out features, in features, weight bytes) of a backend's linear layer (cuda: ``weight
    [out, in]``; numpy: ``weight_t [in, out]``)."""
    weight = getattr(layer, "weight", None)
    if weight is not None:
        return int(weight.shape[0]), int(weight.shape[1]), int(weight.nbytes)
    return int(layer.out_features), int(layer.in_features), int(layer.weight_t.nbytes)


def _shape(value: Any) -> str:
    if isinstance(value, _array_types()):
        return "x".join(map(str, value.shape))
    if hasattr(value, "weight") and isinstance(value.weight, _array_types()):
        return "W" + "x".join(map(str, value.weight.shape))
    if hasattr(value, "weight_t") and isinstance(value.weight_t, _array_types()):
        return f"W{value.out_features}x{value.in_features}"
    return ""


def op_cost(call: OpCall, host: Any) -> tuple[float, float]:
    """(bytes moved at least, FLOPs) of one op call; ``host`` is the step's ForwardBatch."""
    if call.name in ("linear", "add_rms_norm_linear", "silu_mul_linear"):  # the fused ones end in a linear
        x, layer = call.args[0], call.args[-1]
        m = x.shape[0]
        n, k, weight_bytes = _linear_weight(layer)
        extra = 0 if call.name == "linear" else (m * k if call.name == "silu_mul_linear" else 2 * m * k)
        return float(x.itemsize * (m * k + m * n + extra) + weight_bytes), 2.0 * m * n * k
    if call.name == "attention":
        qkv, spec = call.args[0], call.args[1]
        tokens = qkv.shape[0]
        kv_token = 2 * spec.num_kv_heads * spec.head_dim * 2  # K and V, bf16
        context = host.context_lens.astype(np.float64)
        query = np.diff(host.query_start).astype(np.float64)
        # each query attends to its causal prefix: sum over queries of (context - query + i + 1)
        pairs = float(np.sum(query * (context - query) + query * (query + 1) / 2))
        flops = 4.0 * spec.num_heads * spec.head_dim * pairs
        io = qkv.nbytes + tokens * spec.num_heads * spec.head_dim * 2 + tokens * kv_token
        return io + float(context.sum()) * kv_token, flops
    if call.name == "delta_net" and len(call.args) >= 4:  # (proj, weights, conv_state, ssm_state, seqs, config)
        proj, conv, ssm = call.args[0], call.args[2], call.args[3]
        per_seq = conv.nbytes / max(1, conv.shape[0]) + ssm.nbytes / max(1, ssm.shape[0])
        # the step's projections in, the core out, each sequence's state read and written
        return float(proj.nbytes + sum(a.nbytes for a in _arrays(call.result)) + 2 * per_seq * host.num_seqs), 0.0
    moved = sum(a.nbytes for a in _arrays((call.args, call.kwargs)) if a.nbytes < LARGE_ARRAY_BYTES)
    moved += sum(a.nbytes for a in _arrays(call.result))
    return float(moved), 0.0


def op_key(call: OpCall) -> str:
    shapes = [s for s in (_shape(a) for a in call.args) if s.startswith("W")]
    return f"{call.name}({shapes[0]})" if shapes else call.name


# --- timing --------------------------------------------------------------------------------------

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


# --- batches -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepLayout:
    """What a step's batch carries for a model: token ids below ``vocab_size``, a flag per KV cache
    group (paged: block table and write slots; else a state group with neither) and whether
    sequences own state slots."""

    vocab_size: int = 1000
    paged_groups: tuple[bool, ...] = (True,)
    with_state: bool = False

    @classmethod
    def of(cls, engine: Any) -> StepLayout:
        groups = engine.kv_groups
        return cls(int(engine.model.spec.vocab_size), tuple(bool(g.paged) for g in groups.groups),
                   bool(groups.has_state))

    def token_ids(self, count: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, min(1000, self.vocab_size), count).astype(np.int32)


def _batch(token_ids: np.ndarray, positions: np.ndarray, query_start: np.ndarray, context_lens: np.ndarray,
           tables: np.ndarray, logits_rows: np.ndarray, layout: StepLayout) -> Any:
    """A ForwardBatch over ``tables`` (every paged group gets the same block ids: each group's
    pool has that many blocks) with state slots 1..B when the model keeps state."""
    from openinfer.backend.base import ForwardBatch

    seq_of_token = np.repeat(np.arange(len(context_lens)), np.diff(query_start))
    slots = (tables[seq_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).astype(np.int32)
    num_seqs, num_tokens = len(context_lens), len(token_ids)
    group_tables = tuple(tables if paged else np.zeros((num_seqs, 0), np.int32) for paged in layout.paged_groups)
    group_slots = tuple(slots if paged else np.full(num_tokens, -1, np.int32) for paged in layout.paged_groups)
    several = len(layout.paged_groups) > 1
    return ForwardBatch(
        token_ids=token_ids, positions=positions, query_start=query_start, context_lens=context_lens,
        block_tables=tables, slot_mapping=slots, logits_rows=logits_rows,
        max_query_len=int(np.diff(query_start).max()), max_context_len=int(context_lens.max()),
        request_ids=tuple(f"ledger-{i}" for i in range(num_seqs)),
        kv_block_tables=group_tables if several else (), kv_slot_mappings=group_slots if several else (),
        state_slots=np.arange(1, num_seqs + 1, dtype=np.int32) if layout.with_state else np.zeros(0, np.int32))


def decode_batch(num_seqs: int, context: int, layout: StepLayout = StepLayout()) -> Any:
    """One new token per sequence at position ``context - 1``, each sequence its own blocks."""
    blocks = -(-context // BLOCK_SIZE)
    tables = (1 + np.arange(num_seqs * blocks, dtype=np.int32)).reshape(num_seqs, blocks)
    return _batch(layout.token_ids(num_seqs, num_seqs),
                  np.full(num_seqs, context - 1, np.int32), np.arange(num_seqs + 1, dtype=np.int32),
                  np.full(num_seqs, context, np.int32), tables, np.arange(num_seqs, dtype=np.int32), layout)


def prefill_batch(tokens: int, layout: StepLayout = StepLayout()) -> Any:
    """One sequence's whole prompt of ``tokens`` (its state, if any, starts fresh)."""
    blocks = -(-tokens // BLOCK_SIZE)
    return _batch(layout.token_ids(tokens, tokens),
                  np.arange(tokens, dtype=np.int32), np.array([0, tokens], np.int32), np.array([tokens], np.int32),
                  np.arange(1, blocks + 1, dtype=np.int32)[None, :], np.array([tokens - 1], np.int32), layout)


# --- the ledger ----------------------------------------------------------------------------------


class Ledger:
    def __init__(self, engine: Any, timer: Timer | HostTimer, peak: dict[str, float], repeats: int):
        self.engine = engine
        self.model = engine.model
        self.backend = self.model.backend
        self.timer = timer
        self.peak = peak
        self.repeats = repeats
        self.layout = StepLayout.of(engine)
        self.recorder = OpRecorder({"backend": self.backend}, self.model, kernel_names=self.backend.name == "cuda")
        self.graphs = getattr(engine.runner, "graphs", {})

    def decode(self, num_seqs: int, context: int) -> Any:
        if self.layout.with_state and num_seqs >= self.engine.kv_plan.num_state_slots:
            raise ValueError(f"batch {num_seqs} needs more state slots than the engine has "
                             f"({self.engine.kv_plan.num_state_slots}, slot 0 the null slot)")
        return decode_batch(num_seqs, context, self.layout)

    def prefill(self, tokens: int) -> Any:
        return prefill_batch(tokens, self.layout)

    def _forward(self, host: Any) -> Any:
        device = self.backend.prepare_batch(host)
        return lambda: self.model.forward(device, self.engine.kv_cache)

    def measure(self, phase: str, host: Any) -> dict[str, Any]:
        forward = self._forward(host)
        forward()  # warm-up: compiles kernels
        calls = self.recorder.record(forward)
        timed = self.timer.ops(calls, self.repeats, forward)
        device_s, host_s = timed["device_s"], timed["host_s"]
        rows: dict[str, dict[str, Any]] = {}
        for call, dev, hst in zip(calls, device_s, host_s, strict=True):
            key = op_key(call)
            moved, flops = op_cost(call, host)
            row = rows.setdefault(key, {"op": key, "kernels": [], "shape": " ".join(
                s for s in (_shape(a) for a in call.args) if s), "calls": 0, "time_s": 0.0, "host_s": 0.0,
                "bytes": 0.0, "flops": 0.0})
            for kernel_name in call.kernels:
                if kernel_name not in row["kernels"]:
                    row["kernels"].append(kernel_name)
            row["calls"] += 1
            row["time_s"] += dev
            row["host_s"] += hst
            row["bytes"] += moved
            row["flops"] += flops
        for row in rows.values():
            if not row["calls"] or row["op"].startswith("(host"):
                row.update(roofline_s=0.0, roofline_pct=None, bound="host")
                continue
            roofline = max(row["bytes"] / self.peak["copy_bytes_per_s"], row["flops"] / self.peak["bf16_flops_per_s"])
            row["roofline_s"] = roofline
            row["roofline_pct"] = 100.0 * roofline / row["time_s"] if row["time_s"] > 0 else None
            row["bound"] = "memory" if row["bytes"] / self.peak["copy_bytes_per_s"] >= \
                row["flops"] / self.peak["bf16_flops_per_s"] else "compute"
        # the model's Python between ops: host time only (it matters on the eager path)
        between = max(0.0, timed["forward_host_s"] - sum(host_s))
        rows["(host: model code between ops)"] = {
            "op": "(host: model code between ops)", "kernels": [], "shape": "", "calls": 1, "time_s": 0.0,
            "host_s": between, "bytes": 0.0, "flops": 0.0}
        measured = self.measure_step(host, forward)
        result = {"phase": phase, "batch": host.num_seqs, "context": int(host.max_context_len),
                  "tokens": int(host.num_tokens), "ops": sorted(rows.values(), key=lambda r: -r["time_s"]),
                  "sum_device_s": float(sum(device_s)), "sum_host_s": float(sum(host_s)),
                  "forward_host_s": timed["forward_host_s"], "event_cost_s": timed["event_cost_s"], **measured}
        return result

    def measure_step(self, host: Any, forward: Any) -> dict[str, Any]:
        bucket = self.engine.runner.bucket_for(host) if self.graphs else None
        if bucket is not None:
            captured = self.graphs[bucket]
            captured.static.fill(host)
            return {"measured_s": self.timer.gpu(captured.graph.launch, max(10, self.repeats)),
                    "measured_how": f"CUDA graph replay (bucket {bucket}), events"}
        repeats = max(3, self.repeats // 2)
        how = "eager forward, host clock to stream sync" if self.backend.name == "cuda" else "forward, host clock"
        return {"measured_s": self.timer.wall(forward, repeats), "measured_how": how}


# --- the model -----------------------------------------------------------------------------------


def _interpolate(xs: list[float], ys: list[float], x: float, degree: int = 1) -> float:
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
                dev_at.append(max(0.0, _interpolate(contexts, [per_batch[b][c][0] for c in contexts], context,
                                                    self.degree)))
                host_at.append(max(0.0, _interpolate(contexts, [per_batch[b][c][1] for c in contexts], context,
                                                     self.degree)))
            logs = [math.log2(b) for b in batches]
            device += max(0.0, _interpolate(logs, dev_at, math.log2(batch)))
            host += max(0.0, _interpolate(logs, host_at, math.log2(batch)))
        return max(device, host) if self.eager else device - self.graph_saving_s


# --- report --------------------------------------------------------------------------------------


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


# what an op is, by its name (the op key up to its weight shape); first match wins
OP_KINDS = (
    ("projections (GEMM)", ("linear", "add_rms_norm_linear", "silu_mul_linear")),
    ("attention (q/k norm, RoPE, KV write, attention)", ("attention", "mla_attention")),
    ("Gated DeltaNet", ("delta_net",)),
    ("norms", ("rms_norm", "add_rms_norm")),
    ("activations", ("silu_mul", "sigmoid_mul", "gelu_mul")),
    ("embedding, gathers, adds", ("embedding", "gather_rows", "add")),
)


def op_kind(op: str) -> str:
    name = op.split("(")[0]
    return next((kind for kind, names in OP_KINDS if name in names), "other")


def breakdown(entry: dict[str, Any]) -> dict[str, float]:
    """Device seconds of one step by kind of op (largest first); host-only rows left out."""
    kinds: dict[str, float] = defaultdict(float)
    for row in entry["ops"]:
        if not row["op"].startswith("(host"):
            kinds[op_kind(row["op"])] += row["time_s"]
    return dict(sorted(kinds.items(), key=lambda item: -item[1]))


def markdown(report: dict[str, Any]) -> str:
    copy_name, gemm_name = report.get("ceiling_names", ("copy", "cuBLAS bf16"))
    lines = [f"# Kernel ledger: {report['name']}", "",
             f"Device: {report['device']}; ceilings measured in the same run: {copy_name} "
             f"{report['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, {gemm_name} "
             f"{report['ceilings']['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s. Written by `{report['command']}`.",
             "Per op and step: time = device time summed over the op's calls in one step (layers), "
             "% roofline = max(bytes / copy rate, FLOPs / GEMM rate) / time.", "",
             "## Step-time model: predicted vs measured", "",
             f"Decode: {report['model']['decode']}"
             + (f" ({report['model']['decode_graph_saving_s'] * 1e3:.3f} ms)." if report["cuda_graphs"] else ".")
             + f" Prefill: {report['model']['prefill']}. Check points off the grid are true predictions.", "",
             "| phase | batch | context | predicted ms | measured ms | error | grid point? | measured how |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for check in report["checks"]:
        lines.append(f"| {check['phase']} | {check['batch']} | {check['context']} | {check['predicted_s'] * 1e3:.3f} | "
                     f"{check['measured_s'] * 1e3:.3f} | {100 * check['error']:+.1f} % | "
                     f"{'yes' if check['on_grid'] else 'no'} | {check['measured_how']} |")
    for entry in report["entries"]:
        kinds = ", ".join(f"{kind} {seconds * 1e3:.3f} ms ({100 * seconds / max(entry['sum_device_s'], 1e-12):.0f} %)"
                          for kind, seconds in breakdown(entry).items())
        lines += ["", f"## {entry['phase']}: batch {entry['batch']}, context {entry['context']} "
                      f"(measured step {entry['measured_s'] * 1e3:.3f} ms, ops sum {entry['sum_device_s'] * 1e3:.3f} ms)", "",
                  f"By kind: {kinds}.", "",
                  "| op | kernels | shape | calls | ms | GB | GFLOP | % roofline | bound |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for row in entry["ops"]:
            pct = f"{row['roofline_pct']:.0f}" if row.get("roofline_pct") is not None else ""
            if row["op"].startswith("(host"):
                row = {**row, "time_s": row["host_s"], "bound": "host time, not on the device"}
            lines.append(f"| {row['op']} | {', '.join(row['kernels'])} | {row['shape']} | {row['calls']} | "
                         f"{row['time_s'] * 1e3:.3f} | {row['bytes'] / 1e9:.3f} | {row['flops'] / 1e9:.1f} | {pct} | {row['bound']} |")
    return "\n".join(lines) + "\n"


def _grid(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openinfer.tools.ledger", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path", help="checkpoint directory")
    source.add_argument("--random", choices=sorted(PRESETS),
                        help="this shape with random weights (its config.json only, load_format dummy)")
    source.add_argument("--from-json", help="no GPU: re-derive the step-time model and tables from a ledger JSON")
    parser.add_argument("--checkpoint-dir", default="/tmp/openinfer-ledger", help="where --random writes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the NumPy backend, timed on the host clock")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                        help="dummy: random weights at the checkpoint's shapes (default with --random)")
    parser.add_argument("--batches", type=_grid, default=[1, 4, 16, 64, 128, 256])
    parser.add_argument("--contexts", type=_grid, default=[128, 1024, 2048])
    parser.add_argument("--prefill", type=_grid, default=[512, 2048, 8192], help="prefill lengths (one sequence)")
    parser.add_argument("--check", default="1:512,64:512,256:512,48:1536",
                        help="decode batch:context points to predict and measure")
    parser.add_argument("--check-prefill", type=_grid, default=[4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", help="model name in the report")
    parser.add_argument("--out", help="ledger JSON (default with --from-json: that file)")
    parser.add_argument("--markdown", help="ledger table (default: --out with .md)")
    args = parser.parse_args(argv)
    if args.from_json:
        try:
            report = json.loads(Path(args.from_json).read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"cannot read the ledger {args.from_json!r}: {exc}")
        report.setdefault("name", report.pop("model", None) if isinstance(report.get("model"), str) else None)
        write_report(report, Path(args.out or args.from_json), args.markdown)
        return 0
    if not args.out:
        parser.error("--out is required")
    try:
        checks = [tuple(int(v) for v in point.split(":")) for point in args.check.split(",") if point]
        if any(len(c) != 2 or min(c) < 1 for c in checks):
            raise ValueError
    except ValueError:
        parser.error(f"--check takes batch:context pairs, got {args.check!r}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.device == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError:
            print("the ledger times kernels on an NVIDIA GPU: CuPy is not installed (--device cpu: the NumPy "
                  "backend)", file=sys.stderr)
            return 2

    from openinfer import create_engine

    path = Path(args.model_path) if args.model_path else Path(args.checkpoint_dir) / args.random
    if args.random:
        write_preset_config(args.random, path)
    elif not (path / "config.json").is_file():
        parser.error(f"no config.json in --model-path {args.model_path!r}")
    load_format = args.load_format or ("dummy" if args.random else "auto")
    max_batch = max([*args.batches, *(b for b, _ in checks)])
    max_context = max([*args.contexts, *(c for _, c in checks), *args.prefill, *args.check_prefill])
    decode_tokens = max(b * c for b in [*args.batches, *(b for b, _ in checks)]
                        for c in [*args.contexts, *(c for _, c in checks)])
    num_blocks = max(decode_tokens, max_context) // BLOCK_SIZE + max_batch + 2
    engine = create_engine(str(path), device=args.device, max_num_seqs=max_batch,
                           max_model_len=max_context + BLOCK_SIZE, num_kv_blocks=num_blocks,
                           enable_prefix_cache=False, load_format=load_format)
    partial = Path(args.out).with_suffix(".partial.json")
    try:
        timer = Timer() if args.device == "cuda" else HostTimer()
        peak = ceilings(timer)
        print(f"ceilings: {timer.peak_names[0]} {peak['copy_bytes_per_s'] / 1e9:.0f} GB/s, {timer.peak_names[1]} "
              f"{peak['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
        ledger = Ledger(engine, timer, peak, args.repeats)
        backend = engine.model.backend
        report = {"name": args.name or path.name, "model_path": str(path),
                  "device": getattr(backend, "device_name", f"CPU ({backend.name} backend)"),
                  "command": "python -m openinfer.tools.ledger " + " ".join(sys.argv[1:] if argv is None else argv),
                  "ceilings": peak, "ceiling_names": list(timer.peak_names), "cuda_graphs": bool(ledger.graphs),
                  "checks": [], "entries": []}
        grid = {(b, c) for b in args.batches for c in args.contexts}
        for batch in args.batches:
            for context in args.contexts:
                entry = ledger.measure("decode", ledger.decode(batch, context))
                report["entries"].append(entry)
                print(f"decode b={batch} c={context}: ops {entry['sum_device_s'] * 1e3:.3f} ms, "
                      f"measured {entry['measured_s'] * 1e3:.3f} ms", flush=True)
                write_partial(report, partial)
        for tokens in args.prefill:
            entry = ledger.measure("prefill", ledger.prefill(tokens))
            report["entries"].append(entry)
            print(f"prefill {tokens}: ops {entry['sum_device_s'] * 1e3:.2f} ms, measured {entry['measured_s'] * 1e3:.2f} ms",
                  flush=True)
            write_partial(report, partial)
        for batch, context in checks:
            entry = ledger.measure("decode", ledger.decode(batch, context))
            report["checks"].append({"phase": "decode", "batch": batch, "context": context,
                                     "measured_s": entry["measured_s"], "measured_how": entry["measured_how"],
                                     "on_grid": (batch, context) in grid})
            write_partial(report, partial)
        for tokens in args.check_prefill:
            entry = ledger.measure("prefill", ledger.prefill(tokens))
            report["checks"].append({"phase": "prefill", "batch": 1, "context": tokens,
                                     "measured_s": entry["measured_s"], "measured_how": entry["measured_how"],
                                     "on_grid": tokens in args.prefill})
    finally:
        engine.close_sync()
    write_report(report, Path(args.out), args.markdown)
    partial.unlink(missing_ok=True)
    return 0


def write_partial(report: dict[str, Any], path: Path) -> None:
    """The entries so far (a device run cut short still leaves its measurements)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def write_report(report: dict[str, Any], out: Path, markdown_path: str | None) -> None:
    predict_checks(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    Path(markdown_path or out.with_suffix(".md")).write_text(markdown(report))
    print("\n phase    batch context  predicted_ms  measured_ms  error")
    for r in report["checks"]:
        print(f" {r['phase']:8s} {r['batch']:5d} {r['context']:7d} {r['predicted_s'] * 1e3:13.3f} "
              f"{r['measured_s'] * 1e3:12.3f} {100 * r['error']:+6.1f} %")


if __name__ == "__main__":
    raise SystemExit(main())
