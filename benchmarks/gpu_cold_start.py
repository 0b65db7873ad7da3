"""Cold start and idle host memory of openinfer's cuda engine on a Qwen3-4B-shaped checkpoint.

Writes a random bf16 checkpoint (HF ``save_pretrained``) once and reads it into the page cache,
then builds the engine the way the engine-core process does (``openinfer.create_engine(path,
device="cuda", max_model_len=4096)``, whose ``create_paged_engine`` gives back the load's host
memory; the process then only reports it) in fresh processes:

- ``cold``: CuPy's on-disk kernel cache empty (a fresh machine: every kernel compiles);
- ``warm``: the same cache again (a restart on the same machine);
- ``profiled``: cold again under cProfile, for where the time goes (top functions by
  cumulative and own time, in ``gpu_cold_start_profile.txt``).

Each child reports its phases (imports, CUDA context, model load, KV planning and allocation,
graph capture, first token) and its resident memory broken down
(anonymous / file-backed, CuPy pools) after each. Results: benchmarks/results/gpu_cold_start.json
(and $OUT when set; ``--tag`` names them), with each run's seconds per kernel module
(``module_compile_seconds``, slowest first). The served figures (cold start → HTTP ready, idle RSS of every process)
come from ``gpu_concurrency.py``.

    python benchmarks/gpu_cold_start.py [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import asyncio, cProfile, io, json, pstats, sys, time
began = time.perf_counter()
phases, memory = {}, {}
last = [began]
def mark(name):
    now = time.perf_counter()
    phases[name] = round(now - last[0], 4)
    last[0] = now
import cupy
mark("import_cupy")
import openinfer
from openinfer.engine_core.startup import memory_breakdown
from openinfer.v1 import engine_pb2 as pb
mark("import_openinfer")
cupy.cuda.Device(0).use()
cupy.zeros(1).sum().item()
mark("cuda_context")
memory["after_cuda_context"] = memory_breakdown()
profile = cProfile.Profile() if sys.argv[2] == "profile" else None
if profile is not None:
    profile.enable()
engine = openinfer.create_engine(sys.argv[1], device="cuda", max_model_len=4096)
if profile is not None:
    profile.disable()
mark("create_engine")
inside = dict(engine.startup_phases)
inside["model_load"] = phases["create_engine"] - sum(inside.values())
memory["after_engine"] = memory_breakdown()
async def first_token():
    request = pb.GenerateRequest(request_id="cold", prompt_token_ids=list(range(100, 164)),
                                 stop=pb.StopConditions(max_tokens=1, ignore_eos=True))
    async for event in engine.generate(request):
        if event.WhichOneof("event") == "tokens":
            return
asyncio.run(first_token())
mark("first_token")
time.sleep(1.0)
memory["idle"] = memory_breakdown()
free, total = cupy.cuda.runtime.memGetInfo()
from openinfer.backend.cuda import loader
report = {"module_compile_seconds": {k: round(v, 3) for k, v in sorted(loader.module_compile_seconds.items(),
                                                                       key=lambda item: -item[1])},
          "phases": phases, "create_engine_phases": {k: round(v, 4) for k, v in inside.items()},
          "total_s": round(time.perf_counter() - began, 4), "memory": memory,
          "gpu_used_bytes_idle": total - free, "kv_blocks": engine.info().num_kv_blocks}
if profile is not None:
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    report["profile"] = text.getvalue()
print(json.dumps(report))
engine.close_sync()
"""


def write_checkpoint(path: Path) -> float:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_bench import QWEN3_4B

    start = time.perf_counter()
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B)).to(torch.bfloat16)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **QWEN3_4B}
    model.save_pretrained(path, safe_serialization=True)
    saved = json.loads((path / "config.json").read_text())
    saved.update(config)
    (path / "config.json").write_text(json.dumps(saved))
    return time.perf_counter() - start


def warm_page_cache(path: Path) -> None:
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as handle:
            while handle.read(1 << 24):
                pass


def run_child(checkpoint: Path, kernel_cache: str, mode: str) -> dict:
    env = {**os.environ, "CUPY_CACHE_DIR": kernel_cache}
    child = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), mode], capture_output=True, text=True,
                           timeout=400, env=env)
    if child.returncode != 0:
        print(child.stderr[-4000:])
        raise SystemExit(f"the {mode} cold-start child failed")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen3-4b-random")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--tag", default="gpu_cold_start", help="TAG.json and TAG_profile.txt")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile'd cold start")
    args = parser.parse_args()
    path = Path(args.checkpoint)
    write_s = None
    if not (path / "config.json").exists():
        write_s = write_checkpoint(path)
        print(f"wrote the checkpoint in {write_s:.1f} s", flush=True)
    warm_page_cache(path)
    runs = {}
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        runs["cold"] = run_child(path, first, "plain")
        runs["warm"] = run_child(path, first, "plain")
        if not args.no_profile:
            runs["profiled"] = run_child(path, second, "profile")
    profile = runs["profiled"].pop("profile") if "profiled" in runs else ""
    device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.strip()
    result = {"device": device, "checkpoint_write_s": write_s, "runs": runs}
    for name, run in runs.items():
        idle = run["memory"]["idle"]
        print(f"{name}: {run['total_s']:.2f} s {run['phases']} engine {run['create_engine_phases']}; idle RSS "
              f"{idle.get('rss', 0) / 2**20:.0f} MiB (anon {idle.get('anon', 0) / 2**20:.0f}, "
              f"file {idle.get('file', 0) / 2**20:.0f})", flush=True)
        modules = run.get("module_compile_seconds") or {}
        if modules:
            print(f"  {len(modules)} modules built; slowest: "
                  f"{', '.join(f'{k} {v:.2f}' for k, v in list(modules.items())[:6])}", flush=True)
    for out in [Path(args.out)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.tag}.json").write_text(json.dumps(result, indent=2))
        if profile:
            (out / f"{args.tag}_profile.txt").write_text(profile)


if __name__ == "__main__":
    main()
