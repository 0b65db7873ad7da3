"""``TokenIds``: a request's prompt kept as its array, generated ids as a list; every read and
every change the engine makes gives what the former plain list gave."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.sampling import SamplingState
from openinfer.sched import PLACEHOLDER_TOKEN, Request
from openinfer.sched.request import TokenIds
from openinfer.v1 import engine_pb2 as pb


def request(prompt) -> Request:
    return Request(request_id="r", token_ids=prompt, num_prompt_tokens=len(prompt), stop=pb.StopConditions(),
                   max_tokens=8, sampling=SamplingState(pb.SamplingParams(), np.random.default_rng(0),
                                                        np.asarray(prompt)))


@pytest.mark.parametrize("seed", range(6))
def test_reads_and_changes_match_a_plain_list(seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 1000, int(rng.integers(1, 40))).astype(np.int32)
    tokens, reference = TokenIds(prompt), prompt.tolist()
    for _ in range(60):
        action = rng.integers(4)
        if action == 0:
            token = int(rng.integers(-1, 1000))
            tokens.append(token)
            reference.append(token)
        elif action == 1 and len(reference) > len(prompt):
            index = int(rng.integers(len(prompt), len(reference)))
            tokens[index] = reference[index] = int(rng.integers(1000))
        elif action == 2 and len(reference) > len(prompt):
            start = int(rng.integers(len(prompt), len(reference) + 1))
            del tokens[start:]
            del reference[start:]
        assert len(tokens) == len(reference) and tokens.tolist() == reference and list(tokens) == reference
        for index in (0, len(reference) - 1, -1, -len(reference)):
            assert tokens[index] == reference[index] and type(tokens[index]) is int
        start = int(rng.integers(0, len(reference) + 1))
        stop = int(rng.integers(start, len(reference) + 1))
        assert tokens[start:stop].tolist() == reference[start:stop]
        assert tokens[::2].tolist() == reference[::2]


def test_the_prompt_never_changes():
    tokens = TokenIds(np.array([5, 6, 7]))
    with pytest.raises(IndexError):
        tokens[1] = 9
    tokens.append(8)
    with pytest.raises(IndexError):
        del tokens[2:]
    with pytest.raises(IndexError):
        tokens[-5]
    with pytest.raises(IndexError):
        tokens[4]
    assert tokens == [5, 6, 7, 8]


def test_request_keeps_its_prompt_array_and_placeholders_in_the_generated_list():
    prompt = np.frombuffer(np.array([3, 4, 5], "<i4").tobytes(), "<i4")  # read-only, as the core receives it
    r = request(prompt)
    assert r.token_ids.prompt is prompt  # not copied, not converted
    r.append_placeholder(0)
    r.append_placeholder(1)
    assert r.token_ids == [3, 4, 5, PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN] and r.num_resolved_tokens == 3
    r.resolve_placeholder(3, 9)
    assert r.token_at(3) == 9 and r.token_at(1) == 4 and r.output_token_ids == [9, PLACEHOLDER_TOKEN]
    r.truncate_after(3)
    assert r.token_ids == [3, 4, 5, 9] and r.num_tokens == 4 and r.num_output_tokens == 1
    r.append_placeholder(0)
    r.drop_placeholders()
    assert r.token_ids == [3, 4, 5, 9]


def test_a_list_given_is_split_at_the_prompt():
    r = Request(request_id="r", token_ids=[1, 2, 3, 4], num_prompt_tokens=3, stop=pb.StopConditions(), max_tokens=4,
                sampling=SamplingState(pb.SamplingParams(), np.random.default_rng(0), np.asarray([1, 2, 3])))
    assert r.token_ids.prompt.tolist() == [1, 2, 3] and r.token_ids.generated == [4] and r.num_output_tokens == 1
