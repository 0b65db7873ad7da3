"""Qwen3.5 tensor parallel on the NumPy backend (ranks as threads, fake communicator): TP=2
and TP=4 logits equal TP=1 to 1e-5 — GDN value heads split, key heads split (TP=2) or
replicated (TP=4), attention KV heads replicated at TP=4 — over a prefill and a decode step."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
from openinfer_qwen35.plugin import build_model

from openinfer import EngineOptions
from openinfer.errors import ParallelConfigError
from openinfer.parallel.layout import ParallelLayout
from tests.helpers.parallel import prefill_then_decode, rank_logits
from tests.plugins.qwen35.qwen35_helpers import TINY_QWEN35_VARIANT, make_hf_model, write_text_checkpoint

PROMPTS = [[5, 17, 60, 3, 41, 7, 88, 12, 30], [12, 8, 90]]
NEXT = [61, 22]


def factory(path):
    options = EngineOptions(device="cpu", max_num_seqs=4, cpu_kv_cache_gib=0.01)
    return partial(lambda p, c, o, backend, rank: build_model(p, c, backend, o, rank), path,
                   json.loads((path / "config.json").read_text()), options)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_logits_equal_single_rank(tiny, tp):
    path, _ = tiny
    batches = prefill_then_decode(PROMPTS, NEXT)
    (reference,) = rank_logits(factory(path), ParallelLayout(1), batches)
    for rank, logits in enumerate(rank_logits(factory(path), ParallelLayout(tp), batches)):
        for step, expected in enumerate(reference):
            np.testing.assert_allclose(logits[step], expected, rtol=1e-5, atol=1e-5,
                                       err_msg=f"TP={tp} rank {rank} step {step}")


def test_tp2_with_biases_tied_embeddings_and_one_key_head(tmp_path):
    """The variant spelling (attention biases: o_proj's added on rank 0 only; tied LM head) with
    one GDN key head shared by 2 value heads: the key head is replicated on both ranks."""
    hf, config = make_hf_model(seed=4, base=TINY_QWEN35_VARIANT, linear_num_value_heads=2)
    path = write_text_checkpoint(tmp_path / "variant", hf, config)
    batches = prefill_then_decode(PROMPTS, NEXT)
    (reference,) = rank_logits(factory(path), ParallelLayout(1), batches)
    ranks = rank_logits(factory(path), ParallelLayout(2), batches)
    for step, expected in enumerate(reference):
        np.testing.assert_allclose(ranks[1][step], expected, rtol=1e-5, atol=1e-5)


def test_value_heads_not_divisible_is_refused(tiny):
    path, _ = tiny
    with pytest.raises(ParallelConfigError, match="does not divide by --tensor-parallel-size 3"):
        rank_logits(factory(path), ParallelLayout(3), prefill_then_decode(PROMPTS, NEXT))


def test_engine_tp2_matches_tp1_with_state_snapshots(tiny):
    """The engine over thread ranks: each rank keeps its GDN state heads in its own slots; the
    prefix cache's state snapshots and restores reach every rank (a repeated prompt hits)."""
    from openinfer_qwen35.plugin import openinfer_create_engine

    from tests.helpers.engine_utils import make_request, run_all

    path, _ = tiny
    config = json.loads((path / "config.json").read_text())
    prompt = list(range(3, 40))
    outputs = {}
    for tp in (1, 2):
        engine = openinfer_create_engine(str(path), config, EngineOptions(device="cpu", tensor_parallel_size=tp,
                                                                          max_num_seqs=4, block_size=16))
        try:
            first = run_all(engine, [make_request("a", prompt, max_tokens=5), make_request("b", [7, 8, 9], max_tokens=5)])
            again = run_all(engine, [make_request("c", prompt, max_tokens=5)])
            outputs[tp] = [o.token_ids for o in first + again]
            assert again[0].cached_tokens and again[0].cached_tokens >= 16
        finally:
            engine.close_sync()
    assert outputs[2] == outputs[1]
