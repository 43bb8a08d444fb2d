"""Readiness that cannot be fooled: a port held by another process is a configuration error naming the port, never
"serving", never READY=1, never a restart loop; and the ready record names the URLs the daemon serves on."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import msgspec
import pytest
from daemon_harness import ROOT, free_port
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from frontend.spec import FrontendSpec

# The daemon checks its ports before it loads anything, so the answer takes about a Python start-up.
_EXIT_WITHIN_S = 15


@contextlib.contextmanager
def _impostor_grpc_server():
    """A gRPC server on a free loopback port that says SERVING to every health check, as another daemon would."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=None)


@contextlib.contextmanager
def _held_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@contextlib.contextmanager
def _notify_socket():
    """A stand-in for systemd's notification socket: what the daemon tells systemd lands here."""
    with tempfile.TemporaryDirectory() as directory, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        path = str(Path(directory, "notify.sock"))
        listener.bind(path)
        listener.setblocking(False)
        yield path, listener


def _received(listener: socket.socket) -> list[str]:
    messages = []
    with contextlib.suppress(BlockingIOError):
        while True:
            messages.append(listener.recv(4096).decode())
    return messages


def _serve(ports: dict[str, int], notify_path: str, state_dir: Path) -> subprocess.CompletedProcess:
    flags = [f"--{key.replace('_', '-')}={port}" for key, port in ports.items()]
    command = [sys.executable, "-m", "daemon.cli", "serve", *flags, "--state-dir", str(state_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NOTIFY_SOCKET": notify_path}
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=_EXIT_WITHIN_S)


def _ports_with(taken_key: str, taken_port: int) -> dict[str, int]:
    ports = {key: free_port() for key in ("grpc_port", "http_port", "metrics_port")}
    ports[taken_key] = taken_port
    return ports


def _assert_refused_naming(result: subprocess.CompletedProcess, key: str, port: int, notify) -> None:
    assert result.returncode == 78, result.stderr
    assert key in result.stderr and f"127.0.0.1:{port}" in result.stderr, result.stderr
    assert '"serving"' not in result.stderr and '"restarting"' not in result.stderr
    assert not [message for message in _received(notify) if "READY=1" in message]


def test_grpc_port_held_by_a_serving_grpc_server_is_a_configuration_error(tmp_path):
    with _impostor_grpc_server() as port, _notify_socket() as (notify_path, notify):
        result = _serve(_ports_with("grpc_port", port), notify_path, tmp_path)
        _assert_refused_naming(result, "grpc_port", port, notify)
        assert "--grpc-port" in result.stderr  # the way out


@pytest.mark.parametrize("key", ["http_port", "metrics_port"])
def test_http_and_metrics_ports_held_are_configuration_errors(tmp_path, key):
    with _held_port() as port, _notify_socket() as (notify_path, notify):
        result = _serve(_ports_with(key, port), notify_path, tmp_path)
        _assert_refused_naming(result, key, port, notify)


# The daemon's check comes first, but a port can be taken between it and the child's own bind: each child then
# exits 78 itself, which the supervisor passes on instead of restarting it.


def test_gateway_exits_78_naming_its_port_when_it_cannot_bind():
    with _held_port() as port:
        command = [sys.executable, "-m", "daemon.cli", "gateway", "--http-port", str(port)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 78, result.stderr
    assert f"http_port: cannot listen on 127.0.0.1:{port}" in result.stderr


def test_frontend_exits_78_naming_its_port_and_claims_nothing_when_it_cannot_bind(tmp_path):
    listening = tmp_path / "frontend.listening"
    with _impostor_grpc_server() as port:
        spec = FrontendSpec(
            grpc_port=port,
            metrics_port=None,
            output_address=f"ipc://{tmp_path}/frontend.ipc",
            schedulers=[],
            default_model="absent",
            secret_path=str(tmp_path / "secret"),
            state_dir=str(tmp_path),
            listening_path=str(listening),
        )
        command = [sys.executable, "-m", "frontend", msgspec.json.encode(spec).decode()]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 78, result.stderr
    assert f"grpc_port: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert not listening.exists()  # the daemon would never take the impostor's answers for ours
