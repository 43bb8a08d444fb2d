"""The /metrics listener: Prometheus text on the daemon's host, behind a bearer token when the operator sets one."""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the frontend's exit


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


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


def _require_bearer(app, token_sha256: str):
    def guarded(environ, start_response):
        header = environ.get("HTTP_AUTHORIZATION", "")
        presented = header[7:].strip() if header.startswith("Bearer ") else ""
        digest = hashlib.sha256(presented.encode(errors="surrogateescape")).hexdigest()
        if not presented or not hmac.compare_digest(digest, token_sha256):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"metrics: send 'Authorization: Bearer <metrics token>'\n"]
        return app(environ, start_response)

    return guarded
