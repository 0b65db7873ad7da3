"""CUDA graph replay against eager launches of the same padded inputs: bit-identical."""

from __future__ import annotations

import json

import numpy as np
import pytest

from openinfer.backend.base import ForwardBatch
from tests.gpu.conftest import bf16_random

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
MAX_BLOCKS = 16
SMALL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model_and_kv(cuda_backend, tmp_path_factory):
    from openinfer_qwen3.config import qwen3_config
    from openinfer_qwen3.model import Qwen3ForCausalLM

    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    path = write_tiny_qwen3(tmp_path_factory.mktemp("graph"), seed=11, dtype="bfloat16", **SMALL)
    config = qwen3_config(json.loads((path / "config.json").read_text()))
    model = Qwen3ForCausalLM.load(path, config, cuda_backend)
    rng = np.random.default_rng(5)
    num_blocks = 32 * MAX_BLOCKS + 1
    shape = (num_blocks, BLOCK_SIZE, SMALL["num_key_value_heads"], SMALL["head_dim"])
    kv = [cuda_backend.allocate_kv(*shape) for _ in range(SMALL["num_hidden_layers"])]
    for layer in kv:  # stands in for earlier prefill
        layer.k[...] = cuda_backend.upload(bf16_random(rng, *shape))
        layer.v[...] = cuda_backend.upload(bf16_random(rng, *shape))
    return model, kv


def decode_batch(rng: np.random.Generator, num_seqs: int) -> ForwardBatch:
    lengths = rng.integers(1, MAX_BLOCKS * BLOCK_SIZE, size=num_seqs).astype(np.int32)
    width = int(-(-lengths.max() // BLOCK_SIZE))
    tables = np.zeros((num_seqs, width), np.int32)
    for i in range(num_seqs):  # sequence i owns blocks 1 + i*MAX_BLOCKS ...
        used = -(-lengths[i] // BLOCK_SIZE)
        tables[i, :used] = 1 + i * MAX_BLOCKS + np.arange(used)
    positions = lengths - 1
    slots = tables[np.arange(num_seqs), positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    return ForwardBatch(token_ids=rng.integers(0, SMALL["vocab_size"], size=num_seqs).astype(np.int32),
                        positions=positions, query_start=np.arange(num_seqs + 1, dtype=np.int32),
                        context_lens=lengths, block_tables=tables, slot_mapping=slots.astype(np.int32),
                        logits_rows=np.arange(num_seqs, dtype=np.int32), max_query_len=1,
                        max_context_len=int(lengths.max()))


def test_graph_replay_is_bit_identical_to_eager(cuda_backend, model_and_kv):
    from openinfer.graph import CudaGraphRunner

    model, kv = model_and_kv
    runner = CudaGraphRunner(cuda_backend, lambda batch: model.forward(batch, kv), max_num_seqs=32,
                             max_blocks_per_seq=MAX_BLOCKS, buckets=(1, 2, 4, 8, 16, 32))
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16, 32]
    rng = np.random.default_rng(0)
    for num_seqs in (1, 3, 8, 13, 32):
        batch = decode_batch(rng, num_seqs)
        replayed = cuda_backend.to_host(runner.run(batch)).copy()
        eager = cuda_backend.to_host(runner.run_padded_eager(batch))
        assert replayed.shape == (num_seqs, SMALL["vocab_size"])
        assert np.isfinite(replayed).all()
        assert np.array_equal(replayed, eager), f"graph and eager differ at batch size {num_seqs}"
        unpadded = cuda_backend.to_host(model.forward(cuda_backend.prepare_batch(batch), kv))
        assert np.abs(unpadded - replayed).max() < 0.05 * np.abs(replayed).max()
    one = decode_batch(rng, 1)
    first = cuda_backend.to_host(runner.run(one)).copy()
    assert np.array_equal(first, cuda_backend.to_host(runner.run(one)))


def test_prefill_falls_back_to_eager(cuda_backend, model_and_kv):
    from openinfer.graph import CudaGraphRunner

    model, kv = model_and_kv
    runner = CudaGraphRunner(cuda_backend, lambda batch: model.forward(batch, kv), max_num_seqs=4,
                             max_blocks_per_seq=MAX_BLOCKS, buckets=(1, 2, 4))
    batch = decode_batch(np.random.default_rng(1), 2)
    batch.max_query_len = 2  # not a decode step
    assert runner.bucket_for(batch) is None


def short_prefill_step(rng: np.random.Generator, new: list[int]) -> ForwardBatch:
    """Sequence i has a random cached context and runs ``new[i]`` tokens (a warm prefix's last
    block, or 1 for a decoding neighbour), over its own blocks."""
    cached = [int(rng.integers(0, MAX_BLOCKS * BLOCK_SIZE - n)) for n in new]
    width = max(-(-(c + n) // BLOCK_SIZE) for c, n in zip(cached, new, strict=True))
    tables = np.zeros((len(new), width), np.int32)
    for i, (c, n) in enumerate(zip(cached, new, strict=True)):
        used = -(-(c + n) // BLOCK_SIZE)
        tables[i, :used] = 1 + i * MAX_BLOCKS + np.arange(used)
    ids = rng.integers(0, SMALL["vocab_size"], size=sum(new)).astype(np.int32)
    return ForwardBatch.over_blocks(tables, cached, new, BLOCK_SIZE, token_ids=ids)


@pytest.mark.parametrize("short_query", ["1", "0"])
def test_short_prefill_graph_replay_equals_eager(cuda_backend, model_and_kv, monkeypatch, short_query):
    """A few new tokens per sequence replay a short-prefill graph: bit-identical to the same
    padded inputs launched op by op, close to the unpadded eager step; with the short-query
    kernel and with the prefill kernel over the static batch's fixed tiles."""
    from openinfer.backend.cuda.kernel_choices import SHORT_QUERY_ENV, refresh_kernel_choices
    from openinfer.graph import CudaGraphRunner, short_prefill_tokens

    monkeypatch.setenv(SHORT_QUERY_ENV, short_query)
    refresh_kernel_choices()
    try:
        model, kv = model_and_kv
        runner = CudaGraphRunner(cuda_backend, lambda batch: model.forward(batch, kv), max_num_seqs=8,
                                 max_blocks_per_seq=MAX_BLOCKS, buckets=(1, 2, 4, 8), prefill_buckets=(1, 2, 4, 8))
        runner.capture()
        assert sorted(runner.prefill_graphs) == [1, 2, 4, 8]
        rng = np.random.default_rng(7)
        for new, bucket in (([8], 1), ([16], 1), ([2], 1), ([1, 9, 1], 4), ([3, 3], 2), ([1, 1, 1, 1, 1, 16], 8)):
            batch = short_prefill_step(rng, new)
            assert runner.bucket_for(batch) is None and runner.prefill_bucket_for(batch) == bucket
            assert batch.num_tokens <= short_prefill_tokens(bucket)
            replayed = cuda_backend.to_host(runner.run(batch)).copy()
            eager = cuda_backend.to_host(runner.run_padded_eager(batch))
            assert replayed.shape == (len(new), SMALL["vocab_size"])
            assert np.isfinite(replayed).all()
            assert np.array_equal(replayed, eager), f"graph and eager differ for new tokens {new}"
            unpadded = cuda_backend.to_host(model.forward(cuda_backend.prepare_batch(batch), kv))
            assert np.abs(unpadded - replayed).max() < 0.05 * np.abs(replayed).max(), f"new tokens {new}"
        # a decode step still takes its decode graph; 17 new tokens run eagerly
        assert runner.bucket_for(decode_batch(rng, 3)) == 4
        assert runner.prefill_bucket_for(short_prefill_step(rng, [17])) is None
    finally:
        monkeypatch.undo()
        refresh_kernel_choices()


NEAR_TIE = 0.1  # top-2 logprob gap within which graph and eager (other GEMM shapes) may pick differently


def diverges_beyond_tie(ours, reference) -> int | None:
    """The first step where ``ours`` picks another greedy token than ``reference`` while
    ``reference``'s top two were further apart than NEAR_TIE; None if there is none."""
    for step, (a, b) in enumerate(zip(ours.token_ids, reference.token_ids, strict=True)):
        if a != b:
            top = reference.logprobs[step].top
            return None if top[0].logprob - top[1].logprob <= NEAR_TIE else step
    return None


def test_engine_warm_prefixes_replay_short_prefill_graphs_with_the_eager_tokens(tmp_path, monkeypatch):
    """OPENINFER_PREFILL_GRAPHS=1 through the engine: warm prefixes (prompt cached but its last
    partial block), one alone and three at once, replay short-prefill graphs and give the greedy
    tokens of the same requests run with those graphs switched off (the short-query kernel both
    ways, so only the padded GEMM shapes differ)."""
    from openinfer_qwen3 import plugin

    from openinfer import EngineOptions
    from openinfer.backend.cuda.kernel_choices import SHORT_QUERY_ENV, refresh_kernel_choices
    from openinfer.graph import PREFILL_GRAPHS_ENV
    from tests.helpers.engine_utils import make_request, run_all
    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    monkeypatch.setenv(PREFILL_GRAPHS_ENV, "1")
    monkeypatch.setenv(SHORT_QUERY_ENV, "1")
    refresh_kernel_choices()
    path = write_tiny_qwen3(tmp_path, seed=11, dtype="bfloat16", **SMALL)
    config = json.loads((path / "config.json").read_text())
    engine = plugin.openinfer_create_engine(str(path), config, EngineOptions(
        device="cuda", max_model_len=512, max_num_seqs=8, num_kv_blocks=512))
    try:
        runner = engine.runner
        assert sorted(runner.prefill_graphs) == [1, 2, 4, 8]
        assert {"kernel_compile", "graph_capture", "prefill_graph_capture"} <= set(engine.startup_phases)
        short_steps: list[tuple[int, bool]] = []  # (sequences, replayed) of steps of 2..16 new tokens per sequence

        def observe(batch, graphed, began, returned):
            if 1 < batch.max_query_len <= 16:
                short_steps.append((batch.num_seqs, graphed))

        runner.observer = observe
        rng = np.random.default_rng(3)
        # 6, 5 and 4 tokens past their cached blocks: all three at once fit the 4-sequence bucket (19 tokens)
        prompts = [rng.integers(3, SMALL["vocab_size"], size=n).tolist() for n in (150, 197, 84)]
        run_all(engine, [make_request(f"cold{i}", p, max_tokens=1) for i, p in enumerate(prompts)])
        outcomes = {}
        for graphs in (True, False):
            runner.use_prefill_graphs = graphs
            short_steps.clear()
            alone = run_all(engine, [make_request(f"alone{graphs}", prompts[0], max_tokens=12, logprobs=2)])
            together = run_all(engine, [make_request(f"t{graphs}{i}", p, max_tokens=12, logprobs=2)
                                        for i, p in enumerate(prompts)])
            assert alone[0].cached_tokens == 144 and all(o.cached_tokens for o in together)
            assert short_steps and all(graphed == graphs for _, graphed in short_steps), short_steps
            outcomes[graphs] = alone + together
        assert any(seqs > 1 for seqs, _ in short_steps), "the three warm prefixes never shared a step"
        for replayed, eager in zip(outcomes[True], outcomes[False], strict=True):
            assert len(replayed.token_ids) == 12 and replayed.error is None
            step = diverges_beyond_tie(replayed, eager)
            assert step is None, f"graph {replayed.token_ids} vs eager {eager.token_ids} differ at step {step}"
    finally:
        engine.close_sync()
        monkeypatch.undo()
        refresh_kernel_choices()


def test_start_up_prefill_warm_up_changes_no_token(tmp_path, monkeypatch):
    """The start-up prefill warm-up writes synthetic K/V into blocks nothing owns yet: the same
    requests give the same greedy tokens (logprobs up to near-ties) with it on and off, and only
    the engine with it reports the start-up phase."""
    from openinfer_qwen3 import plugin

    from openinfer import EngineOptions
    from openinfer.runtime.warmup import WARMUP_ENV
    from tests.helpers.engine_utils import make_request, run_all
    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    path = write_tiny_qwen3(tmp_path, seed=12, dtype="bfloat16", **SMALL)
    config = json.loads((path / "config.json").read_text())
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, SMALL["vocab_size"], size=n).tolist() for n in (300, 41)]
    outcomes = {}
    for warm in ("1", "0"):
        monkeypatch.setenv(WARMUP_ENV, warm)
        engine = plugin.openinfer_create_engine(str(path), config, EngineOptions(
            device="cuda", max_model_len=512, max_num_seqs=8, num_kv_blocks=512))
        try:
            assert ("prefill_warmup" in engine.startup_phases) == (warm == "1")
            outcomes[warm] = run_all(engine, [make_request(f"r{warm}{i}", p, max_tokens=12, logprobs=2)
                                              for i, p in enumerate(prompts)])
        finally:
            engine.close_sync()
    for warmed, plain in zip(outcomes["1"], outcomes["0"], strict=True):
        assert len(warmed.token_ids) == 12 and warmed.error is None
        step = diverges_beyond_tie(warmed, plain)
        assert step is None, f"warm-up on {warmed.token_ids} vs off {plain.token_ids} differ at step {step}"
