"""Hypothesis strategies for GenerateRequest messages that protobuf itself accepts: every field, edge values included
(max uint32/uint64, NaN and infinite floats, unknown enum values, long and odd strings), plus call metadata."""

from __future__ import annotations

from hypothesis import strategies as st

from chaos.junk import any_float, any_text, weighted
from tokend.v1 import tokend_pb2 as pb

uint32 = st.one_of(
    st.integers(0, 20),
    st.sampled_from([255, 256, 257, 258, 2047, 2048, 2049, 2**31 - 1, 2**31, 2**32 - 1]),
    st.integers(0, 2**32 - 1),
)
uint64 = st.one_of(st.integers(0, 10), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
enum_value = st.one_of(st.integers(0, 3), st.sampled_from([-1, 2**31 - 1, -(2**31)]))
SAMPLING_FIELDS = {
    "max_tokens": uint32,
    "temperature": any_float,
    "top_p": any_float,
    "top_k": uint32,
    "min_p": any_float,
    "seed": uint64,
    "stop": st.lists(any_text, max_size=10),
    "stop_token_ids": st.lists(uint32, max_size=5),
    "ignore_eos": st.booleans(),
    "logprobs": uint32,
    "fill_context": st.booleans(),
}
# A few fields at a time, so that many messages pass validation and reach admission and the scheduler.
sampling = st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), max_size=4, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({key: SAMPLING_FIELDS[key] for key in keys})
)
prompt_input = st.one_of(
    st.tuples(st.just("prompt"), any_text),
    st.tuples(st.just("token_ids"), st.lists(st.one_of(st.integers(0, 257), uint32), max_size=60)),
    st.tuples(st.just("chat"), st.lists(st.tuples(any_text, any_text), max_size=5)),
    st.tuples(st.just("chat"), st.lists(st.tuples(st.just("user"), any_text), min_size=300, max_size=300)),
)
request_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.sampled_from(["", "tokend-tiny-random", "default", "nope"]), any_text),
        "input": prompt_input,
        "sampling": sampling,
        "priority": enum_value,
        "request_id": st.one_of(st.just(""), any_text, st.text(max_size=200)),
    },
)


def build_request(fields: dict) -> pb.GenerateRequest:
    """The message for the fields (ValueError where protobuf refuses a value: the caller counts it as unsent)."""
    request = pb.GenerateRequest(
        model=fields.get("model", ""),
        priority=fields.get("priority", 0),
        request_id=fields.get("request_id", ""),
        sampling=pb.SamplingParams(**fields["sampling"]) if "sampling" in fields else None,
    )
    kind, value = fields.get("input", (None, None))
    if kind == "prompt":
        request.prompt = value
    elif kind == "token_ids":
        request.token_ids.ids.extend(value)
    elif kind == "chat":
        request.chat.SetInParent()
        for role, content in value:
            request.chat.messages.add(role=role, content=content)
    return request


def metadata(fuzz_key: str) -> st.SearchStrategy:
    """Call metadata: mostly the fuzz tenant's key, else none or printable garbage (gRPC refuses other bytes at the
    client, so they would never reach the daemon)."""
    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
    valid = st.just(f"Bearer {fuzz_key}")
    auth = weighted((6, valid), (1, printable.map(lambda text: f"Bearer {text}")), (1, printable))
    extra = st.lists(
        st.tuples(st.sampled_from(["x-request-id", "x-model", "authorization", "user-agent-x"]), printable), max_size=2
    )
    return st.tuples(weighted((6, auth), (1, st.none())), extra).map(
        lambda pair: tuple(([("authorization", pair[0])] if pair[0] is not None else []) + pair[1])
    )
