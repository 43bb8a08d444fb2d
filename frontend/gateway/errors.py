"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the HTTP status gRPC implies."""

from __future__ import annotations

import math
import re

import grpc
from starlette.responses import JSONResponse

# gRPC status -> (HTTP status, OpenAI error type)
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
RETRY_AFTER_S = 1  # what a 429 or 503 tells the client to wait
# The frontend's field names, as the OpenAI request calls them.
_PARAMS = {"token_ids": "prompt", "chat.messages": "messages", "chat": "messages"}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.retry_after_s = retry_after_s  # the server's own hint; None: the default

    def body(self) -> dict:
        code = "model_not_found" if self.status == 404 and self.param == "model" else None
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": code}}

    def response(self) -> JSONResponse:
        retry_after = self.retry_after_s if self.retry_after_s is not None else RETRY_AFTER_S
        headers = {"Retry-After": str(retry_after)} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def from_grpc(code: grpc.StatusCode, details: str | None, chat: bool, trailing_metadata=None) -> OpenAIError:
    """Maps a gRPC failure; a message that starts with the frontend's field name says which param was wrong, and
    the server's pushback (grpc-retry-pushback-ms, sent with a shed) becomes Retry-After."""
    status, type_ = _HTTP.get(code, (500, "internal_error"))
    details = details or code.name
    param = None
    match = re.match(r"^([\w.\[\]]+): ", details)
    if match:
        field = match.group(1)
        field = field.removeprefix("sampling.")
        field = _PARAMS.get(field, field).replace("chat.messages", "messages")
        param = "messages" if chat and field == "prompt" else field
        param = {"logprobs": "top_logprobs" if chat else "logprobs"}.get(param, param)
    return OpenAIError(status, details, type_, param, _retry_after_s(trailing_metadata))


def _retry_after_s(trailing_metadata) -> int | None:
    pushback_ms = dict(trailing_metadata or ()).get("grpc-retry-pushback-ms")
    if pushback_ms is None or not pushback_ms.isdigit():
        return None
    return max(1, math.ceil(int(pushback_ms) / 1000))  # Retry-After is whole seconds
