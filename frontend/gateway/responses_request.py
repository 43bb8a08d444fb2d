"""OpenAI's Responses API request, the stateless subset, read into the chat completions request it means.

`input` is a string or items (messages, `function_call`, `function_call_output`); `instructions` becomes a system
message; tools are flat ({"type": "function", "name", "parameters"}); `text.format` is the structured output;
`max_output_tokens` the token limit. Nothing is kept on the server: `previous_response_id`, `store: true`,
`conversation` and `background` are refused naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from frontend.gateway.errors import bad_request
from frontend.gateway.openai_requests import ChatCompletionRequest

_STATEFUL = ("previous_response_id", "conversation", "background")


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    user: str | None = None
    metadata: dict | None = None


def to_chat(request: ResponsesRequest) -> ChatCompletionRequest:
    for name in _STATEFUL:
        if getattr(request, name) not in (None, False):
            raise bad_request(f"{name}: this server keeps no responses; send the whole input instead", name)
    if request.store:
        raise bad_request("store: this server keeps no responses; leave it unset or false", "store")
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages += _messages(request.input)
    chat: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    if request.max_output_tokens is not None:
        chat["max_completion_tokens"] = request.max_output_tokens
    if request.tools:
        chat["tools"] = [_tool(tool, index) for index, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(request.tool_choice)
    if request.text and request.text.get("format"):
        chat["response_format"] = _format(request.text["format"])
    return msgspec.convert(chat, ChatCompletionRequest)


def _messages(value: str | list[dict]) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for index, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"), "content": _text(item.get("content"), index)})
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}}  # fmt: skip
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # calls of one turn: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": content})
        else:
            raise bad_request(f"input[{index}].type: {kind!r} is not supported (message, function_call, "
                              "function_call_output)", "input")  # fmt: skip
    return messages


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise bad_request(f"input[{index}].content: only text parts are supported", "input")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise bad_request(f"input[{index}].content: must be a string or a list of text parts", "input")


def _tool(tool: dict, index: int) -> dict:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(f"tools[{index}]: only function tools ({{'type': 'function', 'name', 'parameters'}}) are "
                          "supported", "tools")  # fmt: skip
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(spec: dict) -> dict:
    kind = spec.get("type")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": spec.get("name", "output"), "schema": spec.get("schema"),
                                                       "strict": spec.get("strict")}}  # fmt: skip
    return {"type": kind}
