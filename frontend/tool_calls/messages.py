"""A conversation's tool turns as the chat template expects them: assistant messages with `tool_calls` (arguments as
objects, as transformers renders them) and `tool` messages answering one of those calls by its id."""

from __future__ import annotations

import json

from frontend.errors import invalid


def template_message(message, index: int, call_ids: set[str]) -> dict:
    """One gRPC ChatMessage as a template message; `call_ids` collects the conversation's calls so far, so that a
    tool message answering no call is INVALID_ARGUMENT naming it."""
    out: dict = {"role": message.role, "content": message.content}
    if message.name:
        out["name"] = message.name
    if message.tool_calls_json:
        out["tool_calls"] = _calls(message.tool_calls_json, f"chat.messages[{index}].tool_calls_json", call_ids)
    if message.role == "tool":
        if message.tool_call_id not in call_ids:
            raise invalid(f"chat.messages[{index}].tool_call_id: {message.tool_call_id!r} answers no earlier tool call")
        out["tool_call_id"] = message.tool_call_id
    return out


def _calls(text: str, field: str, call_ids: set[str]) -> list[dict]:
    try:
        calls = json.loads(text)
    except ValueError:
        raise invalid(f"{field}: not valid JSON") from None
    if not isinstance(calls, list):
        raise invalid(f"{field}: must be a JSON array of calls")
    out = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(
                f'{field}[{index}]: must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise invalid(f"{field}[{index}].function.arguments: not valid JSON") from None
        call_id = call.get("id") or ""
        call_ids.add(call_id)
        out.append({"id": call_id, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out
