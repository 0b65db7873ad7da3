"""Serving benchmark: an async OpenAI-API client with seeded Poisson arrivals.

Sweeps request rates up to saturation and reports TTFT, TPOT, ITL (p50/p99), request and
output-token throughput; then cold and warm-prefix TTFT at several context lengths (``ttft_rows``:
a fresh prompt, then that prompt with only its last token changed, through the lean client of
``sse_client.py``; ``gpu_concurrency.py`` takes its TTFT rows from here too). Writes JSON + PNG
into benchmarks/results/.

    python benchmarks/serve.py --url http://127.0.0.1:8000 --input-len 1024 --output-len 128 \
        --rates 1,2,4,8,16,32,inf --num-requests 200
    python benchmarks/serve.py --launch --model-path DIR ...   # starts `openinfer serve` itself
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sse_client import StreamRecord, completion_body, stream_completion  # noqa: E402  (the lean client)

RESULTS = Path(__file__).resolve().parent / "results"
TTFT_OUTPUT_TOKENS = 1  # a TTFT request's max_tokens: its first token is all it is timed by


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                now = time.perf_counter()
                if payload.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                usage = payload.get("usage")
                if usage:
                    result.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
        result.latency = time.perf_counter() - start
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)
    return result


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    return {
        "rate": rate, "num_requests": len(results), "num_failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "ttft_ms": {"p50": 1e3 * percentile([r.ttft for r in ok], 50), "p99": 1e3 * percentile([r.ttft for r in ok], 99)},
        "tpot_ms": {"p50": 1e3 * percentile(tpots, 50), "p99": 1e3 * percentile(tpots, 99)},
        "itl_ms": {"p50": 1e3 * percentile(itls, 50), "p99": 1e3 * percentile(itls, 99)},
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


async def sweep_rate(url: str, model: str, rate: float, prompts: list[list[int]], output_len: int,
                     seed: int) -> dict:
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, model, prompt, output_len)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        return summarize(rate, results, time.perf_counter() - start)


def ttft_rows(url: str, model: str, contexts: list[int], repeats: int, vocab: int, seed: int = 1) -> list[dict]:
    """Cold and warm-prefix TTFT per context length, one request at a time, with the lean client
    (``sse_client``).

    Cold: a fresh random prompt of ``context`` tokens (never sent before: a load generated from
    another seed shares no prefix with it). Warm: that same prompt re-sent with only its last token
    changed, so every full KV block before it can come from the prefix cache (issue #16's
    warm-prefix row); its ``cached_tokens`` (where the server reports them) show whether it did.
    Medians over ``repeats`` fresh prompts; before them one discarded fresh prompt per context, so a
    kernel compiled or a graph captured on a prefill length's first use is not in a cold row."""
    parsed = urlsplit(url)
    rng = np.random.default_rng(seed)

    def send(prompt: list[int]) -> StreamRecord:
        body = completion_body(model, prompt, TTFT_OUTPUT_TOKENS)
        try:
            return asyncio.run(stream_completion(parsed.port or 80, body, host=parsed.hostname or "127.0.0.1"))
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:  # a row fails, the run goes on
            return StreamRecord(start=0.0, error=repr(exc))

    def fresh(context: int) -> list[int]:
        return rng.integers(100, vocab - 100, size=context).tolist()

    rows = []
    for context in contexts:
        send(fresh(context))  # the discarded first use of this length
        cold, warm = [], []
        for _ in range(repeats):
            prompt = fresh(context)
            cold.append(send(prompt))
            prompt[-1] = prompt[-1] + 1 if prompt[-1] + 1 < vocab - 100 else prompt[-1] - 1
            warm.append(send(prompt))
        cold_ms = [1e3 * (r.first - r.start) for r in cold if r.ok]
        warm_ms = [1e3 * (r.first - r.start) for r in warm if r.ok]
        row = {"context": context, "repeats": repeats,
               "cold_ttft_ms": float(np.median(cold_ms)) if cold_ms else float("nan"),
               "warm_ttft_ms": float(np.median(warm_ms)) if warm_ms else float("nan"),
               "cold_ttft_ms_each": cold_ms, "warm_ttft_ms_each": warm_ms,
               "cold_cached_tokens": [r.cached_tokens for r in cold if r.ok],
               "warm_cached_tokens": [r.cached_tokens for r in warm if r.ok],
               "num_failed": len(cold) + len(warm) - len(cold_ms) - len(warm_ms)}
        errors = sorted({r.error for r in cold + warm if not r.ok})
        if errors:
            row["errors"] = errors[:5]
        print(json.dumps({"ttft": row}), flush=True)
        rows.append(row)
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = report["sweep"]
    labels = [("∞" if not math.isfinite(s["rate"]) else f"{s['rate']:g}") for s in sweeps]
    x = np.arange(len(sweeps))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(x, [s["output_throughput"] for s in sweeps], "o-")
    left.set(xticks=x, xticklabels=labels, xlabel="request rate (req/s)", ylabel="output tokens/s",
             title="throughput vs request rate")
    right.plot(x, [s["ttft_ms"]["p50"] for s in sweeps], "o-", label="TTFT p50")
    right.plot(x, [s["ttft_ms"]["p99"] for s in sweeps], "s--", label="TTFT p99")
    right.set(xticks=x, xticklabels=labels, xlabel="request rate (req/s)", ylabel="ms", yscale="log",
              title="time to first token vs request rate")
    right.legend()
    fig.suptitle(f"openinfer serving — {report['device']} — {report['input_len']} in / {report['output_len']} out")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def wait_ready(url: str, timeout: float = 600.0) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            models = httpx.get(f"{url}/v1/models", timeout=2.0).json()
            return models["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            time.sleep(1.0)
    raise TimeoutError(f"no server answered at {url} within {timeout}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--launch", action="store_true", help="start `openinfer serve` for --model-path")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--serve-args", default="", help="extra arguments for `openinfer serve`")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rates", default="1,2,4,8,16,32,inf")
    parser.add_argument("--prefix-contexts", default="1024,4096,16384",
                        help="prompt lengths of the cold / warm-prefix TTFT rows (see ttft_rows)")
    parser.add_argument("--ttft-repeats", type=int, default=3, help="fresh prompts per TTFT context (median)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--device-name", default=None, help="recorded in the JSON (default: from the server)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="serve")
    args = parser.parse_args(argv)

    server = None
    if args.launch:
        port = args.url.rsplit(":", 1)[-1]
        command = [sys.executable, "-m", "openinfer.cli", "serve", "--port", port, "--grpc-port", "0"]
        if args.model_path:
            command += ["--model-path", args.model_path]
        command += args.serve_args.split()
        server = subprocess.Popen(command)
    try:
        model = wait_ready(args.url)
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(100, args.vocab_size - 100, size=args.input_len).tolist()
                   for _ in range(args.num_requests)]
        asyncio.run(sweep_rate(args.url, model, float("inf"), prompts[:4], 4, args.seed))  # warm-up
        sweep = []
        for rate_text in args.rates.split(","):
            rate = float(rate_text)
            summary = asyncio.run(sweep_rate(args.url, model, rate, prompts, args.output_len, args.seed))
            print(json.dumps(summary), flush=True)
            sweep.append(summary)
        ttft = ttft_rows(args.url, model, [int(c) for c in args.prefix_contexts.split(",") if c],
                         args.ttft_repeats, args.vocab_size, args.seed + 1)
        report = {"device": args.device_name or platform.node(), "model": model, "input_len": args.input_len,
                  "output_len": args.output_len, "num_requests": args.num_requests, "sweep": sweep,
                  "ttft": ttft, "python": platform.python_version(),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.tag}.json").write_text(json.dumps(report, indent=2))
        plot(report, RESULTS / f"{args.tag}.png")
        print(f"wrote {RESULTS / (args.tag + '.json')} and .png")
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
