"""`--host`: the listeners go where the operator says, and an open port beyond loopback is refused unless meant."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
from daemon_harness import ROOT, Daemon, free_port
from harness.systemd_socket import NotifySocket

HOST = "127.0.0.2"  # loopback, but not 127.0.0.1: a listener still bound there would not answer here


def _serve(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "daemon.cli", "serve", "--grpc-port", str(free_port()), *argv]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_every_listener_binds_the_given_host_and_only_it():
    with NotifySocket() as systemd, Daemon(host=HOST, env=systemd.env) as daemon:
        assert daemon.generate("over the host", max_tokens=3, ignore_eos=True)[-1].finish_reason == "length"
        with urllib.request.urlopen(f"http://{HOST}:{daemon.http_port}/health", timeout=10) as reply:
            assert reply.status == 200
        assert daemon.metric("tokend:requests_in_flight") == 0  # /metrics on the host too
        for port in (daemon.grpc_port, daemon.http_port, daemon.metrics_port):
            assert _refused("127.0.0.1", port), port
        systemd.wait_for("READY=1")  # the daemon writes its ready record, then tells systemd
        (serving,) = daemon.log_entries("serving")
        assert serving["host"] == HOST
        assert serving["urls"] == {  # where to point a client, in the ready record (and the terminal banner)
            "grpc": f"{HOST}:{daemon.grpc_port}",
            "http": f"http://{HOST}:{daemon.http_port}/v1",
            "metrics": f"http://{HOST}:{daemon.metrics_port}/metrics",
        }


def test_a_public_host_without_tenants_is_refused_naming_the_way_out():
    result = _serve("--host", "0.0.0.0")
    assert result.returncode == 78
    assert "host" in result.stderr and "--allow-unauthenticated" in result.stderr


def test_tenant_metrics_on_a_public_host_need_the_metrics_token(tmp_path):
    config = tmp_path / "tokend.toml"
    key_hash = hashlib.sha256(b"sk-someone").hexdigest()
    config.write_text(f'[[tenants]]\nname = "someone"\napi_key_sha256 = "{key_hash}"\n')
    result = _serve("--config", str(config), "--host", "0.0.0.0", "--tenant-metrics")
    assert result.returncode == 78 and "tenant_metrics" in result.stderr and "metrics_token_sha256" in result.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_hosts_need_no_tenants(host):
    from daemon.cli import build_parser
    from daemon.config import load_serve_config

    config = load_serve_config(build_parser().parse_args(["serve", "--host", host]), environ={})
    assert config.host == host
