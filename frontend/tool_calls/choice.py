"""What a chat request's tools and tool_choice mean: which structured output its sampling gets, and which reader
turns its text back into calls.

- `auto` (the default): the model decides; its text is read with its format's reader (Hermes' <tool_call>).
- `none`: no tools (the gateway does not render them) and nothing is read.
- `required`: at least one call (exactly one without parallel_tool_calls), each the name of a given function and
  arguments valid against its `parameters`: enforced as a JSON Schema over a list of calls (vLLM's way).
- a function's name: that function's arguments, enforced by its `parameters` schema.

Every problem is INVALID_ARGUMENT naming the field (chat.tools_json[i]..., chat.tool_choice).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from frontend.errors import invalid
from frontend.tool_calls.calls import CallReader
from frontend.tool_calls.forced import CallListReader, NamedCallReader
from frontend.tool_calls.hermes import HermesReader
from frontend.tool_calls.leading_json import Llama3JsonReader, MistralReader
from gpu_runtime.engine_config import TOOL_CALL_PARSERS
from gpu_runtime.ipc.structured_output import StructuredOutput

_ANY_OBJECT = {"type": "object"}
# `auto`'s reader by the format the model's chat template writes calls in (its source names the markers);
# Hermes' <tool_call> when it names none (ChatML models, and templates that ignore tools).
READERS = {"hermes": HermesReader, "llama3_json": Llama3JsonReader, "mistral": MistralReader}
assert set(READERS) == set(TOOL_CALL_PARSERS) - {"auto"}, "the engine's --tool-call-parser choices are these readers"
_TEMPLATE_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"), ("<tool_call>", "hermes"))


def reader_for_template(source: str) -> str:
    """The reader's name for a chat template's source."""
    return next((name for marker, name in _TEMPLATE_MARKERS if marker in source), "hermes")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[Tool]
    constraint: StructuredOutput | None  # what sampling must satisfy (required, named), or None
    reader: Callable[[], CallReader] | None  # makes the request's reader; None: the text is content only

    def new_reader(self) -> CallReader | None:
        return self.reader() if self.reader is not None else None


def read_tools(tools_json: str) -> list[Tool]:
    """The function tools of chat.tools_json, checked; INVALID_ARGUMENT names the bad entry."""
    if not tools_json:
        return []
    try:
        entries = json.loads(tools_json)
    except ValueError:
        raise invalid("chat.tools_json: not valid JSON") from None
    if not isinstance(entries, list):
        raise invalid("chat.tools_json: must be a JSON array of tools")
    tools: list[Tool] = []
    for index, entry in enumerate(entries):
        field = f"chat.tools_json[{index}]"
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("type", "function") != "function" or not isinstance(function, dict):
            raise invalid(f'{field}: must be {{"type": "function", "function": {{"name", "parameters"}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{field}.function.name: must be a non-empty string")
        if any(tool.name == name for tool in tools):
            raise invalid(f"{field}.function.name: {name!r} is given twice")
        parameters = function.get("parameters", _ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise invalid(f"{field}.function.parameters: must be a JSON Schema object")
        tools.append(Tool(name, parameters))
    return tools


def plan(tools: list[Tool], tool_choice: str, parallel_tool_calls: bool, reader: str = "hermes") -> ToolPlan:
    if not tools or tool_choice == "none":
        return ToolPlan(tools, None, None)
    if tool_choice in ("", "auto"):
        return ToolPlan(tools, None, READERS[reader])
    if tool_choice == "required":
        calls = {"type": "array", "items": {"anyOf": [_call_schema(tool) for tool in tools]}, "minItems": 1}
        if not parallel_tool_calls:
            calls["maxItems"] = 1
        return ToolPlan(tools, StructuredOutput.json_schema(calls), CallListReader)
    tool = next((tool for tool in tools if tool.name == tool_choice), None)
    if tool is None:
        raise invalid(f"chat.tool_choice: no function named {tool_choice!r} in chat.tools_json")
    return ToolPlan(tools, StructuredOutput.json_schema(tool.parameters), lambda: NamedCallReader(tool.name))


def _call_schema(tool: Tool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
