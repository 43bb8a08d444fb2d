"""Calls whose shape tool_choice enforced with a structured output (choice.py), read back from the text:

- a named function: the whole output is its arguments object, streamed as they are generated;
- `required`: the output is a JSON array of {"name", "arguments"} objects, each call read once its object is
  complete.

The constraint guarantees the shape; only a turn cut by max_tokens can end incomplete, and then what was written
stays content (a named call's arguments were already streamed: they end incomplete, as the finish reason says).
"""

from __future__ import annotations

import json

from frontend.tool_calls.calls import CallDelta, CallReader, Piece, call_id


class NamedCallReader(CallReader):
    def __init__(self, name: str):
        self._name = name
        self._id = call_id()
        self.num_calls = 0

    def feed(self, text: str) -> Piece:
        if not text:
            return Piece()
        first = self.num_calls == 0
        self.num_calls = 1
        return Piece(calls=[CallDelta(0, text, id=self._id if first else "", name=self._name if first else "")])

    def finish(self) -> Piece:
        if self.num_calls == 0:  # nothing generated: still the call, with empty arguments
            self.num_calls = 1
            return Piece(calls=[CallDelta(0, "{}", id=self._id, name=self._name)])
        return Piece()


class CallListReader(CallReader):
    """Each call of the list goes out as soon as its object is complete; a list cut by max_tokens keeps the calls
    it completed (the cut one is dropped), and one with none is content."""

    def __init__(self) -> None:
        self._text = ""
        self._at = 0  # where the next element (or the list's opening) starts
        self.num_calls = 0

    def feed(self, text: str) -> Piece:
        self._text += text
        deltas = []
        while True:
            self._at = _skip(self._text, self._at, " \n\t\r,[")
            if self._at >= len(self._text) or self._text[self._at] == "]":
                break
            try:
                call, self._at = _DECODER.raw_decode(self._text, self._at)
            except ValueError:  # not complete yet
                break
            deltas.append(CallDelta(self.num_calls, json.dumps(call["arguments"], ensure_ascii=False), id=call_id(),
                                    name=call["name"]))  # fmt: skip
            self.num_calls += 1
        return Piece(calls=deltas)

    def finish(self) -> Piece:
        return Piece() if self.num_calls else Piece(content=self._text)


_DECODER = json.JSONDecoder()


def _skip(text: str, at: int, characters: str) -> int:
    while at < len(text) and text[at] in characters:
        at += 1
    return at
