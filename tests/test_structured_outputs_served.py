"""Structured outputs served: the official `openai` client against the gateway on the default model gets outputs
that validate (JSON Schema at temperature 1.0, n=4, streamed JSON mode, regex, choice), a spec that cannot be
enforced is a 400 naming the field while another stream goes on at its pace, and /metrics counts compiles, cache
hits and refusals."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from harness.schema_corpus import schemas, validator

pytestmark = pytest.mark.daemon

MESSAGES = [{"role": "user", "content": "Reply with a short JSON object."}]


@pytest.fixture(scope="module")
def daemon(default_model_daemon):
    return default_model_daemon


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def test_sampled_json_schema_outputs_that_stop_validate(client):
    corpus = schemas(8, seed=11)

    def ask(schema: dict):
        return client.chat.completions.create(model="", messages=MESSAGES, temperature=1.0, max_tokens=200,
                                              response_format=_json_schema_format(schema))  # fmt: skip

    with ThreadPoolExecutor(len(corpus)) as pool:
        replies = list(pool.map(ask, corpus))
    stopped = [(s, r.choices[0].message.content) for s, r in zip(corpus, replies, strict=True)
               if r.choices[0].finish_reason == "stop"]  # fmt: skip
    assert len(stopped) >= len(corpus) // 2
    for schema, content in stopped:
        validator(schema).validate(json.loads(content))


def test_n_choices_each_validate_and_a_streamed_json_object_parses(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
              "rank": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "rank"],
              "additionalProperties": False}  # fmt: skip
    reply = client.chat.completions.create(model="", messages=MESSAGES, temperature=1.0, max_tokens=60, n=4,
                                           response_format=_json_schema_format(schema))  # fmt: skip
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        validator(schema).validate(json.loads(choice.message.content))
    stream = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=120, temperature=0, stream=True,
                                            response_format={"type": "json_object"})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_regex_and_choice_through_vllms_fields(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    completion = client.completions.create(model="", prompt="Call me at", max_tokens=24, temperature=1.0, n=3,
                                           extra_body={"structured_outputs": {"regex": phone}})  # fmt: skip
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(phone, choice.text)
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Is water wet?"}],
                                          max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})  # fmt: skip
    assert chat.choices[0].message.content in ("yes", "no") and chat.choices[0].finish_reason == "stop"


BAD_SPECS = [
    ("response_format", {"response_format": _json_schema_format({"type": "integr"})}, "Invalid type"),
    ("guided_json", {"extra_body": {"guided_json": "{not json"}}, "not valid JSON"),
    ("response_format", {"response_format": _json_schema_format({"description": "x" * (1 << 20)})}, "over the limit"),
    ("structured_outputs", {"extra_body": {"structured_outputs": {"regex": "(x{1000}){1000}"}}}, "counted repetitions"),
    ("guided_grammar", {"extra_body": {"guided_grammar": 'start: a\na: "x" a'}}, "no accepting path"),
]  # fmt: skip


def test_bad_specs_are_400s_naming_the_field_while_another_stream_keeps_going(daemon, client):
    lengths = []

    def long_stream():
        stream = client.completions.create(model="", prompt="Once upon a time", max_tokens=96, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        lengths.append(sum(len(c.choices[0].text) > 0 for c in stream if c.choices))

    rejected_before = daemon.metric("tokend:structured_output_rejected_total")
    runner = threading.Thread(target=long_stream)
    runner.start()
    for param, fields, reason in BAD_SPECS:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4, **fields)
        assert raised.value.status_code == 400
        assert raised.value.body["param"] == param
        assert reason in raised.value.body["message"]
    runner.join(timeout=120)  # the stream, running beside the refusals, still delivered every token
    assert lengths and lengths[0] >= 90
    assert daemon.metric("tokend:structured_output_rejected_total") == rejected_before + len(BAD_SPECS)


def test_metrics_count_compiles_and_cache_hits(daemon, client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    hits = daemon.metric("tokend:structured_output_cache_hits_total", kind="json_schema")
    for _ in range(2):
        client.chat.completions.create(model="", messages=MESSAGES, max_tokens=20,
                                       response_format=_json_schema_format(schema))  # fmt: skip
    assert daemon.metric("tokend:structured_output_cache_hits_total", kind="json_schema") == hits + 1
    assert daemon.metric("tokend:structured_output_compile_seconds_count", kind="json_schema") >= 1
