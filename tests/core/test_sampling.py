import numpy as np
import pytest

from openinfer.errors import InvalidRequestError
from openinfer.sampling import SamplingState, log_softmax, sample_row, validate_sampling
from openinfer.v1 import engine_pb2 as pb


def state(seed: int | None = 7, **params) -> SamplingState:
    sampling = pb.SamplingParams(**params)
    if seed is not None:
        sampling.seed = seed
    return SamplingState.create(sampling, [1, 2, 3], engine_seed=0, request_index=0)


LOGITS = np.log(np.array([0.05, 0.5, 0.3, 0.1, 0.05], np.float32))


def draw(n: int, **params) -> list[int]:
    s = state(**params)
    return [sample_row(LOGITS.copy(), s).token_id for _ in range(n)]


def test_greedy_is_argmax():
    assert sample_row(LOGITS.copy(), state(temperature=0.0)).token_id == 1


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    assert draw(50, temperature=1.0) == draw(50, temperature=1.0)
    assert draw(50, temperature=1.0, seed=1) != draw(50, temperature=1.0, seed=2)


def test_top_k_one_and_tiny_top_p_are_greedy():
    assert set(draw(30, temperature=1.0, top_k=1)) == {1}
    assert set(draw(30, temperature=1.0, top_p=0.01)) == {1}


def test_top_k_two_and_min_p_restrict_the_support():
    assert set(draw(200, temperature=1.0, top_k=2)) == {1, 2}
    # min_p 0.5 keeps tokens with p >= 0.25: only 1 and 2
    assert set(draw(200, temperature=1.0, min_p=0.5)) == {1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    assert set(draw(300, temperature=1.0, top_p=0.75)) == {1, 2}


def test_sampling_follows_the_distribution():
    counts = np.bincount(draw(4000, temperature=1.0), minlength=5) / 4000
    assert np.allclose(counts, np.exp(LOGITS), atol=0.03)


def test_penalties():
    logits = np.array([1.0, 2.0, 1.9, -1.0], np.float32)
    s = state(temperature=0.0, repetition_penalty=2.0)  # prompt holds ids 1, 2, 3
    assert sample_row(logits.copy(), s).token_id == 0  # 2.0/2 and 1.9/2 fall below 1.0
    s = state(temperature=0.0, presence_penalty=1.5)
    s.record(1)
    assert sample_row(logits.copy(), s).token_id == 2
    s = state(temperature=0.0, frequency_penalty=0.1)
    for _ in range(5):
        s.record(1)
    assert sample_row(logits.copy(), s).token_id == 2


def test_banned_ids_and_logprobs():
    result = sample_row(LOGITS.copy(), state(temperature=0.0), banned_ids=[1], num_logprobs=3, want_logprob=True)
    assert result.token_id == 2
    raw = log_softmax(LOGITS)
    assert result.logprob == pytest.approx(raw[2], abs=1e-6)
    assert [t for t, _ in result.top] == [1, 2, 3]


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("top_p", 1.5), ("top_p", -0.1), ("min_p", 2.0),
                                         ("top_k", -3), ("presence_penalty", 3.0), ("repetition_penalty", -1.0)])
def test_invalid_sampling_names_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        validate_sampling(pb.SamplingParams(**{field: value}))
    assert info.value.field == field
