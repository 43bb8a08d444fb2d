"""Hypothesis strategies for the bodies of /v1/completions and /v1/chat/completions: plausible fields with wrong
types and awkward values, bodies that are not JSON or not objects, truncated and deeply nested JSON."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from chaos.junk import any_float, any_int, any_text, edge_ints, json_value, maybe, nested_json, nesting_depth, weighted

MAX_BODY_BYTES = 4 * 1024 * 1024  # the gateway's limit: one byte over must be a 413

# Valid counts stay small so that an accepted request costs milliseconds on a CPU, not a 2048-token generation.
token_count = st.one_of(st.integers(1, 16), st.sampled_from([0, -1, 2048, 2049, 4096]), edge_ints)
model_name = st.one_of(st.sampled_from(["", "tokend-tiny-random", "no-such-model", "default"]), any_text)
prompt = st.one_of(
    any_text,
    st.lists(st.integers(0, 257), max_size=40),
    st.lists(any_int, max_size=5),
    st.lists(any_text, max_size=3),
)
stop = st.one_of(any_text, st.lists(any_text, max_size=10))
sampling_fields = {
    "model": maybe(model_name),
    "max_tokens": maybe(token_count),
    "temperature": maybe(any_float),
    "top_p": maybe(any_float),
    "n": maybe(st.one_of(st.integers(-1, 10), edge_ints)),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({}, optional={"include_usage": maybe(st.booleans())})),
    "stop": maybe(stop),
    "seed": maybe(any_int),
    "top_k": maybe(any_int),
    "min_p": maybe(any_float),
    "ignore_eos": maybe(st.booleans()),
    "stop_token_ids": maybe(st.lists(any_int, max_size=5)),
    "presence_penalty": maybe(any_float),
    "frequency_penalty": maybe(any_float),
    "user": maybe(any_text),
}
completion_fields = {
    "logprobs": maybe(any_int),
    "echo": maybe(st.booleans()),
    "best_of": maybe(any_int),
    "suffix": maybe(any_text),
}
content_part = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["text", "image_url", "input_audio"]), any_text)},
    optional={"text": maybe(any_text), "image_url": json_value},
)
message = st.fixed_dictionaries(
    {
        "role": maybe(
            st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer", ""]), any_text), 6
        ),
        "content": maybe(st.one_of(any_text, st.none(), st.lists(content_part, max_size=3)), 6),
    },
    optional={"name": maybe(any_text)},
)
chat_fields = {
    "max_completion_tokens": maybe(token_count),
    "logprobs": maybe(st.booleans()),
    "top_logprobs": maybe(any_int),
    "tools": json_value,
    "response_format": maybe(st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}))),
}
extra_fields = st.dictionaries(st.text(max_size=12), json_value, max_size=2)
MAX_OPTIONAL_FIELDS = 4  # few at once, so that many bodies get past the gateway to the frontend's own checks


def _request(required: dict, optional: dict) -> st.SearchStrategy:
    """The required fields, up to MAX_OPTIONAL_FIELDS optional ones, and a few unknown ones."""
    names = st.lists(st.sampled_from(sorted(optional)), max_size=MAX_OPTIONAL_FIELDS, unique=True)
    chosen = names.flatmap(lambda keys: st.fixed_dictionaries({key: optional[key] for key in keys}))
    return st.tuples(st.fixed_dictionaries(required), chosen, extra_fields).map(
        lambda parts: {**parts[2], **parts[1], **parts[0]}
    )


completion_request = _request({"prompt": maybe(prompt)}, {**sampling_fields, **completion_fields})


def _bounded(body: dict) -> dict:
    # Chat without max_tokens generates to the end of the context (2048 tokens, ~15 s on a CPU at temperature 0):
    # fuzzing is about parsing, so such bodies get a small bound; the canaries and the load cover real generation.
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 8
    return body


chat_request = _request(
    {"messages": maybe(st.lists(maybe(message, odds=6), max_size=5))},
    {**sampling_fields, **chat_fields},
)
chat_request = chat_request.map(_bounded)

SPECIAL_BODIES = (
    b"",
    b"null",
    b"{}",
    b"[]",
    b'"text"',
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
    b'{"prompt": "a", "prompt": 1}',
    b'{"prompt": "hi", "max_tokens": 1e400}',
    b'{"prompt": "hi", "max_tokens": 2.0}',
    b'{"prompt": "hi", "max_tokens": -0}',
    b'{"prompt": "hi", "temperature": NaN}',
    b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}',
    '{"prompt": "hi", "max_tokens": 2}'.encode("utf-16"),
    b'{"prompt": "hi", "max_tokens": 2',
    b'{"prompt": "' + b"a" * (MAX_BODY_BYTES - 14) + b'"}',  # exactly at the limit
    b'{"prompt": "' + b"a" * (MAX_BODY_BYTES - 13) + b'"}',  # one byte over
)


def body_bytes(request: st.SearchStrategy) -> st.SearchStrategy:
    """The bytes of a body: the request as JSON (ASCII or not), truncated, or replaced by junk of many kinds."""
    encoded = st.tuples(request, st.booleans()).map(lambda p: json.dumps(p[0], ensure_ascii=p[1]).encode())
    truncated = st.tuples(encoded, st.floats(0, 1, exclude_max=True)).map(lambda p: p[0][: int(len(p[0]) * p[1])])
    nested = st.tuples(nesting_depth, st.sampled_from(["[", "{"]), st.booleans()).map(_nested_body)
    return weighted(
        (6, encoded),
        (1, truncated),
        (1, nested),
        (1, st.binary(max_size=300)),
        (1, json_value.map(lambda value: json.dumps(value).encode())),
        (1, st.sampled_from(SPECIAL_BODIES)),
    )


def _nested_body(spec: tuple[int, str, bool]) -> bytes:
    depth, opener, as_field = spec
    inner = nested_json(depth, opener)
    return b'{"prompt": "hi", "max_tokens": 2, "user": ' + inner + b"}" if as_field else inner
