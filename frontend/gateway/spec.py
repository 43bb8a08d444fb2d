"""GatewaySpec: the gateway process's settings (JSON on its command line when the daemon spawns it)."""

from __future__ import annotations

from typing import Annotated

import msgspec


class GatewaySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    grpc_address: str  # the frontend, e.g. 127.0.0.1:50051
    http_port: int = 8000
    host: str = "127.0.0.1"  # where it listens (the daemon's --host)
    max_body_bytes: int = 4 * 1024 * 1024  # the frontend's own message limit
    max_header_count: int = 100
    max_header_bytes: int = 32 * 1024
    max_n: int = 8  # choices per request
    keepalive_s: float = 5.0  # an SSE comment goes out after this long without a token (a long prefill)
    shutdown_timeout_s: float = 30.0  # open streams get this long to end when the gateway is stopped
    # A request's head must arrive within this long of the connection (or the previous response), or the connection
    # is closed: a client trickling header bytes (slowloris) holds nothing for long.
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 1024  # one beyond this gets a 503 and is closed
    log_level: str = "info"
    # The frontend's metrics socket (FrontendSpec.metrics_socket): /metrics serves the engine's metrics from it
    # after the gateway's own. "" (the gateway run alone): its own only.
    metrics_socket: str = ""
    metrics_token_sha256: str = ""  # hex SHA-256 of the bearer token /metrics requires; "" = none
    # A public --host with tenants: /metrics is refused (403, naming metrics_token_sha256) while no token is set.
    metrics_require_token: bool = False
    # Created once this process's own listener is bound: the daemon's proof that it is ours ("" = none).
    listening_path: str = ""

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> GatewaySpec:
        return msgspec.json.decode(text, type=cls)
