"""Moonlight's routed experts at decode sizes against the bytes roofline, and the routing at prefill sizes
(issue 13), JSON + PNG into benchmarks/results/ (and $OUT).

``experts``: the bf16 routed experts of one Moonlight-16B-A3B layer (64 experts of 1408, top-6, hidden
2048) at 16 / 64 / 256 tokens, gate_up (SiLU·mul fused) and down timed apart and together, each by
moe_sm90.cu tile shape (``moe_sm90.SM90_SHAPES``), as CUDA-graph replays over 16 routings and two
weight copies (2.2 GB: past the L2, as in a model step). The roofline is the active experts' weight
bytes over the copy bandwidth (read + write of a 2 GiB buffer) and over a read-only stream's.

    python benchmarks/gpu_moe_grouped.py experts [--tokens 16,64,256] [--shapes base,skip,m64]

``routing``: router logits, top-k, grouping and combine at prefill sizes (1k / 4k / 8k tokens) by
kernel (``ROUTING_VARIANTS``), eager device time.

    python benchmarks/gpu_moe_grouped.py routing [--tokens 1024,8192]

``norms``: the per-layer add_rms_norm and combine + norm (apart / fused) kernels at decode sizes, graph replays
(``run_norms``).

    python benchmarks/gpu_moe_grouped.py norms [--tokens 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from gpu_kimi import (  # noqa: E402
    copy_bandwidth,
    device_name,
    device_random_bf16,
    graph_call_seconds,
    switched_env,
)

SHAPE = {"experts": 64, "top_k": 6, "hidden": 2048, "inter": 1408}
EXPERT_TOKENS = "16,64,256"
ROUTING_TOKENS = "1024,4096,8192"
ROUTINGS = 16  # routings (graph calls) per timed graph
# routing parts timed as graph replays (device time only: eagerly, small kernels of big steps time the host's
# launch path; E1 timed 4096 / 8192 tokens eagerly)
COPIES = 2  # weight copies: 2 x 1.1 GB, far past the 50 MB L2

READ_KERNEL = r"""
extern "C" __global__ void read_stream(const uint4* __restrict__ src, long long n, unsigned* __restrict__ sink) {
    unsigned acc = 0u;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;  // keeps the loads; practically never stores
}
"""


def read_bandwidth() -> float:
    """Bytes/s of a read-only stream over a 2 GiB buffer (16-byte loads, 4 blocks of 512 per SM)."""
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    src = cupy.ones(2**30, dtype=cupy.uint16)
    sink = cupy.zeros(1, cupy.uint32)
    fn = cupy.RawKernel(READ_KERNEL, "read_stream")
    blocks = 4 * cupy.cuda.Device().attributes["MultiProcessorCount"]
    n = src.nbytes // 16
    seconds = gpu_seconds(lambda: fn((blocks,), (512,), (src, np.int64(n), sink)), repeats=10, warmup=2)
    return src.nbytes / seconds


def run_experts(args) -> dict:
    import cupy

    from openinfer.backend.cuda import CudaBackend, moe_routing, moe_sm90
    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda.loader import compile_kernels, discover_kernels
    from openinfer.backend.cuda.moe import ExpertLinear

    backend = CudaBackend()
    rng = np.random.default_rng(0)
    shapes, pdl_shapes = args.shapes.split(","), set(args.pdl_shapes.split(",")) - {""}
    unknown = (set(shapes) | pdl_shapes) - set(moe_sm90.SM90_SHAPES)
    if unknown:
        raise SystemExit(f"--shapes: unknown {sorted(unknown)}; choose from {', '.join(moe_sm90.SM90_SHAPES)}")
    c = SHAPE
    copy_bw, read_bw = copy_bandwidth(), read_bandwidth()
    gate_ups = [ExpertLinear("bf16", device_random_bf16((c["experts"], 2 * c["inter"], c["hidden"])), None,
                             2 * c["inter"], c["hidden"]) for _ in range(COPIES)]
    downs = [ExpertLinear("bf16", device_random_bf16((c["experts"], c["hidden"], c["inter"])), None,
                          c["hidden"], c["inter"]) for _ in range(COPIES)]
    expert_bytes = {"gate_up": 2 * 2 * c["inter"] * c["hidden"], "down": 2 * c["hidden"] * c["inter"]}
    expert_bytes["both"] = expert_bytes["pdl"] = expert_bytes["gate_up"] + expert_bytes["down"]
    expert_bytes["chosen"] = expert_bytes["both"]
    report = {"benchmark": "moe_grouped_experts", "device": device_name(), "copy_bandwidth_gbs": copy_bw / 1e9,
              "read_bandwidth_gbs": read_bw / 1e9, "shape": c,
              "shapes": {name: vars(moe_sm90.SM90_SHAPES[name]) for name in shapes}, "pdl_shapes": sorted(pdl_shapes),
              "points": []}
    print(f"copy {copy_bw / 1e9:.0f} GB/s, read {read_bw / 1e9:.0f} GB/s", flush=True)

    def pdl_both(x, gate_up, down, grouping, shape: str):
        with switched_env({moe_sm90.SM90_PDL_ENV: "1"}):
            activated = moe_sm90.grouped_gemm_sm90(x, gate_up, grouping, True, fuse_silu=True, shape=shape)
            return moe_sm90.grouped_gemm_sm90(activated, down, grouping, False, shape=shape, overlap_previous=True)

    for tokens in [int(t) for t in args.tokens.split(",")]:
        groupings, active = [], []
        for _ in range(ROUTINGS):
            ids = np.stack([rng.choice(c["experts"], c["top_k"], replace=False) for _ in range(tokens)])
            groupings.append(moe_routing.group_by_expert(cupy.asarray(ids.astype(np.int32)),
                                                      cupy.ones(ids.shape, cupy.float32), c["experts"]))
            active.append(np.unique(ids).size)
        x = backend.upload(rng.standard_normal((tokens, c["hidden"])).astype(np.float32) * 0.5)
        activated = moe_sm90.grouped_gemm_sm90(x, gate_ups[0], groupings[0], True, fuse_silu=True, shape="base")
        point = {"tokens": tokens, "slots_per_expert": tokens * c["top_k"] / c["experts"],
                 "active_experts_mean": float(np.mean(active))}
        reference = {}
        for shape in shapes:
            projections = {
                "gate_up": lambda w, d, g, shape=shape, x=x: moe_sm90.grouped_gemm_sm90(
                    x, w, g, True, fuse_silu=True, shape=shape),
                "down": lambda w, d, g, shape=shape, a=activated: moe_sm90.grouped_gemm_sm90(a, d, g, False, shape=shape),
                "both": lambda w, d, g, shape=shape, x=x: moe_sm90.grouped_gemm_sm90(
                    moe_sm90.grouped_gemm_sm90(x, w, g, True, fuse_silu=True, shape=shape), d, g, False, shape=shape),
            }
            if shape == shapes[0]:  # what ships at this size (decode GEMV below SM90_ABOVE_ROWS_PER_EXPERT)
                projections["chosen"] = lambda w, d, g, x=x: cuda_moe.routed_experts(backend, x, w, d, g)
            if shape in pdl_shapes:  # down launched to overlap gate_up's last wave (OPENINFER_MOE_SM90_PDL)
                projections["pdl"] = lambda w, d, g, shape=shape, x=x: pdl_both(x, w, d, g, shape)
            if not point.get("compiled"):  # every build of this point's shapes at once, in parallel NVRTC threads
                with discover_kernels() as found:
                    for name in shapes:
                        moe_sm90.grouped_gemm_sm90(x, gate_ups[0], groupings[0], True, fuse_silu=True, shape=name)
                        moe_sm90.grouped_gemm_sm90(activated, downs[0], groupings[0], False, shape=name)
                        if name in pdl_shapes:
                            pdl_both(x, gate_ups[0], downs[0], groupings[0], name)
                started = time.perf_counter()
                built = compile_kernels(found, cupy.cuda.Device().id, threads=16)
                print(f"compiled {built} modules in {time.perf_counter() - started:.1f} s", flush=True)
                point["compiled"] = True
            for projection, run in projections.items():
                calls = [partial(run, gate_ups[i % COPIES], downs[i % COPIES], g) for i, g in enumerate(groupings)]
                out = backend.to_host(calls[0]())
                reference.setdefault("both" if projection in ("pdl", "chosen") else projection, out)
                seconds, error = graph_call_seconds(calls)
                key = f"{shape}_{projection}"
                if error:
                    point[f"{key}_graph_error"] = error
                nbytes = point["active_experts_mean"] * expert_bytes[projection]
                point[f"{key}_us"] = 1e6 * seconds
                point[f"{key}_fraction_of_copy"] = nbytes / seconds / copy_bw
                point[f"{key}_fraction_of_read"] = nbytes / seconds / read_bw
                point[f"{key}_bit_equal_base"] = bool(np.array_equal(
                    out, reference["both" if projection in ("pdl", "chosen") else projection]))
        point.pop("compiled", None)
        for shape in shapes:
            point[f"{shape}_speedup_vs_{shapes[0]}"] = point[f"{shapes[0]}_both_us"] / point[f"{shape}_both_us"]
            if shape in pdl_shapes:
                point[f"{shape}_pdl_speedup"] = point[f"{shape}_both_us"] / point[f"{shape}_pdl_us"]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in point.items()}), flush=True)
        report["points"].append(point)
    return report


# routing parts at prefill sizes: name -> what runs
ROUTING_VARIANTS = {
    "route_default": "router logits + scores and top-k as core chooses them (route())",
    "logits_warps": "moe_router_logits (a warp per token and expert): the default below 1024 tokens",
    "logits_mma": "moe_router_logits_mma (64 x 64 tiles, 4 stages): the default from 1024 tokens",
    "logits_mma_s8": "moe_router_logits_mma with 8 stages in flight",
    "select_narrow": "moe_route in blocks of a thread per expert on the logits: the default from 1024 tokens",
    "select_wide": "moe_route in 256-thread blocks on the logits: the default below 1024 tokens",
    "group_default": "group_by_expert as core chooses (moe_sort_parallel below 4096 slots, then the blocks)",
    "group_blocks": "moe_expert_counts + moe_place_slots: the default from 4096 slots",
    "group_single_block": "moe_sort_parallel",
    "combine": "moe_combine (a block per 256 columns of a token)",
    "combine_vec": "moe_combine_vec8 (8 columns per thread, 16-byte loads; OPENINFER_MOE_COMBINE_VEC=1)",
}


def run_routing(args) -> dict:
    import cupy

    from openinfer.backend.cuda import CudaBackend, moe_routing
    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.moe import RouterSpec

    backend = CudaBackend()
    rng = np.random.default_rng(1)
    c = SHAPE
    router = RouterSpec(c["experts"], c["top_k"], "sigmoid", norm_topk_prob=True, routed_scaling_factor=2.446)
    gate = device_random_bf16((c["experts"], c["hidden"]))
    bias = cupy.asarray((0.01 * rng.standard_normal(c["experts"])).astype(np.float32))
    report = {"benchmark": "moe_routing", "device": device_name(), "shape": c, "variants": ROUTING_VARIANTS,
              "points": []}

    def logits_with(stages: int, x):
        before, moe_routing.ROUTER_STAGES = moe_routing.ROUTER_STAGES, stages
        try:
            return moe_routing.router_logits(x, gate, router, mma=True)
        finally:
            moe_routing.ROUTER_STAGES = before

    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = backend.upload(rng.standard_normal((tokens, c["hidden"])).astype(np.float32))
        logits = moe_routing.router_logits(x, gate, router, mma=True)
        ids, weights = moe_routing.select_experts(x, gate, router, bias, logits, narrow=True)
        x = cupy.ascontiguousarray(x)
        grouping = moe_routing.group_by_expert(ids, weights, c["experts"])
        y = device_random_bf16((tokens * c["top_k"], c["hidden"]))
        calls = {
            "route_default": partial(moe_routing.route, x, gate, router, bias),
            "logits_warps": partial(moe_routing.router_logits, x, gate, router, mma=False),
            "logits_mma": partial(logits_with, 4, x),
            "logits_mma_s8": partial(logits_with, 8, x),
            "select_narrow": partial(moe_routing.select_experts, x, gate, router, bias, logits, narrow=True),
            "select_wide": partial(moe_routing.select_experts, x, gate, router, bias, logits, narrow=False),
            "group_default": partial(moe_routing.group_by_expert, ids, weights, c["experts"]),
            "group_blocks": partial(moe_routing.group_by_expert, ids, weights, c["experts"], method="blocks"),
            "group_single_block": partial(moe_routing.group_by_expert, ids, weights, c["experts"],
                                          per_expert_blocks=False),
            "combine": partial(cuda_moe.combine, y, grouping, None, c["hidden"], vectorized=False),
            "combine_vec": partial(cuda_moe.combine, y, grouping, None, c["hidden"], vectorized=True),
        }
        point = {"tokens": tokens}
        reference_logits = logits.get()
        point["logits_mma_s8_equal"] = bool(np.array_equal(logits_with(8, x).get(), reference_logits))
        point["combine_vec_equal"] = bool(np.array_equal(
            cuda_moe.combine(y, grouping, None, c["hidden"], vectorized=True).get(),
            cuda_moe.combine(y, grouping, None, c["hidden"], vectorized=False).get()))
        for name, call in calls.items():
            seconds, error = graph_call_seconds([call] * 8)
            point[f"{name}_us"] = 1e6 * seconds
            if error:
                point[f"{name}_graph_error"] = error
        point["routing_default_us"] = point["route_default_us"] + point["group_default_us"] + point["combine_us"]
        point["routing_best_us"] = (point["route_default_us"]
                                    + min(point["group_default_us"], point["group_blocks_us"],
                                          point["group_single_block_us"])
                                    + min(point["combine_us"], point["combine_vec_us"]))
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in point.items()}), flush=True)
        report["points"].append(point)
    return report


NORM_TOKENS = "1,16,64"
NORM_CALLS = 26  # one Moonlight decode step's MoE layers


def run_norms(args) -> dict:
    """The small per-layer kernels after the experts, Moonlight widths (hidden 2048, top-6 + 2 fused shared experts),
    as CUDA-graph replays of NORM_CALLS calls (device time per call): add_rms_norm's block kernel alone, and
    moe_combine + add_rms_norm against the fused moe_combine_add_rms_norm (their bits compared)."""
    rng = np.random.default_rng(2)
    report = {"benchmark": "moe_norms", "device": device_name(), "hidden": SHAPE["hidden"],
              "top_k_with_shared": SHAPE["top_k"] + 2, "calls_per_graph": NORM_CALLS, "points": []}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        point = _norm_point(tokens, rng)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in point.items()}), flush=True)
        report["points"].append(point)
    return report


def _norm_point(tokens: int, rng: np.random.Generator) -> dict:
    import cupy

    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda import moe_routing
    from openinfer.backend.cuda.backend import _norm_threads
    from openinfer.backend.cuda.loader import kernel

    hidden, experts, top_k, eps = SHAPE["hidden"], SHAPE["experts"] + 2, SHAPE["top_k"] + 2, 1e-6
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.asarray(
        rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)), experts)
    y = device_random_bf16((tokens * top_k, hidden))
    x, residual, weight = (device_random_bf16(shape) for shape in ((tokens, hidden), (tokens, hidden), (hidden,)))
    threads = _norm_threads(hidden)

    def add_norm(combine: bool):
        source = cuda_moe.combine(y, grouping, None, hidden, vectorized=False) if combine else x
        out, residual_out = cupy.empty_like(x), cupy.empty_like(x)
        kernel("rms_norm.cu", "add_rms_norm")((tokens,), (threads,), (
            source, residual, weight, out, residual_out, np.int32(hidden), np.float32(eps)))
        return out

    calls = {
        "add_rms_norm": partial(add_norm, False),
        "combine_then_add_rms_norm": partial(add_norm, True),
        "combine_add_rms_norm_fused": lambda: cuda_moe.combine_add_rms_norm(y, grouping, None, residual, weight,
                                                                            eps)[0],
    }
    point = {"tokens": tokens}
    outputs = {name: call().get() for name, call in calls.items()}
    point["combine_fused_bit_equal"] = bool(np.array_equal(outputs["combine_then_add_rms_norm"],
                                                           outputs["combine_add_rms_norm_fused"]))
    for name, call in calls.items():
        seconds, error = graph_call_seconds([call] * NORM_CALLS)
        point[f"{name}_us"] = 1e6 * seconds
        if error:
            point[f"{name}_graph_error"] = error
    return point


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    colors = plt.get_cmap("tab20").colors
    if report["benchmark"] == "moe_grouped_experts":
        names = [f"{shape}_{run}" for shape in report["shapes"] for run in ("both", "pdl")
                 if run == "both" or shape in report["pdl_shapes"]]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar(np.arange(len(points)) + i * width, [100 * p[f"{name}_fraction_of_copy"] for p in points],
                   width, label=name.replace("_both", "").replace("_pdl", " + PDL"), color=colors[i % len(colors)])
        ax.axhline(80, color="k", lw=0.8, ls="--", label="80 % of copy bandwidth")
        ax.axhline(90, color="k", lw=0.8, ls=":", label="90 %")
        lowest = min(100 * p[f"{name}_fraction_of_copy"] for p in points for name in names)
        ax.set_ylim(max(0.0, min(60.0, lowest - 5)), 100)
        ax.set_xticks(np.arange(len(points)) + 0.4 - width / 2,
                      [f"{p['tokens']} tokens\n{p['slots_per_expert']:.1f} / expert" for p in points])
        ax.set_ylabel("% of copy bandwidth (gate_up + down)")
        ax.set_title(f"Moonlight routed experts by moe_sm90 tile shape ({report['device']})")
    elif report["benchmark"] == "moe_norms":
        names = [key[:-3] for key in points[0] if key.endswith("_us")]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar(np.arange(len(points)) + i * width, [p[f"{name}_us"] for p in points], width, label=name,
                   color=colors[i % len(colors)])
        ax.set_xticks(np.arange(len(points)) + 0.4 - width / 2, [f"{p['tokens']} tokens" for p in points])
        ax.set_ylabel("us per call (graph replay)")
        ax.set_title(f"Moonlight per-layer norm / combine kernels ({report['device']})")
    else:
        names = list(report["variants"])
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar(np.arange(len(points)) + i * width, [p[f"{name}_us"] for p in points], width, label=name,
                   color=colors[i % len(colors)])
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(points)) + 0.4 - width / 2, [f"{p['tokens']} tokens" for p in points])
        ax.set_ylabel("us per layer")
        ax.set_title(f"Moonlight routing parts by kernel ({report['device']})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from openinfer.backend.cuda import moe_sm90

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    experts = sub.add_parser("experts", help="routed experts by moe_sm90 tile shape at decode sizes")
    experts.add_argument("--tokens", default=EXPERT_TOKENS, help="comma list of token counts")
    experts.add_argument("--shapes", default=",".join(moe_sm90.SM90_SHAPES),
                         help="comma list of moe_sm90.SM90_SHAPES (the first the reference)")
    experts.add_argument("--pdl-shapes", default="base,sk",
                         help="shapes also timed with down overlapping gate_up (OPENINFER_MOE_SM90_PDL)")
    experts.add_argument("--name", default="moe_grouped_experts", help="results file name (JSON + PNG)")
    routing = sub.add_parser("routing", help="routing parts at prefill sizes by kernel")
    routing.add_argument("--tokens", default=ROUTING_TOKENS, help="comma list of token counts")
    routing.add_argument("--name", default="moe_routing", help="results file name (JSON + PNG)")
    norms = sub.add_parser("norms", help="add_rms_norm / combine kernels of a decode step, graph replays")
    norms.add_argument("--tokens", default=NORM_TOKENS, help="comma list of token counts")
    norms.add_argument("--name", default="moe_norms", help="results file name (JSON + PNG)")
    args = parser.parse_args()
    report = {"experts": run_experts, "routing": run_routing, "norms": run_norms}[args.command](args)
    report["time"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    if out is not None:  # the measurements leave first: a failing plot must not lose them
        shutil.copy(RESULTS / f"{args.name}.json", out / f"{args.name}.json")
    plot(report, RESULTS / f"{args.name}.png")
    if out is not None:
        shutil.copy(RESULTS / f"{args.name}.png", out / f"{args.name}.png")


if __name__ == "__main__":
    main()
