"""Hypothesis strategies for raw protobuf bytes: what no protobuf library would send (varints out of range, wrong wire
types, bad UTF-8, lying lengths, deep groups), mutations of real messages, and plain garbage."""

from __future__ import annotations

from hypothesis import strategies as st

from chaos.grpc_messages import build_request, request_fields
from chaos.junk import EDGE_INTS, nesting_depth, weighted

# GenerateRequest's fields (1..7) and SamplingParams' (1..11), plus numbers no message has.
FIELD_NUMBERS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15, 16, 1000, 2**29 - 1)


def varint(value: int) -> bytes:
    """Base-128 varint; a negative value as its 64-bit two's complement, a value past 64 bits as more than 10 bytes."""
    if value < 0:
        value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, wire_type: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire_type) + payload


def length_delimited(number: int, payload: bytes, declared: int | None = None) -> bytes:
    return field(number, 2, varint(len(payload) if declared is None else declared) + payload)


wire_int = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**70), 2**70))
wire_field = st.one_of(
    st.tuples(st.sampled_from(FIELD_NUMBERS), wire_int).map(lambda p: field(p[0], 0, varint(p[1]))),
    st.tuples(st.sampled_from(FIELD_NUMBERS), st.binary(min_size=4, max_size=4)).map(lambda p: field(p[0], 5, p[1])),
    st.tuples(st.sampled_from(FIELD_NUMBERS), st.binary(min_size=8, max_size=8)).map(lambda p: field(p[0], 1, p[1])),
    st.tuples(st.sampled_from(FIELD_NUMBERS), st.binary(max_size=40)).map(lambda p: length_delimited(*p)),
    st.tuples(st.sampled_from(FIELD_NUMBERS), st.binary(max_size=8), wire_int).map(lambda p: length_delimited(*p)),
    st.tuples(st.sampled_from(FIELD_NUMBERS), st.integers(0, 7), st.binary(max_size=8)).map(lambda p: field(*p)),
)
# SamplingParams (field 4) whose uint32/uint64 fields carry values beyond their width, or a negative.
oversized_sampling = st.lists(st.tuples(st.sampled_from([1, 4, 6, 8, 10]), wire_int), min_size=1, max_size=4).map(
    lambda fields: length_delimited(4, b"".join(field(n, 0, varint(v)) for n, v in fields))
)
bad_utf8 = st.tuples(st.sampled_from([1, 2, 6]), st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"a\x80b"])).map(
    lambda p: length_delimited(*p)
)
deep_groups = nesting_depth.map(
    lambda depth: field(15, 3, b"") * min(depth, 20_000) + field(15, 4, b"") * min(depth, 20_000)
)


def _serialized(fields: dict) -> bytes:
    try:
        return build_request(fields).SerializeToString()
    except (ValueError, TypeError):
        return b""


real_message = request_fields.map(_serialized)


def _mutate(spec: tuple[bytes, int, int, bytes]) -> bytes:
    data, kind, position, junk = spec
    cut = position % (len(data) + 1)
    if kind == 0:  # truncated
        return data[:cut]
    if kind == 1 and data:  # one byte flipped
        index = position % len(data)
        return data[:index] + bytes([data[index] ^ 0xFF]) + data[index + 1 :]
    return data[:cut] + junk + data[cut:]  # junk spliced in


mutated = st.tuples(real_message, st.integers(0, 2), st.integers(0, 10_000), st.binary(max_size=12)).map(_mutate)
wire_message = weighted(
    (2, st.lists(wire_field, max_size=6).map(b"".join)),
    (2, st.tuples(real_message, oversized_sampling).map(b"".join)),
    (1, st.tuples(real_message, bad_utf8).map(b"".join)),
    (1, deep_groups),
    (3, mutated),
    (1, st.binary(max_size=200)),
)
# Methods the raw bytes go to: mostly Generate; the unary ones parse the same way.
RAW_METHODS = (
    ("/tokend.v1.Generation/Generate", "stream"),
    ("/tokend.v1.Generation/Generate", "stream"),
    ("/tokend.v1.Generation/Generate", "stream"),
    ("/tokend.v1.Generation/Abort", "unary"),
    ("/tokend.v1.Generation/ListModels", "unary"),
)
raw_call = st.tuples(st.sampled_from(RAW_METHODS), wire_message)
