"""GPU concurrency sweep: `openinfer serve` (and optionally a vLLM server) under bursts of N streams.

On one GPU machine, unattended (< 8 min with a warm page cache; vLLM's first start adds ~3 min):

1. a Qwen3-4B-shaped checkpoint with random bf16 weights (``gpu_cold_start.write_checkpoint``) and a
   word-level tokenizer over its vocabulary (``gpu_serving.write_tokenizer``), unless present;
2. for each ``--api-server-counts`` value: cold start of ``openinfer serve`` → HTTP ready (checkpoint
   in the page cache; CuPy's kernel cache as the machine has it: cold on a fresh one), where each
   process's start went (``--startup-report``: spawn, imports, model load, KV, graph capture, HTTP),
   idle RSS of every openinfer process (from /metrics, after one request), then the existing
   streaming client (``benchmarks/serve.py``) at each ``--streams`` burst (1k in / 128 out,
   ignore_eos): output tok/s, TPOT/TTFT/ITL p50/p99;
3. with ``--vllm-url`` (a running server) or ``--vllm-cmd`` (a launch command; ``{model}`` and
   ``{port}`` are filled in), the same client against vLLM, plus its cold start and idle RSS.

Clients (``--clients``, each point runs once per client): ``httpx`` is ``benchmarks/serve.py``'s
(one process, httpx + a JSON parse per chunk); ``lean`` is a raw HTTP/1.1 + SSE reader spread
over ``--client-procs`` processes (JSON only for the usage chunk), so a burst of 256 streams
measures the server and not the client. Each row records the client's CPU seconds over the burst
(``client_cpu_s``; near ``duration_s`` × processes means the client was the bottleneck) and the
SSE chunks per token.

openinfer's engine core logs every step (``OPENINFER_STEP_LOG``, see
``openinfer.engine_core.step_log``): each row gets ``engine_steps`` — decode-only and mixed
steps, their device time, idle gaps, and when the engine's last step of the burst ended against
the clients' last token (``client_lag_s``); and ``full_batch_decode``: the burst's steps with all
its streams decoding and no prompt chunk (their device time, launch period) with the row's TPOT
p50 over that step (``tpot_over_step``, issue #12's goal: <= 1.2 at 256 streams), the reference
measured in the same run; and with the lean client ``per_request``: each stream's TPOT over the mean
device time of the steps it rode in (p50 / p99 of ``tpot_over_device``; see ``per_request_tpot`` for
why a burst's TPOT cannot reach the full-batch step and what this ratio isolates instead). A
steady-state point, where TPOT over the full-batch step is directly comparable: short prompts and
long outputs, e.g. ``--streams 256 --input-len 64 --output-len 512``. The raw log is kept next to the JSON (``TAG.steps-*.json``). ``--serve-args "--scheduler-policy split"`` picks the scheduler's policy
(``mixed``, the default / ``split`` / ``prefill_first``), recorded in the run (``scheduler_policy``)
and its label.

TTFT rows (``--ttft-contexts 1024,4096,16384``), per server right after its sweep, one request at a
time with the lean client: cold (a fresh random prompt of that many tokens) and warm-prefix (that
prompt again with only its last token changed, so all its full KV blocks are cached: issue #16's
row), medians over ``--ttft-repeats``, with each response's ``cached_tokens`` (vLLM reports them
with ``--enable-prompt-tokens-details``) so a warm row shows it hit the cache. The JSON, the PNG's
third panel and the markdown table (printed at the end; ``--table`` prints it from the JSON alone)
carry them. Both servers need ``--max-model-len`` above the longest context.

Issue #16 / #12 side by side on one GPU machine (two calls, the second appends to the first's JSON;
the table at the end of the second compares both):

    python benchmarks/gpu_concurrency.py --streams 1,16,64,256 --api-server-counts 1 --clients lean \
        --ttft-contexts 1024,4096,16384 --max-model-len 20480 --tag side_by_side_h200
    python benchmarks/gpu_concurrency.py --streams 1,16,64,256 --api-server-counts 0 --append --clients lean \
        --ttft-contexts 1024,4096,16384 --max-model-len 20480 --tag side_by_side_h200 --vllm-start-timeout 540 \
        --vllm-cmd "env PYTHONPATH=/tmp/vsite:/tmp/site python3 -m vllm.entrypoints.openai.api_server \
        --model {model} --port {port} --max-model-len 20480 --gpu-memory-utilization 0.85 \
        --enable-prompt-tokens-details"
    python benchmarks/gpu_concurrency.py --table --tag side_by_side_h200       # the README table again

Other uses:

    python benchmarks/gpu_concurrency.py --streams 64,256 --api-server-counts 1 --clients lean,httpx \
        --serve-args "--scheduler-policy split" --append     # another scheduler policy, in the same JSON
    python benchmarks/gpu_concurrency.py --stub --streams 4,16 --api-server-counts 1 --clients lean \
        --ttft-contexts 1024,8192 --max-model-len 20480       # CPU dry run (stub engine, 14.5 ms steps)
Writes benchmarks/results/TAG.json and .png (``--results-dir``; copies under $OUT when set).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from openinfer.engine_core.step_log import STEP_LOG_ENV, summarize_steps
from openinfer.sched.scheduler import DEFAULT_POLICY

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve import sweep_rate, ttft_rows  # noqa: E402  (benchmarks/serve.py: the httpx client, TTFT rows)
from sse_client import completion_body, stream_completion  # noqa: E402  (the lean client)

STUB_FACTORY = "openinfer.engine_core.stub:create_stub_engine"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def warm_page_cache(path: Path) -> None:
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as handle:
            while handle.read(1 << 24):
                pass


def process_tree_rss(pid: int) -> int:
    """RSS of ``pid`` and all its descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = {pid}, [pid]
    while frontier:
        current = frontier.pop()
        for child, parent in parents.items():
            if parent == current and child not in tree:
                tree.add(child)
                frontier.append(child)
    total = 0
    for member in tree:
        try:
            total += int(Path(f"/proc/{member}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            pass
    return total


def wait_ready(url: str, process: subprocess.Popen | None, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                models = httpx.get(url + "/v1/models", timeout=5).json()
                if models.get("data"):
                    return time.perf_counter() - start
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready within {timeout:.0f} s")


def openinfer_rss(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    rss = {}
    for line in text.splitlines():
        if line.startswith("openinfer_process_resident_memory_bytes{"):
            role = line.split('process="')[1].split('"')[0]
            rss[role] = float(line.rsplit(" ", 1)[1])
    return rss


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# --- the lean client (benchmarks/sse_client.py), its records in this benchmark's terms ---

async def lean_stream(port: int, body: bytes) -> dict:
    record = await stream_completion(port, body)
    if not record.ok:
        return {"ok": False, "error": record.error}
    to_wall = time.time() - time.perf_counter()  # the record's perf_counter times on the engine log's clock
    return {"ok": True, "ttft": record.first - record.start, "latency": record.last - record.start,
            "tokens": record.tokens, "events": record.events, "itl": record.gaps,
            "cached_tokens": record.cached_tokens, "first_wall": record.first + to_wall,
            "last_wall": record.last + to_wall}


def lean_client_process(port: int, bodies: list[bytes], start_at: float, out) -> None:
    async def run() -> list[dict]:
        return await asyncio.gather(*(lean_stream(port, body) for body in bodies))

    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    cpu = time.process_time()
    results = asyncio.run(run())
    out.put((results, time.process_time() - cpu))


def lean_burst(url: str, model: str, prompts: list[list[int]], output_len: int, procs: int) -> dict:
    import multiprocessing

    port = int(url.rsplit(":", 1)[1])
    bodies = [completion_body(model, p, output_len) for p in prompts]
    procs = max(1, min(procs, len(bodies)))
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    start_at = time.time() + 0.5  # every worker forked and ready: the burst starts at once
    workers = [context.Process(target=lean_client_process, args=(port, bodies[i::procs], start_at, out))
               for i in range(procs)]
    for worker in workers:
        worker.start()
    parts = [out.get(timeout=900) for _ in workers]
    for worker in workers:
        worker.join()
    results = [r for rows, _ in parts for r in rows]
    ok = [r for r in results if r["ok"]]
    duration = max((r["latency"] for r in ok), default=0.0)
    tpots = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itls = [x for r in ok for x in r["itl"]]

    def pct(values: list[float]) -> dict:
        return {"p50": 1e3 * float(np.percentile(values, 50)), "p99": 1e3 * float(np.percentile(values, 99))} \
            if values else {"p50": float("nan"), "p99": float("nan")}

    total_tokens = sum(r["tokens"] for r in ok)
    return {"rate": float("inf"), "num_requests": len(results), "num_failed": len(results) - len(ok),
            "duration_s": duration, "request_throughput": len(ok) / duration if duration else 0.0,
            "output_throughput": total_tokens / duration if duration else 0.0,
            "ttft_ms": pct([r["ttft"] for r in ok]), "tpot_ms": pct(tpots), "itl_ms": pct(itls),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
            "client_cpu_s": sum(cpu for _, cpu in parts), "client_procs": procs,
            "sse_chunks_per_token": sum(r["events"] for r in ok) / max(1, total_tokens),
            "burst_began": start_at, "burst_ended": start_at + duration,
            # per stream (wall clock): first token, last token, tokens; per_request_tpot matches them
            # to the engine's step log
            "stream_times": [[r["first_wall"], r["last_wall"], r["tokens"]] for r in ok]}


def sweep(url: str, model: str, streams: list[int], input_len: int, output_len: int, vocab: int,
          clients: list[str], client_procs: int) -> list[dict]:
    rng = np.random.default_rng(0)

    def fresh(count: int) -> list[list[int]]:
        # never a prompt seen before: both servers cache prefixes, and a point must measure cold prefill
        return [rng.integers(100, vocab - 100, size=input_len).tolist() for _ in range(count)]

    asyncio.run(sweep_rate(url, model, float("inf"), fresh(4), 4, 0))  # warm-up
    rows = []
    for count in streams:
        for client in clients:
            if client == "lean":
                summary = lean_burst(url, model, fresh(count), output_len, client_procs)
            else:
                began, cpu = time.time(), time.process_time()
                summary = asyncio.run(sweep_rate(url, model, float("inf"), fresh(count), output_len, count))
                summary.update(client_cpu_s=time.process_time() - cpu, client_procs=1, burst_began=began,
                               burst_ended=time.time())
            summary["streams"] = count
            summary["client"] = client
            print(json.dumps({k: v for k, v in summary.items() if k != "stream_times" and (k != "errors" or v)}),
                  flush=True)
            rows.append(summary)
            time.sleep(0.5)  # the engine's last step of this burst is over before the next one begins
    return rows


def full_batch_decode(log: dict, since: float, until: float) -> dict:
    """The decode step issue #12's TPOT goal is set against, measured in the burst itself: the
    steps that began in ``[since, until]`` with the largest batch of them all decoding one token
    and nothing else (no prompt chunk riding along); ``seqs`` is that batch, the burst's stream
    count unless the scheduler never ran them all at once. ``period_ms_p50``: launch to the next
    launch when that one is also such a step (the engine's token cadence at full batch);
    ``busy_ms_p50``: their device time (CUDA backends only), the GPU step time at that batch."""
    index = {name: i for i, name in enumerate(log["columns"])}
    steps = log["steps"]
    decodes = [position for position, row in enumerate(steps)
               if since <= row[index["began"]] <= until and row[index["tokens"]] == row[index["seqs"]]]
    if not decodes:
        return {"num_steps": 0}
    seqs = max(steps[p][index["seqs"]] for p in decodes)
    full = [p for p in decodes if steps[p][index["seqs"]] == seqs]
    chosen = set(full)
    periods = [1e3 * (steps[p + 1][index["began"]] - steps[p][index["began"]]) for p in full if p + 1 in chosen]
    out = {"num_steps": len(full), "seqs": seqs,
           "host_ms_p50": float(np.median([steps[p][index["host_ms"]] for p in full]))}
    if periods:
        out["period_ms_p50"] = float(np.median(periods))
    busy = [steps[p][index["busy_ms"]] for p in full if "busy_ms" in index and steps[p][index["busy_ms"]] is not None]
    if busy:
        out["busy_ms_p50"] = float(np.median(busy))
    return out


PER_REQUEST_NOTE = (
    "tpot_over_device: each stream's TPOT (client, last - first token over tokens - 1) over the mean device "
    "time of the steps its request rode in as a decode row (mixed steps at full length), p50/p99 over streams. "
    "In a burst every decode window overlaps other requests' prefill chunks, so TPOT cannot reach the "
    "all-decode step (tpot_over_step); this ratio isolates what serving adds on top of the device: "
    "engine_over_device (its token cadence on the device timeline, idle gaps included, over device time: "
    "host-bound steps) x tpot_over_engine (client TPOT over that cadence: frontend, transport, HTTP). "
    "Streams are paired with engine requests by sorting both by (first token, last token).")


def per_request_tpot(row: dict, log: dict) -> dict:
    """Issue #12's TPOT goal asked per request: each stream's TPOT (client: last token − first
    token over tokens − 1) over the mean device time of the steps that request rode in as a
    decode row (``request_decode_steps``: mixed steps at their full length), p50 / p99.

    Why not over the full-batch decode step: in a burst of N prompts every request's decode
    window overlaps other requests' prefill chunks (the 256 × 1k burst prefills 256k tokens,
    ~3.4 s of mixed steps), so no scheduler brings TPOT to the all-decode step's time; what
    serving adds on top of the device (host step preparation while the GPU idles, per-token
    messages, HTTP) is the ratio here. It splits in two: ``engine_over_device`` (the request's
    token cadence on the device timeline, idle gaps included, over its steps' device time: the
    engine's host overhead) and ``tpot_over_engine`` (the client's TPOT over that cadence: the
    frontend and the transport).

    Matching streams to engine requests: both sides sorted by (first token, last token) — the
    engine's by the positions of a request's first and last decode steps — and paired in order.
    Requests whose first tokens came in the same step and whose last did too rode the same steps,
    so where order inside such a group is lost the pairing still gives each stream the right steps.
    Without the same count on both sides (failed streams, a trimmed log) only the distributions."""
    from openinfer.engine_core.step_log import request_decode_steps

    engine = request_decode_steps(log, row["burst_began"], row["burst_ended"])
    streams = sorted((s for s in row.get("stream_times") or [] if s[2] > 1), key=lambda s: (s[0], s[1]))
    out: dict = {"note": PER_REQUEST_NOTE, "num_streams": len(streams), "num_engine_requests": len(engine)}
    if not engine or not streams:
        return out
    timed = all("device_ms" in r for r in engine)  # CUDA backends; the stub and NumPy have launch times only

    def pct(values) -> dict:
        values = np.asarray(values, float)
        return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
                "mean": float(values.mean())}

    tpot = [1e3 * (last - first) / (tokens - 1) for first, last, tokens in streams]
    out.update(tpot_ms=pct(tpot), decode_steps_per_token=float(np.mean([r["steps"] for r in engine]) /
                                                              np.mean([s[2] - 1 for s in streams])))
    for name in ("device_ms", "engine_ms", "launch_ms"):
        values = [r[name] for r in engine if name in r]
        if values:
            out[name] = pct(values)
    out["matched"] = len(streams) == len(engine)
    if not out["matched"]:
        if timed:
            out["tpot_p50_over_device_p50"] = out["tpot_ms"]["p50"] / out["device_ms"]["p50"]
        return out
    pairs = list(zip(tpot, engine, strict=True))
    ratios = {"tpot_over_device": ("device_ms", None), "engine_over_device": ("device_ms", "engine_ms"),
              "tpot_over_engine": ("engine_ms", None), "tpot_over_launch": ("launch_ms", None)}
    for name, (below, above) in ratios.items():
        values = [(t if above is None else r[above]) / r[below] for t, r in pairs
                  if below in r and (above is None or above in r)]
        if values:
            out[name] = pct(values)
    return out


def attach_step_log(rows: list[dict], path: Path) -> None:
    """Each row's ``engine_steps`` (the steps that began during its burst) and ``full_batch_decode``
    with the row's TPOT p50 over that step (``tpot_over_step``: over its device time where measured,
    else over its launch period; issue #12's goal is <= 1.2 at 256 streams); with the lean client,
    ``per_request`` (``per_request_tpot``: each stream's TPOT over its own steps' device time)."""
    if not path.exists():
        return
    log = json.loads(path.read_text())
    for row in rows:
        steps = summarize_steps(log, row["burst_began"], row["burst_ended"])
        if steps.get("last_step_end_estimate"):
            steps["client_lag_s"] = row["burst_ended"] - steps["last_step_end_estimate"]
        row["engine_steps"] = steps
        full = full_batch_decode(log, row["burst_began"], row["burst_ended"])
        step_ms = full.get("busy_ms_p50", full.get("period_ms_p50"))
        if step_ms:
            full["tpot_over_step"] = row["tpot_ms"]["p50"] / step_ms
        row["full_batch_decode"] = full
        if row.get("stream_times") and log.get("decode_rows"):
            row["per_request"] = per_request_tpot(row, log)


def scheduler_policy(serve_args: str) -> str:
    """The scheduler policy ``openinfer serve`` runs with these extra flags."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--scheduler-policy", default=DEFAULT_POLICY)
    return parser.parse_known_args(shlex.split(serve_args))[0].scheduler_policy


def run_openinfer(args: argparse.Namespace, checkpoint: Path, api_servers: int, streams: list[int],
                  vocab: int) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "openinfer.cli", "serve", "--model-path", str(checkpoint), "--port", str(port),
               "--grpc-port", "0", "--max-model-len", str(args.max_model_len), "--api-server-count",
               str(api_servers), "--log-level", "warning"]
    command += ["--engine-factory", STUB_FACTORY, "--device", "cpu", "--num-kv-blocks", "40000"] if args.stub \
        else ["--device", "cuda"]
    command += shlex.split(args.serve_args)
    run_dir = Path(tempfile.mkdtemp(prefix="openinfer-startup-"))
    startup_report, step_log = run_dir / "startup.json", run_dir / "steps.json"
    command += ["--startup-report", str(startup_report)]
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(command, start_new_session=True, env={**os.environ, STEP_LOG_ENV: str(step_log)})
    try:
        ready_s = wait_ready(url, process, args.start_timeout)
        for _ in range(50):  # the supervisor writes it within a poll interval of HTTP ready
            if startup_report.exists():
                break
            time.sleep(0.1)
        startup = json.loads(startup_report.read_text()) if startup_report.exists() else None
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        httpx.post(url + "/v1/completions", json={"model": model, "prompt": [100, 101], "max_tokens": 2},
                   timeout=120)
        time.sleep(2.0)
        rss = openinfer_rss(url)
        print(f"openinfer ×{api_servers} API: ready in {ready_s:.1f} s, idle RSS {sum(rss.values()) / 2**20:.0f} MiB "
              f"{ {k: round(v / 2**20) for k, v in rss.items()} }", flush=True)
        for role, report in (startup or {}).items():
            print(f"  start-up of {role}: {report.get('phases')}", flush=True)
        rows = sweep(url, model, streams, args.input_len, args.output_len, vocab, args.clients.split(","),
                     args.client_procs)
        ttft = ttft_rows(url, model, args.ttft_contexts, args.ttft_repeats, vocab)
    finally:
        stop(process)
    for _ in range(100):  # the engine core writes its step log as it shuts down
        if step_log.exists():
            break
        time.sleep(0.1)
    attach_step_log(rows, step_log)
    if step_log.exists() and os.environ.get("OUT"):
        shutil.copy(step_log, Path(os.environ["OUT"]) / f"{args.tag}.steps-{api_servers}api.json")
    extra = f", {args.serve_args}" if args.serve_args else ""
    return {"server": "openinfer", "label": f"openinfer ({api_servers} API server{'s' if api_servers > 1 else ''}{extra})",
            "api_server_count": api_servers, "cold_start_to_http_ready_s": ready_s, "startup": startup,
            "idle_rss_bytes": {"total": sum(rss.values()), **rss}, "scheduler_policy": scheduler_policy(args.serve_args),
            "sweep": rows, "ttft": ttft}


def run_vllm(args: argparse.Namespace, checkpoint: Path, streams: list[int], vocab: int) -> dict:
    process = None
    ready_s = None
    if args.vllm_url:
        url = args.vllm_url.rstrip("/")
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = args.vllm_cmd.format(model=shlex.quote(str(checkpoint)), port=port)
        process = subprocess.Popen(command, shell=True, start_new_session=True)
    try:
        ready_s = wait_ready(url, process, args.vllm_start_timeout)
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        time.sleep(2.0)
        rss = process_tree_rss(process.pid) if process is not None else None
        rows = sweep(url, model, streams, args.input_len, args.output_len, vocab, args.clients.split(","),
                     args.client_procs)
        ttft = ttft_rows(url, model, args.ttft_contexts, args.ttft_repeats, vocab)
    finally:
        if process is not None:
            stop(process)
    return {"server": "vllm", "label": "vLLM", "cold_start_to_http_ready_s": ready_s if process else None,
            "idle_rss_bytes": {"total": rss} if rss else None, "sweep": rows, "ttft": ttft}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_ttft = [run for run in report["runs"] if run.get("ttft")]
    fig, axes = plt.subplots(1, 3 if with_ttft else 2, figsize=(18 if with_ttft else 12, 4.5))
    left, right = axes[0], axes[1]
    for run in report["runs"]:
        clients = list(dict.fromkeys(r.get("client", "httpx") for r in run["sweep"]))
        for client in clients:
            rows = [r for r in run["sweep"] if r.get("client", "httpx") == client]
            label = run["label"] + (f" [{client} client]" if len(clients) > 1 or client != "httpx" else "")
            xs = [r["streams"] for r in rows]
            left.plot(xs, [r["output_throughput"] for r in rows], "o-", label=label)
            right.plot(xs, [r["tpot_ms"]["p50"] for r in rows], "o-", label=label)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams (burst)")
        axis.legend()
    left.set(ylabel="output tokens/s", title="throughput")
    right.set(ylabel="ms", title="e2e TPOT p50")
    if with_ttft:
        plot_ttft(axes[2], with_ttft)
    fig.suptitle(f"{report['device']} — {report['model']} — {report['input_len']} in / {report['output_len']} out")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_ttft(axis, runs: list[dict]) -> None:
    """Grouped bars: per context, each run's cold TTFT (solid) and warm-prefix TTFT (hatched)."""
    contexts = sorted({row["context"] for run in runs for row in run["ttft"]})
    width = 0.8 / (2 * len(runs))
    for index, run in enumerate(runs):
        by_context = {row["context"]: row for row in run["ttft"]}
        for kind, hatch in (("cold", ""), ("warm", "//")):
            offset = (2 * index + (kind == "warm") - len(runs) + 0.5) * width
            values = [by_context[c][f"{kind}_ttft_ms"] if c in by_context else np.nan for c in contexts]
            axis.bar(np.arange(len(contexts)) + offset, values, width, hatch=hatch,
                     color=f"C{index}", alpha=1.0 if kind == "cold" else 0.55, label=f"{run['label']} {kind}")
    axis.set(xticks=np.arange(len(contexts)), xticklabels=[f"{c:,}" for c in contexts], yscale="log",
             xlabel="prompt tokens", ylabel="ms", title="TTFT: cold prompt (solid) / same prompt, last token changed (hatched)")
    axis.legend(fontsize=8)


def sweep_rows_of(run: dict) -> dict[int, dict]:
    """A run's sweep rows by stream count, from the lean client where it ran (it measures the
    server, not the client), else from the first client the run used."""
    clients = [r.get("client", "httpx") for r in run["sweep"]]
    chosen = "lean" if "lean" in clients else (clients[0] if clients else None)
    return {r["streams"]: r for r in run["sweep"] if r.get("client", "httpx") == chosen}


def comparison_table(report: dict) -> str:
    """Issue #16's and #12's side by side as a markdown table: the first openinfer run against
    the last vLLM run of ``report``. Ratio > 1 means openinfer is better (throughput: ours ÷
    vLLM; times and memory: vLLM ÷ ours)."""
    ours = next((run for run in report["runs"] if run["server"] == "openinfer"), None)
    peer = next((run for run in reversed(report["runs"]) if run["server"] == "vllm"), None)
    runs = [run for run in (ours, peer) if run is not None]
    lines = [f"{report['device']}, {report['model']}, bursts of {report['input_len']} in / "
             f"{report['output_len']} out; " + " vs ".join(run["label"] for run in runs), "",
             "| | openinfer | vLLM | ratio |", "|---|---|---|---|"]

    def number(value: float | None, digits: int) -> str:
        return "—" if value is None or not np.isfinite(value) else f"{value:,.{digits}f}"

    def add(name: str, pick, digits: int, higher_is_better: bool, note=None) -> None:
        values = [pick(run) if run is not None else None for run in (ours, peer)]
        cells = [number(v, digits) + (note(run) if note and run is not None and v is not None else "")
                 for v, run in zip(values, (ours, peer), strict=True)]
        mine, theirs = values
        ratio = "—"
        if mine and theirs and np.isfinite(mine) and np.isfinite(theirs):
            ratio = f"{(mine / theirs if higher_is_better else theirs / mine):.2f}×"
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {ratio} |")

    def stream_value(count: int, metric: str):
        def pick(run: dict) -> float | None:
            row = sweep_rows_of(run).get(count)
            if row is None:
                return None
            return row["output_throughput"] if metric == "throughput" else row["tpot_ms"]["p50"]
        return pick

    def full_batch_value(count: int, metric: str):
        def pick(run: dict) -> float | None:
            full = sweep_rows_of(run).get(count, {}).get("full_batch_decode") or {}
            if metric == "ratio":
                return full.get("tpot_over_step")
            return full.get("busy_ms_p50", full.get("period_ms_p50"))
        return pick

    def per_request_value(count: int, metric: str, quantile: str):
        def pick(run: dict) -> float | None:
            part = (sweep_rows_of(run).get(count, {}).get("per_request") or {}).get(metric)
            return part[quantile] if part else None
        return pick

    def step_note(count: int):
        def note(run: dict) -> str:
            full = sweep_rows_of(run).get(count, {}).get("full_batch_decode") or {}
            batch = f", batch {full['seqs']}" if full.get("seqs") != count else ""
            return (" (GPU time" if "busy_ms_p50" in full else " (launch period") + batch + ")"
        return note

    def ttft_value(context: int, kind: str):
        def pick(run: dict) -> float | None:
            row = next((r for r in run.get("ttft") or [] if r["context"] == context), None)
            return row[f"{kind}_ttft_ms"] if row else None
        return pick

    def cached_note(context: int):
        def note(run: dict) -> str:
            row = next((r for r in run.get("ttft") or [] if r["context"] == context), None)
            cached = [c for c in (row or {}).get("warm_cached_tokens", []) if c is not None]
            return f" ({int(np.median(cached)):,} cached)" if cached else ""
        return note

    streams = sorted({count for run in runs for count in sweep_rows_of(run)})
    if 1 in streams:
        add("bs=1 TPOT p50 (ms)", stream_value(1, "tpot"), 2, False)
    for count in (c for c in streams if c > 1):
        add(f"{count} streams: output tok/s", stream_value(count, "throughput"), 0, True)
        add(f"{count} streams: TPOT p50 (ms)", stream_value(count, "tpot"), 1, False)
        if any(sweep_rows_of(run).get(count, {}).get("full_batch_decode", {}).get("num_steps") for run in runs):
            add(f"{count} streams: full-batch decode step, same run (ms)", full_batch_value(count, "step"), 2,
                False, step_note(count))
            add(f"{count} streams: TPOT p50 ÷ that step", full_batch_value(count, "ratio"), 2, False)
        if any("tpot_over_device" in sweep_rows_of(run).get(count, {}).get("per_request", {}) for run in runs):
            for quantile in ("p50", "p99"):
                add(f"{count} streams: per request, TPOT ÷ its own steps' device time, {quantile}",
                    per_request_value(count, "tpot_over_device", quantile), 2, False)
                add(f"{count} streams: per request, its steps' device time (ms), {quantile}",
                    per_request_value(count, "device_ms", quantile), 2, False)
    contexts = sorted({row["context"] for run in runs for row in run.get("ttft") or []})
    for context in contexts:
        add(f"cold TTFT, {context:,}-token prompt (ms)", ttft_value(context, "cold"), 1, False)
    for context in contexts:
        add(f"warm-prefix TTFT, {context:,}-token prompt, last token changed (ms)", ttft_value(context, "warm"), 1,
            False, cached_note(context))

    def rss(run: dict) -> float | None:
        total = (run.get("idle_rss_bytes") or {}).get("total")
        return total / 2**20 if total else None

    add("idle RSS, all processes (MiB)", rss, 0, False)
    add("cold start → HTTP ready (s)", lambda run: run.get("cold_start_to_http_ready_s"), 1, False)
    lines += ["", "ratio > 1: openinfer better (tok/s: ours ÷ vLLM; ms, MiB, s: vLLM ÷ ours). Full-batch decode "
              "step: the median step in that burst with all its streams decoding and no prompt chunk, from "
              "openinfer's step log (issue #12's goal: TPOT p50 ≤ 1.2× it at 256 streams)"]
    lines += [f"failed: {failure}" for failure in report.get("failures", [])]
    return "\n".join(lines)


def gpu_name() -> str:
    """The GPU's name, or a placeholder where nvidia-smi is missing (a CPU dry run)."""
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        found = ""
    return found or "unknown GPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen3-4b-random")
    parser.add_argument("--streams", default="1,16,64,256")
    parser.add_argument("--api-server-counts", default="1,2", help="openinfer runs to make; 0: none (vLLM only)")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--serve-args", default="", help="extra `openinfer serve` flags, e.g. '--max-num-batched-tokens 8192'")
    parser.add_argument("--vllm-url", help="a running vLLM OpenAI server serving the same checkpoint")
    parser.add_argument("--vllm-cmd", help="launch command for vLLM; {model} and {port} are filled in")
    parser.add_argument("--vllm-start-timeout", type=float, default=420.0)
    parser.add_argument("--clients", default="httpx", help="comma list of httpx, lean (see above)")
    parser.add_argument("--client-procs", type=int, default=4, help="processes of the lean client")
    parser.add_argument("--stub", action="store_true", help="CPU dry run with the stub engine (checks the script)")
    parser.add_argument("--tag", default="gpu_concurrency")
    parser.add_argument("--model-label", default="Qwen3-4B shape, random bf16",
                        help="what the checkpoint is, for the report and the plot (e.g. 'Qwen3.5-4B shape')")
    parser.add_argument("--append", action="store_true",
                        help="add to the runs already in results/TAG.json (e.g. vLLM in a later device call)")
    parser.add_argument("--ttft-contexts", default="",
                        help="comma list of prompt lengths for cold / warm-prefix TTFT rows after each sweep (default: none)")
    parser.add_argument("--ttft-repeats", type=int, default=3, help="fresh prompts per TTFT context (median)")
    parser.add_argument("--results-dir", default=str(HERE / "results"), help="where TAG.json and TAG.png go")
    parser.add_argument("--table", action="store_true",
                        help="only print the markdown comparison table of results/TAG.json (runs nothing)")
    args = parser.parse_args(argv)
    results = Path(args.results_dir)
    if args.table:
        print(comparison_table(json.loads((results / f"{args.tag}.json").read_text())))
        return 0
    args.ttft_contexts = [int(c) for c in args.ttft_contexts.split(",") if c.strip()]
    if args.ttft_repeats < 1 or any(c < 2 for c in args.ttft_contexts):
        parser.error("--ttft-repeats >= 1; each --ttft-contexts length >= 2 (a warm prompt changes the last token)")
    unknown = set(args.clients.split(",")) - {"httpx", "lean"}
    if unknown or args.client_procs < 1:
        parser.error(f"--clients takes httpx and/or lean (got {sorted(unknown)}); --client-procs >= 1")
    streams = [int(s) for s in args.streams.split(",")]
    checkpoint = Path(args.checkpoint)
    if args.stub:
        from openinfer.demo import ensure_demo_model
        from openinfer.engine_core.stub import write_stub_model

        checkpoint = write_stub_model(Path("/tmp/openinfer-stub-concurrency"), ensure_demo_model(), step_ms=14.5,
                                      max_model_len=args.max_model_len)
    elif not (checkpoint / "config.json").exists():
        # a child process, so torch's CUDA memory is gone before the servers size their KV pools
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from pathlib import Path; from gpu_cold_start import write_checkpoint; "
                        "print(f'wrote random checkpoint in {write_checkpoint(Path(sys.argv[2])):.1f}s')",
                        str(HERE), str(checkpoint)], check=True)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    if not (checkpoint / "tokenizer.json").exists():
        from gpu_serving import write_tokenizer

        write_tokenizer(checkpoint, vocab)
    warm_page_cache(checkpoint)
    device = "cpu (stub engine)" if args.stub else gpu_name()
    report = {"device": device, "model": "stub" if args.stub else args.model_label,
              "input_len": args.input_len, "output_len": args.output_len, "streams": streams, "runs": [],
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results.mkdir(parents=True, exist_ok=True)
    previous = results / f"{args.tag}.json"
    if args.append and previous.exists():
        report["runs"] = json.loads(previous.read_text()).get("runs", [])

    def save() -> None:
        (results / f"{args.tag}.json").write_text(json.dumps(report, indent=2))
        if report["runs"]:
            try:
                plot(report, results / f"{args.tag}.png")
            except ModuleNotFoundError as error:  # the JSON is the result; the PNG needs matplotlib
                print(f"no {args.tag}.png: {error} (pip install matplotlib)", file=sys.stderr)
        out = os.environ.get("OUT")
        if out and Path(out).resolve() != results.resolve():  # --results-dir $OUT: already there
            for suffix in (".json", ".png"):
                if (results / f"{args.tag}{suffix}").exists():
                    shutil.copy(results / f"{args.tag}{suffix}", out)

    for count in [int(c) for c in args.api_server_counts.split(",") if c.strip() and int(c) > 0]:
        try:
            report["runs"].append(run_openinfer(args, checkpoint, count, streams, vocab))
        except Exception as exc:  # keep what was measured; say what failed
            report.setdefault("failures", []).append(f"openinfer ×{count}: {exc!r}")
        save()
    if args.vllm_url or args.vllm_cmd:
        try:
            report["runs"].append(run_vllm(args, checkpoint, streams, vocab))
        except Exception as exc:
            report.setdefault("failures", []).append(f"vllm: {exc!r}")
        save()
    print(f"wrote {results / (args.tag + '.json')} and .png")
    if report["runs"]:
        print(comparison_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
