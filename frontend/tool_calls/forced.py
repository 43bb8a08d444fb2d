"""Calls whose shape tool_choice enforced with a structured output (choice.py), read back from the text:

- a named function: the whole output is its arguments object, streamed as they are generated;
- `required`: the output is a JSON array of {"name", "arguments"} objects, read once it is complete.

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
    def __init__(self) -> None:
        self._text = ""
        self.num_calls = 0

    def feed(self, text: str) -> Piece:
        self._text += text
        return Piece()

    def finish(self) -> Piece:
        try:
            calls = json.loads(self._text)
        except ValueError:
            return Piece(content=self._text)
        deltas = [
            CallDelta(index, json.dumps(call["arguments"], ensure_ascii=False), id=call_id(), name=call["name"])
            for index, call in enumerate(calls)
        ]
        self.num_calls = len(deltas)
        return Piece(calls=deltas)
