"""Hermes' tool-call format, which Qwen2.5, Qwen3, Hermes 2/3 and most ChatML tool templates use:

    text <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> more text

Any number of calls, with text before, between and after them. Text that could be the start of a `<tool_call>` tag
is held back until it is known not to be one, so no tag character ever reaches `content`. A call is emitted whole
once its closing tag arrives (or at the end, when the model stopped right after the JSON); one whose JSON does not
parse into a name and an arguments object stays text, tags included.
"""

from __future__ import annotations

import json

from frontend.tool_calls.calls import CallDelta, CallReader, Piece, call_id

START, END = "<tool_call>", "</tool_call>"


class HermesReader(CallReader):
    def __init__(self) -> None:
        self._held = ""  # content that may be the start of a tag
        self._body: str | None = None  # inside a call: its text so far
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
                    break
                self._body += self._held[:end]
                self._held = self._held[end + len(END) :]
                piece += self._close(closed=True)
        return piece

    def finish(self) -> Piece:
        if self._body is None:
            held, self._held = self._held, ""
            return Piece(content=held)
        self._body += self._held
        self._held = ""
        return self._close(closed=False)

    def _close(self, closed: bool) -> Piece:
        body, self._body = self._body, None
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


def _partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `tag` (held back: the tag may follow)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
