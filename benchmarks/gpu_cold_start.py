"""Cold start and idle memory of openinfer's cuda engine on a Qwen3-4B-shaped checkpoint.

Writes a random bf16 checkpoint (HF ``save_pretrained``) once, then in a fresh process times
``openinfer.create_engine(path, device="cuda")`` (plugin discovery, weight load, KV pool, CUDA
graph capture) and the first generated token, and reads GPU memory and host RSS once idle.
Results go to benchmarks/results/gpu_cold_start.json (and $OUT when set).

    python benchmarks/gpu_cold_start.py [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import asyncio, json, resource, sys, time
t0 = time.perf_counter()
import cupy
import openinfer
from openinfer.v1 import engine_pb2 as pb
t_import = time.perf_counter() - t0
engine = openinfer.create_engine(sys.argv[1], device="cuda", max_model_len=4096, max_num_seqs=64,
                                 gpu_memory_utilization=0.5)
t_engine = time.perf_counter() - t0
async def first_token():
    request = pb.GenerateRequest(request_id="cold", prompt_token_ids=list(range(100, 164)),
                                 stop=pb.StopConditions(max_tokens=1, ignore_eos=True))
    async for event in engine.generate(request):
        if event.WhichOneof("event") == "tokens":
            return time.perf_counter() - t0
t_first = asyncio.run(first_token())
time.sleep(1.0)
free, total = cupy.cuda.runtime.memGetInfo()
print(json.dumps({"import_s": t_import, "engine_ready_s": t_engine, "first_token_s": t_first,
                  "gpu_used_bytes_idle": total - free, "gpu_total_bytes": total,
                  "kv_blocks": engine.info().num_kv_blocks,
                  "graph_capture_s": getattr(engine.runner, "capture_seconds", None),
                  "host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen3-4b-random")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    path = Path(args.checkpoint)
    write_s = None
    if not (path / "config.json").exists():
        write_s = write_checkpoint(path)
        print(f"wrote the checkpoint in {write_s:.1f} s", flush=True)
    child = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=400)
    if child.returncode != 0:
        print(child.stderr[-4000:])
        raise SystemExit("the cold-start child failed")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    result["checkpoint_write_s"] = write_s
    print(json.dumps(result, indent=1))
    for out in [Path(args.out)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_cold_start.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
