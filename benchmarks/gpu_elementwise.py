"""GPU benchmark: the memory-bound kernels around the GEMMs at Qwen3-4B's widths, each variant side
by side in one run, from a decode row to a 16k-token prefill (M = 1 .. 16384 rows).

  ceiling       device copy bandwidth (bytes read + written, 2 GiB buffers);
  rms_norm      [M, 2560] -> [M, 2560]                block kernel | rows (OPENINFER_ROW_NORMS)
  add_rms_norm  [M, 2560] x 2 -> [M, 2560] x 2        block kernel | rows
  silu_mul      [M, 19456] -> [M, 9728]               vec8 | rows (OPENINFER_SILU_MUL_ROWS)
  write_qkv     [M, 6144] -> q [M, 32, 128] + K/V pages (8 heads, block 16), q/k RMSNorm + NeoX RoPE:
                qk_norm_rope_write_kv (a warp per head) | qk_norm_rope_write_kv_vec (16-byte
                accesses, the default) with 1 | 2 | 4 tokens per thread, cos / sin loaded
                after the norm | with the row (-prefetch)

Time per call: a CUDA graph of 8 calls, each over its own buffers (so a shape that fits in L2 is
not read back from it), replayed; bytes = activations read + written once (norm weights, cos/sin
and slot tables left out), and their fraction of the copy bandwidth. ``--device cpu`` is a dry
run of the same ops on the NumPy backend at tiny sizes (host clock; it checks the script).
Writes benchmarks/results/gpu_elementwise.json and .png (and copies under $OUT when set).

    python benchmarks/gpu_elementwise.py [--rows 1,64,256,1024,8192,16384]
    python benchmarks/gpu_elementwise.py --device cpu
    python benchmarks/gpu_elementwise.py --plot benchmarks/results/gpu_elementwise.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from openinfer.backend.base import AttentionSpec, ForwardBatch, KVLayer
from openinfer.rope import RopeParameters, RotaryEmbedding

RESULTS = Path(__file__).parent / "results"
HIDDEN, INTERMEDIATE = 2560, 9728  # Qwen3-4B
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
ROWS = (1, 64, 256, 1024, 8192, 16384)
CPU_ROWS = (1, 64)
CALLS_PER_GRAPH = 8
BF16 = 2  # bytes


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def op_bytes(op: str, rows: int) -> int:
    """Activation bytes one call reads and writes (each once)."""
    qkv_width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    return BF16 * rows * {"rms_norm": 2 * HIDDEN, "add_rms_norm": 4 * HIDDEN, "silu_mul": 3 * INTERMEDIATE,
                          "write_qkv": 2 * qkv_width}[op]


def random_activation(backend: Any, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    """Standard normal values in the backend's activation format (drawn on the device for cuda:
    the 16k-row inputs are gigabytes)."""
    if backend.name != "cuda":
        return backend.upload(rng.standard_normal(shape).astype(np.float32))
    import cupy

    values = cupy.random.standard_normal(shape, dtype=cupy.float32)
    return (values.view(cupy.uint32) >> 16).astype(cupy.uint16)  # bf16 bits (truncated)


def numpy_write_qkv(backend: Any, qkv: np.ndarray, spec: AttentionSpec, kv: KVLayer, batch: ForwardBatch) -> Any:
    """The NumPy backend's q/k norm, RoPE and KV write (its attention's first half)."""
    rows = qkv.shape[0]
    q = qkv[:, : spec.q_size].reshape(rows, spec.num_heads, spec.head_dim)
    k = qkv[:, spec.q_size : spec.q_size + spec.kv_size].reshape(rows, spec.num_kv_heads, spec.head_dim)
    v = qkv[:, spec.q_size + spec.kv_size :].reshape(rows, spec.num_kv_heads, spec.head_dim)
    q = backend.apply_rope(backend.rms_norm(q, spec.q_norm, spec.norm_eps), batch.positions, spec)
    k = backend.apply_rope(backend.rms_norm(k, spec.k_norm, spec.norm_eps), batch.positions, spec)
    backend.write_kv(k, v, kv, batch.slot_mapping)
    return q


class Workload:
    """One op at one M on one backend: CALLS_PER_GRAPH calls over their own inputs, per variant."""

    def __init__(self, backend: Any, op: str, rows: int, rng: np.random.Generator):
        self.backend, self.op, self.rows = backend, op, rows

        def upload(*shape: int) -> Any:
            return random_activation(backend, shape, rng)
        weight = backend.weight((1 + 0.3 * rng.standard_normal(HIDDEN)).astype(np.float32))
        calls = range(CALLS_PER_GRAPH)
        if op == "rms_norm":
            inputs = [upload(rows, HIDDEN) for _ in calls]
            self.call = lambda i: backend.rms_norm(inputs[i], weight, 1e-6)
        elif op == "add_rms_norm":
            pairs = [(upload(rows, HIDDEN), upload(rows, HIDDEN)) for _ in calls]
            self.call = lambda i: backend.add_rms_norm(*pairs[i], weight, 1e-6)
        elif op == "silu_mul":
            inputs = [upload(rows, 2 * INTERMEDIATE) for _ in calls]
            self.call = lambda i: backend.silu_mul(inputs[i])
        else:
            self._qkv(upload, rng)

    def _qkv(self, upload: Callable[..., Any], rng: np.random.Generator) -> None:
        backend, rows = self.backend, self.rows
        rope = RotaryEmbedding.create(HEAD_DIM, RopeParameters(theta=1e6), rows + 1)
        norms = [backend.weight((1 + 0.3 * rng.standard_normal(HEAD_DIM)).astype(np.float32)) for _ in range(2)]
        self.spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, rope, HEAD_DIM**-0.5, norms[0], norms[1], 1e-6)
        num_blocks = -(-rows // BLOCK_SIZE)
        table = (1 + np.arange(num_blocks, dtype=np.int32))[None]
        self.batch = backend.prepare_batch(ForwardBatch.over_blocks(table, [0], [rows], BLOCK_SIZE))
        cache_shape = (num_blocks + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.kv = [KVLayer(backend.xp.zeros(cache_shape, backend.activation_dtype),
                           backend.xp.zeros(cache_shape, backend.activation_dtype)) for _ in range(CALLS_PER_GRAPH)]
        self.qkv = [upload(rows, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM) for _ in range(CALLS_PER_GRAPH)]

    def variants(self) -> dict[str, Callable[[int], Any]]:
        """Variant name -> call(i); switches are set inside each call, so a graph holds one variant."""
        backend = self.backend
        if self.op in ("rms_norm", "add_rms_norm"):
            if backend.name != "cuda":
                return {"numpy": self.call}

            def with_row_norms(on: bool) -> Callable[[int], Any]:
                def call(i: int) -> Any:
                    backend.row_norms = on
                    return self.call(i)
                return call
            return {"block": with_row_norms(False), "rows": with_row_norms(True)}
        if self.op == "silu_mul":
            if backend.name != "cuda":
                return {"numpy": self.call}

            def with_silu_rows(on: bool) -> Callable[[int], Any]:
                def call(i: int) -> Any:
                    backend.silu_mul_rows = on
                    return self.call(i)
                return call
            return {"vec8": with_silu_rows(False), "rows": with_silu_rows(True)}
        if backend.name != "cuda":
            return {"numpy": lambda i: numpy_write_qkv(backend, self.qkv[i], self.spec, self.kv[i], self.batch)}
        from openinfer.backend.cuda.attention import write_qkv
        from openinfer.backend.cuda.qkv_write import set_vector_qkv_write, write_qkv_vectorized

        def warp(i: int) -> Any:
            set_vector_qkv_write(False)
            try:
                return write_qkv(self.qkv[i], self.spec, self.kv[i], self.batch, backend.ropes)
            finally:
                set_vector_qkv_write(None)

        def vectorized(tokens_per_thread: int, prefetch_rope: bool, scalar_rope: bool = False) -> Callable[[int], Any]:
            return lambda i: write_qkv_vectorized(self.qkv[i], self.spec, self.kv[i], self.batch, backend.ropes,
                                                  tokens_per_thread, prefetch_rope, scalar_rope)
        variants = {"warp": warp}
        for tokens in (1, 2, 4):
            for prefetch in (False, True):
                name = "vec" + (f"-{tokens}tok" if tokens > 1 else "") + ("-prefetch" if prefetch else "")
                variants[name] = vectorized(tokens, prefetch)
        variants["vec-scalar-rope"] = vectorized(1, False, True)  # 32 registers (vec: 40-48)
        return variants


def time_cuda(calls: list[Callable[[], Any]]) -> float:
    """Seconds per call: one CUDA graph of ``calls`` on a private pool, median replay / len(calls)
    (the decode-attention benchmark's timer)."""
    from gpu_decode_attention import graph_seconds_per_call

    return graph_seconds_per_call(calls)


def time_host(calls: list[Callable[[], Any]], repeats: int = 3) -> float:
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call()
    return (time.perf_counter() - start) / (repeats * len(calls))


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a 2 GiB device copy (a 64 MiB NumPy copy on the CPU)."""
    if device == "cpu":
        src = np.random.default_rng(0).random(2**23)
        dst = np.empty_like(src)
        return 2 * src.nbytes / time_host([lambda: np.copyto(dst, src)])
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    src = cupy.random.random(2**29, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    seconds = gpu_seconds(lambda: dst.__setitem__(Ellipsis, src), 20, 3)
    return 2 * src.nbytes / seconds


def run(device: str, rows_grid: tuple[int, ...], ops: tuple[str, ...], save: Callable[[dict], None]) -> dict:
    """Every op at every M, each variant; ``save(report)`` after each (op, M), so a run cut short
    keeps what it measured."""
    if device == "cuda":
        import cupy

        from openinfer.backend.cuda import CudaBackend

        backend: Any = CudaBackend()
        name, timer = backend.device_name, time_cuda
    else:
        from openinfer.backend.numpy_backend import NumpyBackend

        backend, name, timer = NumpyBackend(), "cpu (NumPy backend)", time_host
    bandwidth = copy_bandwidth(device)
    log(f"{name}: copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    report: dict = {"device": name, "copy_bandwidth_bytes_per_s": bandwidth, "calls_per_graph": CALLS_PER_GRAPH,
                    "shape": "Qwen3-4B (hidden 2560, intermediate 9728, 32 q / 8 kv heads x 128)", "results": []}
    rng = np.random.default_rng(0)
    for op in ops:
        for rows in rows_grid:
            work = Workload(backend, op, rows, rng)
            nbytes = op_bytes(op, rows)
            timings = {}
            for variant, call in work.variants().items():
                seconds = timer([lambda i=i, call=call: call(i) for i in range(CALLS_PER_GRAPH)])
                timings[variant] = seconds
                report["results"].append({"op": op, "rows": rows, "variant": variant, "us": seconds * 1e6,
                                          "bytes": nbytes, "copy_fraction": nbytes / seconds / bandwidth})
            log(f"{op:13s} M={rows:6d}: " + "  ".join(
                f"{v} {s * 1e6:9.1f} us ({100 * nbytes / s / bandwidth:5.1f} %)" for v, s in timings.items()))
            save(report)
            del work
            if device == "cuda":
                cupy.get_default_memory_pool().free_all_blocks()
    if backend.name == "cuda":
        backend.row_norms = backend.silu_mul_rows = None  # back to auto
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in report["results"]))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.4 * len(ops), 4.0), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        rows = [r for r in report["results"] if r["op"] == op]
        for variant in dict.fromkeys(r["variant"] for r in rows):
            sub = [r for r in rows if r["variant"] == variant]
            ax.plot([r["rows"] for r in sub], [100 * r["copy_fraction"] for r in sub], "o-", label=variant)
        ax.axhline(85, color="k", lw=0.8, ls=":", label="85 %")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (M)")
        ax.set_ylabel("% of copy bandwidth")
        ax.set_title(op)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['device']}: Qwen3-4B widths, copy {report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run on the NumPy backend at M = 1 and 64")
    parser.add_argument("--rows", help="comma-separated M values (default 1,64,256,1024,8192,16384)")
    parser.add_argument("--ops", default="rms_norm,add_rms_norm,silu_mul,write_qkv",
                        help="comma-separated subset of rms_norm,add_rms_norm,silu_mul,write_qkv")
    parser.add_argument("--plot", type=Path, help="only draw the PNG of this JSON report")
    args = parser.parse_args(argv)
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return 0
    ops = tuple(args.ops.split(","))
    if not set(ops) <= {"rms_norm", "add_rms_norm", "silu_mul", "write_qkv"}:
        parser.error(f"--ops: unknown op in {args.ops!r}")
    try:
        rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else (
            CPU_ROWS if args.device == "cpu" else ROWS)
    except ValueError:
        parser.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if any(r < 1 for r in rows):
        parser.error("--rows: every M must be >= 1")
    stem = "gpu_elementwise" + ("_cpu_dry_run" if args.device == "cpu" else "")
    outs = [RESULTS] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])

    def save(report: dict) -> None:
        for out in outs:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    report = run(args.device, rows, ops, save)
    try:
        for out in outs:
            plot(report, out / f"{stem}.png")
    except ImportError:
        log("matplotlib missing: JSON only (draw it later with --plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
