"""A burst of N streams through the real scheduler, on an H100 step-cost model (CPU only).

Where does a burst of 256 streams (1k-token prompts, 128 tokens out) spend its time, and what
would another scheduling policy or token budget change? This drives openinfer's own
``Scheduler`` and ``KVCacheManager`` step by step, with a simulated clock: each planned step
costs what the model below says an H100 takes for it, and every sampled token is stamped with
that step's end. Per configuration (``--policies`` × ``--budgets``): the burst's duration, output
tok/s, TTFT and e2e TPOT percentiles, the steps by kind and the device time they took.

The step-cost model, Qwen3-4B shape, from measurements in benchmarks/results/ (H100 80GB HBM3):

* linear layers and the rest of a layer that scales with tokens: ``max(floor, per_token × T)``.
  ``per_token`` from the measured single-prompt prefill TTFTs (``gpu_prefill_attention.json``
  ``after_auto``: 4096 and 16384 tokens) minus their prefill attention time; ``floor`` (the
  weight read of a small batch) from the bs=1 decode step (side by side: TPOT 3.9 ms e2e);
* decode attention (graph-replayed decode steps): per layer ``a + b × Σ context`` fitted to
  ``gpu_decode_attention.json``'s mma kernel (batches 1–256, contexts 512–4096);
* prefill attention (prompt chunks and every row of a mixed step — the kernel gives a decode row
  its own 128-query tile; with ``--mixed-decode-attention``, as OPENINFER_MIXED_DECODE_ATTENTION=1,
  a mixed step's leading decode rows cost decode attention instead): per layer, ``heads × Σ_tiles keys × ns_per_tile_key``, from the sm90
  kernel's "8 prompts of 2048" case (``gpu_prefill_attention.json``);
* logits + sampling: ``lm_head read + rows × per_row``.

The model is a model: the e2e gap between it and a measured run is what neither the GPU nor the
scheduler explains (host, frontends, the client). ``--check`` prints it against
``side_by_side.json``'s 256-stream run.

    python benchmarks/burst_model.py                       # policies mixed,split × budgets 4k..32k
    python benchmarks/burst_model.py --streams 64,256 --policies mixed --budgets 8192
Writes benchmarks/results/burst_model.json and .png.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from openinfer.backend.cuda.attention_routing import MIXED_MIN_DECODE_ROWS
from openinfer.kv import BlockPool, KVCacheManager
from openinfer.sampling import SamplingState
from openinfer.sched import Request, Scheduler
from openinfer.v1 import engine_pb2 as pb

RESULTS = Path(__file__).resolve().parent / "results"
PREFILL_TILE = 128  # queries per tile of the prefill attention kernel
GRAPH_MAX_BATCH = 256  # the largest captured decode bucket


@dataclass
class StepCostModel:
    """Device time of one engine step (ms) for a Qwen3-4B-shaped model on one GPU."""

    layers: int = 36
    heads: int = 32
    linear_floor_ms: float = 3.4
    linear_us_per_token: float = 13.5
    decode_attention_us: float = 5.0  # per layer: fixed part
    decode_attention_ns_per_context_token: float = 1.33  # per layer, per (sequence, context token)
    prefill_ns_per_tile_key: float = 0.168  # per layer, per (head, 128-query tile, key)
    lm_head_ms: float = 0.3  # reading the output embedding once per step
    sample_us_per_row: float = 4.0
    eager_floor_ms: float = 4.0  # an eager step's kernel launches (the host queues ~600 kernels)
    # a one-query tile of the prefill kernel (a decode row of a mixed step) against a full tile of
    # the same keys: 1 = the same work (the kernel computes all 128 rows); a sensitivity knob
    single_query_tile_factor: float = 1.0
    # OPENINFER_MIXED_DECODE_ATTENTION: a mixed step's leading 1-token rows on the decode kernel
    mixed_decode_attention: bool = False

    @classmethod
    def from_results(cls, results: Path = RESULTS) -> StepCostModel:
        """Fit the coefficients to the H100 measurements kept in ``results``."""
        model = cls()
        decode = json.loads((results / "gpu_decode_attention.json").read_text())
        rows = [r for r in decode["attention"] if not r["ragged"]]
        kv_tokens = np.asarray([r["batch_size"] * r["context"] for r in rows], float)
        us = np.asarray([r["mma"]["us"] for r in rows], float)
        slope, intercept = np.polyfit(kv_tokens, us, 1)
        model.decode_attention_us = float(intercept)
        model.decode_attention_ns_per_context_token = float(1e3 * slope)
        prefill = json.loads((results / "gpu_prefill_attention.json").read_text())
        cases = {c["case"]: c for c in prefill["attention"]}
        batched = cases["8 prompts of 2048"]
        tiles = 2048 // PREFILL_TILE
        tile_keys = 8 * sum(min(2048, (i + 1) * PREFILL_TILE) for i in range(tiles)) * model.heads
        model.prefill_ns_per_tile_key = float(1e6 * batched["sm90_ms"] / tile_keys)
        per_token = []
        for entry in prefill["model"]["after_auto"]:
            case = cases.get(f"prompt {entry['tokens']}")
            if entry["tokens"] < 4096 or case is None:
                continue  # a 1k prompt does not fill the GPU: the slope comes from the long ones
            attention_ms = model.layers * case["sm90_ms"]  # measured, same kernel, same prompt
            per_token.append(1e3 * (entry["ttft_ms"] - attention_ms - model.lm_head_ms) / entry["tokens"])
        model.linear_us_per_token = float(np.mean(per_token))
        return model

    def prefill_attention_ms(self, chunks: list[tuple[int, int]]) -> float:
        """One layer of the prefill kernel over ``(start, num_tokens)`` chunks (causal)."""
        tile_keys = 0.0
        for start, count in chunks:
            if count == 1:
                tile_keys += self.single_query_tile_factor * (start + 1)
                continue
            for first in range(0, count, PREFILL_TILE):
                last = min(count, first + PREFILL_TILE)
                tile_keys += start + last  # keys the tile's last query sees
        return 1e-6 * self.prefill_ns_per_tile_key * self.heads * tile_keys

    def decode_attention_ms(self, contexts: list[int]) -> float:
        return 1e-3 * self.decode_attention_us + 1e-6 * self.decode_attention_ns_per_context_token * sum(contexts)

    def step_ms(self, chunks: list[tuple[int, int, bool]]) -> tuple[float, bool]:
        """``chunks``: (start, num_tokens, samples) per sequence. Returns (device ms, graph)."""
        tokens = sum(n for _, n, _ in chunks)
        rows = sum(1 for _, _, s in chunks if s)
        linear = max(self.linear_floor_ms, 1e-3 * self.linear_us_per_token * tokens)
        sampling = self.lm_head_ms + 1e-3 * self.sample_us_per_row * rows
        graphed = all(n == 1 for _, n, _ in chunks) and len(chunks) <= GRAPH_MAX_BATCH
        if graphed:
            attention = self.decode_attention_ms([s + 1 for s, _, _ in chunks])
            return linear + self.layers * attention + sampling, True
        decodes = next((i for i, (_, n, _) in enumerate(chunks) if n != 1), len(chunks))
        if not self.mixed_decode_attention or decodes < MIXED_MIN_DECODE_ROWS:
            decodes = 0
        attention = self.prefill_attention_ms([(s, n) for s, n, _ in chunks[decodes:]])
        if decodes:
            attention += self.decode_attention_ms([s + 1 for s, _, _ in chunks[:decodes]])
        return max(self.eager_floor_ms, linear + self.layers * attention + sampling), False


def _request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id=request_id, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                   stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens,
                   sampling=SamplingState(pb.SamplingParams(), np.random.default_rng(0), np.asarray(prompt)))


def through_client(token_times: dict[str, list[float]], us_per_chunk: float) -> dict[str, list[float]]:
    """When each token reaches a client that handles one SSE chunk at a time, ``us_per_chunk``
    each, in arrival order (one process; a chunk per token, as when the server keeps up)."""
    events = sorted((t, rid, i) for rid, times in token_times.items() for i, t in enumerate(times))
    seen = {rid: [0.0] * len(times) for rid, times in token_times.items()}
    free = 0.0
    for t, rid, i in events:
        free = max(free, t) + 1e-6 * us_per_chunk
        seen[rid][i] = free
    return seen


def simulate(model: StepCostModel, *, streams: int, input_len: int, output_len: int, budget: int,
             policy: str, max_num_seqs: int = 256, block_size: int = 16, arrival_s: float = 0.0,
             client_us_per_chunk: float = 0.0) -> dict:
    """One burst: ``streams`` requests arriving evenly over ``arrival_s`` seconds; with
    ``client_us_per_chunk``, the times are those a one-process client sees (``through_client``)."""
    blocks = streams * (-(-(input_len + output_len) // block_size) + 1) + 16
    kv = KVCacheManager(BlockPool(blocks, block_size, enable_prefix_cache=False))
    scheduler = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=input_len + output_len + 1, max_queue=streams + 1,
                          enable_prefix_cache=False, policy=policy)
    rng = np.random.default_rng(0)
    arrivals = [arrival_s * i / max(1, streams - 1) for i in range(streams)]
    pending = [(_request(f"r{i}", rng.integers(100, 30000, size=input_len).tolist(), output_len), arrivals[i])
               for i in range(streams)]
    token_times: dict[str, list[float]] = {}
    now, steps = 0.0, []
    while pending or scheduler.has_work:
        while pending and pending[0][1] <= now:
            scheduler.add(pending.pop(0)[0])
        if not scheduler.has_work:
            now = pending[0][1]
            continue
        plan = scheduler.schedule()
        if not plan.chunks:
            raise RuntimeError("the scheduler planned an empty step with work pending")
        shape = [(c.start, c.num_tokens, c.samples) for c in plan.chunks]
        device_ms, graphed = model.step_ms(shape)
        now += 1e-3 * device_ms
        decodes = sum(1 for _, n, s in shape if n == 1 and s)
        steps.append((device_ms, sum(n for _, n, _ in shape), decodes, graphed))
        for chunk in plan.chunks:
            request = chunk.request
            samples = chunk.samples
            request.num_computed_tokens += chunk.num_tokens
            if samples:
                request.token_ids.append(1)
                token_times.setdefault(request.request_id, []).append(now)
                if request.num_output_tokens >= request.max_tokens:
                    scheduler.finish(request)
    engine_duration = max(times[-1] for times in token_times.values())
    if client_us_per_chunk:
        token_times = through_client(token_times, client_us_per_chunk)
    starts = dict(zip((f"r{i}" for i in range(streams)), arrivals, strict=True))
    ttft = [times[0] - starts[rid] for rid, times in token_times.items()]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times.values() if len(times) > 1]
    duration = max(times[-1] for times in token_times.values())
    decode_steps = [s for s in steps if s[3]]
    mixed_steps = [s for s in steps if not s[3]]

    def pct(values: list[float]) -> dict:
        return {"p50": 1e3 * float(np.percentile(values, 50)), "p99": 1e3 * float(np.percentile(values, 99))}

    return {
        "policy": policy, "budget": budget, "streams": streams, "client_us_per_chunk": client_us_per_chunk,
        "duration_s": duration, "engine_duration_s": engine_duration,
        "output_throughput": streams * output_len / duration, "ttft_ms": pct(ttft), "tpot_ms": pct(tpot),
        "last_first_token_s": max(ttft), "num_steps": len(steps),
        "graph_decode_steps": {"count": len(decode_steps), "device_s": 1e-3 * sum(s[0] for s in decode_steps),
                               "mean_ms": float(np.mean([s[0] for s in decode_steps])) if decode_steps else 0.0},
        "eager_steps": {"count": len(mixed_steps), "device_s": 1e-3 * sum(s[0] for s in mixed_steps),
                        "decode_rows": int(sum(s[2] for s in mixed_steps)),
                        "mean_ms": float(np.mean([s[0] for s in mixed_steps])) if mixed_steps else 0.0},
    }


def measured_reference(results: Path = RESULTS) -> dict | None:
    """side_by_side.json's 64- and 256-stream rows (served, httpx client): what the model is set against."""
    path = results / "side_by_side.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    out: dict = {"device": report["device"]}
    for run in report["runs"]:
        for row in run["sweep"]:
            if row["streams"] in (64, 256):
                out.setdefault(run["server"], {})[str(row["streams"])] = {
                    "duration_s": row["duration_s"], "output_throughput": row["output_throughput"],
                    "ttft_ms": row["ttft_ms"], "tpot_ms": row["tpot_ms"]}
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for streams in report["streams"]:
        for client_us in report["client_us"]:
            for policy in report["policies"]:
                rows = [r for r in report["rows"] if r["policy"] == policy and r["streams"] == streams
                        and r["client_us_per_chunk"] == client_us]
                label = f"{policy}, {streams} streams" + (f", client {client_us:g} us/chunk" if client_us else "")
                xs = [r["budget"] for r in rows]
                style = "o-" if not client_us else "s--"
                left.plot(xs, [r["output_throughput"] for r in rows], style, label=label)
                right.plot(xs, [r["tpot_ms"]["p50"] for r in rows], style, label=label)
    reference = report.get("measured")
    for server, style in (("openinfer", "--"), ("vllm", ":")):
        for streams, color in (("64", "tab:blue"), ("256", "tab:red")):
            row = (reference or {}).get(server, {}).get(streams)
            if row:
                left.axhline(row["output_throughput"], color=color, ls=style, lw=1,
                             label=f"measured {server}, {streams} (httpx client)")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("max_num_batched_tokens")
        axis.legend(fontsize=7)
    left.set(ylabel="output tokens/s (modelled)", title="burst throughput")
    right.set(ylabel="ms", title="e2e TPOT p50")
    fig.suptitle(f"H100 step-cost model, real scheduler — {report['input_len']} in / {report['output_len']} out")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--policies", default="mixed,split")
    parser.add_argument("--budgets", default="4096,8192,16384,32768")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--arrival-s", type=float, default=0.25,
                        help="the burst's requests arrive evenly over this many seconds (a client opening "
                             "256 connections is not instantaneous)")
    parser.add_argument("--client-us", default="0",
                        help="comma list: per-chunk cost of a one-process client (0: the engine's own times)")
    parser.add_argument("--single-query-tile-factor", type=float, default=1.0,
                        help="cost of a decode row's tile in a mixed step relative to a full tile (sensitivity)")
    parser.add_argument("--mixed-decode-attention", action="store_true",
                        help="a mixed step's leading decode rows on the decode kernel (OPENINFER_MIXED_DECODE_ATTENTION=1)")
    parser.add_argument("--tag", default="burst_model")
    args = parser.parse_args(argv)
    try:
        streams = [int(s) for s in args.streams.split(",")]
        budgets = [int(b) for b in args.budgets.split(",")]
        client_costs = [float(c) for c in args.client_us.split(",")]
    except ValueError:
        parser.error("--streams, --budgets and --client-us take comma-separated numbers")
    if min(client_costs) < 0:
        parser.error("--client-us must be >= 0")
    policies = args.policies.split(",")
    if min(streams + budgets) < 1 or args.input_len < 1 or args.output_len < 1 or args.arrival_s < 0:
        parser.error("streams, budgets and lengths must be positive; --arrival-s >= 0")
    if args.single_query_tile_factor < 0:
        parser.error("--single-query-tile-factor must be >= 0")
    model = StepCostModel.from_results()
    model.single_query_tile_factor = args.single_query_tile_factor
    model.mixed_decode_attention = args.mixed_decode_attention
    print("step-cost model:", json.dumps({k: round(v, 4) for k, v in asdict(model).items()}), flush=True)
    rows = []
    for count in streams:
        for client_us in client_costs:
            for policy in policies:
                for budget in budgets:
                    row = simulate(model, streams=count, input_len=args.input_len, output_len=args.output_len,
                                   budget=budget, policy=policy, arrival_s=args.arrival_s,
                                   client_us_per_chunk=client_us)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    report = {"model": "Qwen3-4B shape", "device_model": "H100 80GB HBM3 (fitted to benchmarks/results)",
              "input_len": args.input_len, "output_len": args.output_len, "arrival_s": args.arrival_s,
              "streams": streams, "policies": policies, "budgets": budgets, "client_us": client_costs,
              "cost_model": asdict(model),
              "measured": measured_reference(), "rows": rows,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.tag}.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / f"{args.tag}.png")
    print(f"wrote {RESULTS / (args.tag + '.json')} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
