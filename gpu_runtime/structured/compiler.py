"""StructuredOutput -> llguidance matcher, for one model's tokenizer, with a bounded cache of compiled grammars.

Torch-free: the frontend compiles every spec once before admission (so a spec that cannot be enforced is a 400
naming the field, never a request failing later), and each engine compiles it again for the matchers it runs;
both hit their cache for a spec they have seen. No JSON-Schema-to-regex code of our own: llguidance
(https://github.com/guidance-ai/llguidance) compiles schemas, regexes and Lark/GBNF grammars lazily, in about a
millisecond for a typical schema.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from gpu_runtime.ipc.structured_output import GrammarKind, StructuredOutput
from gpu_runtime.structured.accepting_path import has_accepting_path
from gpu_runtime.structured.regex_size import MAX_REPEAT_PRODUCT, repeat_product

# Compiled grammars kept per model: a matcher at its start state is a few KB to a few MB (large enums).
DEFAULT_CACHE_SIZE = 256
# JSON as compact as a model writes it unprompted ("a": 1, "b": 2): flexible whitespace would let a small model
# wander into runs of newlines until max_tokens. (The schema's own "x-guidance" options come on top.)
_JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance's resource limits, its defaults but for tighter lexer fuel at compile: a regex whose automaton
# explodes runs out of it in ~20 ms (~50k fuel/ms) and is refused, rather than costing every step later.
_LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, verbose_errors=False)


class GrammarError(ValueError):
    """A spec that does not compile or cannot be enforced; str() is '<field>: <llguidance's reason>'."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Compiled:
    matcher: llguidance.LLMatcher  # at the grammar's start; never advanced itself, only copied
    # What compiling it cost, in the compiling thread's CPU time (llguidance compiles on it): the grammar's cost,
    # not the machine's load (a busy machine's wall clock took a 10 ms schema past a 500 ms limit). A cached hit
    # costs a copy, but the tenant limit reads this.
    compile_s: float


class GrammarCompiler:
    """Thread-safe: the frontend compiles on its worker threads (llguidance drops the GIL while it compiles)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], cache_size=DEFAULT_CACHE_SIZE):
        if not eos_token_ids:  # llguidance ends a complete grammar with it; a model that has none cannot be held to one
            raise GrammarError("structured_output", "the model has no end-of-sequence token (eos_token_id in its "
                               "config.json or generation_config.json), which a grammar ends with")  # fmt: skip
        # ~0.2 s for a 49k vocabulary, once per model and process.
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[GrammarKind, str], Compiled] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_model(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int], **options) -> GrammarCompiler:
        return cls((Path(model_dir) / "tokenizer.json").read_text(), vocab_size, eos_token_ids, **options)

    def compile(self, output: StructuredOutput) -> Compiled:
        """The compiled grammar of `output` (cached); raises GrammarError naming its field."""
        key = (output.kind, canonical_spec(output))
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return compiled
        started = time.thread_time()
        matcher = self._build(output, key[1])
        compiled = Compiled(matcher, time.thread_time() - started)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, output: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence, at the grammar's start."""
        return self.compile(output).matcher.deep_copy()

    def _build(self, output: StructuredOutput, spec: str) -> llguidance.LLMatcher:
        grammar = _llguidance_grammar(output, spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_LIMITS)
        if not matcher.is_error():
            # The first mask builds the lexer's start: what explodes, explodes now, before admission.
            matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(output.field, _reason(matcher.get_error()))
        return matcher


def canonical_spec(output: StructuredOutput) -> str:
    """The spec as the cache keys it: JSON re-serialised compactly (property order kept: it is the output's)."""
    if output.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.CHOICE):
        try:
            return json.dumps(json.loads(output.spec), separators=(",", ":"), ensure_ascii=False)
        except (ValueError, RecursionError) as error:
            raise GrammarError(output.field, f"not valid JSON: {error}") from None
    return output.spec


def _llguidance_grammar(output: StructuredOutput, spec: str) -> str:
    kind, field = output.kind, output.field
    if kind is GrammarKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind is GrammarKind.JSON_SCHEMA:
        schema = json.loads(spec)
        if not isinstance(schema, dict):
            raise GrammarError(field, "a JSON Schema is a JSON object")
        for pattern in _schema_patterns(schema):
            _check_repeats(field, pattern)
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
    if kind is GrammarKind.REGEX:
        _check_repeats(field, spec)
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind is GrammarKind.CHOICE:
        choices = json.loads(spec)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise GrammarError(field, "a non-empty list of non-empty strings")
        return llguidance.grammar_from("choice", spec)
    try:
        lark_grammar = any_to_lark(spec)  # Lark as it is; GBNF (llama.cpp's) translated
    except Exception as error:  # the translator's errors are the grammar's
        raise GrammarError(field, f"not a Lark or GBNF grammar: {error}") from None
    if not has_accepting_path(lark_grammar):
        raise GrammarError(field, "the grammar has no accepting path: its start rule derives no finite string")
    return llguidance.LLMatcher.grammar_from_lark(lark_grammar)


def _check_repeats(field: str, pattern: str) -> None:
    product = repeat_product(pattern)
    if product > MAX_REPEAT_PRODUCT:
        raise GrammarError(
            field,
            f"the pattern {pattern[:80]!r} nests counted repetitions to {product:,} states, over the limit of "
            f"{MAX_REPEAT_PRODUCT:,}",
        )


def _schema_patterns(node) -> list[str]:
    """Every regex in a schema: `pattern` values and `patternProperties` keys, at any depth."""
    found: list[str] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("pattern"), str):
                found.append(item["pattern"])
            if isinstance(item.get("patternProperties"), dict):
                found.extend(item["patternProperties"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _reason(error: str) -> str:
    """llguidance's reason on one line, without the numbered grammar excerpt it may append."""
    lines = []
    for line in error.strip().splitlines():
        if re.match(r"^\s*\d+ \|", line):
            break
        if line.strip() and line.strip() != "^":
            lines.append(line.strip())
    return " ".join(lines) or "the grammar does not compile"
