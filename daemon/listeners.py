"""The daemon's public listeners: which ports they are, whether those are free, and the URLs people reach them at."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from daemon.config import ServeConfig


@dataclass(frozen=True, slots=True)
class Listener:
    key: str  # the config key of its port: grpc_port, http_port, metrics_port
    host: str
    port: int
    url_format: str  # how a client writes its address, from "host:port"

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.url_format.format(self.address)


def listeners_of(config: ServeConfig) -> list[Listener]:
    listeners = [Listener("grpc_port", config.host, config.grpc_port, "{}")]
    if config.http_port:
        listeners.append(Listener("http_port", config.host, config.http_port, "http://{}/v1"))
    if config.metrics_port:
        listeners.append(Listener("metrics_port", config.host, config.metrics_port, "http://{}/metrics"))
    return listeners


def first_unavailable(listeners: list[Listener]) -> str | None:
    """Why the first listener that cannot bind cannot, naming its key and address; None when all can.

    Checked before any child starts, so that a taken port is reported in a second instead of after a model load.
    The children bind for real later and report the same way if the port was taken in between."""
    for listener in listeners:
        family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners do: TIME_WAIT is no obstacle
            try:
                probe.bind((listener.host, listener.port))
            except OSError as error:
                flag = "--" + listener.key.replace("_", "-")
                return (
                    f"{listener.key}: cannot listen on {listener.address} ({error.strerror}): another process holds "
                    f"it, or the address is not this machine's; free it or choose another with {flag}"
                )
    return None


def banner(model_names: list[str], listeners: list[Listener]) -> str:
    """What a person at a terminal reads once the daemon serves."""
    names = {"grpc_port": "gRPC", "http_port": "HTTP", "metrics_port": "metrics"}
    lines = [f"tokend is serving {', '.join(model_names)}"]
    lines += [f"  {names[listener.key]:<8} {listener.url}" for listener in listeners]
    if any(listener.key == "http_port" for listener in listeners):
        http = next(listener for listener in listeners if listener.key == "http_port")
        lines.append(f"  {'page':<8} http://{http.address}/")
    return "\n".join(lines)
