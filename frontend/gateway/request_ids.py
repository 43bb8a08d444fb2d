"""The request id: the client's `X-Request-Id`, or one made here when it sent none. It is the one id a request has:
in the response (its `X-Request-Id` header and OpenAI `id`), in the gRPC calls' `request_id` (so in the frontend's
log lines and its usage ledger row), and in the gateway's own log lines."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.types import Scope

from frontend.gateway.errors import bad_request
from frontend.validation import MAX_REQUEST_ID_CHARS

HEADER = "x-request-id"
# With several choices (n > 1, or a batch of prompts) each gRPC call gets `<id>-<index>`: the client's id leaves room
# for that suffix, so that every derived id still passes the frontend's own request_id check.
_CHOICE_SUFFIX_CHARS = 8
MAX_CHARS = MAX_REQUEST_ID_CHARS - _CHOICE_SUFFIX_CHARS


def from_scope(scope: Scope) -> str:
    """The client's X-Request-Id if it sent one, else a new id; a 400 naming the header if it is not usable."""
    sent = next((value for name, value in scope["headers"] if name == HEADER.encode()), b"")
    if not sent:
        return new()
    # The same rule as the frontend's request_id: it goes back in headers and gRPC metadata, which are ASCII.
    text = sent.decode("latin-1")
    if len(text) > MAX_CHARS or not (text.isascii() and text.isprintable()):
        raise bad_request(f"X-Request-Id: must be printable ASCII of at most {MAX_CHARS} characters")
    return text


def new() -> str:
    return uuid.uuid4().hex


def remember(scope: Scope, request_id: str) -> None:
    scope.setdefault("state", {})["request_id"] = request_id


def of(request: Request) -> str:
    """The id the error funnel gave this request (a new one for a request that bypassed it)."""
    return request.scope.get("state", {}).get("request_id") or new()


def per_choice(request_id: str, count: int) -> list[str]:
    """The gRPC request ids of a request's calls, one per choice (n choices for each of its prompts, in the order of
    their `index`): the id itself for a lone choice, `<id>-<index>` for several (the frontend refuses two calls in
    flight with one id)."""
    if count == 1:
        return [request_id]
    return [f"{request_id}-{index}" for index in range(count)]
