"""Where a warm prefix-cache request's time goes on the host (CPU; no GPU needed).

A request whose prompt is cached but for its last few tokens should cost about one decode step.
Whatever the engine does on the host before and after that step is the same on a GPU, so this
measures it with the model's forward replaced by a stub that returns zero logits at once: a tiny
random Qwen3 with a 32k context, a cold request of ``--context`` tokens, then ``--warm`` requests
sharing all but the last 8 tokens. Reports each warm request's host TTFT and a profile of the
engine loop's steps (cumulative time per function, per warm request). ``--http`` sends the same
requests as token-id prompts to the HTTP app in-process (the demo model's tokenizer, vocab 49152)
and profiles the event loop's thread too: what the API server adds before and after the engine
(``--text``: the prompt as text, which the server tokenizes). Bodies are JSON-encoded before each
request's clock starts, as a client in another process would. ``--serve``: the whole served path
instead, ``openinfer serve`` (an API-server process and the engine-core process) with the stub
engine (``openinfer.engine_core.stub``, a fixed ``--stub-step-ms`` per step), cold and warm TTFT
rows of benchmarks/serve.py's lean client at each ``--contexts`` length: warm TTFT minus the stub
step is the host's part of a warm request on this machine's CPU. ``--device cuda``: the engine path
with a Qwen3-4B-shaped model on the GPU instead of the stub (random weights, short-prefill graphs
on): the warm TTFT with its real device step, and where the engine's step spends its host time
around it (``--contexts``: one engine, a cold and ``--warm`` warm requests at each length).
``--serve --spans``: after the TTFT rows, the server again with a span probe in both processes
(every call of the functions in ``SPAN_TARGETS`` timed, one line per call to a file): each warm
request's timeline from the client's connect to its first token, cut into segments (HTTP parse,
body decode, validation, the hop to the engine core, admission, scheduling, the device step, the
hop back, the SSE write), medians per context length.

    python benchmarks/warm_prefix_host.py --context 16384 --out benchmarks/results/warm_prefix_host.json
    python benchmarks/warm_prefix_host.py --serve --contexts 1024 16384 --spans --out /tmp/warm_prefix_serve.json
    python benchmarks/warm_prefix_host.py --device cuda --contexts 1024 4096 16384 --out /tmp/warm_prefix_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import importlib.abc
import inspect
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


SERVER_FRAMES = ("/frontend/", "/http/", "pydantic", "fastapi/routing", "tokenizer", "json/", "validation")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--warm", type=int, default=5)
    parser.add_argument("--cold", type=int, default=1, help="the engine path: cold requests per context (fresh "
                                                            "prompts; the median is reported)")
    parser.add_argument("--http", action="store_true", help="through the HTTP app (in-process ASGI)")
    parser.add_argument("--text", action="store_true", help="with --http: the prompt as text (the prefix's ids "
                                                              "decoded), tokenized by the server")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "warm_prefix_host.json"))
    parser.add_argument("--compare", help="a JSON of an earlier run (e.g. before a change): plotted next to "
                                          "this one in a PNG beside --out")
    parser.add_argument("--serve", action="store_true", help="the served path: openinfer serve with the stub engine")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="prompt lengths (--serve: default 1024 16384; the engine path: default --context)")
    parser.add_argument("--spans", action="store_true", help="with --serve: the warm requests' timelines through both "
                                                             "processes (a span probe; a second server run)")
    parser.add_argument("--repeats", type=int, default=7, help="with --serve: fresh prompts per context (median)")
    parser.add_argument("--stub-step-ms", type=float, default=1.0, help="with --serve: the stub's device step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="with --serve: the engine's step budget (8192: the GPU default, so a cold prompt takes "
                             "the steps it takes on a GPU; its host part is then cold TTFT minus those steps)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the engine path (no --http/--serve) with a Qwen3-4B-shaped model on the GPU "
                             "(random weights, short-prefill graphs on) instead of the stubbed tiny model: the host "
                             "work around a real warm step, the device step included in the TTFT")
    args = parser.parse_args()
    if args.device == "cuda" and (args.http or args.serve):
        parser.error("--device cuda measures the engine path only (no --http / --serve)")
    if args.contexts is not None and args.http:
        parser.error("--http takes one --context")
    if args.cold < 1 or args.warm < 1:
        parser.error("--cold and --warm are >= 1")
    if args.spans and not args.serve:
        parser.error("--spans goes with --serve")
    if args.serve:
        args.contexts = args.contexts or [1024, 16384]
        if args.repeats < 1 or any(c < 2 for c in args.contexts) or args.stub_step_ms < 0:
            parser.error("--repeats >= 1, --contexts >= 2 tokens each, --stub-step-ms >= 0")
        serve_rows(args)
        return

    import openinfer
    from openinfer.v1 import engine_pb2 as pb
    sys.path.insert(0, str(Path(__file__).parent))
    from model_shapes import TINY_QWEN3, write_config_dir

    contexts = sorted(set(args.contexts or [args.context]))
    n = contexts[-1]  # the engine is sized for the longest; the profiles are of its warm requests
    if args.device == "cuda":
        from gpu_bench import QWEN3_4B

        os.environ.setdefault("OPENINFER_PREFILL_GRAPHS", "1")  # the warm step's short-prefill graph
        path = write_config_dir(Path(tempfile.mkdtemp()) / "qwen3-4b", {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **QWEN3_4B, "bos_token_id": 1,
            "eos_token_id": 2}, max_position_embeddings=max(32768, n + 64))
    else:
        path = write_config_dir(Path(tempfile.mkdtemp()) / "tiny", TINY_QWEN3, max_position_embeddings=32768,
                                vocab_size=49152 if args.http else 96)
    if args.http:
        import shutil

        tokenizer_dir = demo_or_generated_tokenizer(Path(tempfile.mkdtemp()))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, path / name)
    if args.device == "cuda":
        engine = openinfer.create_engine(str(path), device="cuda", max_model_len=n + 64, max_num_seqs=1,
                                         load_format="dummy")
    else:
        engine = openinfer.create_engine(str(path), device="cpu", num_kv_blocks=n // 16 + 64, max_model_len=n + 64,
                                         max_num_batched_tokens=n + 16, load_format="dummy")
        vocab = engine.model.spec.vocab_size
        engine.model.forward = lambda batch, kv: np.zeros((len(batch.logits_rows), vocab), np.float32)
    profile = cProfile.Profile()
    step = engine.step
    profiling = {"on": False}

    def profiled_step() -> None:
        if not profiling["on"]:
            return step()
        profile.enable()
        try:
            return step()
        finally:
            profile.disable()

    engine.step = profiled_step
    rng = np.random.default_rng(0)
    prefixes = {c: rng.integers(3, 90, c - 8).tolist() for c in contexts}  # distinct per length
    prefix = prefixes[n]

    cpu_ms: list[float] = []  # CPU time of the whole process (every thread) to each warm first token
    per_context: dict[int, tuple[float, list[float]]] = {}  # engine path: (cold, warm TTFTs) per length
    cold_each: dict[int, list[float]] = {}  # engine path: every cold TTFT per length (--cold)

    async def one(request_id: str, prefix: list[int] = prefix) -> float:
        # the prompt as the int32 array beside the request, as the engine core receives it
        prompt = np.array(prefix + rng.integers(3, 90, 8).tolist(), np.int32)
        began, began_cpu, first = time.perf_counter(), time.process_time(), None
        request = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(temperature=0.0),
                                     stop=pb.StopConditions(max_tokens=1, ignore_eos=True))
        async for event in engine.generate_prompt_array(request, prompt):
            if event.WhichOneof("event") == "tokens" and first is None:
                first = time.perf_counter() - began
                if not profiling["on"]:
                    cpu_ms.append(1e3 * (time.process_time() - began_cpu))
        return first

    frontend_profile = cProfile.Profile()

    text_prefix = {}  # --text: the prefix as text (decoded once), each request adding a few words

    async def one_http(http, request_id: str) -> float:
        suffix = rng.integers(3, 90, 8).tolist()
        prompt = text_prefix["text"] + " " + " ".join(map(str, suffix)) if args.text else prefix + suffix
        # encoded before the clock starts: a real client does that in its own process
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True}).encode()
        began, began_cpu, first = time.perf_counter(), time.process_time(), None
        async with http.stream("POST", "/v1/completions", content=body,
                               headers={"content-type": "application/json"}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - began
                    if not profiling["on"]:
                        cpu_ms.append(1e3 * (time.process_time() - began_cpu))
        return first

    async def run() -> tuple[float, list[float]]:
        """TTFTs unprofiled; then the same warm requests again under the profilers."""
        if not args.http:
            async def colds(c: int) -> float:
                """``--cold`` - 1 fresh prompts of this length, then the one whose prefix the warm
                requests share: their TTFTs kept (``cold_each``), the median returned."""
                times = [await one(f"cold-{c}-{k}", rng.integers(3, 90, c - 8).tolist()) for k in range(args.cold - 1)]
                times.append(await one(f"cold-{c}", prefixes[c]))
                cold_each[c] = times
                return float(np.median(times))

            for c in contexts[:-1]:  # the shorter lengths first: TTFTs only
                per_context[c] = (await colds(c), [await one(f"warm-{c}-{i}", prefixes[c]) for i in range(args.warm)])
            cpu_ms.clear()
            cold = await colds(n)
            warm = [await one(f"warm{i}") for i in range(args.warm)]
            profiling["on"] = True
            for i in range(args.warm):
                await one(f"profiled{i}")
            return cold, warm
        import httpx

        from openinfer.frontend.http import create_app
        from openinfer.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(path)
        text_prefix["text"] = tokenizer.decode(prefix)
        app = create_app(engine, tokenizer, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b", timeout=600) as http:
            cold = await one_http(http, "cold")
            warm = [await one_http(http, f"warm{i}") for i in range(args.warm)]
            profiling["on"] = True
            frontend_profile.enable()
            for i in range(args.warm):
                await one_http(http, f"profiled{i}")
            frontend_profile.disable()
            return cold, warm

    try:
        cold, warm = asyncio.run(run())
    finally:
        engine.close_sync()

    def top(profile: cProfile.Profile, keep: str) -> list[dict]:
        rows = []
        for (filename, line, function), (_, calls, _, cumulative, _) in pstats.Stats(profile).stats.items():
            if keep in filename:
                rows.append({"function": f"{Path(filename).name}:{line}({function})", "calls": calls,
                             "cumulative_ms_per_request": 1e3 * cumulative / args.warm})
        return sorted(rows, key=lambda r: -r["cumulative_ms_per_request"])[:20]

    def top_all(profile: cProfile.Profile) -> list[dict]:
        return [{"function": f"{filename}:{line}({function})", "calls": calls,
                 "cumulative_ms_per_request": 1e3 * cumulative / args.warm}
                for (filename, line, function), (_, calls, _, cumulative, _) in pstats.Stats(profile).stats.items()]

    rows = top(profile, str(Path(openinfer.__file__).resolve().parent))  # the package's own frames
    if args.device == "cuda":  # and the plugins' and CuPy's (a device wait shows as a CuPy frame)
        rows = sorted(rows + [r for r in top_all(profile) if "/plugins/" in r["function"] or "cupy" in r["function"]],
                      key=lambda r: -r["cumulative_ms_per_request"])[:30]
    result = {"context": n, "device": args.device,
              "through": (f"HTTP app (ASGI, {'text' if args.text else 'token-id'} prompt, streamed)" if args.http
                          else "EngineHandle"),
              "cold_host_ttft_ms": 1e3 * cold, "warm_host_ttft_ms": [1e3 * w for w in warm],
              "warm_host_ttft_ms_median": 1e3 * float(np.median(warm)),
              "warm_host_ttft_ms_min": 1e3 * float(np.min(warm)), "engine_step_profile": rows,
              "note": ("Qwen3-4B-shaped model on the GPU: TTFT = host work + the device step" if args.device == "cuda"
                       else "model forward stubbed: host time only") + ", on the CPU of the machine that ran it; "
                      "TTFTs unprofiled, profiles (cProfile, inflated by it) from a second round of the same requests"}
    per_context[n] = (cold, warm)
    if args.contexts:  # every length's TTFTs (the fields above: the longest's)
        result["rows"] = [{"context": c, "cold_ttft_ms": 1e3 * c_cold,
                           "cold_ttft_ms_each": [1e3 * t for t in cold_each.get(c, [c_cold])],
                           "warm_ttft_ms": [1e3 * w for w in c_warm],
                           "warm_ttft_ms_median": 1e3 * float(np.median(c_warm)),
                           "warm_ttft_ms_min": 1e3 * float(np.min(c_warm))}
                          for c, (c_cold, c_warm) in sorted(per_context.items())]
        result["prefill_graphs"] = os.environ.get("OPENINFER_PREFILL_GRAPHS", "default")
    if cpu_ms:  # robust where the machine is shared: wall time includes waiting for a core
        result["warm_process_cpu_ms"] = cpu_ms[1:]
        result["warm_process_cpu_ms_median"] = float(np.median(cpu_ms[1:]))
    if args.http:
        # the API server's own frames (the benchmark's client shares the loop and is left out)
        result["event_loop_profile"] = sorted(
            (row for row in top_all(frontend_profile) if any(k in row["function"] for k in SERVER_FRAMES)),
            key=lambda r: -r["cumulative_ms_per_request"])[:25]
        # the outermost server frame: the API server's CPU on the event loop per request (profiled),
        # the engine's thread and the tokenizer's worker threads left out
        result["warm_server_event_loop_ms_profiled"] = result["event_loop_profile"][0]["cumulative_ms_per_request"]
    if args.compare:
        earlier = json.loads(Path(args.compare).read_text())
        result["compared_with"] = {"path": args.compare, **{k: v for k, v in earlier.items()
                                                           if k.startswith(("warm_", "cold_")) or k == "rows"}}
        if "rows" in result and "rows" in earlier:  # per context length (e.g. eager vs short-prefill graphs)
            plot_rows_comparison(earlier, result, Path(args.out).with_suffix(".png"), Path(args.compare).stem,
                                 Path(args.out).stem)
        else:
            plot_comparison(result, Path(args.out).with_suffix(".png"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"context {n}: warm host TTFT median {result['warm_host_ttft_ms_median']:.1f} ms, "
          f"min {result['warm_host_ttft_ms_min']:.1f} ms; process CPU per warm request median "
          f"{result.get('warm_process_cpu_ms_median', float('nan')):.1f} ms")
    for row in result.get("rows", []):
        print(f"context {row['context']}: warm TTFT median {row['warm_ttft_ms_median']:.2f} ms, min "
              f"{row['warm_ttft_ms_min']:.2f} ms; cold {row['cold_ttft_ms']:.1f} ms")
    for name in ("engine_step_profile", "event_loop_profile"):
        if name in result:
            print(name)
            for row in result[name][:14]:
                print(f"  {row['cumulative_ms_per_request']:8.2f} ms  {row['calls']:6d}  {row['function']}")


def serve_rows(args: argparse.Namespace) -> None:
    """Cold and warm TTFT rows through ``openinfer serve`` with the stub engine (and with
    ``--spans``, the warm requests' timelines from a second server run with the span probe)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from serve import ttft_rows

    work = Path(tempfile.mkdtemp())
    with stub_server(args, work) as (url, model, vocab):
        rows = ttft_rows(url, model, args.contexts, args.repeats, vocab)
    for row in rows:
        row["warm_host_ms"] = row["warm_ttft_ms"] - args.stub_step_ms
        row["warm_host_ms_min"] = min(row["warm_ttft_ms_each"], default=float("nan")) - args.stub_step_ms
        if args.max_num_batched_tokens:  # the cold prompt's steps, as the scheduler chunks it
            row["cold_steps"] = -(-row["context"] // args.max_num_batched_tokens)
            row["cold_host_ms"] = row["cold_ttft_ms"] - row["cold_steps"] * args.stub_step_ms
    result = {"through": "openinfer serve (API server + engine-core processes), stub engine", "stub_step_ms":
              args.stub_step_ms, "max_num_batched_tokens": args.max_num_batched_tokens, "ttft": rows,
              "note": "warm_host_ms = warm TTFT - the stub's step; cold_host_ms = cold TTFT - its steps; this CPU"}
    if args.spans:
        result["spans"] = span_rows(args, work)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.compare:
        plot_serve_comparison(json.loads(Path(args.compare).read_text()), result, Path(args.out).with_suffix(".png"),
                              Path(args.compare).stem, Path(args.out).stem)
    for row in rows:
        print(f"context {row['context']}: warm TTFT {row['warm_ttft_ms']:.2f} ms (min "
              f"{row['warm_host_ms_min'] + args.stub_step_ms:.2f}), host part {row['warm_host_ms']:.2f} ms; "
              f"cold {row['cold_ttft_ms']:.2f} ms" + (f" (host part {row['cold_host_ms']:.2f} ms over "
                                                      f"{row['cold_steps']} steps)" if "cold_host_ms" in row else "")
              + f"; cached {row['warm_cached_tokens']}")
    for row in result.get("spans", []):
        print(f"context {row['context']}: warm timeline (span probe on; medians of {row['requests']}, ms): "
              + ", ".join(f"{name} {ms:.3f}" for name, ms in row["segments_ms"].items()))


class stub_server:
    """``openinfer serve`` of a stub model (``--stub-step-ms``) for ``args.contexts``: a context
    manager giving (url, model name, vocab size); ``env``: extra environment of its processes."""

    def __init__(self, args: argparse.Namespace, work: Path, env: dict[str, str] | None = None):
        self.args, self.work, self.env = args, work, env

    def __enter__(self) -> tuple[str, str, int]:
        import subprocess

        import httpx
        from gpu_concurrency import free_port, wait_ready

        from openinfer.engine_core.stub import FACTORY_SPEC, write_stub_model

        max_len = max(self.args.contexts) + 64
        checkpoint = self.work / "stub"
        if not checkpoint.exists():
            write_stub_model(checkpoint, demo_or_generated_tokenizer(self.work), step_ms=self.args.stub_step_ms,
                             max_model_len=max_len)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        port = free_port()
        command = [sys.executable, "-m", "openinfer.cli", "serve", "--model-path", str(checkpoint), "--port",
                   str(port), "--grpc-port", "0", "--max-model-len", str(max_len), "--api-server-count", "1",
                   "--log-level", "warning", "--engine-factory", FACTORY_SPEC, "--device", "cpu",
                   "--num-kv-blocks", str(4 * max_len // 16 + 64)]
        if self.args.max_num_batched_tokens:
            command += ["--max-num-batched-tokens", str(self.args.max_num_batched_tokens)]
        self.process = subprocess.Popen(command, start_new_session=True, env={**os.environ, **(self.env or {})})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, self.process, 300)
            model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        except BaseException:
            self.__exit__()
            raise
        return url, model, vocab

    def __exit__(self, *_: object) -> None:
        import signal

        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(30)


# --- the span probe (``--serve --spans``) -----------------------------------------------------

# module -> functions (qualified names) whose every call the probe times in the served processes
SPAN_TARGETS = {
    "uvicorn.protocols.http.httptools_impl": ["HttpToolsProtocol.data_received", "RequestResponseCycle.send"],
    "openinfer.frontend.http.middleware": ["BodySizeLimitMiddleware.__call__"],
    "openinfer.frontend.http.body": ["decode_json_token_ids"],
    "openinfer.frontend.http.completions": ["create_completion"],
    "openinfer.frontend.http.context": ["build_plans"],
    "openinfer.engine_core.client": ["EngineCoreClient._send"],
    "openinfer.engine_core.slots": ["dispatch"],
    "openinfer.engine_core.process": ["CoreTransport._handle", "CoreTransport.deliver"],
    "openinfer.runtime.engine": ["PagedEngine.admit", "PagedEngine._step", "PagedEngine._resolve"],
    "openinfer.sched.scheduler": ["Scheduler.schedule"],
    "openinfer.kv.manager": ["KVCacheManager.start_request"],
}
SPAN_FILE_ENV = "OPENINFER_BENCH_SPAN_FILE"


def install_span_probe(path: str) -> None:
    """Wrap ``SPAN_TARGETS`` as their modules load: each call appends ``pid name begin_ns end_ns``
    to ``path`` (perf_counter_ns: one clock for every process of the machine)."""
    descriptor: list[int] = []

    def record(name: str, began: int) -> None:
        if not descriptor:
            descriptor.append(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        os.write(descriptor[0], f"{os.getpid()} {name} {began} {time.perf_counter_ns()}\n".encode())

    def timed(name: str, function):
        if inspect.iscoroutinefunction(function):
            @functools.wraps(function)
            async def timed_coroutine(*args, **kwargs):
                began = time.perf_counter_ns()
                try:
                    return await function(*args, **kwargs)
                finally:
                    record(name, began)
            return timed_coroutine

        @functools.wraps(function)
        def timed_call(*args, **kwargs):
            began = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                record(name, began)
        return timed_call

    class Loader(importlib.abc.Loader):
        def __init__(self, inner, module_name: str):
            self.inner, self.module_name = inner, module_name

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module) -> None:
            self.inner.exec_module(module)
            for qualified in SPAN_TARGETS[self.module_name]:
                *owners, attribute = qualified.split(".")
                owner = module
                for name in owners:
                    owner = getattr(owner, name)
                setattr(owner, attribute, timed(qualified, getattr(owner, attribute)))

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, search_path, target=None):
            if fullname not in SPAN_TARGETS:
                return None
            for finder in sys.meta_path:
                spec = finder.find_spec(fullname, search_path, target) if finder is not self and hasattr(
                    finder, "find_spec") else None
                if spec is not None:
                    spec.loader = Loader(spec.loader, fullname)
                    return spec
            return None

    sys.meta_path.insert(0, Finder())


# a warm request's milestones: (name, span, which edge, after which milestone); each segment of
# the report is the time from one milestone to the next
MILESTONES = [
    ("http_data", "HttpToolsProtocol.data_received", "begin", None),
    ("asgi_app", "BodySizeLimitMiddleware.__call__", "begin", None),
    ("body_decode", "decode_json_token_ids", "begin", None),
    ("body_decoded", "decode_json_token_ids", "end", None),
    ("handler", "create_completion", "begin", None),
    ("plans_built", "build_plans", "end", None),
    ("sent_to_core", "EngineCoreClient._send", "begin", None),
    ("core_received", "CoreTransport._handle", "begin", None),
    ("admitted", "PagedEngine.admit", "end", "core_received"),
    ("scheduled", "Scheduler.schedule", "end", "admitted"),
    ("launched", "PagedEngine._step", "end", "admitted"),
    ("read_back", "PagedEngine._resolve", "end", "launched"),
    ("token_sent", "CoreTransport.deliver", "end", "read_back"),
    ("token_received", "dispatch", "begin", "token_sent"),
    ("sse_write", "RequestResponseCycle.send", "begin", "token_received"),
    ("sse_written", "RequestResponseCycle.send", "end", "token_received"),
]


def span_probe_env(work: Path) -> tuple[dict[str, str], Path]:
    """The environment that makes every Python process started with it install the span probe
    (a ``sitecustomize`` on its path), and the file the probe appends to."""
    probe_dir = work / "span_probe"
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        f"from warm_prefix_host import install_span_probe\n"
        f"install_span_probe(os.environ[{SPAN_FILE_ENV!r}])\n")
    span_file = work / "spans.txt"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(probe_dir), os.environ.get("PYTHONPATH")])),
           SPAN_FILE_ENV: str(span_file)}
    return env, span_file


def warm_timelines(port: int, model: str, vocab: int, contexts: list[int], repeats: int, seed: int = 2
                   ) -> dict[int, list[tuple[float, float]]]:
    """Per context, ``repeats`` warm requests (each after its own cold one, with a pause after
    each so the cold request's frees settle): (client start, first token) in perf_counter ms."""
    sys.path.insert(0, str(Path(__file__).parent))
    from sse_client import completion_body, stream_completion

    rng = np.random.default_rng(seed)
    timelines: dict[int, list[tuple[float, float]]] = {}

    def send(prompt: list[int]):
        return asyncio.run(stream_completion(port, completion_body(model, prompt, 1)))

    for context in contexts:
        send(rng.integers(100, vocab - 100, context).tolist())  # a length's first use
        timelines[context] = []
        for _ in range(repeats):
            prompt = rng.integers(100, vocab - 100, context).tolist()
            send(prompt)
            time.sleep(0.05)  # the cold request's frees and stray messages settle
            prompt[-1] = prompt[-1] + 1 if prompt[-1] + 1 < vocab - 100 else prompt[-1] - 1
            record = send(prompt)
            if record.ok:
                timelines[context].append((1e3 * record.start, 1e3 * record.first))
            time.sleep(0.05)
    return timelines


def timeline_rows(span_file: Path, timelines: dict[int, list[tuple[float, float]]]) -> list[dict]:
    """Per context, the median time between consecutive milestones (``MILESTONES``) of each
    warm request in ``timelines``, from the probe's ``span_file``."""
    spans = []
    for line in span_file.read_text().splitlines():
        _, name, began, ended = line.split()
        spans.append((int(began) / 1e6, int(ended) / 1e6, name))
    spans.sort()
    rows = []
    for context, requests in timelines.items():
        segments: dict[str, list[float]] = {}
        for start, first in requests:
            inside = [(b - start, e - start, name) for b, e, name in spans if start <= b <= first]
            at = {"client_start": 0.0}
            for milestone, span, edge, after in MILESTONES:
                floor = at.get(after, 0.0) if after else 0.0
                at[milestone] = next((b if edge == "begin" else e for b, e, name in inside
                                      if name == span and b >= floor), float("nan"))
            at["client_first_token"] = first - start
            names = list(at)
            for earlier, later in zip(names, names[1:], strict=False):
                segments.setdefault(f"{earlier}->{later}", []).append(at[later] - at[earlier])
        rows.append({"context": context, "requests": len(requests),
                     "ttft_ms_median": float(np.median([f - s for s, f in requests])) if requests else float("nan"),
                     "segments_ms": {k: float(np.nanmedian(v)) for k, v in segments.items()}})
    return rows


def span_rows(args: argparse.Namespace, work: Path) -> list[dict]:
    """Warm requests one at a time through a stub server with the span probe; per context, the
    median time between consecutive milestones of each request (``MILESTONES``)."""
    env, span_file = span_probe_env(work)
    with stub_server(args, work, env) as (url, model, vocab):
        timelines = warm_timelines(int(url.rsplit(":", 1)[1]), model, vocab, args.contexts, args.repeats)
    return timeline_rows(span_file, timelines)


def demo_or_generated_tokenizer(work: Path) -> Path:
    """The demo model's tokenizer directory, or (a GPU machine without the demo package) a
    generated word-level one under ``work`` (vocab 32000)."""
    from openinfer.demo import ensure_demo_model
    from openinfer.errors import DemoModelUnavailableError

    try:
        return ensure_demo_model(progress=False)
    except DemoModelUnavailableError:
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu_serving import write_tokenizer

        tokenizer_dir = work / "tokenizer"
        tokenizer_dir.mkdir()
        write_tokenizer(tokenizer_dir, 32000)
        return tokenizer_dir


def plot_serve_comparison(before: dict, after: dict, path: Path, before_name: str, after_name: str) -> None:
    """Two ``--serve`` results side by side: the warm host part per context and, where both have
    ``--spans``, the warm timeline's segments at the longest context."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_spans = bool(before.get("spans") and after.get("spans"))
    figure, axes = plt.subplots(1, 2 if with_spans else 1, figsize=(14 if with_spans else 6, 4.5), squeeze=False)
    left = axes[0][0]
    contexts = [row["context"] for row in after["ttft"]]
    x = np.arange(len(contexts))
    for offset, (name, result) in ((-0.2, (before_name, before)), (0.2, (after_name, after))):
        by_context = {row["context"]: row["warm_host_ms"] for row in result["ttft"]}
        left.bar(x + offset, [by_context.get(c, np.nan) for c in contexts], 0.4, label=name)
    left.set_xticks(x, [str(c) for c in contexts])
    left.set(xlabel="context (tokens)", ylabel="ms", title="warm TTFT minus the stub step (host part), median")
    left.legend()
    if with_spans:
        right = axes[0][1]
        longest = {name: max(result["spans"], key=lambda r: r["context"]) for name, result in
                   ((before_name, before), (after_name, after))}
        segments = list(longest[after_name]["segments_ms"])
        y = np.arange(len(segments))
        for offset, name in ((-0.2, before_name), (0.2, after_name)):
            right.barh(y + offset, [longest[name]["segments_ms"].get(k, np.nan) for k in segments], 0.4, label=name)
        right.set_yticks(y, segments, fontsize=7)
        right.invert_yaxis()
        right.set(xlabel="ms (median; span probe on)",
                  title=f"warm {longest[after_name]['context']}-token request, milestone to milestone")
        right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def plot_rows_comparison(before: dict, after: dict, path: Path, before_name: str, after_name: str) -> None:
    """Two engine-path results with ``rows`` (one per context length): warm TTFT medians side by side."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [row["context"] for row in after["rows"]]
    x = np.arange(len(contexts))
    figure, axes = plt.subplots(figsize=(7, 4))
    for offset, (name, result) in ((-0.2, (before_name, before)), (0.2, (after_name, after))):
        by_context = {row["context"]: row["warm_ttft_ms_median"] for row in result["rows"]}
        bars = axes.bar(x + offset, [by_context.get(c, np.nan) for c in contexts], 0.4, label=name)
        axes.bar_label(bars, fmt="%.2f", fontsize=8)
    axes.set_xticks(x, [str(c) for c in contexts])
    axes.set(xlabel="context (tokens)", ylabel="ms", title=f"warm-prefix TTFT, in-process engine ({after['device']})")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def plot_comparison(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = result["compared_with"]
    names = ["warm TTFT median", "warm TTFT min", "process CPU per warm request", "server event loop\n(profiled)"]
    keys = ["warm_host_ttft_ms_median", "warm_host_ttft_ms_min", "warm_process_cpu_ms_median",
            "warm_server_event_loop_ms_profiled"]
    x = np.arange(len(names))
    figure, axes = plt.subplots(figsize=(8.5, 3.8))
    axes.bar(x - 0.2, [before.get(k, np.nan) for k in keys], 0.4, label=f"earlier ({Path(before['path']).name})")
    axes.bar(x + 0.2, [result.get(k, np.nan) for k in keys], 0.4, label="this run")
    axes.set_xticks(x, names)
    axes.set_ylabel("ms")
    axes.set_title(f"warm {result['context']}-token prefix, host path (forward stubbed)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
