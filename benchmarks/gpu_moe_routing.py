"""GPU: a decode step's MoE routing alone (router logits, top-k, grouping), path by path, in CUDA graphs.

    python benchmarks/gpu_moe_routing.py --shapes kimi,moonlight --tokens 1,4,16,64 --out routing.json

Each path (``PATHS``: environment switches of core/backend/cuda/moe_routing.py and what it runs) is captured
``--reps`` times back to back into one graph on one stream, so a call's time is its kernels' device time plus
the graph's launch gaps, as on a decode step's critical path (no host in between). The graph is replayed
``--replays`` times, timed by events; the JSON holds µs per call (median over ``--rounds``) and, per path, whether
its ids / weights / grouping equal the "split" path's (moe_route + moe_sort_parallel: ids and weights exactly,
each expert's slots as a set). Shapes: Kimi-K2 (384 experts x 7168, top-8, sigmoid + correction bias, the shared
expert apart) and Moonlight (64 x 2048, top-6, sigmoid + bias, 2 shared experts fused into the routing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "kimi": {"hidden": 7168, "experts": 384, "top_k": 8, "shared": 0, "scaling": 2.827},
    "moonlight": {"hidden": 2048, "experts": 64, "top_k": 6, "shared": 2, "scaling": 2.446},
}
# path -> (environment switches, what runs)
PATHS = {
    "split": ({"OPENINFER_MOE_ROUTE_SORT": "0", "OPENINFER_MOE_ROUTE_DECODE": "0"},
              "moe_router_logits + moe_route + moe_sort_parallel"),
    "route_sort": ({"OPENINFER_MOE_ROUTE_SORT": "1", "OPENINFER_MOE_ROUTE_DECODE": "0"},
                   "moe_router_logits + moe_route_sort (block)"),
    "route_decode": ({"OPENINFER_MOE_ROUTE_SORT": "1", "OPENINFER_MOE_ROUTE_DECODE": "1"},
                     "moe_route_decode: one launch, logits by warps + the last block's top-k and grouping"),
    "route_decode_w4": ({"OPENINFER_MOE_ROUTE_SORT": "1", "OPENINFER_MOE_ROUTE_DECODE": "1",
                         "OPENINFER_MOE_ROUTE_DECODE_WARPS": "4"}, "moe_route_decode, blocks of 4 warps"),
    "route_decode_w8": ({"OPENINFER_MOE_ROUTE_SORT": "1", "OPENINFER_MOE_ROUTE_DECODE": "1",
                         "OPENINFER_MOE_ROUTE_DECODE_WARPS": "8"}, "moe_route_decode, blocks of 8 warps"),
    "logits": ({}, "moe_router_logits alone"),
}
SWITCHES = sorted({env for switches, _ in PATHS.values() for env in switches})


def build(shape: dict, tokens: int, rng):
    import cupy

    from openinfer.backend.cuda import moe
    from openinfer.moe import RouterSpec

    def bf16(*dims, scale=1.0):
        bits = (scale * rng.standard_normal(dims)).astype(np.float32).view(np.uint32)
        return cupy.asarray(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16))

    spec = RouterSpec(shape["experts"], shape["top_k"], "sigmoid", routed_scaling_factor=shape["scaling"])
    layer = moe.DeviceMoE(spec, bf16(shape["experts"], shape["hidden"], scale=0.02),
                          cupy.asarray((0.05 * rng.standard_normal(shape["experts"])).astype(np.float32)),
                          None, None, shared_experts=shape["shared"])
    return layer, bf16(tokens, shape["hidden"])


def path_call(path: str, x, layer):
    """The path's launches for ``x`` (its switches set by the caller); returns what it made."""
    from openinfer.backend.cuda import moe_routing as routing

    if path.startswith("logits"):
        return lambda: routing.router_logits(x, layer.gate, layer.router)

    def call():
        grouping = (routing.route_and_group(x, layer) if routing.route_sort_wanted(
            int(x.shape[0]), layer.router, None, layer.shared_experts) else None)
        if grouping is None:
            ids, weights = routing.route(x, layer.gate, layer.router, layer.correction_bias,
                                         shared_experts=layer.shared_experts)
            grouping = routing.group_by_expert(ids, weights, layer.router.num_experts + layer.shared_experts)
        return grouping
    return call


def same_grouping(a, b) -> bool:
    """ids and weights exactly; offsets, tiles; each expert's segment of sorted_slots as a set; slot_pos its inverse."""
    if not (np.array_equal(a.ids.get(), b.ids.get()) and np.array_equal(a.weights.get(), b.weights.get())
            and np.array_equal(a.offsets.get(), b.offsets.get())):
        return False
    tiles = int(a.num_tiles.get()[0])
    if tiles != int(b.num_tiles.get()[0]) or not (
            np.array_equal(a.tile_expert.get()[:tiles], b.tile_expert.get()[:tiles])
            and np.array_equal(a.tile_row.get()[:tiles], b.tile_row.get()[:tiles])):
        return False
    offsets, slots, pos = a.offsets.get(), a.sorted_slots.get(), a.slot_pos.get()
    other = b.sorted_slots.get()
    return bool(np.array_equal(slots[pos], np.arange(slots.size)) and all(
        np.array_equal(np.sort(slots[offsets[e]:offsets[e + 1]]), np.sort(other[offsets[e]:offsets[e + 1]]))
        for e in range(offsets.size - 1)))


def time_graph(call, reps: int, replays: int, rounds: int) -> float:
    """µs per call: ``reps`` calls captured into one graph, replayed, event-timed; median over rounds."""
    import cupy

    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(pool.malloc), stream:
        call()
        stream.synchronize()
        stream.begin_capture()
        try:
            for _ in range(reps):
                call()
        finally:
            graph = stream.end_capture()
        for _ in range(3):
            graph.launch(stream)
        stream.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(rounds):
            start.record(stream)
            for _ in range(replays):
                graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / (replays * reps))
    return float(np.median(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="kimi,moonlight")
    parser.add_argument("--tokens", default="1,4,16,64")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="", help="JSON path (default: $OUT/moe_routing.json where $OUT is set)")
    args = parser.parse_args()
    import cupy

    shapes, paths = args.shapes.split(","), args.paths.split(",")
    if set(shapes) - set(SHAPES) or set(paths) - set(PATHS):
        raise SystemExit(f"--shapes from {', '.join(SHAPES)}; --paths from {', '.join(PATHS)}")
    rng = np.random.default_rng(0)
    report = {"benchmark": "moe_routing_decode", "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "paths": {p: PATHS[p][1] for p in paths}, "points": [],
              "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    for shape_name in shapes:
        for tokens in (int(t) for t in args.tokens.split(",")):
            layer, x = build(SHAPES[shape_name], tokens, rng)
            point = {"shape": shape_name, "tokens": tokens, "us": {}, "same_as_split": {}, "errors": {}}
            reference = None
            for path in ["split"] + [p for p in paths if p != "split"]:
                for env in SWITCHES:
                    os.environ.pop(env, None)
                os.environ.update(PATHS[path][0])
                try:
                    call = path_call(path, x, layer)
                    made = call()
                    cupy.cuda.Device().synchronize()
                    if path == "split":
                        reference = made
                    elif not path.startswith("logits"):
                        point["same_as_split"][path] = same_grouping(made, reference)
                    if path in paths:
                        point["us"][path] = time_graph(call, args.reps, args.replays, args.rounds)
                except Exception as exc:  # noqa: BLE001 - one path failing leaves the others' numbers
                    point["errors"][path] = f"{type(exc).__name__}: {exc}"[:300]
            for env in SWITCHES:
                os.environ.pop(env, None)
            print(json.dumps(point), flush=True)
            report["points"].append(point)
    text = json.dumps(report, indent=1)
    target = args.out or (str(Path(os.environ["OUT"]) / "moe_routing.json") if os.environ.get("OUT") else "")
    if target:
        Path(target).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
