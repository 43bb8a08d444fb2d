"""StructuredOutput: the constraint a request's output must satisfy (a JSON Schema, any JSON object, a regex, a choice
of strings or a grammar), as it crosses from the frontend to the engine inside SamplingParams.

Torch-free and llguidance-free: the frontend, the engine and the offline API all build it; gpu_runtime.structured
compiles it. Only its size and shape are checked here; whether it compiles is the compiler's to say.
"""

from __future__ import annotations

import enum
import json

import msgspec

# The largest spec accepted at all (a tenant may be held to less): a schema this size already compiles in tens of
# milliseconds, and one request's spec crosses the IPC boundary with every message about it.
MAX_SPEC_BYTES = 64 * 1024


class GrammarKind(enum.StrEnum):
    """What `StructuredOutput.spec` holds; the values are the gRPC oneof's field names."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's JSON mode); no spec
    REGEX = "regex"  # a regular expression (Rust regex syntax) the whole output matches
    CHOICE = "choice"  # one of a list of strings, as a JSON array
    GRAMMAR = "grammar"  # a context-free grammar in Lark (llguidance's dialect) or GBNF


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    kind: GrammarKind
    spec: str = ""

    def __post_init__(self) -> None:
        field = self.kind.value
        size = len(self.spec.encode())
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"structured_output.{field}: {size} bytes is over the limit of {MAX_SPEC_BYTES}")
        if self.kind is GrammarKind.JSON_OBJECT:
            if self.spec:
                raise ValueError("structured_output.json_object: takes no spec")
        elif not self.spec.strip():
            raise ValueError(f"structured_output.{field}: must not be empty")

    @property
    def field(self) -> str:
        """Where errors about it point: structured_output.<kind>."""
        return f"structured_output.{self.kind.value}"

    # -- constructors for the offline API and tests (vLLM's StructuredOutputsParams has the same five) ----------

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        return cls(GrammarKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls(GrammarKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls(GrammarKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls(GrammarKind.CHOICE, json.dumps(list(choices)))

    @classmethod
    def grammar(cls, grammar: str) -> StructuredOutput:
        return cls(GrammarKind.GRAMMAR, grammar)
