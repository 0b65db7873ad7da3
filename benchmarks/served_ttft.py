"""Served cold / warm-prefix TTFT per prompt length, one ``openinfer serve`` per variant (A/B).

Issue #16.3: a warm prefix (the whole prompt cached but its last token) should cost about one
decode step, served over HTTP. Each variant is a set of environment switches (``--variant
NAME:KEY=VALUE,KEY=VALUE``; ``NAME:`` alone is the defaults); the variants run one after the
other on the same machine, ``--rounds`` times in alternating order (A B C, C B A, ...), each
server answering benchmarks/serve.py's ``ttft_rows`` (the lean client, one request at a time:
a fresh prompt, then that prompt with its last token changed). The report keeps every
request's TTFT per variant and context and prints, per context, each variant's median and
p25 / min over all its rounds next to the first variant's. ``--spans``: before the rounds, one
server of the first variant with benchmarks/warm_prefix_host.py's span probe in both of
its processes: each warm request's timeline from the client's connect to its first token (HTTP
parse, body decode, the hop to the engine core, admission, scheduling, the device step, the hop
back, the SSE write), medians per context: where a served warm request's time goes on this
machine, the device step included.

    python benchmarks/served_ttft.py --contexts 1024,4096,16384 --repeats 9 --rounds 2 \\
        --variant before: --variant spin:OPENINFER_CORE_SPIN_MS=20 --out $OUT/served_ttft.json
    python benchmarks/served_ttft.py --stub --contexts 1024,16384 --variant a: --variant b:  # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_concurrency import STUB_FACTORY, free_port, stop, wait_ready, warm_page_cache  # noqa: E402
from serve import ttft_rows  # noqa: E402
from warm_prefix_host import span_probe_env, timeline_rows, warm_timelines  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:KEY=VALUE,KEY=VALUE`` → (NAME, {KEY: VALUE}); ``NAME:`` has no switches."""
    name, sep, rest = text.partition(":")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"a variant is NAME:KEY=VALUE,... (NAME: for the defaults), got {text!r}")
    switches = {}
    for item in filter(None, rest.split(",")):
        key, equals, value = item.partition("=")
        if not equals or not key.startswith("OPENINFER_"):
            raise argparse.ArgumentTypeError(f"a variant's switch is OPENINFER_NAME=VALUE, got {item!r}")
        switches[key] = value
    return name, switches


def serve_once(args: argparse.Namespace, checkpoint: Path, switches: dict[str, str], vocab: int, seed: int,
               span_work: Path | None = None) -> dict:
    """One server with ``switches``: its TTFT rows, or with ``span_work`` (a directory for the
    probe) the warm requests' timelines instead."""
    port = free_port()
    command = [sys.executable, "-m", "openinfer.cli", "serve", "--model-path", str(checkpoint), "--port", str(port),
               "--grpc-port", "0", "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    command += (["--engine-factory", STUB_FACTORY, "--device", "cpu", "--num-kv-blocks", "40000",
                 "--max-num-batched-tokens", "8192"] if args.stub else ["--device", "cuda"])
    command += shlex.split(args.serve_args)
    probe_env, span_file = span_probe_env(span_work) if span_work is not None else ({}, None)
    process = subprocess.Popen(command, start_new_session=True, env={**os.environ, **switches, **probe_env})
    url = f"http://127.0.0.1:{port}"
    try:
        ready_s = wait_ready(url, process, args.start_timeout)
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        httpx.post(url + "/v1/completions", json={"model": model, "prompt": [100, 101], "max_tokens": 2}, timeout=120)
        if span_file is None:
            rows = ttft_rows(url, model, args.contexts, args.repeats, vocab, seed=seed)
        else:
            timelines = warm_timelines(port, model, vocab, args.contexts, args.repeats, seed=seed)
    finally:
        stop(process)
    if span_file is not None:
        return {"ready_s": ready_s, "ttft": [], "spans": timeline_rows(span_file, timelines)}
    return {"ready_s": ready_s, "ttft": rows}


def summary(report: dict) -> list[str]:
    lines = []
    base = report["variants"][0]["name"]
    for context in report["contexts"]:
        for kind in ("warm", "cold"):
            parts, base_median = [], None
            for variant in report["variants"]:
                each = [t for run in variant["runs"] for row in run["ttft"] if row["context"] == context
                        for t in row[f"{kind}_ttft_ms_each"]]
                if not each:
                    parts.append(f"{variant['name']} -")
                    continue
                median = float(np.median(each))
                if variant["name"] == base:
                    base_median = median
                ratio = f" ({median / base_median:.3f}x {base})" if base_median and variant["name"] != base else ""
                parts.append(f"{variant['name']} {median:.2f} (p25 {np.percentile(each, 25):.2f}, min {min(each):.2f},"
                             f" n {len(each)}){ratio}")
            lines.append(f"{kind} {context:>6}: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen3-4b-random")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=9, help="fresh prompts per context per server (ttft_rows)")
    parser.add_argument("--rounds", type=int, default=1, help="servers per variant, in alternating order")
    parser.add_argument("--variant", action="append", type=parse_variant, default=None,
                        help="NAME:OPENINFER_X=V,... (repeat; the first is the baseline of the ratios)")
    parser.add_argument("--max-model-len", type=int, default=20480)
    parser.add_argument("--serve-args", default="")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--spans", action="store_true", help="first, the first variant's warm timelines (span probe)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no further server after this many seconds (the summary still prints)")
    parser.add_argument("--stub", action="store_true", help="the stub engine on the CPU (checks the script)")
    parser.add_argument("--out", default=str(HERE / "results" / "served_ttft.json"))
    args = parser.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    variants = args.variant or [("defaults", {})]
    if args.repeats < 1 or args.rounds < 1 or any(c < 2 for c in args.contexts):
        parser.error("--repeats >= 1, --rounds >= 1, each context >= 2")
    checkpoint = Path(args.checkpoint)
    if args.stub:
        from openinfer.demo import ensure_demo_model
        from openinfer.engine_core.stub import write_stub_model

        checkpoint = write_stub_model(Path(tempfile.mkdtemp(prefix="openinfer-stub-ttft-")), ensure_demo_model(),
                                      step_ms=1.0, max_model_len=args.max_model_len)
    else:
        warm_page_cache(checkpoint)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    report = {"checkpoint": str(checkpoint), "stub": args.stub, "contexts": args.contexts, "repeats": args.repeats,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "variants": [{"name": name, "switches": switches, "runs": []} for name, switches in variants]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()

    def out_of_time() -> bool:
        return args.budget_s is not None and time.perf_counter() - began > args.budget_s

    if args.spans:  # first: the timeline is what a short budget should keep
        try:
            report["spans"] = serve_once(args, checkpoint, report["variants"][0]["switches"], vocab, seed=100,
                                         span_work=Path(tempfile.mkdtemp(prefix="openinfer-spans-")))["spans"]
        except Exception as exc:
            report["spans_error"] = repr(exc)
        out.write_text(json.dumps(report, indent=2) + "\n")
    for round_index in range(args.rounds):
        order = report["variants"] if round_index % 2 == 0 else report["variants"][::-1]
        for variant in order:
            if out_of_time():
                report.setdefault("skipped", []).append(f"{variant['name']} round {round_index}: --budget-s")
                continue
            try:
                run = serve_once(args, checkpoint, variant["switches"], vocab, seed=1 + round_index)
            except Exception as exc:  # keep what was measured; say what failed
                run = {"error": repr(exc), "ttft": []}
            variant["runs"].append(run)
            print(json.dumps({"variant": variant["name"], "round": round_index,
                              **{k: v for k, v in run.items() if k != "ttft"}}), flush=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
    report["summary"] = summary(report) + [f"skipped: {s}" for s in report.get("skipped", [])] + [
        f"{report['variants'][0]['name']} warm timeline {row['context']} (medians of {row['requests']}, ms, probe on): "
        + ", ".join(f"{k} {v:.3f}" for k, v in row["segments_ms"].items()) for row in report.get("spans", [])]
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(report["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
