"""Where the host part of a served start goes, piece by piece (#12): each piece in a fresh process.

``context``: CuPy's import and the CUDA context (``cudaFree(0)``) one after the other; the context
alone through the driver API by ctypes (which releases the GIL); the engine core's imports then
the context, one after the other vs the context made in a thread beside the imports.
``copies``: a Qwen3 load with deferred weights, then its queued copies alone (nothing beside them),
per uploader variant (``OPENINFER_UPLOAD_READS`` map / read, ``OPENINFER_UPLOAD_THREADS``), each on a
fresh load (fresh memory maps). ``imports``: ``python -X importtime`` of the ``openinfer serve``
supervisor's imports and of the engine core's, the heaviest modules by cumulative time.

    python benchmarks/gpu_start_probe.py --checkpoint /tmp/qwen3-4b-random --out probe.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CONTEXT_BY_CTYPES = """
import ctypes
driver = ctypes.CDLL("libcuda.so.1")
device, context = ctypes.c_int(), ctypes.c_void_p()
assert driver.cuInit(0) == 0
assert driver.cuDeviceGet(ctypes.byref(device), 0) == 0
assert driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
"""

ENGINE_IMPORTS = """
import openinfer.engine_core.process
import openinfer.backend.cuda.backend
from openinfer.plugins import discover_plugins
discover_plugins()
"""

SNIPPETS = {
    "cupy_then_context": (
        "import time; t0 = time.perf_counter()\nimport cupy\nt1 = time.perf_counter()\n"
        "cupy.cuda.runtime.free(0)\nt2 = time.perf_counter()\n"
        "print({'import_cupy': t1 - t0, 'context': t2 - t1})"),
    "ctypes_context": (
        "import time; t0 = time.perf_counter()\n" + CONTEXT_BY_CTYPES + "t1 = time.perf_counter()\n"
        "import cupy\nt2 = time.perf_counter()\ncupy.cuda.runtime.free(0)\nt3 = time.perf_counter()\n"
        "print({'ctypes_context': t1 - t0, 'import_cupy': t2 - t1, 'cudart_on_it': t3 - t2})"),
    "imports_then_context": (
        "import time; t0 = time.perf_counter()\n" + ENGINE_IMPORTS + "t1 = time.perf_counter()\n"
        "import cupy\ncupy.cuda.runtime.free(0)\nt2 = time.perf_counter()\n"
        "print({'imports': t1 - t0, 'context': t2 - t1, 'total': t2 - t0})"),
    "context_beside_imports": (
        "import time, threading; t0 = time.perf_counter()\n"
        f"thread = threading.Thread(target=exec, args=({CONTEXT_BY_CTYPES!r},))\nthread.start()\n"
        + ENGINE_IMPORTS + "t1 = time.perf_counter()\nthread.join()\nt2 = time.perf_counter()\n"
        "import cupy\ncupy.cuda.runtime.free(0)\nt3 = time.perf_counter()\n"
        "print({'imports': t1 - t0, 'joined': t2 - t1, 'cudart_on_it': t3 - t2, 'total': t3 - t0})"),
}


def run_snippet(code: str) -> dict:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        return {"error": done.stderr[-800:], "process_wall": wall}
    result = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 — our own snippet's dict
    return {**{k: round(v, 4) for k, v in result.items()}, "process_wall": round(wall, 4)}


def context_probe(rounds: int) -> dict:
    out: dict = {name: [] for name in SNIPPETS}
    for _ in range(rounds):
        for name, code in SNIPPETS.items():
            out[name].append(run_snippet(code))
    return out


COPIES = """
import json, sys, time
import cupy
from openinfer.backend import create_backend
from openinfer.parallel.rank import RankContext
from openinfer.backend.cuda import weight_upload
from openinfer.plugin_glue import DecoderPlugin
import openinfer_qwen3.plugin as plugin_module
path, reads, threads = sys.argv[1], sys.argv[2] == "read", int(sys.argv[3])
backend = create_backend("cuda")
cupy.zeros(1).sum().item()
config = json.load(open(f"{path}/config.json"))
plugin = next(v for v in vars(plugin_module).values() if isinstance(v, DecoderPlugin))
weight_upload._uploaders[0] = weight_upload.WeightUploader(0, num_threads=threads, read_files=reads)
t0 = time.perf_counter()
with weight_upload.deferred_uploads() as copies:
    model = plugin.load_rank_model(path, config, 4096, backend, RankContext())
t1 = time.perf_counter()
gigabytes = copies.nbytes / 1e9
copies.start(); copies.wait()
t2 = time.perf_counter()
print({"structure": t1 - t0, "copies": t2 - t1, "gb": gigabytes, "gb_per_s": gigabytes / (t2 - t1)})
"""


def copies_probe(checkpoint: str, variants: list[tuple[str, int]]) -> list[dict]:
    out = []
    for reads, threads in variants:
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", COPIES, checkpoint, reads, str(threads)],
                              capture_output=True, text=True, timeout=120)
        entry: dict = {"reads": reads, "threads": threads, "process_wall": round(time.perf_counter() - began, 3)}
        if done.returncode != 0:
            entry["error"] = done.stderr[-800:]
        else:
            result = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307
            entry.update({k: round(v, 4) for k, v in result.items()})
        out.append(entry)
        print(json.dumps(entry), flush=True)
    return out


def import_profile(code: str, top: int = 25) -> dict:
    """``-X importtime`` of ``code`` in a fresh interpreter: its wall and the heaviest modules."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - began
    rows = []
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            own, cumulative, name = line[len("import time:"):].split("|")
            try:
                rows.append((int(cumulative), int(own), name.rstrip()))
            except ValueError:  # the header line
                continue
    rows.sort(reverse=True)
    return {"process_wall": round(wall, 4), "heaviest": [
        {"module": name.strip(), "cumulative_ms": c / 1e3, "own_ms": o / 1e3, "depth": (len(name) - len(name.lstrip())) // 2}
        for c, o, name in rows[:top]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen3-4b-random")
    parser.add_argument("--out", default="start_probe.json")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="imports,context,copies")
    parser.add_argument("--copies", default="map:4,read:4,map:8,read:8,read:16,map:4",
                        help="READS:THREADS uploader variants, each on a fresh load")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    results: dict = {}
    if "imports" in parts:
        results["imports"] = {
            "supervisor": import_profile("import openinfer.cli as c; c.build_parser(); import openinfer.frontend.supervisor"),
            "engine_core": import_profile(ENGINE_IMPORTS),
            "api_server": import_profile("import openinfer.frontend.api_server, uvicorn, openinfer.frontend.http.metrics, "
                                         "openinfer.tokenizer, openinfer.frontend.http"),
        }
        for name, profile in results["imports"].items():
            print(name, profile["process_wall"], [(h["module"], h["cumulative_ms"]) for h in profile["heaviest"][:8]],
                  flush=True)
    if "context" in parts:
        results["context"] = context_probe(args.rounds)
        for name, runs in results["context"].items():
            print(name, runs, flush=True)
    if "copies" in parts:
        variants = [(v.split(":")[0], int(v.split(":")[1])) for v in args.copies.split(",")]
        results["copies"] = copies_probe(args.checkpoint, variants)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
