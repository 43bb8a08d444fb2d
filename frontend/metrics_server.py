"""The /metrics listeners: Prometheus text on the daemon's host, behind a bearer token when the operator sets one,
and the same text on a Unix socket in the daemon's private directory, where the gateway fetches it."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import threading
from socketserver import ThreadingMixIn, UnixStreamServer
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, MetricsHandler, make_wsgi_app

UNAUTHORIZED_TEXT = b"metrics: send 'Authorization: Bearer <metrics token>'\n"
# Beyond loopback with tenants, the series (model names, load, usage) are not for whoever reaches the port.
TOKEN_REQUIRED_TEXT = (b"metrics: refused: this daemon listens beyond loopback with tenants, so /metrics needs a "
                       b"token; set metrics_token_sha256 (printf %s \"$TOKEN\" | sha256sum) and scrape with "
                       b"'Authorization: Bearer <token>'\n")  # fmt: skip


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the frontend's exit


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _ThreadingUnixServer(ThreadingMixIn, UnixStreamServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 (the stdlib's name)
        pass  # one line per scrape on stderr is noise; the frontend logs JSON only


def start_metrics_server(host: str, port: int, registry: CollectorRegistry, token_sha256: str = "") -> WSGIServer:
    """Serves the registry on host:port from a daemon thread; raises OSError when the port is taken. The metrics
    port is the operator's scrape port (an in-cluster scraper such as the inference pool's EPP sends no token),
    so unlike the API port's /metrics it is not closed when no token is set."""
    app = guarded_metrics_app(make_wsgi_app(registry), token_sha256, require_token=False)
    server_class = _ThreadingWSGIServer6 if ":" in host else _ThreadingWSGIServer
    server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def start_socket_metrics_server(path: str, registry: CollectorRegistry) -> UnixStreamServer:
    """Serves the registry over HTTP on a Unix socket at `path`, from a daemon thread. No token: only the service
    user can reach the socket (its directory is 0700), and whoever serves it on (the gateway) checks the bearer."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by a previous frontend of this daemon, which the supervisor restarted
    server = _ThreadingUnixServer(path, MetricsHandler.factory(registry))
    threading.Thread(target=server.serve_forever, name="metrics-socket", daemon=True).start()
    return server


def bearer_allowed(authorization: str, token_sha256: str) -> bool:
    """Whether an Authorization header value passes: always when no token is set, else its bearer must hash to it."""
    if not token_sha256:
        return True
    presented = authorization[7:].strip() if authorization.startswith("Bearer ") else ""
    digest = hashlib.sha256(presented.encode(errors="surrogateescape")).hexdigest()
    return bool(presented) and hmac.compare_digest(digest, token_sha256)


def guarded_metrics_app(app, token_sha256: str, require_token: bool):
    """The WSGI app behind the bearer check: as it is with no token and none required, refusing with none set but
    one required, else wanting the token."""
    if require_token and not token_sha256:
        return _refuse_all
    return _require_bearer(app, token_sha256) if token_sha256 else app


def _refuse_all(environ, start_response):
    start_response("403 Forbidden", [("Content-Type", "text/plain")])
    return [TOKEN_REQUIRED_TEXT]


def _require_bearer(app, token_sha256: str):
    def guarded(environ, start_response):
        if not bearer_allowed(environ.get("HTTP_AUTHORIZATION", ""), token_sha256):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [UNAUTHORIZED_TEXT]
        return app(environ, start_response)

    return guarded
