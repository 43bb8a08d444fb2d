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
    """Serves the registry on host:port from a daemon thread; raises OSError when the port is taken."""
    app = make_wsgi_app(registry)
    if token_sha256:
        app = _require_bearer(app, token_sha256)
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


def _require_bearer(app, token_sha256: str):
    def guarded(environ, start_response):
        if not bearer_allowed(environ.get("HTTP_AUTHORIZATION", ""), token_sha256):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [UNAUTHORIZED_TEXT]
        return app(environ, start_response)

    return guarded
