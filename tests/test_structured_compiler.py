"""The structured-output compiler on the default model's tokenizer: what cannot be enforced is refused naming the
field and llguidance's reason (before any request runs), what compiled once is served from the cache."""

from __future__ import annotations

import json

import pytest

from gpu_runtime.default_model import ensure_default_model
from gpu_runtime.ipc.structured_output import MAX_SPEC_BYTES, StructuredOutput
from gpu_runtime.structured.accepting_path import has_accepting_path
from gpu_runtime.structured.compiler import GrammarCompiler, GrammarError
from gpu_runtime.structured.regex_size import repeat_product

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.for_model(ensure_default_model(), 49152, [2])


@pytest.mark.parametrize(
    "output, field, reason",
    [
        (StructuredOutput.json_schema("{not json"), "json_schema", "not valid JSON"),
        (StructuredOutput.json_schema("[1, 2]"), "json_schema", "a JSON Schema is a JSON object"),
        (StructuredOutput.json_schema({"type": "integr"}), "json_schema", "Invalid type"),
        (StructuredOutput.json_schema({"type": "array", "uniqueItems": True}), "json_schema", "Unimplemented keys"),
        (StructuredOutput.json_schema({"type": "string", "format": "colour"}), "json_schema", "Unknown format"),
        (StructuredOutput.json_schema({"properties": {"a": {"$ref": "#/$defs/missing"}}}), "json_schema", "missing"),
        (StructuredOutput.json_schema({"type": "string", "pattern": "(a{1000}){1000}"}), "json_schema",
         "nests counted repetitions"),
        (StructuredOutput.regex("(unclosed"), "regex", "unclosed group"),
        (StructuredOutput.regex("(x{1000}){1000}"), "regex", "nests counted repetitions to 1,000,000"),
        (StructuredOutput.choice([]), "choice", "non-empty list"),
        (StructuredOutput.grammar('start: item\nitem: "a" item'), "grammar", "no accepting path"),
        (StructuredOutput.grammar('root ::= "a" root'), "grammar", "no accepting path"),  # GBNF
        (StructuredOutput.grammar("start: undefined_rule"), "grammar", ""),
    ],
)  # fmt: skip
def test_a_spec_that_cannot_be_enforced_is_refused_naming_the_field_and_the_reason(compiler, output, field, reason):
    with pytest.raises(GrammarError) as raised:
        compiler.compile(output)
    assert raised.value.field == f"structured_output.{field}"
    assert str(raised.value).startswith(f"structured_output.{field}: ")
    assert reason in raised.value.reason


def test_an_oversized_or_empty_spec_is_refused_before_it_is_compiled():
    with pytest.raises(
        ValueError, match=rf"^structured_output\.json_schema: \d+ bytes is over the limit of {MAX_SPEC_BYTES}"
    ):
        StructuredOutput.json_schema({"description": "x" * MAX_SPEC_BYTES})
    with pytest.raises(ValueError, match=r"^structured_output\.grammar: must not be empty"):
        StructuredOutput.grammar(" \n")


@pytest.mark.parametrize(
    "output",
    [
        StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "string", "format": "email"}},
                                      "$defs": {"b": {"type": "integer"}},
                                      "patternProperties": {"^x": {"type": "null"}}}),
        StructuredOutput.json_object(),
        StructuredOutput.regex(r"\d{3}-\d{4}"),
        StructuredOutput.choice(["yes", "no"]),
        StructuredOutput.grammar('start: "a"+ | "b"'),
        StructuredOutput.grammar('root ::= "yes" | "no"'),
        StructuredOutput.grammar('start: %json {"type": "object"}'),  # llguidance's own extension: lark cannot read it
    ],
    ids=lambda output: output.kind.value,
)  # fmt: skip
def test_supported_specs_compile(compiler, output):
    compiler.compile(output)


def test_a_spec_compiled_once_is_a_cache_hit_even_with_other_whitespace(compiler):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}}}
    first = compiler.compile(StructuredOutput.json_schema(json.dumps(schema)))
    hits = compiler.hits
    again = compiler.compile(StructuredOutput.json_schema(json.dumps(schema, indent=4)))
    assert compiler.hits == hits + 1 and again is first
    # Property order is the output's order: the same properties in another order are another grammar.
    reordered = {"type": "object", "properties": {"alpha": {"type": "boolean"}, "zeta": {"type": "integer"}}}
    assert compiler.compile(StructuredOutput.json_schema(reordered)) is not first


def test_the_cache_is_bounded():
    small = GrammarCompiler.for_model(ensure_default_model(), 49152, [2], cache_size=2)
    outputs = [StructuredOutput.regex(f"a{{{n}}}") for n in range(1, 4)]
    for output in outputs:
        small.compile(output)
    small.compile(outputs[0])  # evicted by the third: compiled again
    assert small.misses == 4 and small.hits == 0


def test_repeat_products_and_accepting_paths():
    assert repeat_product("(a{10}){20}b{3}") == 200
    assert repeat_product("(?:x|y)*z+") == 1
    assert repeat_product(r"\p{L}{5}") == 1  # Rust-only syntax: left to llguidance
    assert has_accepting_path('start: a\na: "x" a | "y"')
    assert not has_accepting_path('start: a b\na: "x"\nb: b "y"')


def test_a_tenants_limits_on_spec_size_and_compile_time_are_refusals_naming_the_field():
    import asyncio

    from frontend.metrics import FrontendMetrics
    from frontend.spec import TenantSpec
    from frontend.structured_outputs import GrammarChecks, StructuredOutputRefused
    from gpu_runtime.ipc.messages import SchedulerReady

    model = SchedulerReady("w", "i", 1, "m", str(ensure_default_model()), "g", 2048, 49152, 64, 16, 8, b"",
                           eos_token_ids=(2,))  # fmt: skip
    checks = GrammarChecks(FrontendMetrics())
    schema = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    small = TenantSpec("small", "0" * 64, max_structured_output_bytes=16)
    hasty = TenantSpec("hasty", "0" * 64, max_grammar_compile_ms=0.000001)
    roomy = TenantSpec("roomy", "0" * 64)

    async def run():
        await checks.check(schema, model, roomy)
        for tenant, reason, words in [(small, "too_large", "over this tenant's limit of 16"),
                                      (hasty, "too_slow", "over the limit of 1e-06 ms")]:  # fmt: skip
            with pytest.raises(StructuredOutputRefused) as raised:
                await checks.check(schema, model, tenant)
            assert raised.value.reason == reason
            assert (
                raised.value.message.startswith("sampling.structured_output.json_schema: ")
                and words in raised.value.message
            )

    try:
        asyncio.run(run())
    finally:
        checks.close()
