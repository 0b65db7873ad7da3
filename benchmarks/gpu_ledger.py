"""GPU: the kernel ledgers and step-time models of Qwen3-4B and Qwen3.5 (random weights at the real
shapes), in one device run, then where a long prefill's time goes by kind of op.

Each model runs ``python -m openinfer.tools.ledger`` (in-process): decode over a (batch, context)
grid with checks at batch 1 / 64 / 256 (the issue's 15 % goal) and one off-grid point, prefill
up to 16k tokens (Qwen3) with an off-grid check. Writes ``ledger_<model>.json`` + ``.md`` and
``ledger_prefill_breakdown.json`` into ``--out`` (and ``$OUT`` when set); the committed copies
live beside each plugin's ``kernel_plan.py`` (``ledger.json`` / ``ledger.md``).

    python benchmarks/gpu_ledger.py [--models qwen3,qwen35] [--quick] [--model-path qwen3=DIR ...]

``--quick``: a small grid. ``--model-path NAME=DIR``: that model from a checkpoint (or a config.json
with ``--load-format dummy`` passed through) instead of its random preset; with ``--device cpu`` and
a tiny config it smoke-tests this script on the NumPy backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from openinfer.tools.ledger import breakdown
from openinfer.tools.ledger import main as ledger_main

# name -> (preset, name in the report, full grid arguments, quick grid arguments). The decode grids
# keep batch x context KV within an 80 GB GPU (Qwen3-4B: 147 KB per token, 256 x 1024 = 39 GB);
# the checks at context 512 / 1536 sit between or past grid points (true predictions).
MODELS = {
    "qwen3": ("qwen3-4b", "Qwen3-4B-shape",
              ["--batches", "1,4,16,64,128,256", "--contexts", "128,384,1024", "--prefill", "2048,8192,16384",
               "--check", "1:512,64:512,256:512,48:1536", "--check-prefill", "12288"],
              ["--batches", "1,4", "--contexts", "64,256", "--prefill", "128,256,512", "--check", "2:128",
               "--check-prefill", "384"]),
    "qwen35": ("qwen3.5-default", "Qwen3.5-default-shape",
               ["--batches", "1,16,64,256", "--contexts", "128,2048", "--prefill", "512,2048,8192",
                "--check", "1:512,64:512,256:512", "--check-prefill", "4096"],
               ["--batches", "1,4", "--contexts", "64,256", "--prefill", "128,256,512", "--check", "2:128",
                "--check-prefill", "384"]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3,qwen35")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-path", action="append", default=[], metavar="NAME=DIR",
                        help="run model NAME from DIR instead of its random preset")
    parser.add_argument("--load-format", choices=("auto", "dummy"), help="with --model-path")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    paths = dict(item.split("=", 1) for item in args.model_path if "=" in item)
    if len(paths) != len(args.model_path) or set(paths) - set(MODELS):
        parser.error(f"--model-path takes NAME=DIR with NAME in {sorted(MODELS)}, got {args.model_path}")
    out_dirs = [Path(args.out)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    summary: dict = {}
    for name in names:
        preset, title, full, quick = MODELS[name]
        out = out_dirs[-1] / f"ledger_{name}.json"
        began = time.perf_counter()
        source = ["--model-path", paths[name]] if name in paths else ["--random", preset]
        if name in paths and args.load_format:
            source += ["--load-format", args.load_format]
        status = ledger_main([*source, "--name", title, "--device", args.device, "--repeats", str(args.repeats),
                              *(quick if args.quick else full), "--out", str(out)])
        if status:
            return status
        report = json.loads(out.read_text())
        summary[name] = {
            "device": report["device"], "seconds": time.perf_counter() - began,
            "checks": [{k: c[k] for k in ("phase", "batch", "context", "predicted_s", "measured_s", "error")}
                       for c in report["checks"]],
            "prefill": [{"tokens": e["tokens"], "measured_s": e["measured_s"], "ops_sum_s": e["sum_device_s"],
                         "by_kind_s": breakdown(e)} for e in report["entries"] if e["phase"] == "prefill"]}
        for directory in out_dirs[:-1]:  # the same files in every output folder
            directory.mkdir(parents=True, exist_ok=True)
            for suffix in (".json", ".md"):
                (directory / out.with_suffix(suffix).name).write_text(out.with_suffix(suffix).read_text())
    for directory in out_dirs:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "ledger_prefill_breakdown.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, result in summary.items():
        print(f"\n{name} on {result['device']} ({result['seconds']:.0f} s)")
        for check in result["checks"]:
            print(f"  {check['phase']:8s} b={check['batch']:<4d} c={check['context']:<6d} predicted "
                  f"{check['predicted_s'] * 1e3:9.3f} ms  measured {check['measured_s'] * 1e3:9.3f} ms  "
                  f"{100 * check['error']:+6.1f} %")
        for entry in result["prefill"]:
            kinds = ", ".join(f"{kind} {100 * s / entry['ops_sum_s']:.0f} %" for kind, s in entry["by_kind_s"].items())
            print(f"  prefill {entry['tokens']:6d}: measured {entry['measured_s'] * 1e3:8.1f} ms, ops "
                  f"{entry['ops_sum_s'] * 1e3:8.1f} ms: {kinds}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
