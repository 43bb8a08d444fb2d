"""Entry point of the gateway: `python -m frontend.gateway <GatewaySpec file>` (spawned by the daemon; the JSON
itself works too), or `tokend gateway --address ADDR` on its own."""

from __future__ import annotations

import socket
import sys

import uvicorn
from prometheus_client import disable_created_metrics

from common.exit_codes import EXIT_CONFIG_ERROR
from common.logs import configure_logging
from frontend.gateway.app import build_app
from frontend.gateway.http_protocol import BoundedH11Protocol
from frontend.gateway.spec import GatewaySpec


def run_gateway(spec: GatewaySpec) -> int:
    log = configure_logging("gateway", spec.log_level)
    disable_created_metrics()  # no `_created` series on /metrics: no dashboard reads them
    # Bound here rather than by uvicorn, which exits 1 on a taken port (a restart loop under the daemon): a port
    # someone else holds is a configuration error that names the port.
    try:
        listener = bind_listener(spec.host, spec.http_port)
    except OSError as error:
        where = f"[{spec.host}]:{spec.http_port}" if ":" in spec.host else f"{spec.host}:{spec.http_port}"
        log.error("cannot_listen", error=f"http_port: cannot listen on {where} ({error.strerror})")
        return EXIT_CONFIG_ERROR
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
    server.run(sockets=[listener])
    return 0


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; OSError when the port is taken or the address is not this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a predecessor's TIME_WAIT is no obstacle
        listener.bind((host, port))
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    return listener


def main(argv: list[str]) -> int:
    from common.child_process import become_child
    from frontend.spec import spec_text

    spec = GatewaySpec.from_json(spec_text(argv[1]))
    become_child("tokend: gateway")
    return run_gateway(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
