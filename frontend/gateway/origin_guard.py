"""OriginGuard: refuses requests a web page could send to a loopback gateway behind its user's back.

A page on any site may POST to http://127.0.0.1:8000 without a CORS preflight if the body is a "simple" one
(text/plain, a form), and by DNS rebinding (a name of its own that resolves to 127.0.0.1) it may even read the
answer. With tenants off nothing else stands in its way, so: a JSON route takes only a JSON body (or one with no
Content-Type at all, as curl and HTTP/1.0 clients send), which forces the preflight a page cannot pass; and a gateway
listening on loopback answers only requests addressed to a loopback name, which a rebound name is not.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from common.addresses import is_loopback
from frontend.gateway.errors import OpenAIError


def _host_name(host_header: str) -> str:
    """The name of a Host header, without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "[::1]"."""
    if host_header.startswith("["):
        return host_header.split("]", 1)[0] + "]"
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


class OriginGuard:
    """ASGI middleware: a 400 naming the Host header, a 415 naming Content-Type, before any handler runs."""

    def __init__(self, app: ASGIApp, listen_host: str):
        self.app = app
        # Only a loopback listener is private to this machine; one the operator opened (--host) takes any name.
        self.loopback_only = is_loopback(listen_host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> OpenAIError | None:
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        host = headers.get("host")
        if self.loopback_only and host is not None and not is_loopback(_host_name(host)):
            why = "is not a name of this machine's loopback interface, where the gateway listens"
            return OpenAIError(400, f"Host: {host!r} {why} (a page reaching it by DNS rebinding?)", param="host")
        content_type = headers.get("content-type")
        if scope["method"] == "POST" and content_type is not None and not _is_json(content_type):
            return OpenAIError(415, f"Content-Type: the body must be application/json, got {content_type!r}",
                               param="content-type")  # fmt: skip
        return None
