"""Which completion prompts skip the worker thread (nothing to tokenize) and which go through it."""

from types import SimpleNamespace

import pytest

from openinfer.frontend.http.completions import is_token_ids
from openinfer.frontend.http.structured import may_constrain


@pytest.mark.parametrize("prompt, expected", [
    ([1, 2, 3], True),
    ([[1, 2], [3]], True),
    ("hello", False),
    (["hello", "world"], False),
    ([[1, 2], "text"], False),  # mixed: a text prompt among them must be tokenized
    ([], False),  # refused later with the usual error, through the usual path
])
def test_is_token_ids(prompt, expected):
    assert is_token_ids(prompt) is expected


@pytest.mark.parametrize("response_format, structured_outputs, expected", [
    (None, None, False),
    ({"type": "json_object"}, None, True),
    ({"type": "text"}, None, True),  # checked (and found to be no constraint) by constraint_of
    (None, {"regex": "a+"}, True),
])
def test_may_constrain(response_format, structured_outputs, expected):
    body = SimpleNamespace(response_format=response_format, structured_outputs=structured_outputs)
    assert may_constrain(body) is expected
