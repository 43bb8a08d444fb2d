"""Hypothesis strategies shared by every surface: JSON junk, awkward numbers and text, and deep nesting."""

from __future__ import annotations

import math

from hypothesis import strategies as st

# Integers where parsers and fixed-width fields break: signed/unsigned 32/64-bit edges, float precision, beyond.
EDGE_INTS = (
    0,
    1,
    -1,
    255,
    256,
    2047,
    2048,
    2049,
    4096,
    2**15,
    2**16,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    10**30,
    -(2**31),
    -(2**31) - 1,
    -(2**63),
    -(2**63) - 1,
    -(2**64),
)
EDGE_FLOATS = (
    0.0,
    -0.0,
    1e-45,
    1e-300,
    0.5,
    1.0,
    1.0000001,
    2.0,
    -1.0,
    1e38,
    3.5e38,
    1e308,
    math.inf,
    -math.inf,
    math.nan,
)
NESTING_DEPTHS = (1, 10, 100, 127, 128, 129, 255, 256, 500, 999, 1000, 1001, 2000, 5000, 20_000, 100_000)

edge_ints = st.sampled_from(EDGE_INTS)
any_int = st.one_of(st.integers(-3, 20), edge_ints, st.integers())
edge_floats = st.sampled_from(EDGE_FLOATS)
any_float = st.one_of(st.floats(-2.0, 2.0), edge_floats, st.floats())
# Text a tokenizer or a log line may choke on: surrogates excluded (JSON encoders refuse them), everything else not.
any_text = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(codec="utf-8"), max_size=200),
    st.sampled_from(["", " ", "\x00", "\n", "\u202e", "\ufeff", "🙂" * 50, "é" * 300, "a" * 5000, "<|im_end|>"]),
)
json_scalar = st.one_of(st.none(), st.booleans(), any_int, st.floats(allow_nan=False), any_text)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)
nesting_depth = st.one_of(st.sampled_from(NESTING_DEPTHS), st.integers(1, 100_000))


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each as often as its weight says (st.one_of ignores a strategy given twice)."""
    picks = [index for index, (weight, _) in enumerate(choices) for _ in range(weight)]
    return st.sampled_from(picks).flatmap(lambda index: choices[index][1])


def maybe(plausible: st.SearchStrategy, odds: int = 3) -> st.SearchStrategy:
    """A plausible value `odds` times as often as any JSON value at all (a wrong type)."""
    return weighted((odds, plausible), (1, json_value))


def nested_json(depth: int, opener: str) -> bytes:
    """`depth` levels of arrays ("[") or objects ('{"a":'), closed properly."""
    if opener == "[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"null" + b"}" * depth


def shown(value: object, limit: int = 300) -> str:
    """A short, printable rendering of an input for the report (a raw HTTP request as its bytes)."""
    value = getattr(value, "data", value)
    if isinstance(value, bytes | bytearray):
        text = repr(bytes(value[:limit]))
        return text + (f"... ({len(value)} bytes)" if len(value) > limit else "")
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
