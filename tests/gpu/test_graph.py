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
