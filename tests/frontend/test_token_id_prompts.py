"""A /v1/completions prompt of token ids is checked in one C pass (msgspec) and taken by the
prompt field as it is: it validates to the same ids, every prompt that is not a list of valid
token ids goes through the field's own validation with the same errors as a model whose prompt
field has no fast path, and the JSON schema is unchanged."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, Field, ValidationError

from openinfer.frontend.http.schemas import (
    INT32_LIMIT,
    CompletionRequest,
    TokenId,
    TokenIds,
    checked_token_ids,
)


class PlainPrompt(BaseModel):
    """The completions prompt field as pydantic validates it without the fast path."""

    prompt: Annotated[str | list[TokenId] | list[list[TokenId]] | list[str], Field(union_mode="left_to_right")]


PROMPTS = [
    [1, 2, 3], [0, INT32_LIMIT - 1], [7] * 20_000, "text", ["a", "b"], [[1, 2], [3]], [],
    [1, True], [True, 1], [1, 1.0], [1, -1], [1, INT32_LIMIT], [1, 2**70], [1, "a"], [1, None], [1, [2]],
    [1, {"a": 1}], [1, "\ud800"], [-1], [1.5], 5, None, {"a": 1},
]


def outcome(model: type[BaseModel], prompt):
    try:
        value = model.model_validate({"prompt": prompt}).prompt
        return "ok", list(value) if isinstance(value, list) else value
    except ValidationError as exc:
        # the prompt's own errors (the surrogate walk reports its own message before the field's)
        return "refused", [(e["type"], e["loc"], e["msg"]) for e in exc.errors() if e["loc"][:1] == ("prompt",)]


@pytest.mark.parametrize("prompt", PROMPTS, ids=[repr(p)[:30] for p in PROMPTS])
def test_the_prompt_validates_as_the_plain_field_does(prompt):
    expected, got = outcome(PlainPrompt, prompt), outcome(CompletionRequest, prompt)
    if prompt == [1, "\ud800"]:  # the surrogate walk refuses it before the field, as it did
        assert got[0] == "refused"
    else:
        assert got == expected


def test_valid_token_ids_take_the_fast_path():
    ids = list(range(100, 16484))
    request = CompletionRequest.model_validate({"prompt": ids, "max_tokens": 1})
    assert isinstance(request.prompt, TokenIds) and request.prompt == ids
    for bad in ([1, True], [1, 1.0], [1, -1], [1, INT32_LIMIT], [1, "x"], [], [[1]], "x", (1, 2)):
        assert checked_token_ids(bad) is None
    assert checked_token_ids([0, INT32_LIMIT - 1]) == [0, INT32_LIMIT - 1]


def test_the_json_schema_of_the_prompt_is_the_plain_fields():
    assert CompletionRequest.model_json_schema()["properties"]["prompt"]["anyOf"] == \
        PlainPrompt.model_json_schema()["properties"]["prompt"]["anyOf"]
