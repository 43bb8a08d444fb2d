"""Varied JSON Schemas for the structured-output tests and check script, the same for a seed on every run.

Each schema mixes the features clients send: nested objects, arrays with min/max items, enums and consts, integer
and number ranges, string lengths, patterns and formats, anyOf, $ref/$defs, required and optional properties,
additionalProperties false. Sizes stay small (strings of at most 16 characters, at most 3 items) so a small model
finishes most outputs inside a few hundred tokens.
"""

from __future__ import annotations

import random
import re

import jsonschema

_NAMES = ["id", "name", "title", "count", "price", "tags", "owner", "status", "when", "score", "email", "kind"]
_PATTERNS = [r"^[A-Z][a-z]{1,8}$", r"^[a-z]{2,6}-[0-9]{2,4}$", r"^[0-9]{3}$", r"^(red|green|blue)$"]
# Formats jsonschema's format checker checks without extra packages, so a wrong one would be caught.
_FORMATS = ["date", "email", "ipv4", "uuid"]
_WORDS = ["alpha", "beta", "gamma", "delta", "north", "south", "on", "off"]


def schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_schema(rng) for _ in range(count)]


def validator(schema: dict) -> jsonschema.protocols.Validator:
    """A validator that also checks `format` (jsonschema skips formats unless asked), `date` as RFC 3339 defines a
    full-date: jsonschema's own checker asks Python's datetime, which has no year 0000, a year RFC 3339 allows."""
    cls = jsonschema.validators.validator_for(schema)
    checker = jsonschema.FormatChecker()
    checker.checks("date")(_is_rfc3339_date)
    return cls(schema, format_checker=checker)


def _is_rfc3339_date(value: object) -> bool:
    if not isinstance(value, str):
        return True  # formats apply to strings only
    match = re.fullmatch(r"(\d{4})-(\d{2})-(\d{2})", value)
    if match is None:
        return False
    year, month, day = (int(part) for part in match.groups())
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    days = [31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    return 1 <= month <= 12 and 1 <= day <= days[month - 1]


def _schema(rng: random.Random) -> dict:
    schema = _object(rng, depth=0)
    if rng.random() < 0.3:  # a shared definition, referenced from a property
        schema.setdefault("$defs", {})["item"] = _object(rng, depth=2)
        schema["properties"]["ref_" + rng.choice(_NAMES)] = {"$ref": "#/$defs/item"}
    return schema


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(_NAMES, rng.randint(1, 4 if depth < 2 else 2))
    properties = {name: _value(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7] or names[:1]
    schema = {"type": "object", "properties": properties, "required": required}
    if rng.random() < 0.8:
        schema["additionalProperties"] = False
    return schema


def _value(rng: random.Random, depth: int) -> dict:
    choices = ["string", "integer", "number", "boolean", "enum", "pattern", "format", "const", "anyOf"]
    if depth < 3:
        choices += ["array", "object"]
    kind = rng.choice(choices)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 16)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        low = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(low, 2), "maximum": round(low + rng.uniform(1, 100), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(2, 4))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "format":
        return {"type": "string", "format": rng.choice(_FORMATS)}
    if kind == "const":
        return {"const": rng.choice(_WORDS)}
    if kind == "anyOf":
        return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 8}]}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 1)}
    return _object(rng, depth)
