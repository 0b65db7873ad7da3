"""Decode-sized GEMMs: cuBLAS gemmEx's default pick against cuBLASLt's timed pick
(``OPENINFER_GEMM_TUNING=1``), side by side in one run, on Qwen3-4B's projections.

Per (projection, rows M): both paths captured in one CUDA graph each (``CALLS`` launches over
``COPIES`` weight copies, so a replay reads weights from HBM, not L2) and the median replay
time per launch; the chosen candidate's count; the roofline (max of weight+activation bytes at
the measured copy rate and FLOPs at gemmEx's own 8192^3 rate). Per M, a whole decode step's
projections (36 layers x qkv/o/gate_up/down + the LM head) for both paths and their ratio.
``--split-k 2,3,4``: a third path, the timed pick among the heuristic candidates and their split-K
copies (``OPENINFER_GEMM_SPLIT_K``), timed the same way (``split_*`` fields).

    python benchmarks/gpu_gemm_tuning.py                     # M = 16,64,128,192,256
    python benchmarks/gpu_gemm_tuning.py --rows 256 --out /tmp/x [--split-k 2,3,4]
    python benchmarks/gpu_gemm_tuning.py --plot benchmarks/results/gpu_gemm_tuning.json
Writes TAG.json and TAG.png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LAYERS = 36
# Qwen3-4B: (name, out_features N, in_features K, launches per decode step)
PROJECTIONS = (("qkv", 6144, 2560, LAYERS), ("o", 2560, 4096, LAYERS), ("gate_up", 19456, 2560, LAYERS),
               ("down", 2560, 9728, LAYERS), ("lm_head", 151936, 2560, 1))
CALLS = 8  # launches per captured graph
COPIES = 4  # weight copies the launches cycle over (two for the LM head: 0.8 GB each)


def gemm_rate(blas) -> float:
    """gemmEx's bf16 rate (FLOP/s) at 8192^3: the compute ceiling of the roofline."""
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    n = 8192
    a = cupy.zeros((n, n), dtype=cupy.uint16)
    b = cupy.zeros((n, n), dtype=cupy.uint16)
    c = cupy.empty((n, n), dtype=cupy.uint16)
    seconds = gpu_seconds(lambda: blas.matmul_nt(a, b, c), 10, 3)
    return 2 * n**3 / seconds


def copy_rate() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) over 1 GiB."""
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    src = cupy.zeros(1 << 29, dtype=cupy.uint16)
    dst = cupy.empty_like(src)
    seconds = gpu_seconds(lambda: dst.__setitem__(slice(None), src), 10, 3)
    return 2 * src.nbytes / seconds


def time_projection(blas, m: int, n: int, k: int, copies: int) -> float:
    """Seconds per launch of ``blas.matmul_nt`` at (m, n, k), from a graph of CALLS launches."""
    import cupy
    from gpu_decode_attention import graph_seconds_per_call

    rng = cupy.random.default_rng(m * 7 + n)

    def random_bf16(shape: tuple[int, int], scale: float):  # bf16 bits: the top half of float32's
        return ((rng.standard_normal(shape, dtype=cupy.float32) * scale).view(cupy.uint32) >> 16).astype(cupy.uint16)

    x_bits = random_bf16((m, k), 0.5)
    weights = [random_bf16((n, k), 0.02) for _ in range(copies)]
    outs = [cupy.empty((m, n), dtype=cupy.uint16) for _ in range(copies)]
    calls = [lambda i=i: blas.matmul_nt(x_bits, weights[i % copies], outs[i % copies]) for i in range(CALLS)]
    return graph_seconds_per_call(calls)


def measure(rows: list[int], split_k: tuple[int, ...] = ()) -> dict:
    import cupy

    from openinfer.backend.cuda.cublas import Cublas
    from openinfer.backend.cuda.gemm_tuning import LtTunedGemm, TuningCache

    plain = Cublas()
    plain.tuned = None
    tuned = Cublas()
    # in-memory caches: every shape is timed in this run, whatever an earlier one kept on disk
    tuned.tuned = LtTunedGemm.create(tuned.workspace, split_k=(), cache=TuningCache(None))
    if tuned.tuned is None:
        raise SystemExit("cuBLASLt is unavailable: nothing to compare")
    split = None
    if split_k:
        split = Cublas()
        split.tuned = LtTunedGemm.create(split.workspace, split_k=split_k, cache=TuningCache(None))
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    flops_rate, bytes_rate = gemm_rate(plain), copy_rate()
    print(f"{name}: gemmEx 8192^3 {flops_rate / 1e12:.1f} TFLOP/s, copy {bytes_rate / 1e12:.2f} TB/s", flush=True)
    results, steps = [], []
    for m in rows:
        step = {"rows": m, "gemm_ex_ms": 0.0, "tuned_ms": 0.0, "roofline_ms": 0.0, **({"split_ms": 0.0} if split else {})}
        for label, n, k, per_step in PROJECTIONS:
            copies = 2 if n * k > 10**8 else COPIES
            plain_s = time_projection(plain, m, n, k, copies)
            tuned_s = time_projection(tuned, m, n, k, copies)
            chosen = tuned.tuned.shapes.get((m, n, k))
            roofline = max(2 * (n * k + m * k + m * n) / bytes_rate, 2 * m * n * k / flops_rate)
            row = {"projection": label, "rows": m, "n": n, "k": k, "gemm_ex_us": 1e6 * plain_s,
                   "tuned_us": 1e6 * tuned_s, "speedup": plain_s / tuned_s, "roofline_us": 1e6 * roofline,
                   "gemm_ex_roofline_fraction": roofline / plain_s, "tuned_roofline_fraction": roofline / tuned_s,
                   "candidates": chosen.candidates if chosen else 0, "chosen_rank": chosen.chosen if chosen else -1,
                   "first_pick_us_while_tuning": chosen.first_pick_microseconds if chosen else 0.0}
            if split is not None:
                split_s = time_projection(split, m, n, k, copies)
                kept = split.tuned.shapes.get((m, n, k))
                row.update(split_us=1e6 * split_s, split_speedup=plain_s / split_s,
                           split_roofline_fraction=roofline / split_s, split_chosen_rank=kept.chosen if kept else -1,
                           split_count=kept.split_k if kept else 1, split_candidates=kept.candidates if kept else 0)
                step["split_ms"] += 1e3 * per_step * split_s
            print(json.dumps(row), flush=True)
            results.append(row)
            step["gemm_ex_ms"] += 1e3 * per_step * plain_s
            step["tuned_ms"] += 1e3 * per_step * tuned_s
            step["roofline_ms"] += 1e3 * per_step * roofline
        step["speedup"] = step["gemm_ex_ms"] / step["tuned_ms"]
        if split is not None:
            step["split_speedup"] = step["gemm_ex_ms"] / step["split_ms"]
        print(json.dumps(step), flush=True)
        steps.append(step)
    return {"device": name, "split_k": list(split_k), "gemm_ex_flops_per_s": flops_rate, "copy_bytes_per_s": bytes_rate,
            "shape": "Qwen3-4B projections (hidden 2560, intermediate 9728, 32 q / 8 kv heads x 128, vocab 151936)",
            "calls_per_graph": CALLS, "projections": results, "decode_step_projections": steps,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, *_ in PROJECTIONS:
        rows = [r for r in report["projections"] if r["projection"] == label]
        xs = [r["rows"] for r in rows]
        left.plot(xs, [r["gemm_ex_roofline_fraction"] for r in rows], "o--", label=f"{label} gemmEx")
        left.plot(xs, [r["tuned_roofline_fraction"] for r in rows], "s-", label=f"{label} tuned")
        if rows and "split_roofline_fraction" in rows[0]:
            left.plot(xs, [r["split_roofline_fraction"] for r in rows], "^:", label=f"{label} tuned + split-K")
    left.set(xlabel="rows M", ylabel="fraction of roofline", title="per projection")
    left.legend(fontsize=7, ncol=2)
    steps = report["decode_step_projections"]
    xs = [s["rows"] for s in steps]
    right.plot(xs, [s["gemm_ex_ms"] for s in steps], "o--", label="gemmEx")
    right.plot(xs, [s["tuned_ms"] for s in steps], "s-", label="cuBLASLt, timed pick")
    if steps and "split_ms" in steps[0]:
        right.plot(xs, [s["split_ms"] for s in steps], "^-", label="cuBLASLt, timed pick + split-K copies")
    right.plot(xs, [s["roofline_ms"] for s in steps], ":", label="roofline")
    right.set(xlabel="batch (rows M)", ylabel="ms per decode step", title="all projections of one decode step")
    right.legend(fontsize=8)
    fig.suptitle(f"{report['device']}: Qwen3-4B projections, gemmEx vs cuBLASLt timed pick")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,64,128,192,256", help="comma-separated M values (2..256)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for TAG.json / TAG.png")
    parser.add_argument("--tag", default="gpu_gemm_tuning")
    parser.add_argument("--plot", type=Path, help="only draw the PNG of this JSON report")
    parser.add_argument("--split-k", default="", help="split counts timed as a third path (e.g. 2,3,4)")
    args = parser.parse_args(argv)
    if args.plot:
        if not args.plot.is_file():
            parser.error(f"--plot: no such file {args.plot}")
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return 0
    from openinfer.backend.cuda.gemm_tuning import TUNED_MAX_ROWS, split_k_counts

    try:
        split_k = split_k_counts(args.split_k)
    except ValueError as exc:
        parser.error(f"--split-k: {exc}")

    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error("--rows takes comma-separated integers")
    if not rows or min(rows) < 2 or max(rows) > TUNED_MAX_ROWS:
        parser.error(f"--rows must lie in 2..{TUNED_MAX_ROWS} (the tuned path's rows)")
    from openinfer.backend import cuda_available

    if not cuda_available():
        print("needs CuPy and an NVIDIA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).parent))  # gpu_decode_attention's graph timer
    report = measure(rows, split_k)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.tag}.json"
    path.write_text(json.dumps(report, indent=2))
    plot(report, path.with_suffix(".png"))
    print(f"wrote {path} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
