"""The worker interface: a step batch survives the wire, and a worker in another thread/process
answers exactly as the same worker called in process."""

from __future__ import annotations

import threading

import numpy as np

from openinfer.backend.base import ForwardBatch
from openinfer.engine_core.worker import (
    InProcessWorker,
    RemoteWorker,
    StepInput,
    WorkerConfig,
    decode_step,
    encode_step,
    serve_worker,
)


def _step(rows: int) -> StepInput:
    rng = np.random.default_rng(rows)
    batch = ForwardBatch(
        token_ids=rng.integers(0, 1000, rows, dtype=np.int32), positions=np.arange(rows, dtype=np.int32),
        query_start=np.arange(rows + 1, dtype=np.int32), context_lens=np.arange(1, rows + 1, dtype=np.int32),
        block_tables=rng.integers(0, 50, (rows, 3), dtype=np.int32), slot_mapping=np.arange(rows, dtype=np.int32),
        logits_rows=np.arange(rows, dtype=np.int32), max_query_len=1, max_context_len=rows,
        request_ids=tuple(f"r{i}" for i in range(rows)))
    return StepInput(batch, rng.random((rows, 5)))


def _worker() -> InProcessWorker:
    return InProcessWorker(lambda path, config, options: {"path": path, "rank": config.rank},
                           lambda model, step: (step.batch.token_ids * 2 + step.batch.positions).astype(np.int32))


def test_a_step_survives_encoding():
    step = _step(7)
    back = decode_step(encode_step(step))
    for name in ("token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping",
                 "logits_rows", "token_sources"):
        assert np.array_equal(getattr(back.batch, name), getattr(step.batch, name))
        assert getattr(back.batch, name).dtype == getattr(step.batch, name).dtype
    assert back.batch.request_ids == step.batch.request_ids and np.array_equal(back.sampling, step.sampling)


def test_remote_worker_answers_like_the_in_process_one(tmp_path):
    address = f"ipc://{tmp_path}/w.sock"
    thread = threading.Thread(target=serve_worker, args=(address, _worker()), daemon=True)
    thread.start()
    remote, local = RemoteWorker(address), _worker()
    for worker in (remote, local):
        worker.init(WorkerConfig(rank=0, world_size=1, device="cpu"))
        worker.load_model("m", {})
    for rows in (1, 5, 64):
        assert np.array_equal(remote.execute_step(_step(rows)), local.execute_step(_step(rows)))
    remote.shutdown()
    thread.join(5)
    assert not thread.is_alive()
    other_rank = _worker()
    other_rank.init(WorkerConfig(rank=1, world_size=2, device="cpu"))
    assert other_rank.execute_step(_step(3)) is None  # only rank 0 returns sampled ids
