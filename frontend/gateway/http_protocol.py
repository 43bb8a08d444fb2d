"""BoundedH11Protocol: uvicorn's h11 protocol with a deadline for each request's head and a cap on connections."""

from __future__ import annotations

import asyncio
import contextlib

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from frontend.gateway.errors import OpenAIError
from frontend.gateway.json_wire import line_safe_dumps


class BoundedH11Protocol(H11Protocol):
    """uvicorn with h11 waits for a request's head forever, so a client trickling header bytes (slowloris) holds a
    connection as long as it likes; and it takes every connection offered. Here the head must be complete within
    `header_timeout_s` of the connection opening, or of the previous response ending on a kept-alive connection,
    or the connection is closed; and a connection beyond `max_connections` gets a 503 in OpenAI's shape for its
    first request and is then closed. uvicorn's own `limit_concurrency` answers plain text, hence this instead.
    Use `with_limits` to make the class that uvicorn.Config(http=...) instantiates per connection."""

    header_timeout_s: float = 10.0
    max_connections: int = 1024

    @classmethod
    def with_limits(cls, header_timeout_s: float, max_connections: int) -> type[BoundedH11Protocol]:
        limits = {"header_timeout_s": header_timeout_s, "max_connections": max_connections}
        return type(cls.__name__, (cls,), limits)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.app = self._over_capacity  # what handle_events runs for this connection's requests
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()  # the next request on this kept-alive connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._cancel_head_deadline()
        self.head_deadline = self.loop.call_later(self.header_timeout_s, self._head_overdue)

    def _cancel_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_overdue(self) -> None:
        self.head_deadline = None
        # h11 leaves IDLE once a whole request head is parsed; a request under way is not cut, however long.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            with contextlib.suppress(h11.LocalProtocolError):  # h11's bookkeeping only; the socket closes anyway
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP/1.1, in OpenAI's shape rather than plain text."""
        if self.cycle is not None:
            # Bad bytes in the body of a request the app is already handling: this answer (or, once the app's
            # own has begun, the close) ends the connection, and what the app sends later goes nowhere.
            self.cycle.disconnected = True
            if self.cycle.response_started:
                self.transport.close()
                return
        body = line_safe_dumps(OpenAIError(400, "the request is not valid HTTP/1.1").body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    async def _over_capacity(self, scope, receive, send) -> None:
        error = OpenAIError(
            503, f"the gateway holds its maximum of {self.max_connections} connections; retry", "service_unavailable"
        )
        await error.response(headers={"Connection": "close"})(scope, receive, send)
