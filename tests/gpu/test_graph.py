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
