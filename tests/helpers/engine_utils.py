"""Driving engines and models directly from tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from openinfer import EngineOptions
from openinfer.backend.base import ForwardBatch
from openinfer.offline import Outcome, collect, generate_request, run_requests  # noqa: F401 (re-exported)
from openinfer.v1 import engine_pb2 as pb

make_request = generate_request
run_all = run_requests


def run_one(engine, request: pb.GenerateRequest) -> Outcome:
    return run_all(engine, [request])[0]


def prefill_logits(model, token_ids: Sequence[int], chunk_sizes: Sequence[int] | None = None,
                   block_size: int = 16) -> np.ndarray:
    """All-position logits of one sequence through ``model.forward``, optionally in chunks."""
    ops = model.backend
    n = len(token_ids)
    num_blocks = -(-n // block_size) + 1
    spec = model.spec
    if hasattr(model, "kv_cache_specs"):  # per-layer specs (one token group assumed: one block table)
        kv = [ops.allocate_kv(s, num_blocks + 1, block_size) for s in model.kv_cache_specs()]
    else:
        kv = [ops.allocate_kv(num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
              for _ in range(spec.num_layers)]
    table = np.arange(1, num_blocks + 1, dtype=np.int32)
    chunks = list(chunk_sizes) if chunk_sizes else [n]
    assert sum(chunks) == n
    out = []
    start = 0
    for size in chunks:
        pos = np.arange(start, start + size, dtype=np.int32)
        batch = ForwardBatch(
            token_ids=np.asarray(token_ids[start:start + size], np.int32), positions=pos,
            query_start=np.array([0, size], np.int32), context_lens=np.array([start + size], np.int32),
            block_tables=table[None, :], slot_mapping=(table[pos // block_size] * block_size + pos % block_size),
            logits_rows=np.arange(size, dtype=np.int32), max_query_len=size, max_context_len=start + size)
        out.append(ops.to_host(model.forward(ops.prepare_batch(batch), kv)))
        start += size
    return np.concatenate(out)


def build_plugin_engine(plugin: ModuleType, path: Path, **options):
    """``plugin.openinfer_create_engine`` on the checkpoint in ``path``, on the CPU."""
    config = json.loads((Path(path) / "config.json").read_text())
    return plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cpu", **options))


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def assert_everything_returned(engine) -> None:
    """No request holds a KV block or a live state slot once every request has finished (the
    prefix cache's state snapshots keep theirs)."""
    assert wait_until(lambda: engine.load().num_running == 0
                      and engine.state_slots.num_used_slots == engine.kv.num_snapshots), \
        engine.state_slots.owners()
    assert not any(not owner.startswith("\x00snapshot") for owner in engine.state_slots.owners())
    load = engine.load()
    assert load.kv_blocks_used == 0 and load.num_running == 0 and load.num_waiting == 0, load


def run_greedy_batch(engine, prompts: Sequence[Sequence[int]], reference: dict[tuple[int, ...], list[int]],
                     max_tokens: int, prefix: str) -> list[Outcome]:
    """Greedy ``prompts`` submitted together; asserts each equals ``reference[tuple(prompt)]``."""
    outcomes = run_all(engine, [make_request(f"{prefix}{i}", p, max_tokens=max_tokens) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outcomes] == [reference[tuple(p)] for p in prompts]
    return outcomes
