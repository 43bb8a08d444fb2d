"""RequestLimits: refuses oversized headers and bodies before any handler runs, in OpenAI's error shape."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.gateway.errors import OpenAIError


class BodyTooLarge(Exception):
    pass


class RequestLimits:
    """ASGI middleware. The body limit holds for a declared Content-Length and for chunked bodies alike."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_count: int, max_header_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_count = max_header_count
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        header_bytes = sum(len(name) + len(value) for name, value in headers)
        if len(headers) > self.max_header_count or header_bytes > self.max_header_bytes:
            error = OpenAIError(
                431,
                f"headers: at most {self.max_header_count} headers and {self.max_header_bytes} bytes, "
                f"got {len(headers)} and {header_bytes}",
            )
            await error.response()(scope, receive, send)
            return
        declared = next((value for name, value in headers if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, counting_receive, send)
        except BodyTooLarge:
            await self._too_large().response()(scope, receive, send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"body: requests are limited to {self.max_body_bytes} bytes")
