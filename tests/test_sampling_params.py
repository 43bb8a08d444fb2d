"""SamplingParams validation: every bad value is a ValueError that names the offending field."""

from __future__ import annotations

import math

import pytest

from gpu_runtime import SamplingParams

INVALID = [
    # max_tokens: an integer >= 1
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("max_tokens", 1.5),
    ("max_tokens", "8"),
    ("max_tokens", None),
    # temperature: a finite number >= 0
    ("temperature", -0.1),
    ("temperature", -1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("temperature", "0.7"),
    ("temperature", None),
    # top_p: in (0, 1]
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0000001),
    ("top_p", 2),
    ("top_p", math.nan),
    ("top_p", math.inf),
    # top_k: an integer >= 0
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_k", "5"),
    # min_p: in [0, 1]
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("min_p", math.inf),
    # logprobs: None or an integer in [0, 20]
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1000),
    ("logprobs", 2.0),
    # seed: an integer or None
    ("seed", 1.5),
    ("seed", "42"),
    # stop_token_ids: non-negative integers
    ("stop_token_ids", [-1]),
    ("stop_token_ids", (5, -3)),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", ["7"]),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}:"), message
    # The message also shows the value that was rejected, so a user can find it in their request.
    assert message.endswith(f"got {value!r}"), message


def test_first_bad_field_is_reported_even_with_other_valid_fields():
    with pytest.raises(ValueError, match=r"^top_k:"):
        SamplingParams(max_tokens=4, temperature=0.5, top_p=0.9, top_k=-2, min_p=0.1, seed=3, logprobs=1)


def test_defaults_construct_and_are_documented_values():
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.min_p == 0.0
    assert params.seed is None
    assert params.stop_token_ids == ()
    assert params.ignore_eos is False
    assert params.logprobs is None
    assert not params.is_greedy


VALID = [
    {"max_tokens": 1},
    {"max_tokens": 100_000},
    {"temperature": 0},
    {"temperature": 0.0},
    {"temperature": 5},
    {"top_p": 1},
    {"top_p": 1e-9},
    {"top_k": 0},
    {"top_k": 1},
    {"min_p": 0},
    {"min_p": 1.0},
    {"logprobs": 0},
    {"logprobs": 20},
    {"seed": 0},
    {"seed": -7},
    {"stop_token_ids": [0, 5, 5]},
]


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(v) for v in VALID])
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(params, key) == expected


def test_stop_token_ids_list_is_frozen_into_a_tuple():
    ids = [3, 4]
    params = SamplingParams(stop_token_ids=ids)
    ids.append(5)  # the caller's list changing later must not change the request
    assert params.stop_token_ids == (3, 4)
    hash(params)  # frozen and hashable, so params can be shared across prompts safely


def test_params_are_immutable():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]
    assert params.temperature == 1.0


def test_is_greedy_at_temperature_zero_and_below_float_resolution():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    # logits / 1e-6 would overflow float32; like vLLM, such a temperature means greedy.
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "logprobs", "seed"])
def test_bool_is_not_accepted_for_integer_fields(field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**{field: True})


@pytest.mark.parametrize("value", [7, None])
def test_non_iterable_stop_token_ids_raise_value_error(value):
    with pytest.raises(ValueError, match=r"^stop_token_ids:"):
        SamplingParams(stop_token_ids=value)
