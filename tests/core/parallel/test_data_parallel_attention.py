"""Data-parallel attention under expert parallel (NumPy backend, fake communicator): each rank
attends for its own sequences and caches only their MLA latent rows, yet the tiny Kimi-K2
(DeepSeek-V3 architecture) logits equal the single-rank model's — through prefill, decode, a
prompt in chunks and a freed block reused by another rank — and the engine generates the same
tokens."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest

from openinfer.backend.base import ForwardBatch
from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.errors import OpenInferError, ParallelConfigError
from openinfer.parallel.data import DataParallelAttention, engine_blocks
from openinfer.parallel.fake import run_ranks
from openinfer.parallel.layout import ParallelLayout
from openinfer.parallel.rank import RankContext
from openinfer.runtime.model import kv_cache_specs_of
from tests.helpers.engine_utils import make_request, run_all

BLOCK = 4
NUM_BLOCKS = 32


def step(sequences: list[tuple[list[int], int, list[int]]]) -> ForwardBatch:
    """One step from ``(new tokens, start position, engine block table)`` per sequence; the
    last token of each sequence gets logits."""
    width = max(len(t) for _, _, t in sequences)
    tables = np.array([t + [0] * (width - len(t)) for _, _, t in sequences], np.int32)
    tokens, positions, slots, lens = [], [], [], []
    for new, start, table in sequences:
        for i, token in enumerate(new):
            position = start + i
            tokens.append(token)
            positions.append(position)
            slots.append(table[position // BLOCK] * BLOCK + position % BLOCK)
        lens.append(len(new))
    query_start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    context = np.array([s + len(n) for n, s, _ in sequences], np.int32)
    return ForwardBatch(
        token_ids=np.array(tokens, np.int32), positions=np.array(positions, np.int32), query_start=query_start,
        context_lens=context, block_tables=tables, slot_mapping=np.array(slots, np.int32),
        logits_rows=(query_start[1:] - 1).astype(np.int32), max_query_len=max(lens),
        max_context_len=int(context.max()), request_ids=tuple(f"s{i}" for i in range(len(sequences))))


def steps() -> list[ForwardBatch]:
    """Three prompts (one in two chunks), decodes (rank 0 idle in the third step), then
    sequence 1's blocks freed and reused by a new prompt that lands on the other rank."""
    a, b, c = [5, 17, 99, 3, 150, 41, 7], [12, 8, 90], [33, 44, 55, 66, 77, 88, 11, 22, 30]
    table_a, table_b, table_c = [1, 2], [3, 7], [4, 5, 6]
    return [
        step([(a, 0, table_a), (b, 0, table_b), (c[:5], 0, table_c)]),
        step([([61], 7, table_a), ([122], 3, table_b), (c[5:], 5, table_c)]),
        step([([9], 4, table_b), ([14], 9, table_c)]),
        step([([70, 71, 72, 73, 74, 75], 0, table_b), ([15], 10, table_c)]),
    ]


def test_ownership_split_and_logits_gather():
    """Every sequence lands on exactly one rank, its rows and blocks mapped into that rank's
    smaller pool; gathered logits come back in the batch's order."""
    batches = steps()

    def rank(comm):
        dp = DataParallelAttention(comm)
        local_blocks = dp.local_blocks(NUM_BLOCKS, BLOCK)
        seen = []
        for batch in batches:
            part = dp.split(batch)
            local = part.batch
            assert local.num_seqs == part.sequences.size
            for i, seq in enumerate(part.sequences.tolist()):
                begin, end = batch.query_start[seq], batch.query_start[seq + 1]
                np.testing.assert_array_equal(local.token_ids[local.query_start[i]: local.query_start[i + 1]],
                                              batch.token_ids[begin:end])
            assert local.slot_mapping.max(initial=0) < local_blocks * BLOCK
            # logits: each rank's rows are the global row numbers, gathered back in order
            mine = batch.logits_rows[part.logits_owner == comm.rank].astype(np.float32)[:, None]
            gathered = dp.gather_logits(part, mine)
            np.testing.assert_array_equal(gathered[:, 0], batch.logits_rows)
            seen.append(part.sequences.tolist())
        return local_blocks, seen

    results = run_ranks(2, rank)
    assert all(blocks == 24 for blocks, _ in results)  # 1.5 x 32 / 2
    for index, batch in enumerate(batches):
        owned = sorted(s for _, seen in results for s in seen[index])
        assert owned == list(range(batch.num_seqs))
    # the first step's three prompts are spread: neither rank holds them all
    assert all(len(seen[0]) < 3 for _, seen in results)


def test_a_full_local_pool_is_a_clear_error():
    def rank(comm):
        dp = DataParallelAttention(comm, headroom=1.0)
        dp.local_blocks(4, BLOCK)  # two blocks per rank
        dp.split(step([([1] * 12, 0, [1, 2, 3])]))

    with pytest.raises(OpenInferError, match="KV pool .* is full"):
        run_ranks(2, rank)


def test_layout_refuses_data_parallel_attention_without_expert_parallel():
    with pytest.raises(ParallelConfigError, match="expert-parallel-size of at least 2"):
        ParallelLayout(attention_data_parallel=True)
    with pytest.raises(ParallelConfigError, match="tensor-parallel-size 1"):
        ParallelLayout(2, 2, attention_data_parallel=True)


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory):
    from tests.helpers.tiny_deepseek_v3 import write_tiny_deepseek_v3

    path, _ = write_tiny_deepseek_v3(tmp_path_factory.mktemp("kimi-dp"), seed=5)
    return path


def kimi_rank(path, backend, rank):
    from openinfer_kimi_k2.plugin import build_model

    from openinfer import EngineOptions

    config = json.loads((path / "config.json").read_text())
    return build_model(path, config, EngineOptions(device="cpu"), backend, rank)


def run_kimi(path, layout: ParallelLayout, batches: list[ForwardBatch]):
    """Every rank's logits per step, its pool size and how many cache rows its blocks hold."""

    def rank(comm):
        backend = NumpyBackend()
        model = kimi_rank(path, backend, RankContext(layout=layout, rank=comm.rank, comm=comm))
        dp = model.data_parallel_attention
        blocks = dp.local_blocks(NUM_BLOCKS, BLOCK) if dp is not None else NUM_BLOCKS
        kv = [backend.allocate_kv(spec, blocks, BLOCK) for spec in kv_cache_specs_of(model)]
        logits = [np.array(model.forward(backend.prepare_batch(b), kv)) for b in batches]
        held = kv[0].k if dp is None else kv[0].k[dp.local_of[dp.local_of >= 0]]  # blocks it still owns
        return logits, blocks, int(np.count_nonzero(np.any(held != 0, axis=-1)))

    return run_ranks(layout.world_size, rank)


def test_kimi_data_parallel_attention_equals_one_rank(tiny_kimi):
    batches = steps()
    ((reference, _, rows_single),) = run_kimi(tiny_kimi, ParallelLayout(), batches)
    ranks = run_kimi(tiny_kimi, ParallelLayout(expert_parallel_size=2, attention_data_parallel=True), batches)
    for rank, (logits, blocks, _) in enumerate(ranks):
        assert blocks < NUM_BLOCKS
        for index, expected in enumerate(reference):
            np.testing.assert_allclose(logits[index], expected, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}")
    # the latent rows are split between the ranks, not repeated: together they hold what one
    # rank holds alone, and each holds part of it
    rows = [r for _, _, r in ranks]
    assert sum(rows) == rows_single and all(0 < r < rows_single for r in rows)


def test_kimi_engine_with_data_parallel_attention_generates_the_same_tokens(tiny_kimi):
    """Through the engine (thread ranks): more requests than ranks, a shared prompt prefix."""
    from openinfer_kimi_k2.plugin import openinfer_create_engine

    from openinfer import EngineOptions, PagedEngine
    from openinfer.parallel.workers import start_thread_group

    config = json.loads((tiny_kimi / "config.json").read_text())
    prefix = [7, 3, 19, 44, 2, 91, 60, 13]
    requests = [make_request(f"r{i}", prefix + [20 + i] * (i + 1), max_tokens=6) for i in range(4)]
    options = EngineOptions(device="cpu", num_kv_blocks=64, max_num_seqs=4)
    single = openinfer_create_engine(str(tiny_kimi), config, options)
    try:
        expected = [o.token_ids for o in run_all(single, requests)]
    finally:
        single.close_sync()
    model = start_thread_group(partial(kimi_rank, tiny_kimi),
                               ParallelLayout(expert_parallel_size=2, attention_data_parallel=True), "auto",
                               NumpyBackend)
    engine = PagedEngine(model, options)
    try:
        assert [o.token_ids for o in run_all(engine, requests)] == expected
        assert [o.token_ids for o in run_all(engine, requests)] == expected  # prefix-cache hits this time
    finally:
        engine.close_sync()
        model.close()


def test_kimi_engine_data_parallel_attention_under_a_tight_pool(tiny_kimi):
    """Ten requests (half on a shared prefix) through 10 blocks of 16 tokens and 8-token chunks:
    chunked prefill, preemption and recompute, blocks freed and reused across ranks — the
    tokens still equal the single-rank engine's."""
    from openinfer_kimi_k2.plugin import openinfer_create_engine

    from openinfer import EngineOptions, PagedEngine
    from openinfer.parallel.workers import start_thread_group

    config = json.loads((tiny_kimi / "config.json").read_text())
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 150, 12).tolist()
    requests = [make_request(f"r{i}", (prefix if i % 2 else []) + rng.integers(3, 150, int(rng.integers(3, 40))).tolist(),
                             max_tokens=int(rng.integers(20, 40))) for i in range(10)]
    options = EngineOptions(device="cpu", num_kv_blocks=10, max_num_seqs=6, max_num_batched_tokens=8)
    single = openinfer_create_engine(str(tiny_kimi), config, options)
    try:
        expected = run_all(single, requests)
    finally:
        single.close_sync()
    assert all(o.error is None for o in expected)
    model = start_thread_group(partial(kimi_rank, tiny_kimi),
                               ParallelLayout(expert_parallel_size=2, attention_data_parallel=True), "auto",
                               NumpyBackend)
    engine = PagedEngine(model, options)
    try:
        outputs = run_all(engine, requests)
        assert engine.scheduler.num_preemptions > 0  # the pool was tight enough to recompute some
    finally:
        engine.close_sync()
        model.close()
    assert all(o.error is None for o in outputs)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


@pytest.mark.parametrize("world_size", [2, 3, 8])
@pytest.mark.parametrize("headroom", [1.0, 1.5, 2.7])
def test_engine_blocks_is_the_largest_pool_whose_rank_parts_fit(world_size, headroom):
    def local(num_blocks: int) -> int:
        def rank(comm):
            return DataParallelAttention(comm, headroom).local_blocks(num_blocks, BLOCK)

        return run_ranks(world_size, rank)[0]

    for rank_blocks in (1, 2, 7, 40, 1001):
        blocks = engine_blocks(rank_blocks, world_size, headroom)
        assert local(blocks) <= rank_blocks < local(blocks + 1)
        assert blocks == pytest.approx(rank_blocks * world_size / headroom, abs=1) or blocks == rank_blocks


def test_kimi_engine_kv_pool_is_sized_from_what_each_rank_stores(tiny_kimi):
    """Sized from memory (no --num-kv-blocks): with data-parallel attention each rank's memory
    holds only its own sequences' latent rows, so the engine's pool is ~ranks / headroom times
    what one rank holds, while every rank allocates no more than the KV budget (the same as a
    single rank, or an EP=2 group without it, whose pool stays one rank's)."""
    from openinfer_kimi_k2.plugin import openinfer_create_engine

    from openinfer import EngineOptions, PagedEngine
    from openinfer.parallel.data import DEFAULT_HEADROOM
    from openinfer.parallel.workers import start_thread_group

    config = json.loads((tiny_kimi / "config.json").read_text())
    probe = kimi_rank(tiny_kimi, NumpyBackend(), RankContext())
    block_bytes = sum(spec.page_bytes(16) for spec in kv_cache_specs_of(probe))
    budget = 40.5 * block_bytes  # 40 blocks per rank, well below every sequence at full context
    options = EngineOptions(device="cpu", cpu_kv_cache_gib=budget / 2**30, max_num_seqs=64)
    requests = [make_request(f"r{i}", [5 + i, 17, 99, 3, 150][: 2 + i], max_tokens=5) for i in range(3)]

    def allocated(kv_cache) -> int:
        return sum(layer.k.nbytes + (layer.v.nbytes if getattr(layer, "v", None) is not None else 0)
                   for layer in kv_cache)

    single = openinfer_create_engine(str(tiny_kimi), config, options)
    try:
        rank_blocks = single.kv_plan.num_blocks
        single_bytes = allocated(single.kv_cache)
        expected = [o.token_ids for o in run_all(single, requests)]
    finally:
        single.close_sync()
    assert rank_blocks == 40 and single_bytes <= budget

    pools = {}
    for data_parallel in (False, True):
        model = start_thread_group(partial(kimi_rank, tiny_kimi),
                                   ParallelLayout(expert_parallel_size=2, attention_data_parallel=data_parallel),
                                   "auto", NumpyBackend)
        engine = PagedEngine(model, options)
        try:
            caches = [engine.kv_cache] + [remote.worker.kv_cache for remote in model.remotes]
            assert [allocated(c) for c in caches] == [single_bytes] * 2  # each rank fills its budget, no more
            pools[data_parallel] = engine.kv_plan.num_blocks
            assert engine.info().num_kv_blocks == pools[data_parallel]
            assert [o.token_ids for o in run_all(engine, requests)] == expected
        finally:
            engine.close_sync()
            model.close()
    assert pools[False] == rank_blocks
    assert pools[True] == engine_blocks(rank_blocks, 2) == int(rank_blocks * 2 / DEFAULT_HEADROOM)  # 53 of 40


def test_an_explicit_pool_is_the_engines_under_data_parallel_attention(tiny_kimi):
    """--num-kv-blocks fixes the engine's pool; each rank then allocates its part of it."""
    from openinfer import EngineOptions, PagedEngine
    from openinfer.parallel.workers import start_thread_group

    model = start_thread_group(partial(kimi_rank, tiny_kimi),
                               ParallelLayout(expert_parallel_size=2, attention_data_parallel=True), "auto",
                               NumpyBackend)
    engine = PagedEngine(model, EngineOptions(device="cpu", num_kv_blocks=NUM_BLOCKS))
    try:
        assert engine.kv_plan.num_blocks == NUM_BLOCKS
        assert engine.kv_cache[0].k.shape[0] == 24  # 1.5 x 32 / 2
    finally:
        engine.close_sync()
        model.close()
