"""Structured outputs checked as a client sees them: the official `openai` client against the gateway of a daemon on
the default model, --schemas varied JSON Schemas (tests/harness/schema_corpus.py) at temperature 1.0 through
response_format, then regexes and choices through vLLM's structured_outputs field, then --tool-calls requests
each with tool_choice "required" and with a named function (every call's arguments validated). Every output that
finishes with `stop` must parse and validate (jsonschema, formats checked), match its regex or be one of its
choices. Prints JSON
(--out writes it too); exits 1 if any output that stopped is invalid.

    .venv/bin/python scripts/check_structured_outputs.py [--schemas 200] [--out docs/benchmarks/structured_outputs.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from bench_engine import emit_json  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402
from harness.schema_corpus import schemas, validator  # noqa: E402

from gpu_runtime.default_model import DEFAULT_MODEL_NAME  # noqa: E402

MESSAGES = [{"role": "user", "content": "Reply with a short JSON object."}]
REGEXES = [r"\d{3}-\d{4}", r"[A-Z][a-z]{2,9}( [A-Z][a-z]{2,9})?", r"(yes|no|maybe)", r"#[0-9a-f]{6}",
           r"\d{4}-\d{2}-\d{2}", r"[a-z]+@[a-z]+\.(com|org)"]  # fmt: skip
CHOICES = [["red", "green", "blue"], ["yes", "no"], ["Paris", "London", "Rome", "Berlin"], ["positive", "negative"]]


def check_schemas(client: openai.OpenAI, count: int, concurrency: int) -> dict:
    corpus = schemas(count, seed=2026)

    def one(schema: dict) -> dict:
        reply = client.chat.completions.create(
            model="", messages=MESSAGES, temperature=1.0, max_tokens=256,
            response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}},
        )  # fmt: skip
        choice = reply.choices[0]
        if choice.finish_reason != "stop":
            return {"finish_reason": choice.finish_reason}
        try:
            validator(schema).validate(json.loads(choice.message.content))
        except Exception as error:  # noqa: BLE001 - any parse or validation failure is what this counts
            return {"finish_reason": "stop", "invalid": f"{type(error).__name__}: {str(error)[:200]}",
                    "schema": schema, "output": choice.message.content}  # fmt: skip
        return {"finish_reason": "stop"}

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, corpus))
    return _summary(results)


def check_regexes_and_choices(client: openai.OpenAI, per_spec: int) -> dict:
    def one(kind: str, spec) -> dict:
        reply = client.completions.create(model="", prompt="Answer:", temperature=1.0, max_tokens=48, n=per_spec,
                                          extra_body={"structured_outputs": {kind: spec}})  # fmt: skip
        out = []
        for choice in reply.choices:
            ok = re.fullmatch(spec, choice.text) if kind == "regex" else choice.text in spec
            bad = choice.finish_reason == "stop" and not ok
            out.append(
                {"finish_reason": choice.finish_reason, **({"invalid": choice.text, "spec": spec} if bad else {})}
            )
        return out

    regex = [r for spec in REGEXES for r in one("regex", spec)]
    choice = [r for spec in CHOICES for r in one("choice", spec)]
    return {"regex": _summary(regex), "choice": _summary(choice)}


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"], "additionalProperties": False}}},
]  # fmt: skip


def check_tool_calls(client: openai.OpenAI, count: int, concurrency: int) -> dict:
    """tool_choice required and a named function at temperature 1.0: every call's arguments validate."""
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    messages = [{"role": "user", "content": "What is the weather in Lisbon, and find me a bakery?"}]

    def one(args: tuple[int, object]) -> dict:
        seed, choice = args
        reply = client.chat.completions.create(model="", messages=messages, tools=TOOLS, tool_choice=choice,
                                               temperature=1.0, seed=seed, max_tokens=120)  # fmt: skip
        result = reply.choices[0]
        calls = result.message.tool_calls or []
        bad = [
            c for c in calls if not validator(parameters[c.function.name]).is_valid(json.loads(c.function.arguments))
        ]
        # Counted by whether calls came (a list cut by max_tokens keeps its complete calls: finish_reason length).
        outcome = {"finish_reason": "calls" if calls else "no_call", "api_finish_reason": result.finish_reason}
        return outcome | ({"invalid": str(bad[0]), "spec": str(choice)} if bad else {})

    named = {"type": "function", "function": {"name": "search"}}
    with ThreadPoolExecutor(concurrency) as pool:
        required = list(pool.map(one, [(seed, "required") for seed in range(count)]))
        forced = list(pool.map(one, [(seed, named) for seed in range(count)]))
    return {"required": _summary(required, "calls"), "named": _summary(forced, "calls")}


def _summary(results: list[dict], complete: str = "stop") -> dict:
    invalid = [r for r in results if "invalid" in r]
    stopped = sum(r["finish_reason"] == complete for r in results)
    return {
        "requests": len(results),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in results)),
        "stopped_valid_fraction": round((stopped - len(invalid)) / stopped, 4) if stopped else None,
        "invalid": invalid[:5],
    }


def _client(daemon: LocalDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", max_retries=0, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--per-spec", type=int, default=8)
    parser.add_argument("--tool-calls", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = time.monotonic()
    flags = ("--model", DEFAULT_MODEL_NAME, "--device", "cpu", "--max-num-seqs", str(args.concurrency))
    with LocalDaemon(*flags) as daemon, _client(daemon) as client:
        result = {"model": DEFAULT_MODEL_NAME, "client": f"openai {openai.__version__}", "temperature": 1.0}
        result["json_schema"] = check_schemas(client, args.schemas, args.concurrency)
        result |= check_regexes_and_choices(client, args.per_spec)
        result["tool_calls"] = check_tool_calls(client, args.tool_calls, args.concurrency)
    result["seconds"] = round(time.monotonic() - started, 1)
    emit_json(result, args.out)
    parts = [result["json_schema"], result["regex"], result["choice"], *result["tool_calls"].values()]
    sys.exit(1 if any(part["invalid"] for part in parts) else 0)


if __name__ == "__main__":
    main()
