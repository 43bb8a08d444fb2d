"""The OpenAI and vLLM ways of asking for structured output, read into the gRPC StructuredOutput.

- OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}};
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ...};
- the older vLLM names its clients still send: guided_json, guided_regex, guided_choice, guided_grammar.

A request uses one of them. Whether the spec compiles is the frontend's to say (its 400 names the field); here only
the shapes are checked, each failure a 400 naming the field the client sent.
"""

from __future__ import annotations

import json
from typing import Any

from frontend.gateway.errors import bad_request
from tokend.v1 import tokend_pb2 as pb

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams options that change nothing here: tokend has one backend (no fallback) and writes
# JSON without optional whitespace already.
_NO_OP_OPTIONS = {"disable_fallback": (True, False, None), "disable_any_whitespace": (True, None)}


def structured_output(request: Any) -> pb.StructuredOutput | None:
    """The request's constraint, or None; a 400 names the field when it is malformed or asked for twice."""
    found = []
    if request.response_format not in (None, {"type": "text"}):
        found.append(("response_format", _from_response_format(request.response_format)))
    if request.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(request.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            found.append((name, _constraint(name, kind, value)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"{found[1][0]}: only one structured output per request; this one sets {names}", found[1][0])
    return found[0][1] if found else None


def structured_param(request: Any) -> str | None:
    """The field the request asked for its structured output with: where the frontend's refusal points."""
    if request.response_format not in (None, {"type": "text"}):
        return "response_format"
    if request.structured_outputs is not None:
        return "structured_outputs"
    return next((name for name in _GUIDED if getattr(request, name) is not None), None)


def _from_response_format(value: Any) -> pb.StructuredOutput:
    if not isinstance(value, dict):
        raise bad_request("response_format: must be an object with a type", "response_format")
    kind = value.get("type")
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema: must be an object with a schema", "response_format")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema: must be a JSON Schema object", "response_format")
        return pb.StructuredOutput(json_schema=json.dumps(schema))
    raise bad_request(
        f"response_format.type: must be text, json_object or json_schema, got {kind!r}", "response_format"
    )


def _from_structured_outputs(value: Any) -> pb.StructuredOutput:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs: must be an object", "structured_outputs")
    options = {key: item for key, item in value.items() if item is not None}
    for key, allowed in _NO_OP_OPTIONS.items():
        if key in options and options.pop(key) not in allowed:
            raise bad_request(f"structured_outputs.{key}: {value[key]!r} is not supported", "structured_outputs")
    unknown = sorted(set(options) - set(_CONSTRAINTS))
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]}: not supported by this server", "structured_outputs")
    if len(options) != 1:
        raise bad_request(
            f"structured_outputs: set exactly one of {', '.join(_CONSTRAINTS)}, got {sorted(options)}",
            "structured_outputs",
        )
    ((kind, item),) = options.items()
    if kind == "json_object":
        if item is not True:
            raise bad_request("structured_outputs.json_object: must be true", "structured_outputs")
        return pb.StructuredOutput(json_object=True)
    return _constraint("structured_outputs", kind, item, f"structured_outputs.{kind}")


def _constraint(param: str, kind: str, value: Any, field: str | None = None) -> pb.StructuredOutput:
    field = field or param
    if kind == "json":
        if isinstance(value, dict):
            return pb.StructuredOutput(json_schema=json.dumps(value))
        if isinstance(value, str):
            return pb.StructuredOutput(json_schema=value)  # its JSON is checked where it is compiled
        raise bad_request(f"{field}: must be a JSON Schema (an object, or one as a string)", param)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(item, str) for item in value)):
            raise bad_request(f"{field}: must be a non-empty list of strings", param)
        return pb.StructuredOutput(choice=pb.Choices(choices=value))
    if not isinstance(value, str):
        raise bad_request(f"{field}: must be a string", param)
    return pb.StructuredOutput(regex=value) if kind == "regex" else pb.StructuredOutput(grammar=value)
