"""The pieces every tool-call reader produces: content text and tool-call deltas, in OpenAI's streaming shape."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


@dataclass(slots=True)
class CallDelta:
    """One step of one call: its id and name come once, with its first piece of arguments (a JSON text)."""

    index: int  # the call's place in the turn, from 0
    arguments: str
    id: str = ""
    name: str = ""


@dataclass(slots=True)
class Piece:
    """What one chunk of model text turned into: text for `content`, and call deltas."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: Piece) -> Piece:
        self.content += other.content
        self.calls += other.calls
        return self

    def __add__(self, other: Piece) -> Piece:
        return Piece(self.content + other.content, self.calls + other.calls)


def call_id() -> str:
    """OpenAI's shape of a call id: `call_` and 24 random characters."""
    return f"call_{secrets.token_hex(12)}"


class CallReader:
    """Reads a turn's text as it streams: feed() each new piece of text, finish() at the end. A reader never
    raises on the model's text: what does not parse as a call stays content."""

    num_calls = 0

    def feed(self, text: str) -> Piece:
        raise NotImplementedError

    def finish(self) -> Piece:
        raise NotImplementedError

    def read_whole(self, text: str) -> Piece:
        piece = self.feed(text)
        piece += self.finish()
        return piece
