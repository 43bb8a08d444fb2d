"""The gateway reads every way a client asks for structured output (OpenAI's response_format, vLLM's
structured_outputs and guided_* fields) into the one gRPC StructuredOutput, on chat and completions alike, and
refuses a malformed or doubled one with a 400 naming the field the client sent."""

from __future__ import annotations

import json

import msgspec
import pytest

from frontend.gateway.errors import OpenAIError
from frontend.gateway.openai_requests import ChatCompletionRequest, CompletionRequest, chat_to_grpc, completion_to_grpc
from frontend.validation import _sampling_params
from gpu_runtime.ipc.messages import SchedulerReady
from gpu_runtime.ipc.structured_output import GrammarKind, StructuredOutput

pytestmark = pytest.mark.fast

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**fields) -> StructuredOutput | None:
    body = msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **fields})
    (request,) = chat_to_grpc(msgspec.json.decode(body, type=ChatCompletionRequest), 4, "r")
    return _frontend_reads(request)


def _completion(**fields) -> StructuredOutput | None:
    body = msgspec.json.encode({"prompt": "hi", **fields})
    (request,) = completion_to_grpc(msgspec.json.decode(body, type=CompletionRequest), 4, "r")
    return _frontend_reads(request)


def _frontend_reads(request) -> StructuredOutput | None:
    ready = SchedulerReady("w", "i", 1, "m", "/m", "g", 2048, 100, 64, 16, 8, b"")
    params, _ = _sampling_params(request.sampling, None, ready)
    return params.structured_output


@pytest.mark.parametrize("read", [_chat, _completion])
@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         StructuredOutput.json_schema(SCHEMA)),
        ({"response_format": {"type": "json_object"}}, StructuredOutput.json_object()),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput.json_schema(SCHEMA)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput.json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": r"\d+"}}, StructuredOutput.regex(r"\d+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput.choice(["yes", "no"])),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, StructuredOutput.grammar('start: "a"')),
        ({"structured_outputs": {"json_object": True, "disable_fallback": True}}, StructuredOutput.json_object()),
        ({"guided_json": SCHEMA}, StructuredOutput.json_schema(SCHEMA)),
        ({"guided_regex": "[a-z]+"}, StructuredOutput.regex("[a-z]+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput.choice(["a", "b"])),
        ({"guided_grammar": 'root ::= "x"'}, StructuredOutput.grammar('root ::= "x"')),
        ({}, None),
    ],
)  # fmt: skip
def test_every_spelling_reaches_the_engine_as_one_structured_output(read, fields, expected):
    got = read(**fields)
    if expected is None:
        assert got is None
    else:
        assert got.kind is expected.kind
        spec = json.loads(got.spec) if got.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.CHOICE) else got.spec
        assert spec == (json.loads(expected.spec) if isinstance(spec, (dict, list)) else expected.spec)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
         "response_format", "json_schema.schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "json_object"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "list of strings"),
        ({"guided_regex": 5}, "guided_regex", "a string"),
        ({"guided_json": 5}, "guided_json", "JSON Schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ],
)  # fmt: skip
def test_a_malformed_or_doubled_structured_output_is_a_400_naming_the_field_sent(fields, param, words):
    with pytest.raises(OpenAIError) as raised:
        _chat(**fields)
    assert raised.value.status == 400
    assert raised.value.param == param
    assert words in raised.value.message


def test_the_frontend_refuses_an_empty_or_oversized_spec_naming_the_field():
    from frontend.errors import RequestError

    with pytest.raises(RequestError, match=r"^sampling\.structured_output\.regex: must not be empty"):
        _chat(guided_regex="  ")
    with pytest.raises(RequestError, match=r"^sampling\.structured_output\.json_schema: \d+ bytes is over the limit"):
        _chat(guided_json={"type": "object", "description": "x" * 70_000})
