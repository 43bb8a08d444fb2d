"""The gateway's /metrics: its own series, then the engine's, fetched from the frontend at every scrape.

vLLM users scrape the API port, so the engine's metrics (which the frontend holds) are served here too. The frontend
serves them on a Unix socket in the daemon's private directory; when it does not answer (restarting, stuck), the
scrape still succeeds with the gateway's own series and `tokend:engine_metrics_up 0`, never a 500.
"""

from __future__ import annotations

import asyncio
import http.client
import socket

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from frontend.metrics_server import TOKEN_REQUIRED_TEXT, UNAUTHORIZED_TEXT, bearer_allowed

_FETCH_TIMEOUT_S = 2.0  # well under Prometheus's default scrape timeout (10 s)


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, engine_socket: str = "", token_sha256: str = "",
                 require_token: bool = False):  # fmt: skip
        self._registry = registry
        self._engine_socket = engine_socket  # "": a gateway run alone, whose metrics are its own only
        self._token_sha256 = token_sha256
        # A public host with tenants and no token set: refused, as the frontend's metrics port refuses them.
        self._refuse_all = require_token and not token_sha256
        self._engine_up = None
        if engine_socket:
            self._engine_up = Gauge(
                "tokend:engine_metrics_up",
                "1 when this scrape carries the engine's metrics (fetched from the frontend), 0 when they are missing",
                registry=registry,
            )

    async def response(self, request: Request) -> Response:
        if self._refuse_all:
            return Response(TOKEN_REQUIRED_TEXT, 403, media_type="text/plain")
        if not bearer_allowed(request.headers.get("authorization", ""), self._token_sha256):
            return Response(UNAUTHORIZED_TEXT, 401, {"WWW-Authenticate": "Bearer"}, media_type="text/plain")
        engine = b""
        if self._engine_socket:
            try:
                engine = await asyncio.wait_for(asyncio.to_thread(_fetch, self._engine_socket), _FETCH_TIMEOUT_S + 1)
                self._engine_up.set(1)
            except (OSError, TimeoutError, http.client.HTTPException) as error:
                self._engine_up.set(0)
                engine = f"# engine metrics missing: the frontend did not answer ({type(error).__name__})\n".encode()
        return Response(generate_latest(self._registry) + engine, media_type=CONTENT_TYPE_LATEST)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("frontend", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _fetch(path: str) -> bytes:
    """The frontend's exposition text (Prometheus text format, as it is asked for no other)."""
    connection = _UnixHTTPConnection(path, _FETCH_TIMEOUT_S)
    try:
        connection.request("GET", "/metrics")
        reply = connection.getresponse()
        body = reply.read()
    finally:
        connection.close()
    if reply.status != 200:
        raise http.client.HTTPException(f"status {reply.status}")
    return body
