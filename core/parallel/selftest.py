"""NCCL self-check across the GPUs of this machine: every collective of ``NcclCommunicator``
against its definition, eagerly and inside a captured CUDA graph replayed on new inputs (the
decode step's all-reduce lives in such a graph).

    NCCL_NVLS_ENABLE=0 python -m openinfer.parallel.selftest [--world-size 2]

Prints one JSON line per rank; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from typing import Any

import numpy as np

from openinfer.parallel.nccl import disable_multicast


def _rank_checks(rank: int, world: int, unique_id: Any, results: Any) -> None:
    disable_multicast()
    import cupy

    from openinfer.backend.cuda.bf16 import bf16_bits_to_float, float_to_bf16_bits
    from openinfer.parallel.nccl import NcclCommunicator

    report: dict[str, Any] = {"rank": rank}
    try:
        cupy.cuda.Device(rank).use()
        comm = NcclCommunicator.create(unique_id, rank, world)
        base = np.arange(world * 6, dtype=np.float32).reshape(world * 2, 3)

        def mine(r: int) -> np.ndarray:
            return base + 10 * r

        total = sum(mine(r) for r in range(world))
        x = cupy.asarray(mine(rank))
        report["all_reduce"] = bool(np.array_equal(comm.all_reduce(x).get(), total))
        report["all_gather"] = bool(np.array_equal(comm.all_gather(x).get(),
                                                   np.concatenate([mine(r) for r in range(world)])))
        report["reduce_scatter"] = bool(np.array_equal(comm.reduce_scatter(x).get(), total[2 * rank: 2 * rank + 2]))
        expected_a2a = np.concatenate([mine(r)[2 * rank: 2 * rank + 2] for r in range(world)])
        report["all_to_all"] = bool(np.array_equal(comm.all_to_all(x).get(), expected_a2a))
        report["broadcast"] = bool(np.array_equal(comm.broadcast(x, root=world - 1).get(), mine(world - 1)))
        bf16 = cupy.asarray(float_to_bf16_bits(mine(rank)))
        report["all_reduce_bf16"] = bool(np.array_equal(bf16_bits_to_float(comm.all_reduce(bf16).get()), total))

        # an all-reduce captured into a CUDA graph, replayed on inputs written after the capture
        static_in = cupy.zeros(4096, dtype=cupy.float32)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            warm = comm.all_reduce(static_in) * 2  # warm-up outside the capture (NCCL connects lazily)
            stream.synchronize()
            stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
            static_out = comm.all_reduce(static_in) * 2
            graph = stream.end_capture()
        del warm
        ok = True
        replay_us = []
        for trial in range(5):
            static_in[...] = trial + rank
            cupy.cuda.Device().synchronize()
            start = time.perf_counter()
            graph.launch(stream)
            stream.synchronize()
            replay_us.append((time.perf_counter() - start) * 1e6)
            want = 2 * sum(trial + r for r in range(world))
            ok &= bool(cupy.all(static_out == want).get())
        report["all_reduce_in_cuda_graph"] = ok
        report["graph_replay_us_median"] = float(np.median(replay_us))
        comm.barrier()
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        report["error"] = repr(exc)
    results.put(report)


def run(world_size: int) -> list[dict[str, Any]]:
    from openinfer.parallel.nccl import new_unique_id

    disable_multicast()
    unique_id = new_unique_id()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank_checks, args=(r, world_size, unique_id, results))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    reports = sorted((results.get(timeout=300) for _ in processes), key=lambda r: r["rank"])
    for process in processes:
        process.join(timeout=30)
    return reports


def passed(reports: list[dict[str, Any]]) -> bool:
    return all("error" not in r and all(v for k, v in r.items() if isinstance(v, bool)) for r in reports)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    reports = run(args.world_size)
    for report in reports:
        print(json.dumps(report))
    return 0 if passed(reports) else 1


if __name__ == "__main__":
    sys.exit(main())
