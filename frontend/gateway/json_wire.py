"""JSON at the gateway's edge: a nesting bound checked before decoding, and line-safe text for what goes out."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from starlette.responses import JSONResponse

# OpenAI request bodies nest a handful of levels (a tool's JSON schema perhaps twenty); the decoder recurses once
# per level, so an attacker's 100k levels must be refused before it runs.
MAX_JSON_DEPTH = 64

_DEPTH_STEPS = np.zeros(256, np.int8)  # by byte: +1 opens an array or object, -1 closes one
_DEPTH_STEPS[list(b"[{")] = 1
_DEPTH_STEPS[list(b"]}")] = -1

# Characters that str.splitlines() (and so httpx's iter_lines) treats as line ends but json.dumps leaves raw: an
# SSE client splitting on them would cut an event in the middle of its JSON. Control characters below U+0020 are
# escaped by json.dumps already. In JSON text these can only occur inside strings, where a \u escape is the same.
_LINE_BREAKERS = {0x0085: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def nesting_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests arrays and objects deeper than `limit`, found without recursion.

    Brackets inside strings are text, not nesting, and do not count. A few numpy passes over the bytes: a body at
    the size limit costs tens of milliseconds at most, whatever its shape (a Python loop per byte costs seconds).
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # cannot nest deeper than it has openers: the common case, at the cost of two counts
    # Backslashes occur only inside strings; dropping escaped backslashes first, then escaped quotes, pairs them
    # left to right as JSON does, so every quote left delimits a string.
    codes = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    steps = _DEPTH_STEPS[codes]
    steps[np.bitwise_xor.accumulate(codes == ord('"'))] = 0  # between a string's quotes: text, not nesting
    # Unbalanced text (not JSON) gets a depth too: its prefix depth, which bounds what the decoder would recurse.
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0)) > limit


def line_safe_dumps(payload: Any) -> str:
    """Compact JSON text, UTF-8 kept readable, with no character a line-splitting client would break on."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKERS)


class LineSafeJSONResponse(JSONResponse):
    """Starlette's JSONResponse, rendered with line_safe_dumps: bodies are read by line-oriented tools too."""

    def render(self, content: Any) -> bytes:
        return line_safe_dumps(content).encode("utf-8")
