"""OpenAI ``response_format`` and vLLM ``structured_outputs`` as the contract's ``StructuredOutput``.

Checked here so that a bad schema, regex or grammar is a 400 naming the field and the problem;
the engine compiles the same constraint again with the model's vocabulary.
"""

from __future__ import annotations

import json
from typing import Any

from openinfer.errors import InvalidRequestError
from openinfer.structured import check_constraint
from openinfer.v1 import engine_pb2 as pb

STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _checked(constraint: pb.StructuredOutput, field: str) -> pb.StructuredOutput:
    try:
        check_constraint(constraint)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{field}: {exc}", field) from exc
    return constraint


def from_response_format(response_format: dict[str, Any] | None) -> pb.StructuredOutput | None:
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                                  f"{kind!r}", "response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequestError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                                  "response_format")
    schema = spec["schema"]
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("response_format.json_schema.schema must be a JSON Schema object",
                                  "response_format")
    return _checked(pb.StructuredOutput(json_schema=json.dumps(schema)), "response_format")


def from_structured_outputs(options: dict[str, Any] | None) -> pb.StructuredOutput | None:
    if not options:
        return None
    given = [k for k in STRUCTURED_OUTPUT_KEYS if options.get(k) not in (None, False)]
    unknown = sorted(k for k in options if k not in STRUCTURED_OUTPUT_KEYS and options[k] is not None)
    if unknown:
        raise InvalidRequestError(f"structured_outputs does not support {unknown}; use one of "
                                  f"{list(STRUCTURED_OUTPUT_KEYS)}", "structured_outputs")
    if len(given) != 1:
        raise InvalidRequestError(f"structured_outputs takes exactly one of {list(STRUCTURED_OUTPUT_KEYS)}, got "
                                  f"{given or 'none'}", "structured_outputs")
    key = given[0]
    value = options[key]
    if key == "json":
        constraint = pb.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    elif key == "json_object":
        constraint = pb.StructuredOutput(json_object=True)
    elif key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError("structured_outputs.choice must be a list of strings", "structured_outputs")
        constraint = pb.StructuredOutput(choice=pb.ChoiceList(choices=value))
    else:
        if not isinstance(value, str):
            raise InvalidRequestError(f"structured_outputs.{key} must be a string", "structured_outputs")
        constraint = pb.StructuredOutput(**{key: value})
    return _checked(constraint, "structured_outputs")


def may_constrain(body: Any) -> bool:
    """Whether ``constraint_of`` has anything to compile or check (else it returns None at once:
    no need to send it to a worker thread)."""
    return bool(body.response_format or body.structured_outputs)


def constraint_of(body: Any) -> pb.StructuredOutput | None:
    """The request's constraint (``response_format`` or ``structured_outputs``, not both)."""
    by_format = from_response_format(body.response_format)
    by_options = from_structured_outputs(body.structured_outputs)
    if by_format is not None and by_options is not None:
        raise InvalidRequestError("give response_format or structured_outputs, not both", "structured_outputs")
    return by_format or by_options
