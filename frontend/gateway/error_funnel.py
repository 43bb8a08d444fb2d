"""ErrorFunnel: where every exception the gateway did not expect ends, as an OpenAI-shaped 500 logged once."""

from __future__ import annotations

import contextlib

import structlog
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.gateway import request_ids
from frontend.gateway.calls import sse_event
from frontend.gateway.errors import OpenAIError, gateway_log


class ErrorFunnel:
    """ASGI middleware, outermost but for Starlette's own ServerErrorMiddleware (which then never sees an error,
    and so never answers plain text nor hands uvicorn a traceback to print). It also settles the request's id (the
    client's X-Request-Id, or a new one): every response carries it in `x-request-id`, every gateway log line of the
    request carries it, and a 500 names it, so that a client's report finds the one log line with the traceback."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            request_id = request_ids.from_scope(scope)
        except OpenAIError as error:  # a bad X-Request-Id: refused, under an id of our own
            await error.response(headers={request_ids.HEADER: request_ids.new()})(scope, receive, send)
            return
        request_ids.remember(scope, request_id)
        response = _ResponseProgress()
        id_header = (request_ids.HEADER.encode(), request_id.encode())

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            response.saw(message)
            await send(message)

        try:
            with structlog.contextvars.bound_contextvars(request_id=request_id):
                await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            pass  # the client left mid-request: nobody to answer, nothing went wrong here
        except Exception as error:
            gateway_log().error(
                "unexpected_error", request_id=request_id, method=scope["method"], path=scope["path"], exc_info=error
            )
            await _answer(scope, receive, send, response, request_id)


class _ResponseProgress:
    """How far a response got: whether it started, whether it is an SSE stream, whether it ended."""

    def __init__(self):
        self.started = False
        self.event_stream = False
        self.complete = False

    def saw(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers", ())).get(b"content-type", b"")
            self.event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True


async def _answer(scope: Scope, receive: Receive, send: Send, response: _ResponseProgress, request_id: str) -> None:
    """A 500 in OpenAI's shape if nothing was sent yet; an error event ending a stream already under way. A plain
    body already started cannot be mended: uvicorn closes the connection, so the client sees it cut short."""
    error = OpenAIError(
        500, f"the gateway failed on this request; it is logged under request id {request_id}", "internal_error"
    )
    # The connection may be failing too; the error is logged already, and a second one would only be noise.
    with contextlib.suppress(Exception):
        if not response.started:
            await error.response(headers={request_ids.HEADER: request_id})(scope, receive, send)
        elif response.event_stream and not response.complete:
            await send({"type": "http.response.body", "body": sse_event(error.body()).encode(), "more_body": False})
