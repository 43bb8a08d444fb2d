"""Tool-call formats where the turn opens with the calls as JSON, after a special token the detokenizer drops:

- Llama 3.1/3.2/3.3: `<|python_tag|>{"name": "f", "parameters": {...}}` (or the JSON bare, as the template
  instructs), several calls separated by `;`;
- Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`.

A turn whose first character opens the format's JSON is held until it ends, then read: calls when all of it is
calls, else the text as it was (content). A turn that opens otherwise is content, streamed as it comes.
"""

from __future__ import annotations

import json

from frontend.tool_calls.calls import CallDelta, CallReader, Piece, call_id

_DECODER = json.JSONDecoder()


class LeadingJsonReader(CallReader):
    opening = "{"

    def __init__(self) -> None:
        self._held: str | None = ""  # None once the turn is known to be content
        self.num_calls = 0

    def feed(self, text: str) -> Piece:
        if self._held is None:
            return Piece(content=text)
        self._held += text
        stripped = self._held.lstrip()
        if stripped and not stripped.startswith(self.opening):
            held, self._held = self._held, None
            return Piece(content=held)
        return Piece()

    def finish(self) -> Piece:
        if self._held is None:
            return Piece()
        held, self._held = self._held, None
        calls = self._calls(held.strip())
        if not calls:
            return Piece(content=held)
        self.num_calls = len(calls)
        return Piece(
            calls=[CallDelta(i, arguments, id=call_id(), name=name) for i, (name, arguments) in enumerate(calls)]
        )

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError


class Llama3JsonReader(LeadingJsonReader):
    opening = "{"

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        calls, at = [], 0
        while at < len(text):
            try:
                value, at = _DECODER.raw_decode(text, at)
            except ValueError:
                return None
            call = _call(value, "parameters")
            if call is None:
                return None
            calls.append(call)
            while at < len(text) and text[at] in " \n\t;":
                at += 1
        return calls or None


class MistralReader(LeadingJsonReader):
    opening = "["

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        try:
            value, end = _DECODER.raw_decode(text)
        except ValueError:
            return None
        if end != len(text) or not isinstance(value, list):
            return None
        calls = [_call(item, "arguments") for item in value]
        return calls if calls and all(calls) else None


def _call(value, arguments_key: str) -> tuple[str, str] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)
