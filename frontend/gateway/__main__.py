"""Entry point of the gateway: `python -m frontend.gateway '<GatewaySpec JSON>'` (spawned by the daemon), or
`tokend gateway --grpc ADDR` on its own."""

from __future__ import annotations

import sys

import uvicorn

from common.logs import configure_logging
from frontend.gateway.app import build_app
from frontend.gateway.http_protocol import BoundedH11Protocol
from frontend.gateway.spec import GatewaySpec


def run_gateway(spec: GatewaySpec) -> int:
    log = configure_logging("gateway", spec.log_level)
    config = uvicorn.Config(
        build_app(spec),
        host=spec.host,
        port=spec.http_port,
        loop="uvloop",
        # h11, with a deadline for request heads and a cap on connections that uvicorn does not have itself.
        http=BoundedH11Protocol.with_limits(spec.header_timeout_s, spec.max_connections),
        # h11 must read a request with many headers in full, so that RequestLimits can refuse it in OpenAI's
        # shape (431) instead of h11 dropping the connection.
        h11_max_incomplete_event_size=1 << 20,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=spec.shutdown_timeout_s,
    )
    log.info(
        "gateway_listening",
        http_port=spec.http_port,
        grpc=spec.grpc_address,
        header_timeout_s=spec.header_timeout_s,
        max_connections=spec.max_connections,
    )
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 75  # not started: the port is taken (EX_TEMPFAIL)


def main(argv: list[str]) -> int:
    from common.child_process import become_child

    spec = GatewaySpec.from_json(argv[1])
    become_child("tokend: gateway")
    return run_gateway(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
