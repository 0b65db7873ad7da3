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

    python benchmarks/gpu_concurrency.py
    python benchmarks/gpu_concurrency.py --vllm-cmd "env PYTHONPATH=/tmp/vsite:/tmp/site python3 -m \
        vllm.entrypoints.openai.api_server --model {model} --port {port} --max-model-len 4096 \
        --gpu-memory-utilization 0.85"
    python benchmarks/gpu_concurrency.py --stub --streams 4,16 --api-server-counts 1   # CPU dry run
Writes benchmarks/results/gpu_concurrency.json and .png (copies under $OUT when set).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve import sweep_rate  # noqa: E402  (benchmarks/serve.py: the streaming client)

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


def sweep(url: str, model: str, streams: list[int], input_len: int, output_len: int, vocab: int) -> list[dict]:
    rng = np.random.default_rng(0)

    def fresh(count: int) -> list[list[int]]:
        # never a prompt seen before: both servers cache prefixes, and a point must measure cold prefill
        return [rng.integers(100, vocab - 100, size=input_len).tolist() for _ in range(count)]

    asyncio.run(sweep_rate(url, model, float("inf"), fresh(4), 4, 0))  # warm-up
    rows = []
    for count in streams:
        summary = asyncio.run(sweep_rate(url, model, float("inf"), fresh(count), output_len, count))
        summary["streams"] = count
        print(json.dumps(summary), flush=True)
        rows.append(summary)
    return rows


def run_openinfer(args: argparse.Namespace, checkpoint: Path, api_servers: int, streams: list[int],
                  vocab: int) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "openinfer.cli", "serve", "--model-path", str(checkpoint), "--port", str(port),
               "--grpc-port", "0", "--max-model-len", str(args.max_model_len), "--api-server-count",
               str(api_servers), "--log-level", "warning"]
    command += ["--engine-factory", STUB_FACTORY, "--device", "cpu", "--num-kv-blocks", "40000"] if args.stub \
        else ["--device", "cuda"]
    command += shlex.split(args.serve_args)
    startup_report = Path(tempfile.mkdtemp(prefix="openinfer-startup-")) / "startup.json"
    command += ["--startup-report", str(startup_report)]
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(command, start_new_session=True)
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
        rows = sweep(url, model, streams, args.input_len, args.output_len, vocab)
    finally:
        stop(process)
    extra = f", {args.serve_args}" if args.serve_args else ""
    return {"server": "openinfer", "label": f"openinfer ({api_servers} API server{'s' if api_servers > 1 else ''}{extra})",
            "api_server_count": api_servers, "cold_start_to_http_ready_s": ready_s, "startup": startup,
            "idle_rss_bytes": {"total": sum(rss.values()), **rss}, "sweep": rows}


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
        rows = sweep(url, model, streams, args.input_len, args.output_len, vocab)
    finally:
        if process is not None:
            stop(process)
    return {"server": "vllm", "label": "vLLM", "cold_start_to_http_ready_s": ready_s if process else None,
            "idle_rss_bytes": {"total": rss} if rss else None, "sweep": rows}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in report["runs"]:
        xs = [r["streams"] for r in run["sweep"]]
        left.plot(xs, [r["output_throughput"] for r in run["sweep"]], "o-", label=run["label"])
        right.plot(xs, [r["tpot_ms"]["p50"] for r in run["sweep"]], "o-", label=run["label"])
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams (burst)")
        axis.legend()
    left.set(ylabel="output tokens/s", title="throughput")
    right.set(ylabel="ms", title="e2e TPOT p50")
    fig.suptitle(f"{report['device']} — {report['model']} — {report['input_len']} in / {report['output_len']} out")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    parser.add_argument("--stub", action="store_true", help="CPU dry run with the stub engine (checks the script)")
    parser.add_argument("--tag", default="gpu_concurrency")
    parser.add_argument("--append", action="store_true",
                        help="add to the runs already in results/TAG.json (e.g. vLLM in a later device call)")
    args = parser.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    checkpoint = Path(args.checkpoint)
    if args.stub:
        from openinfer.demo import ensure_demo_model
        from openinfer.engine_core.stub import write_stub_model

        checkpoint = write_stub_model(Path("/tmp/openinfer-stub-concurrency"), ensure_demo_model(), step_ms=14.5)
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
    device = "cpu (stub engine)" if args.stub else (subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        or "unknown GPU")
    report = {"device": device, "model": "stub" if args.stub else "Qwen3-4B shape, random bf16",
              "input_len": args.input_len, "output_len": args.output_len, "streams": streams, "runs": [],
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    previous = results / f"{args.tag}.json"
    if args.append and previous.exists():
        report["runs"] = json.loads(previous.read_text()).get("runs", [])

    def save() -> None:
        (results / f"{args.tag}.json").write_text(json.dumps(report, indent=2))
        if report["runs"]:
            plot(report, results / f"{args.tag}.png")
        if os.environ.get("OUT"):
            for suffix in (".json", ".png"):
                if (results / f"{args.tag}{suffix}").exists():
                    shutil.copy(results / f"{args.tag}{suffix}", os.environ["OUT"])

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
