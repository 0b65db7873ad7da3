"""CPU serving benchmark with a stub model: how much slower than the model step do tokens reach clients?

The server is the real one (`openinfer serve`: engine-core process, API servers, tokenizer,
detokenization, SSE); only the model is a stub whose "device" takes ``--step-ms`` per step
(``openinfer.engine_core.stub``). A burst of ``--streams`` concurrent streaming completions
(``--prompt-len`` tokens in, ``--output-len`` out, ignore_eos) is driven by a lean HTTP client
spread over ``--client-procs`` processes. Reported: e2e TPOT p50/p99 (last token − first token
over tokens − 1, per request) and its ratio to the step time, TTFT, output tok/s — and, next
to them, the engine-side step time (the interval between the stub's consecutive full-batch
decode launches, from its launch log ``OPENINFER_STUB_STATS``): on a shared, noisy box the
engine itself slows down when other processes take the CPU, and TPOT / engine step separates
that from what the frontends add. Each mode runs ``--repeats`` bursts (default 3); the summary
gives the median of each ratio.

Modes (``--modes``): ``multi`` = the default process model; ``single`` = ``--single-process``;
``inproc`` = the stub engine + HTTP app in one process built from whatever ``openinfer`` is
importable (``--inproc-pythonpath`` points it at another checkout, e.g. the code before the
engine-core work, to reproduce the old number).

    python benchmarks/stub_serving.py --streams 256 --step-ms 14.5 --modes multi,single
Writes benchmarks/results/stub_serving.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_client import stream_completion  # noqa: E402  (the lean client)

RESULTS = Path(__file__).resolve().parent / "results"
FACTORY = "openinfer.engine_core.stub:create_stub_engine"
STATS_ENV = "OPENINFER_STUB_STATS"  # openinfer.engine_core.stub.STATS_ENV (older checkouts ignore it)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the lean streaming client (benchmarks/sse_client.py), its records in this benchmark's terms ---

async def one_stream(port: int, body: bytes, start_at: float) -> dict:
    delay = start_at - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    record = await stream_completion(port, body)
    if not record.ok:
        return {"ok": False, "error": record.error}
    return {"ok": True, "ttft": record.first - record.start, "span": record.last - record.first,
            "tokens": record.tokens, "events": record.events, "latency": record.last - record.start,
            "first_tokens": max(1, record.first_tokens)}


def client_process(port: int, bodies: list[bytes], start_at: float, out: multiprocessing.Queue) -> None:
    async def run() -> list[dict]:
        return await asyncio.gather(*(one_stream(port, body, start_at) for body in bodies))

    out.put(asyncio.run(run()))


def engine_step_ms(stats_path: str, since: float, until: float, streams: int) -> dict | None:
    """p50/p99 interval between consecutive stub launches within [since, until] (wall clock,
    the burst): how fast the engine itself stepped while it had work."""
    time.sleep(0.6)  # the stub rewrites its log every 0.25 s
    try:
        launches = json.loads(Path(stats_path).read_text())["launches"]
    except (OSError, ValueError, KeyError):
        return None
    times = [t for t, _ in launches if since <= t <= until]
    gaps = np.diff(times)
    if len(gaps) < 3:
        return None
    return {"p50": 1e3 * float(np.percentile(gaps, 50)), "p99": 1e3 * float(np.percentile(gaps, 99)),
            "num_steps": len(times)}


def burst(port: int, streams: int, prompt_len: int, output_len: int, vocab: int, procs: int, seed: int,
          stats_path: str | None = None) -> dict:
    rng = np.random.default_rng(seed)
    bodies = [json.dumps({"prompt": rng.integers(300, vocab - 10, size=prompt_len).tolist(), "max_tokens": output_len,
                          "ignore_eos": True, "temperature": 0, "stream": True,
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode() for _ in range(streams)]
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    start_at = time.time() + 1.0
    workers = [context.Process(target=client_process, args=(port, bodies[i::procs], start_at, out))
               for i in range(procs)]
    for worker in workers:
        worker.start()
    results = [r for _ in workers for r in out.get(timeout=600)]
    for worker in workers:
        worker.join()
    finished_at = time.time()
    duration = max((r["latency"] for r in results if r["ok"]), default=0.0) + 0.0
    ok = [r for r in results if r["ok"]]
    # serve.py's e2e TPOT: (last - first chunk) / (tokens - 1). Chunks merge tokens when the
    # frontend lags, so a first chunk carrying k tokens makes that an underestimate; the decode
    # TPOT divides by the tokens that arrived after the first chunk (counted from the per-chunk usage)
    tpot = [r["span"] / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    decode = [r["span"] / (r["tokens"] - r["first_tokens"]) for r in ok if r["tokens"] > r["first_tokens"]]
    return {
        "num_ok": len(ok), "num_failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
        "tpot_ms": {"p50": 1e3 * float(np.percentile(tpot, 50)), "p99": 1e3 * float(np.percentile(tpot, 99))}
        if tpot else None,
        "decode_tpot_ms": {"p50": 1e3 * float(np.percentile(decode, 50)),
                           "p99": 1e3 * float(np.percentile(decode, 99))} if decode else None,
        "first_chunk_tokens_p50": float(np.percentile([r["first_tokens"] for r in ok], 50)) if ok else None,
        "ttft_ms": {"p50": 1e3 * float(np.percentile([r["ttft"] for r in ok], 50)),
                    "p99": 1e3 * float(np.percentile([r["ttft"] for r in ok], 99))} if ok else None,
        "output_tok_s": sum(r["tokens"] for r in ok) / duration if duration else 0.0,
        "sse_events_per_token": sum(r["events"] for r in ok) / max(1, sum(r["tokens"] for r in ok)),
        "engine_step_ms": engine_step_ms(stats_path, start_at, finished_at, streams) if stats_path else None,
    }


# --- servers ---------------------------------------------------------------------------------

def serve_in_process(model_dir: str, port: int) -> None:
    """``--internal-inproc``: stub engine + HTTP app in this process, using only APIs that
    predate the engine-core work (so an older checkout on PYTHONPATH runs it too)."""
    import uvicorn

    from openinfer.engine_core.stub import create_stub_engine
    from openinfer.frontend.http import create_app
    from openinfer.tokenizer import Tokenizer

    engine = create_stub_engine(model_dir, device="cpu", num_kv_blocks=40000)
    app = create_app(engine, Tokenizer.from_dir(model_dir), "stub")
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", access_log=False)


def start_server(mode: str, model_dir: str, port: int, args: argparse.Namespace, stats_path: str) -> subprocess.Popen:
    env = {**os.environ, STATS_ENV: stats_path}
    if mode == "inproc":
        if args.inproc_pythonpath:
            env["PYTHONPATH"] = args.inproc_pythonpath
        command = [sys.executable, __file__, "--internal-inproc", model_dir, "--port", str(port)]
    else:
        command = [sys.executable, "-m", "openinfer.cli", "serve", "--model-path", model_dir, "--engine-factory",
                   FACTORY, "--port", str(port), "--grpc-port", "0", "--device", "cpu", "--num-kv-blocks", "40000",
                   "--log-level", "warning", "--api-server-count", str(args.api_server_count)]
        if mode == "single":
            command.append("--single-process")
    return subprocess.Popen(command, env=env)


def wait_healthy(port: int, process: subprocess.Popen, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server not healthy")


def make_model(step_ms: float) -> tuple[str, int]:
    from openinfer.demo import ensure_demo_model
    from openinfer.engine_core.stub import write_stub_model

    directory = Path(tempfile.mkdtemp(prefix="openinfer-stub-")) / "stub"
    write_stub_model(directory, ensure_demo_model(), step_ms)
    return str(directory), json.loads((directory / "config.json").read_text())["vocab_size"]


def summarize(runs: list[dict]) -> dict:
    """Per label: the median (and range) over its repeats of each ratio."""
    summary: dict[str, dict] = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        entry: dict = {"repeats": len(mine)}
        for key in ("tpot_over_step", "engine_step_over_step", "tpot_over_engine_step"):
            values = [r[key] for r in mine if r.get(key) is not None]
            if values:
                entry[key] = {"median": float(np.median(values)), "min": min(values), "max": max(values)}
        summary[label] = entry
    return summary


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r.get("decode_tpot_ms") or r["tpot_ms"]]
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(runs)), 4.5))
    labels = [f"{r['label'].replace(' (', chr(10) + '(')}\nload {r['loadavg_1min'][0]:.0f}" if "loadavg_1min" in r else r["label"] for r in runs]
    ratios = [(r.get("decode_tpot_ms") or r["tpot_ms"])["p50"] / report["step_ms"] for r in runs]
    x = np.arange(len(runs))
    ax.bar(x, ratios, color=["tab:gray" if r["mode"] == "inproc" else "tab:blue" for r in runs])
    ax.axhline(1.2, color="tab:red", linestyle="--", label="goal 1.2×")
    ax.axhline(1.0, color="gray", linestyle=":", label="model step")
    for i, ratio in enumerate(ratios):
        ax.text(i, ratio + 0.05, f"{ratio:.2f}×", ha="center")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set(ylabel="decode TPOT p50 / step time", title=f"stub model, step {report['step_ms']} ms, "
           f"{report['streams']} streams, {report['output_len']} out\n(shared 2-core box; load = 1-min load average)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=14.5)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--modes", default="multi,single")
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--inproc-pythonpath", default="")
    parser.add_argument("--inproc-label", default="inproc")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="stub_serving")
    parser.add_argument("--append", action="store_true", help="add runs to an existing JSON of the same tag")
    parser.add_argument("--internal-inproc", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.internal_inproc:
        serve_in_process(args.internal_inproc, args.port)
        return 0
    model_dir, vocab = make_model(args.step_ms)
    path = RESULTS / f"{args.tag}.json"
    report = json.loads(path.read_text()) if args.append and path.exists() else {"runs": []}
    report.update({"step_ms": args.step_ms, "streams": args.streams, "prompt_len": args.prompt_len,
                   "output_len": args.output_len, "host": platform.node(), "cpus": os.cpu_count(),
                   "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    stats_path = str(Path(model_dir).parent / "stub_stats.json")
    for mode in args.modes.split(","):
        port = free_port()
        server = start_server(mode, model_dir, port, args, stats_path)
        try:
            wait_healthy(port, server)
            burst(port, 8, args.prompt_len, 8, vocab, 1, 0)  # warm-up
            for repeat in range(args.repeats):
                load_before = os.getloadavg()[0]
                result = burst(port, args.streams, args.prompt_len, args.output_len, vocab, args.client_procs, repeat,
                               stats_path)
                label = args.inproc_label if mode == "inproc" else (
                    f"multi ×{args.api_server_count} API" if mode == "multi" else "single-process")
                # the CPU box is shared: the 1-minute load average says how contended the run was
                result.update({"mode": mode, "label": label, "api_server_count": args.api_server_count,
                               "loadavg_1min": [load_before, os.getloadavg()[0]]})
                if result["tpot_ms"]:
                    result["tpot_over_step"] = result["tpot_ms"]["p50"] / args.step_ms
                if result["decode_tpot_ms"]:
                    result["decode_tpot_over_step"] = result["decode_tpot_ms"]["p50"] / args.step_ms
                if result["tpot_ms"] and result["engine_step_ms"]:
                    result["engine_step_over_step"] = result["engine_step_ms"]["p50"] / args.step_ms
                    result["tpot_over_engine_step"] = result["tpot_ms"]["p50"] / result["engine_step_ms"]["p50"]
                print(json.dumps(result), flush=True)
                report["runs"].append(result)
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    report["summary"] = summarize(report["runs"])
    for label, summary in report["summary"].items():
        print(f"{label}: {summary}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / f"{args.tag}.png")
    print(f"wrote {path} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
