"""Tensor parallel on the NumPy backend: TP=2 and TP=4 logits equal TP=1 (to 1e-5) for tiny
Qwen3 and Llama checkpoints, every rank returns the same full-vocabulary logits, and the
engine serves the same greedy tokens with its ranks as threads."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from openinfer.errors import ParallelConfigError
from openinfer.parallel.layout import ParallelLayout
from tests.helpers.engine_utils import make_request, run_all
from tests.helpers.parallel import prefill_then_decode, rank_logits

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [12, 8, 190]]
NEXT = [61, 222]


def qwen3_factory(path: Path):
    from openinfer_qwen3.plugin import load_rank_model

    return partial(load_rank_model, str(path), json.loads((path / "config.json").read_text()), None)


def llama_factory(path: Path):
    from openinfer_llama.plugin import load_rank_model

    return partial(load_rank_model, str(path), json.loads((path / "config.json").read_text()), None)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Llama with every bias on (row-parallel biases are added once) and a vocabulary that does
    not divide by 2 or 4 (the last rank's LM-head rows are padded)."""
    from tests.plugins.llama.tiny_llama import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("llama-tp"), seed=3, vocab_size=301, attention_bias=True,
                            mlp_bias=True)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tp_logits_equal_single_rank(family, tp, tiny_qwen3_dir, tiny_llama_dir):
    factory = qwen3_factory(tiny_qwen3_dir) if family == "qwen3" else llama_factory(tiny_llama_dir)
    batches = prefill_then_decode(PROMPTS, NEXT)
    (reference,) = rank_logits(factory, ParallelLayout(1), batches)
    ranks = rank_logits(factory, ParallelLayout(tp), batches)
    for step, expected in enumerate(reference):
        assert expected.shape[1] == (320 if family == "qwen3" else 301)
        for rank, logits in enumerate(ranks):
            np.testing.assert_allclose(logits[step], expected, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{family} TP={tp} rank {rank} step {step}")


def test_tp4_replicates_kv_heads(tiny_qwen3_dir):
    """tiny Qwen3 has 2 KV heads: at TP=4 each is held by two ranks, one KV head per rank."""
    from openinfer.backend.numpy_backend import NumpyBackend
    from openinfer.parallel.fake import run_ranks
    from openinfer.parallel.rank import RankContext

    factory = qwen3_factory(tiny_qwen3_dir)
    specs = run_ranks(4, lambda comm: factory(NumpyBackend(), RankContext(ParallelLayout(4), comm.rank, comm))
                      .stack.layers[0].attention)
    assert [(s.num_heads, s.num_kv_heads) for s in specs] == [(1, 1)] * 4


def test_heads_not_divisible_is_refused_before_loading(tiny_qwen3_dir):
    with pytest.raises(ParallelConfigError, match="num_attention_heads = 4 does not divide by --tensor-parallel-size 3"):
        rank_logits(qwen3_factory(tiny_qwen3_dir), ParallelLayout(3), prefill_then_decode(PROMPTS, NEXT))


def test_engine_with_thread_ranks_generates_the_same_tokens(tiny_qwen3_dir):
    from tests.plugins.qwen3.conftest import build_engine

    requests = [make_request(f"r{i}", p, max_tokens=6) for i, p in enumerate(PROMPTS)]
    outputs = {}
    for tp in (1, 2):
        engine = build_engine(tiny_qwen3_dir, tensor_parallel_size=tp, num_kv_blocks=64)
        try:
            outputs[tp] = [o.token_ids for o in run_all(engine, requests)]
        finally:
            engine.close_sync()
    assert outputs[2] == outputs[1]
    assert all(len(ids) == 6 for ids in outputs[1])


def test_a_failing_rank_fails_the_step_not_the_engine(tiny_qwen3_dir, monkeypatch):
    """Rank 1 raising in its forward breaks the group's collectives: the step's requests end
    with an error naming the rank, nobody hangs, and the engine still answers health()."""
    from openinfer.parallel import workers
    from tests.plugins.qwen3.conftest import build_engine

    real_step = workers.RankWorker.step

    def step(self, batch, previous, num_previous):
        if self.comm.rank == 1:
            raise RuntimeError("rank 1 lost its device")
        return real_step(self, batch, previous, num_previous)

    monkeypatch.setattr(workers.RankWorker, "step", step)
    engine = build_engine(tiny_qwen3_dir, tensor_parallel_size=2, num_kv_blocks=64)
    try:
        (outcome,) = run_all(engine, [make_request("x", [5, 6, 7], max_tokens=3)])
        assert outcome.error is not None and "rank 1: RuntimeError('rank 1 lost its device')" in outcome.error.message
        assert not outcome.token_ids
    finally:
        engine.close_sync()


def test_model_info_reports_the_ranks(tiny_qwen3_dir):
    from tests.plugins.qwen3.conftest import build_engine

    engine = build_engine(tiny_qwen3_dir, tensor_parallel_size=2, num_kv_blocks=16)
    try:
        info = engine.info()
        assert (info.tensor_parallel_size, info.expert_parallel_size) == (2, 1)
    finally:
        engine.close_sync()
