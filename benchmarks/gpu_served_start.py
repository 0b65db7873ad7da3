"""Served start → HTTP ready of ``openinfer serve`` and its first request, per start-up variant.

For each ``--variant NAME[:ENV=VALUE,...]`` (environment switches of that start), two starts of
``openinfer serve`` (one API server, the engine core, the checkpoint in the page cache):

- ``cold``: CuPy's kernel disk cache a fresh empty folder (``CUPY_CACHE_DIR``; a fresh machine:
  every kernel compiles);
- ``warm``: the same folder again (a restart on the same machine).

Each start records the seconds from launching the command to HTTP ready (``/health`` 200 and a
model in ``/v1/models``, polled every 20 ms), every process's start-up phases (``--startup-report``:
spawn and imports, model load, KV, kernel compile, graph capture, prefill warm-up, API server
imports), then the first request's TTFT and the next ones' (fresh ``--prompt-len``-token prompts,
one output token, non-streaming: its latency is its TTFT plus one HTTP round trip), so a start made
shorter by building kernels later shows up as a slower first request. ``{kind}`` in a switch's value
becomes ``cold`` / ``warm`` (e.g. ``OPENINFER_STACK_SAMPLES=/tmp/stacks-{kind}.json``: a file per start).
Results: ``TAG.json`` in ``--results-dir`` (and ``$OUT`` when set); a summary table at the end.

    python benchmarks/gpu_served_start.py --variant base:OPENINFER_COMPILE_ORDER=discovery \\
        --variant new:OPENINFER_ONE_COMPILE_WAVE=1,OPENINFER_COMPILE_THREADS=16
    python benchmarks/gpu_served_start.py --stub      # CPU dry run of the script (stub engine)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_concurrency import free_port, stop  # noqa: E402  (one way to start and stop a server process tree)

STUB_FACTORY = "openinfer.engine_core.stub:create_stub_engine"
STARTUP_LINES = ("kernel modules", "captured", "prefill warm-up", "start-up", "Traceback", "Error")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME`` or ``NAME:ENV=VALUE,ENV=VALUE`` → (name, environment)."""
    name, _, switches = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected NAME[:ENV=VALUE,...]")
    env = {}
    for item in filter(None, switches.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {item!r} is not ENV=VALUE")
        env[key] = value
    return name, env


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, body=payload, headers={"Content-Type": "application/json"} if body else {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def wait_ready(port: int, process: subprocess.Popen, began: float, timeout: float) -> tuple[float, str]:
    """Seconds from ``began`` until /health answers 200 and /v1/models names a model; the model."""
    while time.perf_counter() - began < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            status, _ = request(port, "GET", "/health", timeout=2)
            if status == 200:
                status, body = request(port, "GET", "/v1/models")
                models = json.loads(body).get("data") if status == 200 else None
                if models:
                    return time.perf_counter() - began, models[0]["id"]
        except (OSError, ValueError, http.client.HTTPException):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"not ready within {timeout:.0f} s")


def timed_requests(port: int, model: str, prompt_len: int, count: int, seed: int) -> list[float]:
    """Seconds of ``count`` one-token completions of fresh ``prompt_len``-token prompts (each its
    own first token, so no prefix is cached)."""
    seconds = []
    for index in range(count):
        first = 1000 + (seed * 97 + index * 7919) % 20000
        prompt = [first + (i * 31) % 5000 for i in range(prompt_len)]
        began = time.perf_counter()
        status, body = request(port, "POST", "/v1/completions",
                               {"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}, timeout=120)
        seconds.append(time.perf_counter() - began)
        if status != 200:
            raise RuntimeError(f"completion failed ({status}): {body[:300]!r}")
    return seconds


CHECK_PROMPT = [int(t) for t in range(1000, 1064)]  # the same in every start: greedy outputs must agree


def greedy_check(port: int, model: str, max_tokens: int = 16) -> str:
    """The greedy completion of a fixed prompt: every variant of one checkpoint must give the same
    text (a start-up change that left a weight or a kernel wrong would not)."""
    status, body = request(port, "POST", "/v1/completions",
                           {"model": model, "prompt": CHECK_PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True}, timeout=120)
    if status != 200:
        return f"error {status}: {body[:200]!r}"
    return json.loads(body)["choices"][0]["text"]


def one_start(args: argparse.Namespace, env: dict[str, str], cache_dir: str, seed: int, kind: str = "cold") -> dict:
    port = free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="openinfer-served-start-"))
    report_path = run_dir / "startup.json"
    command = [sys.executable, "-m", "openinfer.cli", "serve", "--model-path", str(args.checkpoint),
               "--port", str(port), "--grpc-port", "0", "--max-model-len", str(args.max_model_len),
               "--api-server-count", "1", "--log-level", args.log_level, "--startup-report", str(report_path)]
    command += ["--engine-factory", STUB_FACTORY, "--device", "cpu", "--num-kv-blocks", "4000"] if args.stub \
        else ["--device", "cuda"]
    log_path = run_dir / "server.log"
    with open(log_path, "w") as log:
        began = time.perf_counter()
        switches = {key: value.replace("{kind}", kind) for key, value in env.items()}  # e.g. a path per start
        process = subprocess.Popen(command, start_new_session=True, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **switches, "CUPY_CACHE_DIR": cache_dir})
        try:
            ready_s, model = wait_ready(port, process, began, args.start_timeout)
            for _ in range(100):  # the supervisor writes it within a poll interval of HTTP ready
                if report_path.exists():
                    break
                time.sleep(0.05)
            startup = json.loads(report_path.read_text()) if report_path.exists() else None
            first = timed_requests(port, model, args.prompt_len, 1, seed)
            later = timed_requests(port, model, args.prompt_len, args.repeats, seed + 1)
            check = greedy_check(port, model)
        finally:
            stop(process)
    log = log_path.read_text()
    return {"ready_s": round(ready_s, 4), "startup": startup,
            "first_request_ms": round(1e3 * first[0], 2),
            "later_requests_ms": [round(1e3 * s, 2) for s in later],
            "later_median_ms": round(1e3 * statistics.median(later), 2) if later else None,
            "greedy_check": check,
            # the start-up lines of the server's log (kernel modules built, graphs, warm-up), and its end
            "server_log_start_up": [line for line in log.splitlines() if any(key in line for key in STARTUP_LINES)],
            "server_log_tail": log[-2000:] if args.keep_logs else None}


def write(results: dict, args: argparse.Namespace) -> None:
    for out in [Path(args.results_dir)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.tag}.json").write_text(json.dumps(results, indent=2))


def core_phases(start: dict) -> dict:
    return ((start.get("startup") or {}).get("engine-core") or {}).get("phases") or {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen3-4b-random")
    parser.add_argument("--variant", action="append", type=parse_variant, default=[],
                        help="NAME[:ENV=VALUE,...]; repeat for several (default: one named 'default')")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=1024, help="tokens of each timed request's prompt")
    parser.add_argument("--repeats", type=int, default=3, help="fresh prompts timed after the first")
    parser.add_argument("--only-cold", action="store_true", help="no warm restart")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--log-level", default="info", help="the server's (its log tail is kept with --keep-logs)")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--stub", action="store_true", help="CPU dry run with the stub engine (checks the script)")
    parser.add_argument("--tag", default="gpu_served_start")
    parser.add_argument("--results-dir", default=str(HERE / "results"))
    args = parser.parse_args()
    variants = args.variant or [("default", {})]
    if args.stub:
        from openinfer.demo import ensure_demo_model
        from openinfer.engine_core.stub import write_stub_model

        args.checkpoint = write_stub_model(Path(tempfile.mkdtemp(prefix="openinfer-stub-start-")), ensure_demo_model(),
                                           step_ms=5.0, max_model_len=args.max_model_len)
    else:
        for file in Path(args.checkpoint).glob("*.safetensors"):  # into the page cache
            with open(file, "rb") as handle:
                while handle.read(1 << 24):
                    pass
    results: dict = {"checkpoint": str(args.checkpoint), "prompt_len": args.prompt_len, "variants": {}}
    for seed, (name, env) in enumerate(variants):
        with tempfile.TemporaryDirectory(prefix="cupy-cache-") as cache_dir:
            runs = {"env": env}
            for kind in ("cold",) if args.only_cold else ("cold", "warm"):
                try:
                    runs[kind] = one_start(args, env, cache_dir, seed=10 * seed + (kind == "warm"), kind=kind)
                except Exception as exc:  # noqa: BLE001 — one failed variant must not lose the others
                    runs[kind] = {"error": repr(exc)}
                run = runs[kind]
                if "error" in run:
                    print(f"{name} {kind}: FAILED {run['error']}", flush=True)
                else:
                    print(f"{name} {kind}: ready {run['ready_s']:.2f} s, first request {run['first_request_ms']:.1f} ms "
                          f"(later {run['later_median_ms']} ms); engine core {json.dumps(core_phases(run))}", flush=True)
            results["variants"][name] = runs
            write(results, args)  # after each variant: a run cut short keeps what it measured
    checks = {run.get("greedy_check") for runs in results["variants"].values() for kind, run in runs.items()
              if kind in ("cold", "warm") and "error" not in run}
    results["greedy_outputs_agree"] = len(checks) == 1
    write(results, args)
    print(f"\ngreedy outputs of every start agree: {len(checks) == 1} ({len(checks)} distinct)")
    print("variant      start  ready_s  first_ms  later_ms  kernel_compile  prefill_warmup  model_load")
    for name, runs in results["variants"].items():
        for kind in ("cold", "warm"):
            run = runs.get(kind)
            if not run or "error" in run:
                continue
            phases = core_phases(run)
            print(f"{name:12s} {kind:5s} {run['ready_s']:8.2f} {run['first_request_ms']:9.1f} "
                  f"{run['later_median_ms'] or 0:9.1f} {phases.get('kernel_compile', 0):15.2f} "
                  f"{phases.get('prefill_warmup', 0):15.2f} {phases.get('model_load', 0):11.2f}")


if __name__ == "__main__":
    main()
