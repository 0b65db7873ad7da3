"""benchmarks/burst_model.py: the step-cost model and a burst through the real scheduler."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from burst_model import StepCostModel, simulate, through_client  # noqa: E402


@pytest.fixture(scope="module")
def model() -> StepCostModel:
    return StepCostModel.from_results()


def test_the_fitted_model_reproduces_its_own_measurements(model):
    # a decode step of 256 sequences at ~1k context costs what the H100 measurements say (~17 ms);
    # a mixed step pays a whole prefill tile per decode row, so 256 of them cost more than a graphed step
    decode_ms, graphed = model.step_ms([(1024, 1, True)] * 256)
    assert graphed and 12 < decode_ms < 25
    prompts = [(0, 1024, True)] * 8
    alone, _ = model.step_ms(prompts)
    mixed, graphed = model.step_ms(prompts + [(1024, 1, True)] * 256)
    assert not graphed and 80 < alone < 140 and mixed - alone > decode_ms


def test_mixed_decode_attention_costs_the_decode_rows_as_a_decode_step(model):
    # OPENINFER_MIXED_DECODE_ATTENTION: running decodes first, then a chunk; the decode rows cost
    # decode attention, so the step gets cheaper by about the tiles they no longer take
    from dataclasses import replace

    split = replace(model, mixed_decode_attention=True)
    step = [(1024, 1, True)] * 256 + [(0, 512, True)]
    before, _ = model.step_ms(step)
    after, graphed = split.step_ms(step)
    tiles = model.layers * (model.prefill_attention_ms([(1024, 1)] * 256))
    decode = model.layers * (model.decode_attention_ms([1025] * 256))
    assert not graphed and after == pytest.approx(before - tiles + decode)
    assert split.step_ms([(0, 512, True)] + [(1024, 1, True)] * 256) == model.step_ms(
        [(0, 512, True)] + [(1024, 1, True)] * 256)  # decodes after the chunk: not split


@pytest.mark.parametrize("policy", ["mixed", "split", "prefill_first"])
def test_a_burst_emits_every_token_and_the_policies_order_as_modelled(model, policy):
    row = simulate(model, streams=16, input_len=256, output_len=8, budget=1024, policy=policy)
    assert row["output_throughput"] == pytest.approx(16 * 8 / row["duration_s"])
    assert row["ttft_ms"]["p99"] <= 1e3 * row["duration_s"]
    if policy != "mixed":  # decodes never ride along with prompt chunks
        assert row["eager_steps"]["decode_rows"] == 0
    else:
        assert row["eager_steps"]["decode_rows"] > 0


def test_split_beats_mixed_when_decode_rows_cost_a_tile_each(model):
    mixed = simulate(model, streams=64, input_len=1024, output_len=16, budget=8192, policy="mixed")
    split = simulate(model, streams=64, input_len=1024, output_len=16, budget=8192, policy="split")
    assert split["duration_s"] < mixed["duration_s"]


def test_a_slow_client_delays_tokens_in_arrival_order():
    seen = through_client({"a": [0.0, 1.0], "b": [0.0]}, us_per_chunk=500_000)
    assert seen == {"a": [0.5, 1.5], "b": [1.0]}
