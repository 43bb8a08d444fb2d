"""Hermes' tool-call format, which Qwen2.5, Qwen3, Hermes 2/3 and most ChatML tool templates use:

    text <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> more text

Any number of calls, with text before, between and after them. Text that could be the start of a `<tool_call>` tag
is held back until it is known not to be one, so no tag character ever reaches `content`.

A call written the usual way, `{"name": "...", "arguments": {`, streams: its id and name go out as soon as they are
read, then its arguments object piece by piece as the model writes it (the pieces are the model's own text, so
they join to exactly the arguments of the whole turn read at once). Any other shape is read whole once its closing
tag arrives (or at the end, when the model stopped right after the JSON); one that does not parse into a name and
an arguments object stays text, tags included.
"""

from __future__ import annotations

import json
import re

from frontend.tool_calls.calls import CallDelta, CallReader, Piece, call_id

START, END = "<tool_call>", "</tool_call>"
# A call's opening up to its arguments object: from there on its arguments can stream.
_STREAMABLE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class HermesReader(CallReader):
    def __init__(self) -> None:
        self._held = ""  # content that may be the start of a tag
        self._body: str | None = None  # inside a call: its text so far
        self._arguments: _ObjectScan | None = None  # a streaming call's arguments, once its name went out
        self.num_calls = 0

    def feed(self, text: str) -> Piece:
        piece = Piece()
        self._held += text
        while self._held:
            if self._body is None:
                start = self._held.find(START)
                if start < 0:
                    keep = _partial_tag_length(self._held, START)
                    piece.content += self._held[: len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep :]
                    break
                piece.content += self._held[:start]
                self._held, self._body = self._held[start + len(START) :], ""
            else:
                end = self._held.find(END)
                if end < 0:
                    keep = _partial_tag_length(self._held, END)
                    self._body += self._held[: len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep :]
                    piece += self._stream()
                    break
                self._body += self._held[:end]
                self._held = self._held[end + len(END) :]
                piece += self._stream()
                piece += self._close(closed=True)
        return piece

    def finish(self) -> Piece:
        if self._body is None:
            held, self._held = self._held, ""
            return Piece(content=held)
        self._body += self._held
        self._held = ""
        piece = self._stream()
        piece += self._close(closed=False)
        return piece

    def _stream(self) -> Piece:
        """The call's name once its opening is read, then each new piece of its arguments object."""
        if self._arguments is None:
            opening = _STREAMABLE.match(self._body)
            if opening is None:
                return Piece()
            try:
                name = json.loads(f'"{opening.group(1)}"')
            except ValueError:
                return Piece()
            self._arguments = _ObjectScan(opening.end())
            return Piece(calls=[CallDelta(self.num_calls, "", id=call_id(), name=name)]) + self._stream()
        arguments = self._arguments.advance(self._body)
        return Piece(calls=[CallDelta(self.num_calls, arguments)]) if arguments else Piece()

    def _close(self, closed: bool) -> Piece:
        body, self._body = self._body, None
        if self._arguments is not None:  # streamed: its name and arguments went out already
            self._arguments = None
            self.num_calls += 1
            return Piece()
        call = _parse(body)
        if call is None:  # not a call after all: the text as the model wrote it
            return Piece(content=START + body + (END if closed else ""))
        name, arguments = call
        delta = CallDelta(self.num_calls, arguments, id=call_id(), name=name)
        self.num_calls += 1
        return Piece(calls=[delta])


def _parse(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class _ObjectScan:
    """Finds where a JSON object that starts at `start` ends, as its text grows (strings and escapes respected)."""

    def __init__(self, start: int):
        self._at = start
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.closed = False

    def advance(self, text: str) -> str:
        """The object's text new since the last call, up to its closing brace."""
        begin = self._at
        while self._at < len(text) and not self.closed:
            char = text[self._at]
            self._at += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                self.closed = self._depth == 0
        return text[begin : self._at]


def _partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `tag` (held back: the tag may follow)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
