"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the HTTP status gRPC implies."""

from __future__ import annotations

import math
import re

import grpc
import structlog

from frontend.gateway.json_wire import LineSafeJSONResponse

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
# What the channel itself says when it cannot reach the frontend or loses it (gRPC core's words, never the
# frontend's): addresses, sockets and resolver errors, which a client can neither use nor should see. Lower case.
_TRANSPORT_WORDS = (
    *("failed to connect", "connect to", "connection", "refused", "reset by peer", "broken pipe", "unreachable"),
    *("socket", "ipv4:", "ipv6:", "unix:", "address", "dns", "resolv", "network", "endpoint", "handshake"),
    *("transport", "channel", "subchannel", "backends", "stream removed", "rst_stream", "goaway", "http2"),
    *("keepalive", "too many pings", "fd shutdown", "recvmsg", "sendmsg", "errno", "os error"),
    *("deadline exceeded", "timeout occurred", "cancelling all calls", "locally cancelled"),
)
# The codes gRPC's channel gives its own failures with, and its words for them (UNKNOWN and INTERNAL are hidden
# whoever sends them). The frontend's refusals quote the request, and pass through unless they use such words.
_CHANNEL_WORDS = {
    grpc.StatusCode.UNAVAILABLE: _TRANSPORT_WORDS,
    grpc.StatusCode.DEADLINE_EXCEEDED: _TRANSPORT_WORDS,
    grpc.StatusCode.CANCELLED: _TRANSPORT_WORDS,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ("larger than max",),  # a shed names its tenant, which may be any word
}
# What a client is told instead of a hidden gRPC message, by HTTP status.
_PLAIN_WORDS = {
    503: "the model server is unavailable; retry",
    504: "the model server did not answer in time; retry",
    429: "the model server cannot take a request this large",
    499: "the request was cancelled",
}
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

    def response(self, headers: dict[str, str] | None = None) -> LineSafeJSONResponse:
        headers = dict(headers or {})
        if self.status in (429, 503):
            headers["Retry-After"] = str(self.retry_after_s if self.retry_after_s is not None else RETRY_AFTER_S)
        return LineSafeJSONResponse(self.body(), status_code=self.status, headers=headers)


def gateway_log() -> structlog.stdlib.BoundLogger:
    """The gateway's logger, made at each use: the process configures structlog after importing this module, and a
    logger bound earlier would keep structlog's default, non-JSON output."""
    return structlog.get_logger().bind(process="gateway")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def from_grpc(code: grpc.StatusCode, details: str | None, chat: bool, trailing_metadata=None) -> OpenAIError:
    """Maps a gRPC failure; a message that starts with the frontend's field name says which param was wrong, and
    the server's pushback (grpc-retry-pushback-ms, sent with a shed) becomes Retry-After. What the channel says
    about itself (a refused connection, a lost socket) or a crash's status is logged and replaced by plain words."""
    retry_after_s = _retry_after_s(trailing_metadata)
    details = details or code.name
    from_channel = any(word in details.lower() for word in _CHANNEL_WORDS.get(code, ()))
    if code not in _HTTP or from_channel:
        gateway_log().warning("frontend_call_failed", code=code.name, details=details)
        # UNKNOWN and INTERNAL are never the frontend's deliberate answer: a crash there, or the transport.
        status, type_ = _HTTP.get(code, _HTTP[grpc.StatusCode.UNAVAILABLE])
        message = _PLAIN_WORDS.get(status, f"the model server failed the request ({code.name.lower()}); retry")
        return OpenAIError(status, message, type_, None, retry_after_s)
    status, type_ = _HTTP[code]
    param = None
    match = re.match(r"^([\w.\[\]]+): ", details)
    if match:
        field = match.group(1)
        field = field.removeprefix("sampling.")
        if field.startswith("structured_output"):  # asked for as response_format (or vLLM's structured_outputs)
            field = "response_format"
        field = _PARAMS.get(field, field).replace("chat.messages", "messages")
        param = "messages" if chat and field == "prompt" else field
        param = {"logprobs": "top_logprobs" if chat else "logprobs"}.get(param, param)
    return OpenAIError(status, details, type_, param, retry_after_s)


def _retry_after_s(trailing_metadata) -> int | None:
    pushback_ms = dict(trailing_metadata or ()).get("grpc-retry-pushback-ms")
    if pushback_ms is None or not pushback_ms.isdigit():
        return None
    return max(1, math.ceil(int(pushback_ms) / 1000))  # Retry-After is whole seconds
