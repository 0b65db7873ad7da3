"""Where should the worker of a one-GPU server live: in the engine-core process, or its own?

Measures the per-step cost the placement adds on the CPU: a decode step of ``--batch`` sequences
(``--context`` tokens each, so block tables of context/16 entries) handed to a stub worker that
returns one id per row, either by a call (``InProcessWorker``) or over ZMQ IPC to a worker process
(``RemoteWorker`` ↔ ``serve_worker``: batch encoding + round trip). The step itself does no work
here, so the numbers are pure overhead; the ratio column puts them against a 14.5 ms GPU step.

    python benchmarks/worker_placement.py
Writes benchmarks/results/worker_placement.json and .png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from openinfer.backend.base import ForwardBatch
from openinfer.engine_core.worker import InProcessWorker, RemoteWorker, StepInput, WorkerConfig, serve_worker

RESULTS = Path(__file__).resolve().parent / "results"


def stub_step(model, step: StepInput) -> np.ndarray:
    return (step.batch.token_ids + 1).astype(np.int32)


def stub_worker() -> InProcessWorker:
    return InProcessWorker(lambda path, config, options: object(), stub_step)


def worker_process(address: str) -> None:
    serve_worker(address, stub_worker())


def decode_step(batch_size: int, context: int, rng: np.random.Generator) -> StepInput:
    blocks = -(-context // 16)
    positions = np.full(batch_size, context - 1, np.int32)
    batch = ForwardBatch(
        token_ids=rng.integers(0, 150000, batch_size, dtype=np.int32), positions=positions,
        query_start=np.arange(batch_size + 1, dtype=np.int32), context_lens=positions + 1,
        block_tables=rng.integers(1, 100000, (batch_size, blocks), dtype=np.int32),
        slot_mapping=rng.integers(0, 1600000, batch_size, dtype=np.int32),
        logits_rows=np.arange(batch_size, dtype=np.int32), max_query_len=1, max_context_len=context,
        request_ids=tuple(f"req-{i:032x}" for i in range(batch_size)))
    return StepInput(batch, np.zeros((batch_size, 5)))


def time_steps(worker, step: StepInput, steps: int) -> float:
    for _ in range(10):
        worker.execute_step(step)
    start = time.perf_counter()
    for _ in range(steps):
        ids = worker.execute_step(step)
    assert ids is not None and len(ids) == step.batch.num_seqs
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=1152)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=14.5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    address = f"ipc://{tempfile.mkdtemp(prefix='oi-w-')}/worker.sock"
    process = multiprocessing.get_context("spawn").Process(target=worker_process, args=(address,), daemon=True)
    process.start()
    remote = RemoteWorker(address)
    remote.init(WorkerConfig(rank=0, world_size=1, device="cpu"))
    remote.load_model("stub", {})
    local = stub_worker()
    local.init(WorkerConfig())
    local.load_model("stub", {})
    rows = []
    for batch_size in [int(b) for b in args.batches.split(",")]:
        step = decode_step(batch_size, args.context, rng)
        in_process, in_other = time_steps(local, step, args.steps), time_steps(remote, step, args.steps)
        row = {"batch": batch_size, "in_core_us": 1e6 * in_process, "worker_process_us": 1e6 * in_other,
               "added_us": 1e6 * (in_other - in_process),
               "added_fraction_of_step": (in_other - in_process) / (args.step_ms / 1e3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    remote.shutdown()
    process.join(10)
    report = {"context": args.context, "step_ms": args.step_ms, "rows": rows, "host": platform.node(),
              "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "worker_placement.json").write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [str(r["batch"]) for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["in_core_us"] for r in rows], 0.4, label="worker in the engine core")
    ax.bar(x + 0.2, [r["worker_process_us"] for r in rows], 0.4, label="worker process (ZMQ IPC)")
    ax.set(xticks=x, xticklabels=labels, xlabel="decode batch", ylabel="µs per step (overhead only)",
           title=f"worker placement, context {args.context}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "worker_placement.png", dpi=120)
    print(f"wrote {RESULTS / 'worker_placement.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
